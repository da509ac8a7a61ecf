"""The audit of a finished run: every attack that applies to its method, on what its server
kept (:mod:`cloud_server.audit.kept`), scored against the agents' private images next to
the mean-image baseline, written to ``RUN_DIR/audit/leakage.json`` and ``leakage.png``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from models.registry import build_model

from ..audit_keeper import AUDIT_DIR, MASKED_KIND
from ..evaluation import EvalSet, EvalSetSpec
from .activations import (BEST_MAP_FIT, ArchitectureOnlyConfig, WhiteBoxConfig, invert_features_architecture_only,
                          white_box_candidates)
from .errors import AuditError
from .guarded import as_uploaded, guard_of, public_map_noise
from .inverse_network import InverseNetworkConfig, decode_features, train_inverse_network
from .audit_updates import attack_update, image_row, match_private
from .kept import AgentImages, KeptMaps, KeptRun, agent_images, load_kept_run
from .labels import label_histogram_from_labels, label_histogram_from_logits, uniform_guess_error
from .leakage_report import attach_to_report, eval_models_note, leakage_section
from .registry import AuditPlan, ServerKnowledge, attacks_for
from .scoring import PixelSpace

__all__ = ["AuditOptions", "run_audit"]

LEAKAGE_JSON = "leakage.json"
LEAKAGE_PNG = "leakage.png"
# Images per agent shown in the picture grid.
_GRID_COLUMNS = 8


@dataclass(frozen=True)
class AuditOptions:
    """How hard the audit tries.

    Attributes:
        steps: optimisation steps of every optimising attack (None: each attack's default).
        public_samples: public images the inverse network trains on and the baseline averages
            (0: the whole global test set).
        max_update_images: the update attacks run on an update that covers at most this
            many images (the unrolled schedule goes through every one of them).
        attacks: run only these attacks (empty: every one that applies).
        seed: seeds the attacks' starting points.
    """

    steps: int | None = None
    public_samples: int = 500
    max_update_images: int = 16
    attacks: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise AuditError(f"--steps must be >= 1, got {self.steps}")
        if self.public_samples < 0 or self.max_update_images < 1:
            raise AuditError("--public-samples must be >= 0 and --max-update-images >= 1")


Progress = Callable[[str], None]


def _steps(options: AuditOptions, default: int) -> int:
    return default if options.steps is None else options.steps


def server_knowledge(kept: KeptRun) -> tuple[ServerKnowledge, list[str]]:
    """What the server held in this run: the method's defaults, less what it did not keep."""
    plan = attacks_for(kept.method)
    knowledge, notes = plan.knowledge, []
    if kept.method == "fedgkt" and not kept.extractor and not any(m.eval_model for m in kept.maps.values()):
        knowledge = replace(knowledge, extractor_weights=False, note="the server sent no initial edge model (edge_init is "
                            "not 'shared') and no evaluation report of the kept round came with a ResNet-8")
        notes.append("no extractor kept: the white-box and inverse-network attacks do not apply")
    if kept.method == "splitnn" and kept.method_config.get("extractor") == "private":
        knowledge = replace(knowledge, extractor_weights=False, note="each agent keeps its own extractor (splitnn.extractor "
                            "= 'private'): the server never holds one, only the activations and labels")
        notes.append("private extractors: the white-box and inverse-network attacks do not apply")
    elif kept.method == "splitnn" and not any(m.extractor for m in kept.maps.values()):
        knowledge = replace(knowledge, extractor_weights=False)
        notes.append("no extractor kept with the maps: the white-box and inverse-network attacks do not apply")
    return knowledge, notes


def _extractor(kept: KeptRun, maps: KeptMaps) -> tuple[nn.Module, str, str] | None:
    """The extractor the server held for ``maps``, loaded into its architecture, where it came
    from, and a digest of its weights (agents with the same extractor share one decoder)."""
    turn = "the agent's turn" if maps.split == "train" else "the agent's evaluation (the round's final extractor)"
    for weights, source in ((maps.extractor, f"the extractor the server sent for {turn}"),
                            (maps.eval_model, "the edge model of the agent's evaluation report of the round"),
                            (kept.extractor, "the initial edge model the server sent")):
        if weights:
            break
    else:
        return None
    if weights is kept.extractor and kept.method_config.get("train_extractor"):
        source += " (the agent has trained it since: the server holds its start only)"
    name = str(kept.method_config.get("edge_model", "resnet8"))
    model = build_model(name, kept.num_classes, kept.in_channels)
    target: nn.Module = model if any(k.startswith("extractor.") for k in weights) else model.extractor
    state = target.state_dict()
    target.load_state_dict({k: torch.from_numpy(np.asarray(weights[k])).to(state[k].dtype) for k in state})
    digest = hashlib.sha256()
    for value in model.extractor.state_dict().values():
        digest.update(value.numpy().tobytes())
    return model.extractor.eval(), source, digest.hexdigest()


def _public(kept: KeptRun, options: AuditOptions) -> torch.Tensor:
    config = kept.config
    samples = int(config.get("eval_samples", 0))
    if options.public_samples:
        samples = min(samples, options.public_samples) if samples else options.public_samples
    spec = EvalSetSpec(dataset=str(config.get("eval_dataset") or kept.dataset), samples=samples,
                       seed=int(config.get("eval_seed", 0)), root=config.get("eval_root"))
    eval_set = EvalSet.load(spec)
    if eval_set is None:
        raise AuditError("the run has no global test set (eval_dataset = 'none'): the audit needs the server's public images")
    return torch.from_numpy(np.asarray(eval_set.data.images, dtype=np.float32) / 255.0)  # (M, C, H, W)


def _attack_maps(kept: KeptRun, maps: KeptMaps, plan: AuditPlan, images: AgentImages, public: torch.Tensor,
                 pixels: PixelSpace, options: AuditOptions, decoders: dict[str, nn.Module],
                 progress: Progress) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], torch.Tensor | None]:
    rows: list[dict[str, Any]] = []
    pictures: dict[str, torch.Tensor] = {}
    private: torch.Tensor | None = None
    best_matched_db: float | None = None
    by_id = bool((maps.sample_ids >= 0).all())
    if by_id:
        private, _ = images.by_sample_id(maps.agent, maps.sample_ids, maps.split)
    else:  # split learning's uploads carry no ids: each reconstruction is matched to an image of the shard
        shard, _ = images.all_of(maps.agent, maps.split)
    image_shape = tuple(public.shape[1:])
    held = _extractor(kept, maps)
    extractor, source, digest = held if held is not None else (None, "", "")
    guard = guard_of(kept.method_config)  # the attacks model the clipping the agents applied
    extractor = as_uploaded(extractor, guard) if extractor is not None else None
    # Split learning's training activations came from train-mode BatchNorm (batch statistics);
    # its evaluation ran the extractor in eval mode (running statistics), like FedGKT's maps.
    batch_statistics = kept.method == "splitnn" and maps.split == "train"
    for spec in plan.attacks:
        if options.attacks and spec.name not in options.attacks:
            continue
        extra: dict[str, str] = {}
        if spec.scores == "labels":
            rows.append(_label_row(spec.name, maps, images))
            continue
        if batch_statistics and not maps.whole_batch:
            rows.append({"attack": spec.name, "skipped": "the kept rows are part of a training batch, whose normalisation "
                         "used the whole batch: set [server] audit_samples_per_agent to the batch size or more"})
            continue
        if "extractor_weights" in spec.needs:
            if extractor is None:
                rows.append({"attack": spec.name, "skipped": "no extractor kept for this agent"})
                continue
            extra["extractor"] = source
        progress(f"  {maps.agent}: {spec.name} on {len(maps.features)} maps ...")
        started = time.perf_counter()
        candidates: dict[str, torch.Tensor] = {}
        if spec.name == "white_box_inversion" and extractor is not None:
            white_box = WhiteBoxConfig(steps=_steps(options, WhiteBoxConfig.steps), batch_statistics=batch_statistics,
                                       seed=options.seed)
            candidates = white_box_candidates(extractor, maps.features, pixels, image_shape, white_box)
            reconstructed = candidates[BEST_MAP_FIT]
        elif spec.name == "inverse_network" and extractor is not None:
            # One decoder per extractor: FedGKT's agents share theirs while the stems stay at the shared start.
            extra["decoder"] = "trained here" if digest not in decoders else "an earlier agent's, same extractor"
            if digest not in decoders:
                decoders[digest] = train_inverse_network(extractor, public, pixels, InverseNetworkConfig(
                    steps=_steps(options, InverseNetworkConfig.steps), seed=options.seed), public_map_noise(guard, options.seed))
            if guard.noisy:
                extra["decoder_input"] = "public maps clipped and noised as the agents' were"
            reconstructed = decode_features(decoders[digest], maps.features)
        elif spec.name == "architecture_only":
            surrogate = as_uploaded(build_model(str(kept.method_config.get("edge_model", "resnet8")), kept.num_classes,
                                                kept.in_channels).extractor, guard)
            architecture = ArchitectureOnlyConfig(warmup_steps=_steps(options, ArchitectureOnlyConfig.warmup_steps),
                                                  steps=_steps(options, ArchitectureOnlyConfig.steps), seed=options.seed)
            reconstructed = invert_features_architecture_only(surrogate, maps.features, pixels, public, architecture)
        else:
            rows.append({"attack": spec.name, "skipped": f"{spec.name} does not read activation uploads"})
            continue
        wall_s = time.perf_counter() - started
        if by_id:
            assert private is not None
            row, reconstructed, _ = best_candidate(spec.name, candidates or {"": reconstructed}, private, public, wall_s, **extra)
        else:
            extra["matched"] = "each reconstruction scored against the image of the agent's shard it fits best"
            row, reconstructed, matched = best_candidate(spec.name, candidates or {"": reconstructed},
                                                         lambda found: match_private(found, shard), public, wall_s, **extra)
            # Every attack reconstructs the same maps in the same order: the picture shows them
            # beneath the images the best-scoring attack matched them to.
            if best_matched_db is None or row["psnr_db"] > best_matched_db:
                private, best_matched_db = matched, row["psnr_db"]
        rows.append(row)
        pictures[spec.name] = reconstructed
    return rows, pictures, private


