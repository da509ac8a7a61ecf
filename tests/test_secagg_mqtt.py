"""Secure aggregation over a real mosquitto: what each agent uploads looks like uniform noise,
the aggregate is plain FedAvg's to fixed-point precision, and an agent that drops after
sharing its keys is recovered."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from cloud_server.aggregation import weighted_mean
from edge_agent.secagg_client import SecAggClient
from fedhelpers import agent_config, method_server_config, mqtt_federation
from shared_protocol.secagg import quantise

pytestmark = pytest.mark.broker

RESNET8 = {"model": "resnet8", "batch_size": 32}


class Recorder:
    """Wraps SecAggClient.mask: keeps each agent's update, sample count and masked vector, and
    makes the agents named in ``drop`` fail right after (they shared keys, then went away)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, drop: tuple[str, ...] = ()) -> None:
        self.lock = threading.Lock()
        self.updates: dict[str, np.ndarray] = {}
        self.num_samples: dict[str, int] = {}
        self.masked: dict[str, np.ndarray] = {}
        self.clients: dict[str, SecAggClient] = {}
        original = SecAggClient.mask

        def mask(client: SecAggClient, update: np.ndarray, num_samples: int, uniform: bool = False) -> np.ndarray:
            masked = original(client, update, num_samples, uniform=uniform)
            with self.lock:
                self.updates[client.me], self.num_samples[client.me] = update.copy(), num_samples
                self.masked[client.me], self.clients[client.me] = masked.copy(), client
            if client.me in drop:
                raise RuntimeError(f"{client.me} goes away after sharing its keys")
            return masked

        monkeypatch.setattr(SecAggClient, "mask", mask)


def _run(tmp_path: Path, broker_url: str, agents: int, run_id: str) -> tuple[dict, object]:
    cfg = replace(method_server_config(tmp_path, "fedavg", RESNET8, run_id=run_id, agents=agents, rounds=1, eval_samples=40),
                  secure_aggregation=True, secagg_stage_timeout_s=30.0)
    fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, agents, train_samples=48 * agents + 8 * i, test_samples=16)
                                for i in range(agents)], broker_url)
    initial = dict(fed.coordinator.method.global_state)
    report = fed.start().join()
    return report, (fed.coordinator.method, initial)


def _secure_mean_matches(server: object, initial: dict, rec: Recorder, survivors: list[str]) -> None:
    """The global model after the round against plain FedAvg's weighted mean of the survivors'
    trained models (each rebuilt as the initial model plus the update it masked)."""
    names = sorted(n for n, a in initial.items() if a.dtype.kind == "f")
    states = []
    for agent in survivors:
        flat, offset, state = rec.updates[agent], 0, {}
        for name in names:
            size = initial[name].size
            state[name] = initial[name].astype(np.float64) + flat[offset:offset + size].reshape(initial[name].shape)
            offset += size
        states.append(state)
    plain = weighted_mean(states, [rec.num_samples[a] for a in survivors])
    params = server.secagg.params  # type: ignore[attr-defined]
    # Each agent's entry and weight are rounded to half a fixed-point unit; the ratio's error
    # is then a few units over the summed weight (at least one agent's, up to the roster's).
    tolerance = 4 * len(survivors) * 2.0 ** -params.fraction_bits
    worst = max(float(np.abs(server.global_state[n].astype(np.float64) - plain[n]).max()) for n in names)  # type: ignore[attr-defined]
    assert worst < tolerance, f"secure aggregate is {worst:.3g} from FedAvg's, beyond fixed point's {tolerance:.3g}"
    # Positive control: the unweighted mean (a wrong aggregate) is told apart at this tolerance.
    unweighted = weighted_mean(states, [1.0] * len(states))
    assert max(float(np.abs(unweighted[n] - plain[n]).max()) for n in names) > tolerance


def _uniformity_p(ring: np.ndarray, bits: int) -> float:
    """Chi-square p-value of the top and the bottom byte of every entry against uniform (the
    smaller of the two): a fixed-point update has its top bits all 0 or all 1."""
    ring = ring.astype(np.uint64)
    top = (ring >> np.uint64(bits - 8)) & np.uint64(0xFF)
    low = ring & np.uint64(0xFF)
    return min(float(stats.chisquare(np.bincount(b.astype(np.int64), minlength=256)).pvalue) for b in (top, low))


def test_masked_uploads_look_uniform_and_the_sum_is_fedavgs(mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    rec = Recorder(monkeypatch)
    report, (server, initial) = _run(tmp_path, mosquitto.url, 3, "sa-mq")
    record = report["rounds"][0]
    assert record["status"] == "ok", record
    secagg = record["method"]["secagg"]
    assert secagg["stage"] == "done" and secagg["survivors"] == ["agent-0", "agent-1", "agent-2"]
    assert secagg["recovered_dropped"] == [] and secagg["messages_up"] == 4 * 3 and secagg["bytes_up"] > 0
    assert report["config"]["secure_aggregation"] is True and report["config"]["secagg_ring_bits"] == 32
    _secure_mean_matches(server, initial, rec, secagg["survivors"])
    params = server.secagg.params
    for agent, masked in rec.masked.items():
        # (a) what left the agent: indistinguishable from uniform ring elements (a uniform vector's
        # p-value is itself uniform, and a run judges six of them: the bound keeps a false alarm to
        # about one run in twenty thousand, while a fixed-point vector scores below 1e-12) ...
        assert _uniformity_p(masked, params.ring_bits) > 1e-5, agent
        # ... while the same update unmasked (the positive control) is not.
        client = rec.clients[agent]
        weight = rec.num_samples[agent] / client.weight_scale
        plain, _ = quantise(np.append(rec.updates[agent] * weight, weight), params, len(client.roster))
        assert _uniformity_p(plain, params.ring_bits) < 1e-12, agent
    # Not one FedAvgUpdate crossed the wire: the server took masked inputs only.
    assert not server.staged


def test_an_agent_that_drops_after_sharing_keys_is_recovered(mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    rec = Recorder(monkeypatch, drop=("agent-3",))
    report, (server, initial) = _run(tmp_path, mosquitto.url, 4, "sa-drop")
    record = report["rounds"][0]
    assert record["status"] == "ok", record
    secagg = record["method"]["secagg"]
    assert secagg["roster"] == 4 and secagg["survivors"] == ["agent-0", "agent-1", "agent-2"]
    assert secagg["recovered_dropped"] == ["agent-3"]
    assert "agent-3" in record["missing"]
    _secure_mean_matches(server, initial, rec, secagg["survivors"])
