"""DP-FedAvg with secure aggregation (cloud_server/privacy.py, edge_agent/methods/fedavg.py's
``shared_update``): the agents clip (``local``: and noise) before masking, the server adds the
noise to the unmasked sum; the aggregate is plain client-side clipping's to fixed-point
precision, the noise has the stated scale, central DP is refused, the report shows both."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cloud_server.aggregation import weighted_mean
from cloud_server.config import ServerConfig
from cloud_server.privacy import PrivacyConfig, PrivacyLedger, client_level_epsilon
from cloud_server.report import validate_report
from cloud_server.secagg_server import SecAggRounds
from edge_agent.methods.fedavg import FedAvgEdge
from edge_agent.secagg_client import SecAggClient
from fedhelpers import agent_config, in_memory_federation, method_server_config, mqtt_federation
from secagghelpers import Federation
from shared_protocol.errors import SecAggError
from shared_protocol.privacy import update_norm
from shared_protocol.secagg import SecAggParams

RESNET8 = {"model": "resnet8", "batch_size": 32}
C, Z = 0.1, 1.0


def _std_matches(samples: np.ndarray, std: float, tolerance: float = 0.01) -> bool:
    """The sample's standard deviation within ``tolerance`` (relative) of ``std``, its mean within
    6 standard errors of 0 (an N(0, std^2) sample of this size)."""
    return abs(samples.std() / std - 1) < tolerance and abs(samples.mean()) < 6 * std / np.sqrt(samples.size)


def _six_sigma(size: int) -> float:
    """Six standard errors of a sample standard deviation (or of the norm of a Gaussian vector)
    relative to its value, for ``size`` draws: about 1 / sqrt(2 size) each. A chance failure at
    that bound is about one in five hundred million."""
    return 6 / np.sqrt(2 * size)


class Recorder:
    """What each agent passed through ``shared_update`` (the update as trained, and as masked)
    and to ``SecAggClient.mask``, per (round, agent); and each round's global state before and
    after the server's ``SecAggRounds.finish``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.raw_norm: dict[tuple[int, str], float] = {}
        self.masked_update: dict[tuple[int, str], np.ndarray] = {}
        self.uniform: dict[tuple[int, str], bool] = {}
        self.fixed_point_clipped: dict[tuple[int, str], int] = {}
        self.num_samples: dict[str, int] = {}
        self.before: dict[int, dict[str, np.ndarray]] = {}
        self.after: dict[int, dict[str, np.ndarray]] = {}
        shared_update, mask, finish = FedAvgEdge.shared_update, SecAggClient.mask, SecAggRounds.finish

        def recording_shared_update(edge: FedAvgEdge, update: dict, cfg: object) -> dict:
            norm = update_norm(update)
            out = shared_update(edge, update, cfg)
            with self.lock:
                self.raw_norm[(cfg.model_version + 1, edge.ctx.agent_id)] = norm  # type: ignore[attr-defined]
            return out

        def recording_mask(client: SecAggClient, update: np.ndarray, num_samples: int, uniform: bool = False) -> np.ndarray:
            with self.lock:
                self.masked_update[(client.round, client.me)] = update.copy()
                self.uniform[(client.round, client.me)] = uniform
                self.num_samples[client.me] = num_samples
            masked = mask(client, update, num_samples, uniform=uniform)
            with self.lock:
                self.fixed_point_clipped[(client.round, client.me)] = client.clipped
            return masked

        def recording_finish(rounds: SecAggRounds, round_: int, global_state: dict, *args: object) -> object:
            self.before[round_] = {n: a.copy() for n, a in global_state.items()}
            out = finish(rounds, round_, global_state, *args)
            if out is not None:
                self.after[round_] = {n: a.copy() for n, a in out[0].items()}
            return out

        monkeypatch.setattr(FedAvgEdge, "shared_update", recording_shared_update)
        monkeypatch.setattr(SecAggClient, "mask", recording_mask)
        monkeypatch.setattr(SecAggRounds, "finish", recording_finish)

    def updates(self, round_: int, agents: list[str], names: list[str], shapes: dict[str, tuple]) -> list[dict[str, np.ndarray]]:
        """The masked updates of ``round_``, unflattened by name (sorted, as both sides flatten)."""
        out = []
        for agent in agents:
            flat, offset, update = self.masked_update[(round_, agent)], 0, {}
            for name in names:
                size = int(np.prod(shapes[name]))
                update[name] = flat[offset:offset + size].reshape(shapes[name])
                offset += size
            out.append(update)
        return out


