"""The audit of a kept weight update (the FedAvg family's model, FedKD's factored mentee
update): the agent's local schedule read from the round config the server sent, the update
inverted through it (:func:`~cloud_server.audit.updates.invert_update`) and the labels read
from the classifier's bias update.

The update carries no order of its images: each reconstruction is scored against the private
image it fits best (a greedy matching on the error). Labels for more than one image come from
the bias update's class shares, as the server has no other source of them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from models.registry import build_model

from ..audit_keeper import AGGREGATE_KIND
from .kept import AgentImages, KeptRun, KeptUpdate
from .labels import label_histogram_from_bias_update, uniform_guess_error
from .received import update_from_fedavg, update_from_fedkd
from .registry import AuditPlan
from .schedule import LocalSchedule
from .scoring import PixelSpace, mean_image_baseline, score_images
from .updates import UpdateInversionConfig, invert_update, last_linear_layer

__all__ = ["aggregate_schedule", "attack_update", "image_row", "local_schedule", "match_private", "received_update", "start_model"]

Progress = Callable[[str], None]


def image_row(attack: str, reconstructed: torch.Tensor, private: torch.Tensor, public: torch.Tensor, wall_s: float,
              **extra: Any) -> dict[str, Any]:
    """One image attack's row of leakage.json: its scores beside the mean-image baseline's."""
    scores, baseline = score_images(reconstructed, private), mean_image_baseline(public, private)
    return {"attack": attack, "psnr_db": scores.psnr_db, "ssim": scores.ssim, "baseline_psnr_db": baseline.psnr_db,
            "baseline_ssim": baseline.ssim, "gain_db": scores.psnr_db - baseline.psnr_db, "num_images": scores.num_images,
            "wall_s": wall_s, **extra}


def local_schedule(update: KeptUpdate) -> tuple[LocalSchedule, str]:
    """The agent's local training as the round config set it, and what the unrolled attack leaves out."""
    cfg = update.round_config
    if update.kind == "fedkd.update":
        lr, note = float(cfg.get("mentee_lr", 0.001)), "FedKD's mentee loss adds distillation from the private mentor, which the attack leaves out"
    else:
        lr = float(cfg.get("lr", 0.001))
        extra = sorted(set(cfg) - {"model_version", "local_epochs", "optimizer", "lr", "momentum", "weight_decay",
                                    "batch_size", "upload_codec", "int_buffers"})
        note = f"the round config adds {extra}: a local loss beyond cross-entropy, which the attack leaves out" if extra else ""
    batch = min(int(cfg.get("batch_size", 64)), update.num_samples)
    steps = int(cfg.get("local_epochs", 1)) * math.ceil(update.num_samples / batch)
    optimizer = str(cfg.get("optimizer", "adam"))
    schedule = LocalSchedule(lr=lr, local_steps=steps, batch_size=batch, optimizer=optimizer,
                             momentum=float(cfg.get("momentum", 0.0)) if optimizer == "sgd" else 0.0,
                             weight_decay=float(cfg.get("weight_decay", 0.0)))
    return schedule, note


def aggregate_schedule(update: KeptUpdate) -> tuple[LocalSchedule | None, str]:
    """A secure aggregate as one update over the survivors' images together, where it is one:
    when every agent took one SGD step on its whole shard, the (sample-weighted) mean of their
    steps is that step on the union, whose batch the attack unrolls; else (None, why not)."""
    cfg = update.round_config
    counts = [int(c) for c in update.arrays["agent_samples"]]
    optimizer, epochs, batch = str(cfg.get("optimizer", "adam")), int(cfg.get("local_epochs", 1)), int(cfg.get("batch_size", 64))
    if optimizer != "sgd" or epochs != 1 or batch < max(counts, default=0):
        return None, (f"the aggregate is the mean of {len(counts)} agents' local trainings ({optimizer}, {epochs} epoch(s), batch "
                      f"{batch}, shards of {counts} images): one update over their union only for one full-batch SGD step "
                      "each, and the unrolled attack does not model a mean of several trajectories")
    schedule = LocalSchedule(lr=float(cfg.get("lr", 0.001)), local_steps=1, batch_size=sum(counts), optimizer="sgd",
                             weight_decay=float(cfg.get("weight_decay", 0.0)))
    return schedule, "one SGD step on the survivors' images together (each agent's full-batch step, averaged)"


def start_model(kept: KeptRun, update: KeptUpdate) -> nn.Module:
    """The global model ``update`` started from, as the server sent it, in the run's architecture."""
    name = str(kept.method_config.get("mentee_model" if update.kind == "fedkd.update" else "model",
                                      "resnet8" if update.kind == "fedkd.update" else "resnet56"))
    model = build_model(name, kept.num_classes, kept.in_channels)
    state = model.state_dict()
    loaded = {k: torch.from_numpy(np.asarray(v)).to(state[k].dtype) for k, v in update.global_weights.items() if k in state}
    model.load_state_dict(loaded, strict=False)
    return model


