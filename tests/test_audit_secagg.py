"""The leakage audit of a secure-aggregation run (cloud_server/audit_keeper.py): the server
keeps each agent's masked input as it received it and the round's unmasked aggregate, and the
audit's update inversion runs on exactly those.

The setting is one where update inversion works: each agent holds one image and takes one SGD
step on it (a small ReLU network without normalisation). The positive control is the same
attack code on the agent's unmasked update of that round, captured on the agent before
masking: it rebuilds the private image well above the mean image, while the masked input the
server kept gives nothing beyond it. Were the unmasked update kept, the first would fail."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from audithelpers import one_torch_thread  # noqa: F401 (a fixture: importing it applies it here)
from cloud_server.audit.audit_run import AuditOptions, _public, run_audit
from cloud_server.audit.audit_updates import aggregate_schedule, attack_update, received_update, start_model
from cloud_server.audit.kept import agent_images, load_kept_run
from cloud_server.audit.registry import attacks_for
from cloud_server.audit.scoring import PixelSpace
from cloud_server.audit.updates import unrolled_update
from conftest import Broker
from edge_agent.config import DataConfig, EdgeConfig
from edge_agent.secagg_client import SecAggClient
from fedhelpers import agent_config, in_memory_federation, method_server_config, mqtt_federation, write_agent_toml
from shared_protocol.secagg import SecAggParams, dequantise

AGENTS = 2
# One image per agent, one SGD step on it: where the audit's update inversion rebuilds an image.
ONE_STEP = {"model": "convnet", "optimizer": "sgd", "lr": 0.01, "batch_size": 1, "local_epochs": 1}
STEPS = 600


@dataclasses.dataclass
class SecAggRun:
    run_dir: Path
    unmasked: dict[str, np.ndarray]  # agent -> the flat float update it passed to the masking


@pytest.fixture(scope="module")
def secagg_run(tmp_path_factory: pytest.TempPathFactory) -> SecAggRun:
    tmp = tmp_path_factory.mktemp("audit-secagg")
    unmasked: dict[str, np.ndarray] = {}
    lock = threading.Lock()
    mask = SecAggClient.mask

    def spying_mask(client: SecAggClient, update: np.ndarray, num_samples: int, uniform: bool = False) -> np.ndarray:
        with lock:
            unmasked.setdefault(client.me, update.copy())
        return mask(client, update, num_samples, uniform=uniform)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SecAggClient, "mask", spying_mask)
        config = dataclasses.replace(
            method_server_config(tmp, "fedavg", ONE_STEP, run_id="audit-sa", agents=AGENTS, rounds=1, dataset="fashion-mnist",
                                 eval_samples=40, audit=True),
            secure_aggregation=True, secagg_stage_timeout_s=30.0)
        agents = [EdgeConfig(agent_id=f"agent-{i}", run_id="audit-sa", broker_url="mqtt://127.0.0.1:1", progress=False,
                             data=DataConfig(dataset="fashion-mnist", partition="iid", num_agents=AGENTS, agent_index=i, seed=0,
                                             train_samples=AGENTS, test_samples=20))
                  for i in range(AGENTS)]
        report = in_memory_federation(config, agents).start().join()
    assert report["rounds"][0]["status"] == "ok" and report["rounds"][0]["method"]["secagg"]["stage"] == "done"
    run_dir = Path(config.out_dir)
    (run_dir / "configs").mkdir(exist_ok=True)
    for i, agent in enumerate(agents):  # where `edgesplit local` writes them: the audit derives the private images
        write_agent_toml(run_dir / "configs" / f"agent-{i}.toml", agent)
    return SecAggRun(run_dir, unmasked)


def _as_named(flat: np.ndarray, start: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The agent's flat update by name: floats in name order (edge_agent/methods/fedavg.py)."""
    out, offset = {}, 0
    for name in sorted(n for n, a in start.items() if a.dtype.kind == "f"):
        out[name] = flat[offset:offset + start[name].size].reshape(start[name].shape).astype(np.float32)
        offset += start[name].size
    return out


