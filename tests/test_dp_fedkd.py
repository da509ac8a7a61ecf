"""DP-FedAvg for FedKD (edge_agent/methods/fedkd.py, cloud_server/privacy.py): with
``client_clipping`` and ``local`` the agent clips (and noises) its dense mentee update before
SVD-factoring it; the truncated SVD never lengthens it, so what the server rebuilds stays within
C; the server noises the uniform mean (client_clipping) or adds nothing (local); ε is the
accountant's."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import edge_agent.methods.fedkd as fedkd_edge
from cloud_server.methods.fedkd import FedKdServer
from cloud_server.privacy import PrivacyConfig, PrivacyLedger, client_level_epsilon
from cloud_server.report import validate_report
from fedhelpers import agent_config, in_memory_federation, method_server_config, mqtt_federation
from shared_protocol import svd
from shared_protocol.privacy import clip_update, update_norm

FAST_KD = {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32}
C = 0.1
AGENTS = ["agent-0", "agent-1"]


def _std_matches(samples: np.ndarray, std: float, tolerance: float) -> bool:
    """The sample's standard deviation within ``tolerance`` (relative) of ``std``, its mean within
    6 standard errors of 0 (an N(0, std^2) sample of this size)."""
    return abs(samples.std() / std - 1) < tolerance and abs(samples.mean()) < 6 * std / np.sqrt(samples.size)


def _six_sigma(size: int) -> float:
    """Six standard errors of a sample standard deviation (or of a Gaussian vector's norm),
    relative, for ``size`` draws."""
    return 6 / np.sqrt(2 * size)


def _flat(update: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(update[n], dtype=np.float64).ravel() for n in sorted(update)])


class Recorder:
    """Each agent's call of ``privatise_update`` (the update as trained and as factored), and
    each server aggregation (the rebuilt updates, their agents, the update added)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.private: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        self.aggregated: dict[int, tuple[list[str], list[dict[str, np.ndarray]], dict[str, np.ndarray]]] = {}
        self.samples: dict[int, list[int]] = {}
        self.ranks: dict[int, list[dict[str, int]]] = {}  # the factored tensors of each rebuilt update
        privatise, aggregate = fedkd_edge.privatise_update, FedKdServer.aggregate

        def recording_privatise(update, settings, rng):  # type: ignore[no-untyped-def]
            out = privatise(update, settings, rng)
            with self.lock:
                self.private.append(({n: np.array(u) for n, u in update.items()}, {n: np.array(u) for n, u in out[0].items()}))
            return out

        def recording_aggregate(server, staged, round_=0, agents=None):  # type: ignore[no-untyped-def]
            out = aggregate(server, staged, round_, agents)
            self.aggregated[round_] = (list(agents), [dict(s.delta) for s in staged], {n: a.copy() for n, a in out.items()})
            self.samples[round_] = [s.num_samples for s in staged]
            self.ranks[round_] = [dict(s.ranks) for s in staged]
            return out

        monkeypatch.setattr(fedkd_edge, "privatise_update", recording_privatise)
        monkeypatch.setattr(FedKdServer, "aggregate", recording_aggregate)


def _source(delta: dict[str, np.ndarray], factored: dict[str, int], sent: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Which of the agents' privatised updates ``delta`` was rebuilt from: the one its dense
    tensors equal (to float32 rounding)."""
    dense = [n for n in delta if n not in factored]
    found = [u for u in sent if max(float(np.abs(delta[n] - u[n]).max()) for n in dense) < 1e-6]
    assert len(found) == 1
    return found[0]


def _config(tmp_path: Path, run_id: str, rounds: int, fedkd: dict | None = None, **server: object):  # type: ignore[no-untyped-def]
    cfg = method_server_config(tmp_path, "fedkd", {**FAST_KD, **(fedkd or {})}, run_id=run_id, agents=2, rounds=rounds,
                               eval_samples=40)
    return replace(cfg, **server)


def _agents(run_id: str) -> list:
    return [agent_config(run_id, i, 2, train_samples=96, test_samples=32) for i in range(2)]


def test_a_truncated_svd_never_lengthens_a_tensor() -> None:
    rng = np.random.default_rng(5)
    shortened = 0
    for shape in [(16, 144), (32, 16, 3, 3), (10, 64), (64, 32, 1, 1)]:
        array = rng.standard_normal(shape).astype(np.float32)
        norm = float(np.linalg.norm(array.astype(np.float64)))
        for threshold in (0.3, 0.5, 0.8, 0.95, 1.0):
            packed = svd.factorize(array, threshold)
            rebuilt = float(np.linalg.norm(packed.reconstruct().astype(np.float64)))
            assert rebuilt <= norm * (1 + 1e-6), (shape, threshold)
            if packed.mode == "factored" and packed.energy < 1 - 1e-3:
                # The energy kept is the squared norm's share: the bound is tight, not loose.
                assert rebuilt == pytest.approx(norm * np.sqrt(packed.energy), rel=1e-5)
                shortened += 1
    assert shortened >= 4  # truncation did happen: the bound was tested where it bites


def test_client_clipping_fedkd_clips_before_factoring_and_the_server_noises_the_uniform_mean(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    z = 1.0
    # A low T: the truncation drops a visible share of every factored update.
    cfg = _config(tmp_path, "kd-dp-cc", 2, {"threshold_start": 0.5, "threshold_end": 0.5}, dp_fedavg="client_clipping",
                  dp_clip_norm=C, dp_noise_multiplier=z)
    fed = in_memory_federation(cfg, _agents(cfg.run_id))
    server = fed.coordinator.method
    server.ctx.privacy.rng = np.random.default_rng(11)  # the server's noise, drawn again below
    report = fed.start().join(300)
    validate_report(report)
    assert report["status"] == "finished" and [r["status"] for r in report["rounds"]] == ["ok", "ok"]
    # (1) every agent clipped its update to C before factoring; the update as trained was longer.
    assert len(rec.private) == 4
    for trained, factored in rec.private:
        assert update_norm(trained) > 1.5 * C  # positive control: the clipping did something
        assert update_norm(factored) == pytest.approx(C, rel=1e-9)
    replay = PrivacyLedger(PrivacyConfig(dp_fedavg="client_clipping", dp_clip_norm=C, dp_noise_multiplier=z), np.random.default_rng(11))
    for round_ in (1, 2):
        agents, rebuilt, added = rec.aggregated[round_]
        assert sorted(agents) == AGENTS
        # (2) what the server rebuilt from the factors is within C: the truncation only shortened it.
        for delta in rebuilt:
            assert update_norm(delta) <= C * (1 + 1e-6)
        # Positive control: the SVD truncated the factored tensors, so the bound is tested where it bites.
        for delta, factored in zip(rebuilt, rec.ranks[round_]):
            sent = _source(delta, factored, [u for _, u in rec.private])
            assert factored and update_norm({n: delta[n] for n in factored}) < 0.99 * update_norm({n: sent[n] for n in factored})
        # (3) the update added is the noised uniform mean of the rebuilt updates, the same noise drawn again ...
        plain = replay.noised_mean(round_, agents, rebuilt)
        worst = max(float(np.abs(added[n].astype(np.float64) - plain[n]).max()) for n in added)
        assert worst < 1e-6
        # ... and the noise on it has std z C / n (n = 2), not z C nor z C / sqrt(n).
        mean = {n: sum(d[n].astype(np.float64) for d in rebuilt) / 2 for n in added}
        residual = _flat(added) - _flat(mean)
        within = _six_sigma(residual.size)
        assert _std_matches(residual, z * C / 2, within)
        assert not _std_matches(residual, z * C, within) and not _std_matches(residual, z * C / np.sqrt(2), within)
    # (4) the report: ε from Opacus's accountant for (z, q = 1, 2 rounds); per round the norms it saw.
    section = report["privacy"]["dp_fedavg"]
    assert section["mode"] == "client_clipping" and section["noised_rounds"] == 2 and section["sample_rate"] == 1.0
    assert section["epsilon"] == pytest.approx(client_level_epsilon(z, 1.0, 2, 1e-5))
    for record in report["rounds"]:
        dp = record["privacy"]["dp_fedavg"]
        assert dp["aggregated"] == 2 and dp["noise_std_on_mean"] == pytest.approx(z * C / 2) and dp["clipped"] == []
        assert sorted(dp["update_norms"]) == AGENTS and max(dp["update_norms"].values()) <= C + 1e-6
    assert "DP-FedAvg (client_clipping" in (tmp_path / "run" / "summary.md").read_text()


@pytest.mark.broker
def test_local_fedkd_over_mosquitto_uploads_noised_updates_and_the_server_adds_none(
        mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    rec = Recorder(monkeypatch)
    z = 1.0
    cfg = _config(tmp_path, "kd-dp-local", 1, dp_fedavg="local", dp_clip_norm=C, dp_noise_multiplier=z)
    fed = mqtt_federation(cfg, _agents(cfg.run_id), mosquitto.url)
    fed.start().join(300)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished" and report["rounds"][0]["status"] == "ok"
    # (1) each agent's upload, before factoring, is its clipped update plus N(0, (z C)^2) per entry.
    assert len(rec.private) == 2
    for trained, factored in rec.private:
        clipped, norm = clip_update(trained, C)
        assert norm > 1.5 * C
        residual = _flat(factored) - _flat(clipped)
        d, within = residual.size, _six_sigma(residual.size)
        assert _std_matches(residual, z * C, within) and not _std_matches(residual, z * C / 2, within)
        assert update_norm(factored) == pytest.approx(z * C * np.sqrt(d), rel=within)
        assert update_norm(factored) != pytest.approx(z * C * np.sqrt(d) * 1.1, rel=within)  # the bound tells a tenth apart
    # (2) the server rebuilt the noised updates as sent: the noise is full rank, so Eq. 8's rank
    # sends every matrix dense (docs/privacy.md).
    agents, rebuilt, added = rec.aggregated[1]
    assert rec.ranks[1] == [{}, {}]
    for delta in rebuilt:
        sent = _source(delta, {}, [u for _, u in rec.private])
        assert update_norm(delta) == pytest.approx(update_norm(sent), rel=1e-6)
    # (3) the server added nothing: the update is the sample-weighted mean of the rebuilt updates.
    samples = rec.samples[1]
    mean = {n: sum(w * d[n].astype(np.float64) for w, d in zip(samples, rebuilt)) / sum(samples) for n in added}
    assert max(float(np.abs(added[n].astype(np.float64) - mean[n]).max()) for n in added) < 1e-6
    dp = report["rounds"][0]["privacy"]["dp_fedavg"]
    assert "noise_std_on_mean" not in dp and dp["local_agents"] == AGENTS
    section = report["privacy"]["dp_fedavg"]
    assert section["mode"] == "local" and section["sample_rate"] == 1.0
    assert section["epsilon"] == pytest.approx(client_level_epsilon(z, 1.0, 1, 1e-5))