def _config(tmp_path: Path, run_id: str, agents: int, rounds: int, **server: object) -> ServerConfig:
    return replace(method_server_config(tmp_path, "fedavg", RESNET8, run_id=run_id, agents=agents, rounds=rounds, eval_samples=40),
                   secure_aggregation=True, secagg_stage_timeout_s=30.0, **server)


def _agents(cfg: ServerConfig, agents: int) -> list:
    # Unequal shards: a sample-weighted mean differs from the uniform one DP-FedAvg takes.
    return [agent_config(cfg.run_id, i, agents, train_samples=48 * (1 + i), test_samples=16) for i in range(agents)]


# --------------------------------------------------------------------------- #
# Over mosquitto: client_clipping with secure aggregation
# --------------------------------------------------------------------------- #


@pytest.mark.broker
def test_client_clipping_on_the_secure_sum_is_plain_client_clippings_aggregate(mosquitto, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    cfg = _config(tmp_path, "dp-sa", 3, 2, dp_fedavg="client_clipping", dp_clip_norm=C, dp_noise_multiplier=Z)
    fed = mqtt_federation(cfg, _agents(cfg, 3), mosquitto.url)
    server = fed.coordinator.method
    server.ctx.privacy.rng = np.random.default_rng(11)  # the server's noise, drawn again below
    fed.start().join()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished" and [r["status"] for r in report["rounds"]] == ["ok", "ok"]
    agents = ["agent-0", "agent-1", "agent-2"]
    names = sorted(n for n, a in server.global_state.items() if a.dtype.kind == "f")
    shapes = {n: server.global_state[n].shape for n in names}
    replay = PrivacyLedger(PrivacyConfig(dp_fedavg="client_clipping", dp_clip_norm=C, dp_noise_multiplier=Z), np.random.default_rng(11))
    params = SecAggParams()
    # Each agent's entries are rounded to half a fixed-point unit; the mean of n carries at most
    # that; the float32 global model adds its own rounding.
    tolerance = 2.0 ** -params.fraction_bits + 1e-6
    for round_ in (1, 2):
        # (2) every agent masked its update clipped to C, with the weight 1 ...
        for agent in agents:
            assert update_norm({"u": rec.masked_update[(round_, agent)]}) <= C * (1 + 1e-9), (round_, agent)
            assert rec.uniform[(round_, agent)] is True and rec.fixed_point_clipped[(round_, agent)] == 0
            # ... and the clipping did something: the update as trained is longer than C (positive control).
            assert rec.raw_norm[(round_, agent)] > 1.5 * C, (round_, agent)
        # (1) the secure aggregate is plain client_clipping's noised mean over the same updates,
        # with the same noise draw.
        updates = rec.updates(round_, agents, names, shapes)
        base = {n: rec.before[round_][n].astype(np.float64) for n in names}
        plain = replay.noised_mean(round_, agents, updates)
        got = {n: rec.after[round_][n].astype(np.float64) - base[n] for n in names}
        worst = max(float(np.abs(got[n] - plain[n]).max()) for n in names)
        assert worst < tolerance, f"round {round_}: secure DP aggregate is {worst:.3g} from plain client_clipping's"
        # Positive controls: the sample-weighted mean with the same noise, and another noise draw,
        # are told apart at this tolerance.
        noise = {n: plain[n] - sum(u[n] for u in updates) / 3 for n in names}
        weighted = weighted_mean(updates, [rec.num_samples[a] for a in agents])
        assert max(float(np.abs(weighted[n] + noise[n] - plain[n]).max()) for n in names) > 5 * tolerance
        other = PrivacyLedger(replay.cfg, np.random.default_rng(12)).noised_mean(round_, agents, updates)
        assert max(float(np.abs(other[n] - plain[n]).max()) for n in names) > 5 * tolerance
        # (3) the aggregate minus the mean of the clipped updates is noise of std z C / n.
        residual = np.concatenate([(got[n] - sum(u[n] for u in updates) / 3).ravel() for n in names])
        within = _six_sigma(residual.size)
        assert _std_matches(residual, Z * C / 3, tolerance=within)
        assert not _std_matches(residual, Z * C, tolerance=within) and not _std_matches(residual, Z * C / np.sqrt(3), tolerance=within)
    # (5) the report: the privacy section with ε per round and for the run, and the secagg figures.
    section = report["privacy"]["dp_fedavg"]
    assert section["mode"] == "client_clipping" and section["secure_aggregation"] is True
    assert section["noised_rounds"] == 2 and section["epsilon"] == pytest.approx(client_level_epsilon(Z, 1.0, 2, 1e-5))
    eps = [e for _, e in section["epsilon_by_round"]]
    assert len(eps) == 2 and eps[0] == pytest.approx(client_level_epsilon(Z, 1.0, 1, 1e-5)) and eps[0] < eps[1] == section["epsilon"]
    for record in report["rounds"]:
        dp = record["privacy"]["dp_fedavg"]
        assert dp["secure_sum"] is True and dp["aggregated"] == 3 and dp["denominator"] == 3
        assert dp["noise_std_on_mean"] == pytest.approx(Z * C / 3) and "update_norms" not in dp  # no single update seen
        secagg = record["method"]["secagg"]
        assert secagg["stage"] == "done" and secagg["survivors"] == agents and secagg["bytes_up"] > 0
    assert not server.staged  # not one plain update crossed the wire
    assert "DP-FedAvg (client_clipping, on the secure sum" in (tmp_path / "run" / "summary.md").read_text()


# --------------------------------------------------------------------------- #
# local with secure aggregation (in memory: the transport is not what is tested)
# --------------------------------------------------------------------------- #


def test_local_dp_is_noised_on_the_agents_and_only_unmasked_by_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    z = 2.0
    cfg = _config(tmp_path, "dp-sa-local", 3, 1, dp_fedavg="local", dp_clip_norm=C, dp_noise_multiplier=z)
    fed = in_memory_federation(cfg, _agents(cfg, 3))
    server = fed.coordinator.method
    report = fed.start().join()
    assert report["rounds"][0]["status"] == "ok"
    agents = ["agent-0", "agent-1", "agent-2"]
    names = sorted(n for n, a in server.global_state.items() if a.dtype.kind == "f")
    shapes = {n: server.global_state[n].shape for n in names}
    updates = rec.updates(1, agents, names, shapes)
    for agent, update in zip(agents, updates):
        assert rec.uniform[(1, agent)] is False  # local DP keeps FedAvg's sample weights
        # What was masked carries the agent's own noise: far longer than C, as N(0, (z C)^2) per entry makes it.
        d = sum(u.size for u in update.values())
        assert update_norm(update) == pytest.approx(z * C * np.sqrt(d), rel=_six_sigma(d))
        assert update_norm(update) != pytest.approx(z * C * np.sqrt(d) * 1.1, rel=_six_sigma(d))  # the bound tells a tenth apart
    # The server added nothing: the new model is the sample-weighted mean of what was masked.
    expected = weighted_mean(updates, [rec.num_samples[a] for a in agents])
    worst = max(float(np.abs(rec.after[1][n].astype(np.float64) - rec.before[1][n] - expected[n]).max()) for n in names)
    assert worst < 4 * 2.0 ** -SecAggParams().fraction_bits
    dp = report["privacy"]["dp_fedavg"]
    assert dp["mode"] == "local" and dp["secure_aggregation"] is True and dp["sample_rate"] == 1.0
    assert dp["epsilon"] == pytest.approx(client_level_epsilon(z, 1.0, 1, 1e-5))


# --------------------------------------------------------------------------- #
# The server's step on its own
# --------------------------------------------------------------------------- #


def test_noise_on_the_secure_sum_has_std_z_c_over_the_sampled_agents() -> None:
    n, z = 4, 1.3
    ledger = PrivacyLedger(PrivacyConfig(dp_fedavg="client_clipping", dp_clip_norm=C, dp_noise_multiplier=z,
                                         secure_aggregation=True), np.random.default_rng(5))
    zeros = {"w": np.zeros(100_000)}
    noise = ledger.noised_secure_mean(1, [f"a{k}" for k in range(n)], zeros, float(n), n)["w"]
    assert _std_matches(noise, z * C / n)
    for wrong in (z * C, z * C / np.sqrt(n), z * C / n * 1.05, z * C / n * 0.95, C / n):  # positive controls
        assert not _std_matches(noise, wrong), wrong
    # An agent sampled and dropped counts as a zero update: the denominator stays the sampled count.
    dropped = ledger.noised_secure_mean(2, ["a0", "a1", "a2"], zeros, 3.0, n)["w"]
    assert _std_matches(dropped, z * C / n) and not _std_matches(dropped, z * C / 3)
    record = ledger.close_round(2, {"a0": {}, "a1": {}, "a2": {}})["dp_fedavg"]
    assert record["aggregated"] == 3 and record["denominator"] == n and record["noised_rounds"] == 2
    # A sum whose weights are not one per survivor (an agent that weighted by its samples) is refused.
    with pytest.raises(SecAggError, match="weight 1"):
        ledger.noised_secure_mean(3, ["a0", "a1"], zeros, 1.37, n)
    assert ledger.noised_rounds == 2  # nothing counted for it


def test_the_secure_sum_knows_the_agents_sampled_when_one_drops() -> None:
    agents, length = ["a0", "a1", "a2", "a3"], 6
    fed = Federation(agents, SecAggParams(), length)
    fed.advertise({a: 10 for a in agents})
    fed.share()
    fed.take_shares()
    rng = np.random.default_rng(0)
    updates = {a: rng.normal(size=length) for a in agents[:3]}  # a3 shared its keys, then went away
    for agent, update in updates.items():
        fed.server.receive(agent, _masked(fed, agent, update))
    fed.server.drop("a3")
    fed.unmask(agents[:3])
    result = fed.server.result
    assert result is not None and result.survivors == agents[:3] and result.sampled == 4
    assert result.weight_sum == pytest.approx(3.0)  # weight 1 each
    assert np.allclose(result.update_sum, sum(updates.values()), atol=3 * 2.0 ** -SecAggParams().fraction_bits)


def _masked(fed: Federation, agent: str, update: np.ndarray) -> object:
    from edge_agent.secagg_client import wire_view
    from secagghelpers import through_wire
    from shared_protocol.secagg_messages import SecAggMaskedInput

    masked = fed.clients[agent].mask(update, 10, uniform=True)
    return through_wire(SecAggMaskedInput(run="sa", round=1, sender=agent, model_version=0, masked=wire_view(masked)))


# --------------------------------------------------------------------------- #
# Refusals
# --------------------------------------------------------------------------- #


def test_central_dp_with_secure_aggregation_is_refused_naming_both_keys_and_the_fix() -> None:
    base = ServerConfig(method="fedavg", secure_aggregation=True, dp_clip_norm=C, dp_noise_multiplier=Z)
    with pytest.raises(ValueError, match=r"secure_aggregation = true conflicts with server\.dp_fedavg = 'central'.*client_clipping"):
        replace(base, dp_fedavg="central")
    for mode in ("client_clipping", "local"):  # the two that hold
        assert replace(base, dp_fedavg=mode).secagg_params() == SecAggParams()
    ServerConfig(method="fedavg", dp_fedavg="central", dp_clip_norm=C, dp_noise_multiplier=Z)  # central alone still holds


def test_a_clip_norm_beyond_the_fixed_point_bound_is_refused() -> None:
    # 32-bit ring, 20 fraction bits: one agent of 4 may carry entries within 2^11 / 4 = 512.
    base = ServerConfig(method="fedavg", secure_aggregation=True, expected_agents=4, dp_fedavg="client_clipping",
                        dp_clip_norm=500.0, dp_noise_multiplier=Z)
    with pytest.raises(ValueError, match="fixed-point bound.*secagg_ring_bits = 64"):
        replace(base, dp_clip_norm=600.0)
    with pytest.raises(ValueError, match="fixed-point bound"):  # local: C plus six standard deviations of its noise
        replace(base, dp_fedavg="local", dp_clip_norm=100.0)
    replace(base, dp_clip_norm=600.0, secagg_ring_bits=64)  # the wider ring holds it


@pytest.mark.parametrize("method", ["fedgkd", "feddistill"])
def test_the_fedavg_family_noises_the_secure_sum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    rec = Recorder(monkeypatch)
    cfg = replace(_config(tmp_path, "dp-sa-fam", 3, 1, dp_fedavg="client_clipping", dp_clip_norm=C, dp_noise_multiplier=Z),
                  method=method)
    report = in_memory_federation(cfg, _agents(cfg, 3)).start().join()
    record = report["rounds"][0]
    assert record["status"] == "ok" and record["method"]["secagg"]["stage"] == "done"
    dp = record["privacy"]["dp_fedavg"]
    assert dp["secure_sum"] is True and dp["aggregated"] == 3 and dp["denominator"] == 3
    assert all(rec.uniform[(1, a)] for a in ("agent-0", "agent-1", "agent-2"))
    assert all(update_norm({"u": u}) <= C * (1 + 1e-9) for u in rec.masked_update.values())