def test_the_masked_upload_gives_nothing_back_while_the_same_attack_on_the_unmasked_update_does(secagg_run: SecAggRun) -> None:
    kept = load_kept_run(secagg_run.run_dir)
    assert sorted(kept.updates) == ["agent-0", "agent-1"] and kept.manifest["not_kept"] == {}
    masked = kept.updates["agent-0"]
    assert masked.kind == "secagg.masked_input" and masked.num_samples == 1
    plain = _as_named(secagg_run.unmasked["agent-0"], masked.global_weights)
    # What was kept is the masked input, not the update: it does not point the update's way.
    received = received_update(masked)
    assert set(received) == set(plain)
    whole = [torch.cat([torch.as_tensor(u[n]).flatten() for n in sorted(plain)]) for u in (received, plain)]
    assert abs(float(F.cosine_similarity(*whole, dim=0))) < 6 / whole[0].numel() ** 0.5  # six standard errors of two random directions
    # The positive control: the kept item with the agent's unmasked update in place of what the server received.
    control = dataclasses.replace(masked, arrays={**{k: v for k, v in masked.arrays.items() if not k.startswith("update/")},
                                                  **{f"update/{n}": v for n, v in plain.items()}})
    plan = attacks_for("fedavg")
    images = agent_images(kept.run_dir, ["agent-0"])
    public = _public(kept, AuditOptions(public_samples=40))
    pixels = PixelSpace.of_dataset("fashion-mnist", 1)
    rows = {}
    for what, update in (("masked", masked), ("unmasked", control)):
        found, _, _ = attack_update(kept, update, plan, images, public, pixels, STEPS, 16, ("update_inversion",), 0, lambda _: None)
        (rows[what],) = found
    got, truth = rows["masked"], rows["unmasked"]
    print(f"masked: PSNR {got['psnr_db']:.2f} dB SSIM {got['ssim']:.3f}; unmasked: PSNR {truth['psnr_db']:.2f} dB "
          f"SSIM {truth['ssim']:.3f}; mean image: PSNR {got['baseline_psnr_db']:.2f} dB SSIM {got['baseline_ssim']:.3f}")
    assert truth["psnr_db"] > truth["baseline_psnr_db"] + 2.0 and truth["ssim"] > truth["baseline_ssim"] + 0.3
    assert got["psnr_db"] < got["baseline_psnr_db"] + 1.0 and got["ssim"] < got["baseline_ssim"] + 0.1


def test_the_aggregate_is_kept_and_is_one_step_on_the_survivors_images_together(secagg_run: SecAggRun) -> None:
    kept = load_kept_run(secagg_run.run_dir)
    aggregate = kept.aggregate
    assert aggregate is not None and aggregate.agents == ("agent-0", "agent-1") and aggregate.num_samples == 2
    schedule, _ = aggregate_schedule(aggregate)
    assert schedule is not None and schedule.local_steps == 1 and schedule.batch_size == 2
    # What the server learns in clear is the update one SGD step on both private images makes.
    images = agent_images(kept.run_dir, list(aggregate.agents))
    private = torch.cat([images.all_of(a)[0] for a in aggregate.agents])
    labels = torch.from_numpy(np.concatenate([images.all_of(a)[1] for a in aggregate.agents])).long()
    replayed = unrolled_update(start_model(kept, aggregate), PixelSpace.of_dataset("fashion-mnist", 1).to_model(private), labels,
                               schedule)
    received = received_update(aggregate)
    for name, delta in replayed.items():
        assert F.cosine_similarity(delta.detach().flatten(), received[name].flatten(), dim=0) > 0.999, name
    # ... and not one agent's alone (the aggregate is not an update the keeper mistook for one).
    alone = unrolled_update(start_model(kept, aggregate), PixelSpace.of_dataset("fashion-mnist", 1).to_model(private[:1]),
                            labels[:1], dataclasses.replace(schedule, batch_size=1))
    assert min(float(F.cosine_similarity(alone[n].detach().flatten(), received[n].flatten(), dim=0)) for n in alone) < 0.99
    # Another schedule (Adam, or several steps) is not one update on the union: named, not attacked.
    adam = dataclasses.replace(aggregate, round_config={**aggregate.round_config, "optimizer": "adam"})
    assert aggregate_schedule(adam)[0] is None and "mean of several trajectories" in aggregate_schedule(adam)[1]
    # The audit's report says what it attacked: masked inputs per agent, and the aggregate apart.
    result = run_audit(kept.run_dir, AuditOptions(steps=5, public_samples=40, attacks=("update_inversion",)), progress=lambda _: None)
    assert all("masked input" in result["agents"][a]["masked"] for a in ("agent-0", "agent-1"))
    entry = result["agents"]["aggregate of 2 agents"]
    assert entry["kept"] == "secagg.aggregate" and entry["agents"] == ["agent-0", "agent-1"]
    assert entry["attacks"][0]["num_images"] == 2
    assert any("secure aggregation" in note for note in result["notes"])
    section = json.loads((kept.run_dir / "report.json").read_text())["leakage"]
    assert any("masked input" in note for note in section["notes"])