def best_candidate(attack: str, candidates: dict[str, torch.Tensor],
                   private: torch.Tensor | Callable[[torch.Tensor], torch.Tensor], public: torch.Tensor, wall_s: float,
                   **extra: Any) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """An attack's row, reconstruction and the private images it was scored against: of its
    candidate reconstructions (one, or the white-box attack's learning rates and their best map
    fit), the one that scores best, named in the row when there were several. ``private`` is
    the images in the maps' order, or, for uploads without ids, a function that matches a
    reconstruction to the private images it fits (each candidate is matched on its own)."""
    scored = []
    for name, images in candidates.items():
        against = private(images) if callable(private) else private
        scored.append((image_row(attack, images, against, public, wall_s, **extra), name, images, against))
    row, name, images, against = max(scored, key=lambda entry: entry[0]["psnr_db"])
    if len(candidates) > 1:
        row["candidate"] = f"{name} (the best-scoring of {', '.join(candidates)})"
    return row, images, against


def _attack_eval_maps(kept: KeptRun, maps: KeptMaps, plan: AuditPlan, images: AgentImages, public: torch.Tensor,
                      pixels: PixelSpace, options: AuditOptions, decoders: dict[str, nn.Module], progress: Progress,
                      grid: list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]]) -> dict[str, Any]:
    """The image attacks on evaluation's upload of the agent's local test images (private too)."""
    image_plan = replace(plan, attacks=tuple(spec for spec in plan.attacks if spec.scores == "images"))
    rows, pictures, private = _attack_maps(kept, maps, image_plan, images, public, pixels, options, decoders, progress)
    for row in rows:
        row["assumes"] = _assumed(row_needs(plan, row["attack"]))
        progress(_line(f"{maps.agent} (evaluation)", row))
    if private is not None and pictures:
        grid.append((f"{maps.agent} (evaluation)", private, pictures))
    return {"kept": "activations of the agent's local test images", "round": maps.round, "maps": len(maps.features),
            "attacks": rows}