def received_update(update: KeptUpdate) -> dict[str, torch.Tensor]:
    """The kept upload as ``uploaded - global`` per parameter (:mod:`cloud_server.audit.received`)."""
    from shared_protocol.methods.fedavg import FedAvgUpdate
    from shared_protocol.methods.fedkd import FedKdUpdate

    a = update.arrays
    decoded = {k[len("update/"):]: v for k, v in a.items() if k.startswith("update/")}
    if decoded:  # secure aggregation's masked input or aggregate, kept as the update the server reads
        return {name: torch.from_numpy(np.asarray(v, dtype=np.float32)) for name, v in decoded.items()}
    if update.kind == "fedkd.update":
        msg = FedKdUpdate(run="audit", round=update.round, sender=update.agent, instance="", num_samples=update.num_samples,
                          base_version=int(a["base_version"]), payload=str(a["payload"]), threshold=float(a["threshold"]),
                          layout=json.loads(str(a["layout"])), factors=a["factors"])
        return update_from_fedkd(msg, float(update.round_config.get("mentee_lr", 1.0)))
    uploaded = {k[len("uploaded/"):]: v for k, v in a.items() if k.startswith("uploaded/")}
    floats = {k: v for k, v in uploaded.items() if v.dtype.kind == "f"}
    msg = FedAvgUpdate(run="audit", round=update.round, sender=update.agent, instance="", num_samples=update.num_samples,
                       model_version=0, weights=floats)
    return update_from_fedavg(msg, update.global_weights)


def _labels_from_shares(shares: np.ndarray, n: int) -> torch.Tensor:
    """``n`` labels in the estimated shares (largest remainder)."""
    raw = shares * n
    counts = np.floor(raw).astype(int)
    for c in np.argsort(-(raw - counts))[: n - counts.sum()]:
        counts[c] += 1
    return torch.from_numpy(np.repeat(np.arange(len(shares)), counts)).long()


def match_private(reconstructed: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """For each reconstruction ``(N, C, H, W)``, the candidate private image ``(M >= N)`` it fits
    best, no candidate twice (greedy on the squared error): for uploads that carry no order or id
    of their images. The baseline is then scored on the same images."""
    n, m = reconstructed.shape[0], candidates.shape[0]
    mse = (reconstructed.flatten(1)[:, None, :] - candidates.flatten(1)[None, :, :]).square().mean(-1)  # (N, M)
    order = [-1] * n
    free_r, free_p = set(range(n)), set(range(m))
    for flat in torch.argsort(mse.flatten()).tolist():
        r, p = divmod(flat, m)
        if r in free_r and p in free_p:
            order[r] = p
            free_r.discard(r)
            free_p.discard(p)
            if not free_r:
                break
    return candidates[order]


def attack_update(kept: KeptRun, update: KeptUpdate, plan: AuditPlan, images: AgentImages, public: torch.Tensor,
                  pixels: PixelSpace, steps: int | None, max_images: int, only: tuple[str, ...], seed: int,
                  progress: Progress) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], torch.Tensor | None]:
    """The update attacks of ``plan`` on one agent's kept update (``only``: these attacks, if given):
    the rows of leakage.json, the reconstructions by attack, and the private images they match."""
    rows: list[dict[str, Any]] = []
    pictures: dict[str, torch.Tensor] = {}
    held = [images.all_of(agent) for agent in update.agents]
    private_all, true_labels = torch.cat([p for p, _ in held]), np.concatenate([t for _, t in held])
    if update.kind == AGGREGATE_KIND:
        aggregate, why = aggregate_schedule(update)
        if aggregate is None:
            return [{"attack": spec.name, "skipped": why} for spec in plan.attacks if not only or spec.name in only], {}, None
        schedule, left_out = aggregate, ""
    else:
        schedule, left_out = local_schedule(update)
    model = start_model(kept, update)
    received = received_update(update)
    _, head = last_linear_layer(model)
    head_name = next(name for name, module in model.named_modules() if module is head)
    bias_update = received.get(f"{head_name}.bias")
    shares = None
    if bias_update is not None:
        shares = label_histogram_from_bias_update(bias_update.numpy(), schedule)
    private: torch.Tensor | None = None
    for spec in plan.attacks:
        if only and spec.name not in only:
            continue
        if spec.name == "bias_update_labels":
            if shares is None:
                rows.append({"attack": spec.name, "skipped": "the update carries no classifier bias"})
            else:
                rows.append({"attack": spec.name, "histogram_error": shares.error(true_labels),
                             "baseline_histogram_error": uniform_guess_error(true_labels, kept.num_classes), "exact": False,
                             "source": shares.source, "estimate": [round(float(s), 4) for s in shares.shares],
                             "num_labels": int(len(true_labels))})
            continue
        if spec.name != "update_inversion":
            continue
        n = update.num_samples
        if n > max_images or n != len(private_all):
            rows.append({"attack": spec.name, "skipped": f"the update covers {n} images (its agents hold {len(private_all)}); "
                         f"the unrolled inversion runs up to --max-update-images {max_images}, and on the project's "
                         "ResNets it recovers little more than the mean image even from one image's update, and "
                         "nothing at one step of the agents' default batch: bench/results/update_inversion.json "
                         "measures it"})
            continue
        labels = None if n == 1 else _labels_from_shares(shares.shares if shares is not None else np.full(kept.num_classes, 1 / kept.num_classes), n)
        progress(f"  {update.agent}: update_inversion on {n} images, {schedule.local_steps} local steps ({schedule.optimizer}) ...")
        started = time.perf_counter()
        result = invert_update(model, received, pixels, tuple(public.shape[1:]), n, schedule, labels=labels,
                               start=public.mean(0), config=UpdateInversionConfig(
                                   steps=UpdateInversionConfig.steps if steps is None else steps, seed=seed))
        wall_s = time.perf_counter() - started
        private = match_private(result.images, private_all)
        rows.append(image_row(spec.name, result.images, private, public, wall_s, labels_inferred=True, matched=True,
                               cosine_distance=result.cosine_distance, schedule=vars(schedule) | {"betas": list(schedule.betas)},
                               **({"left_out": left_out} if left_out else {})))
        pictures[spec.name] = result.images
    return rows, pictures, private