@pytest.mark.broker
def test_over_mosquitto_the_keeper_holds_exactly_the_masked_inputs_sent_and_the_aggregate(tmp_path: Path, mosquitto: Broker) -> None:
    sent: dict[str, np.ndarray] = {}
    unmasked: dict[str, np.ndarray] = {}
    lock = threading.Lock()
    mask = SecAggClient.mask

    def spying_mask(client: SecAggClient, update: np.ndarray, num_samples: int, uniform: bool = False) -> np.ndarray:
        ring = mask(client, update, num_samples, uniform=uniform)
        with lock:
            sent.setdefault(client.me, ring.copy())
            unmasked.setdefault(client.me, update.copy())
        return ring

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SecAggClient, "mask", spying_mask)
        config = dataclasses.replace(method_server_config(tmp_path, "fedavg", {"model": "resnet8", "batch_size": 16}, run_id="audit-sa-mq",
                                                          agents=AGENTS, rounds=1, eval_samples=40, audit=True),
                                     secure_aggregation=True, secagg_stage_timeout_s=30.0)
        fed = mqtt_federation(config, [agent_config("audit-sa-mq", i, AGENTS, train_samples=64, test_samples=16) for i in range(AGENTS)],
                              mosquitto.url)
        report = fed.start().join()
    assert report["rounds"][0]["method"]["secagg"]["stage"] == "done"
    kept = load_kept_run(tmp_path / "run")
    params = SecAggParams()
    for agent in ("agent-0", "agent-1"):
        update = kept.updates[agent]
        assert update.kind == "secagg.masked_input" and update.num_samples == 32
        # Exactly what crossed the broker, read in the agent's layout ...
        wire = _as_named(dequantise(sent[agent], params)[:-1], update.global_weights)
        received = received_update(update)
        assert all(np.array_equal(received[n].numpy(), wire[n]) for n in wire)
        # ... which is not the agent's update.
        plain = _as_named(unmasked[agent], update.global_weights)
        whole = [torch.cat([torch.as_tensor(u[n]).flatten() for n in sorted(plain)]) for u in (received, plain)]
        assert abs(float(F.cosine_similarity(*whole, dim=0))) < 6 / whole[0].numel() ** 0.5
    # The aggregate: the server's new model minus the one the round started from, the mean of the two updates.
    aggregate = kept.aggregate
    assert aggregate is not None and aggregate.agents == ("agent-0", "agent-1") and aggregate.num_samples == 64
    final = fed.coordinator.method.global_state
    plain = [_as_named(unmasked[a], aggregate.global_weights) for a in aggregate.agents]
    mean = {n: (plain[0][n] + plain[1][n]) / 2 for n in plain[0]}  # equal shards: the sample-weighted mean
    for name, delta in received_update(aggregate).items():
        assert np.allclose(delta.numpy(), final[name] - aggregate.global_weights[name], atol=1e-6), name
        assert np.allclose(delta.numpy(), mean[name], atol=1e-5), name