def row_needs(plan: AuditPlan, attack: str) -> tuple[str, ...]:
    """What the attack named ``attack`` in ``plan`` assumes the server holds."""
    return next(spec.needs for spec in plan.attacks if spec.name == attack)


def _label_row(attack: str, maps: KeptMaps, images: AgentImages) -> dict[str, Any]:
    _, true_labels = images.all_of(maps.agent)
    num_classes = int(max(true_labels.max(), maps.round_labels.max())) + 1
    num_classes = max(num_classes, 10)
    if attack == "labels_in_the_clear":
        estimate = label_histogram_from_labels(maps.round_labels, num_classes)
    elif maps.round_predicted is not None:
        estimate = label_histogram_from_logits(np.eye(num_classes, dtype=np.float32)[maps.round_predicted])
    else:
        return {"attack": attack, "skipped": "no logits kept"}
    return {"attack": attack, "histogram_error": estimate.error(true_labels),
            "baseline_histogram_error": uniform_guess_error(true_labels, num_classes), "exact": estimate.exact,
            "estimate": [round(float(s), 4) for s in estimate.shares], "num_labels": int(len(maps.round_labels))}


def _describe(knowledge: ServerKnowledge) -> dict[str, Any]:
    return {"holds": [item for item in ("extractor_weights", "start_model", "local_schedule", "public_images", "architecture")
                      if knowledge.holds(item)], "note": knowledge.note}


def _assumed(spec_needs: tuple[str, ...]) -> str:
    return ", ".join(spec_needs) if spec_needs else "nothing beyond the uploads"


def run_audit(run_dir: str | Path, options: AuditOptions = AuditOptions(), progress: Progress = print) -> dict[str, Any]:
    """Audit ``run_dir``: print each attack's scores and write ``leakage.json`` and ``leakage.png``.

    Raises:
        AuditError: nothing kept, no way to find the private images, or a method without an audit entry.
    """
    started = time.perf_counter()
    kept = load_kept_run(run_dir)
    knowledge, notes = server_knowledge(kept)
    plan = attacks_for(kept.method, knowledge)
    unknown = sorted(set(options.attacks) - {spec.name for spec in plan.attacks})
    if unknown:
        raise AuditError(f"--attacks {unknown} do not apply to {kept.method} here; those that do: {', '.join(plan.attack_names)}")
    agents = sorted(set(kept.maps) | set(kept.updates) | set(kept.eval_maps))
    progress(f"edgesplit audit: {kept.method}, {len(agents)} agents; the server is assumed to hold: "
             f"{', '.join(_describe(knowledge)['holds'])}")
    for note in notes:
        progress(f"edgesplit audit: {note}")
    images = agent_images(kept.run_dir, sorted(set(agents) | set(kept.aggregate.agents if kept.aggregate else ())))
    progress(f"edgesplit audit: {images.source}")
    public = _public(kept, options)
    pixels = PixelSpace.of_dataset(kept.dataset, kept.in_channels)
    not_kept = kept.manifest.get("not_kept", {})
    handed = eval_models_note(kept.method, kept.manifest.get("eval_models", {}))
    if handed:
        notes.append(handed)
        progress(f"edgesplit audit: {handed}")
    per_agent: dict[str, Any] = {}
    grid: list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]] = []
    decoders: dict[str, nn.Module] = {}
    for agent in agents:
        rows: list[dict[str, Any]] = []
        private: torch.Tensor | None = None
        pictures: dict[str, torch.Tensor] = {}
        if agent in kept.maps:
            maps = kept.maps[agent]
            rows, pictures, private = _attack_maps(kept, maps, plan, images, public, pixels, options, decoders, progress)
            where = {"kept": "activations", "round": maps.round, "maps": len(maps.features)}
        elif agent not in kept.updates:
            where = {"kept": "evaluation activations only"}
        else:
            update = kept.updates[agent]
            rows, pictures, private = attack_update(kept, update, plan, images, public, pixels, options.steps,
                                                    options.max_update_images, options.attacks, options.seed, progress)
            where = {"kept": update.kind, "round": update.round, "num_samples": update.num_samples}
            if update.kind == MASKED_KIND:
                where["masked"] = ("the masked input the server received (secure aggregation), decoded as it would read a "
                                   "plain update")
        for row in rows:
            row["assumes"] = _assumed(row_needs(plan, row["attack"]))
            progress(_line(agent, row))
        per_agent[agent] = {**where, "attacks": rows}
        if private is not None and pictures:
            grid.append((agent, private, pictures))
        if agent in kept.eval_maps:
            per_agent[agent]["evaluation_uploads"] = _attack_eval_maps(kept, kept.eval_maps[agent], plan, images, public,
                                                                       pixels, options, decoders, progress, grid)
    if kept.aggregate is not None:  # secure aggregation: the unmasked mean of the survivors, which the server does learn
        aggregate = kept.aggregate
        who = f"aggregate of {len(aggregate.agents)} agents"
        rows, pictures, private = attack_update(kept, aggregate, plan, images, public, pixels, options.steps,
                                                options.max_update_images, options.attacks, options.seed, progress)
        for row in rows:
            row["assumes"] = _assumed(row_needs(plan, row["attack"]))
            progress(_line(who, row))
        per_agent[who] = {"kept": aggregate.kind, "round": aggregate.round, "num_samples": aggregate.num_samples,
                          "agents": list(aggregate.agents), "attacks": rows}
        if private is not None and pictures:
            grid.append((who, private, pictures))
    if any(u.kind == MASKED_KIND for u in kept.updates.values()):
        notes.append("secure aggregation: each agent's update attacked is its masked input as the server received it; "
                     "what the server learns in clear is the survivors' aggregate, attacked apart")
        progress(f"edgesplit audit: {notes[-1]}")
    summary = _best(per_agent)
    result = {
        "method": kept.method, "run_dir": str(kept.run_dir), "knowledge": _describe(knowledge), "notes": notes,
        "private_images": images.source, "not_kept": not_kept,
        "not_supported": (f"{', '.join(sorted(not_kept))} uploads were not kept: the audit does not read them yet, and "
                          "says nothing about what they reveal") if not_kept else None,
        "options": {"steps": options.steps, "public_samples": len(public), "max_update_images": options.max_update_images,
                    "seed": options.seed},
        "agents": per_agent, "best": summary, "wall_s": time.perf_counter() - started,
    }
    out = kept.run_dir / AUDIT_DIR
    (out / LEAKAGE_JSON).write_text(json.dumps(result, indent=1) + "\n")
    if grid:
        _picture_grid(grid, out / LEAKAGE_PNG)
        shutil.copyfile(out / LEAKAGE_PNG, kept.run_dir / LEAKAGE_PNG)
    if attach_to_report(kept.run_dir, leakage_section(result, picture=LEAKAGE_PNG if grid else None)):
        progress(f"edgesplit audit: added the leakage section to {kept.run_dir / 'report.json'} and summary.md")
    if not_kept:
        progress(f"edgesplit audit: NOT SUPPORTED: {result['not_supported']}")
    for attack, best in summary.items():
        progress(f"edgesplit audit: best {attack}: {best['psnr_db']:.1f} dB PSNR, SSIM {best['ssim']:.3f} "
                 f"(baseline {best['baseline_psnr_db']:.1f} dB) on {best['agent']}")
    progress(f"edgesplit audit: wrote {out / LEAKAGE_JSON}" + (f" and {out / LEAKAGE_PNG}" if grid else ""))
    return result


def _line(agent: str, row: dict[str, Any]) -> str:
    head = f"  {agent} {row['attack']:<22}"
    if "skipped" in row:
        return f"{head} not run: {row['skipped']}"
    if "psnr_db" in row:
        return (f"{head} PSNR {row['psnr_db']:6.1f} dB (baseline {row['baseline_psnr_db']:.1f}), SSIM {row['ssim']:.3f} "
                f"(baseline {row['baseline_ssim']:.3f}), {row['num_images']} images, {row['wall_s']:.1f} s; assumes: {row['assumes']}")
    return (f"{head} label-histogram error {row['histogram_error']:.3f} (total variation; a uniform guess "
            f"{row['baseline_histogram_error']:.3f}) over {row['num_labels']} labels; "
            f"assumes: {row['assumes']}")


def _best(per_agent: dict[str, Any]) -> dict[str, Any]:
    """Per image attack, the agent (training or evaluation upload) where it scored highest."""
    best: dict[str, Any] = {}
    for agent, entry in per_agent.items():
        evaluation = entry.get("evaluation_uploads", {}).get("attacks", [])
        for who, row in [(agent, row) for row in entry["attacks"]] + [(f"{agent} (evaluation)", row) for row in evaluation]:
            if "psnr_db" in row and (row["attack"] not in best or row["psnr_db"] > best[row["attack"]]["psnr_db"]):
                best[row["attack"]] = {"agent": who, **{k: row[k] for k in ("psnr_db", "ssim", "baseline_psnr_db", "baseline_ssim")}}
    return best


def _picture_grid(grid: list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]], path: Path) -> None:
    """One block per agent: its private images, then each attack's reconstructions beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: list[tuple[str, torch.Tensor]] = []
    for agent, private, pictures in grid:
        lines.append((f"{agent}: private", private))
        lines.extend((f"{agent}: {attack}", images) for attack, images in pictures.items())
    columns = min(_GRID_COLUMNS, max(images.shape[0] for _, images in lines))
    fig, axes = plt.subplots(len(lines), columns, figsize=(1.2 * columns + 1.6, 1.25 * len(lines)), squeeze=False)
    for r, (label, images) in enumerate(lines):
        for c in range(columns):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c < images.shape[0]:
                picture = images[c].permute(1, 2, 0).numpy()  # (H, W, C)
                ax.imshow(picture[..., 0] if picture.shape[-1] == 1 else picture, cmap="gray", vmin=0.0, vmax=1.0)
            else:
                ax.axis("off")
        axes[r][0].set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
