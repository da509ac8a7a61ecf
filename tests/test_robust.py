"""Robustness to a bad device (cloud_server/robust/: its __init__ gathers the names of the modules beside it):
the aggregation rules against hand computations, the configuration bounds, plausibility
checks, the ledger and quarantine, the server step's guard, and what the report shows. No
broker: tests/test_robust_mqtt.py runs the federations."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cloud_server.config import ServerConfig
from cloud_server.methods import ServerContext
from cloud_server.methods.fedavg import FedAvgServer
from cloud_server.methods.fedgkt import FedGktServer
from cloud_server.methods.fedkd import FedKdServer, _check_factors
from cloud_server.records import RoundRecord
from cloud_server.report import format_summary_line
from cloud_server.report.markdown import _robustness_md
from cloud_server.robust import (
    ImplausibleUploadError,
    RobustnessConfig,
    RobustnessLedger,
    aggregate_vectors,
    choose_rule,
    clip_rows,
    direction_cosines,
    implausible_directions,
    implausible_norms,
    krum_scores,
    robust_state_aggregate,
    tolerated,
)
from models.training import Step, StepSkipped, Trainer, Batch
from shared_protocol import svd
from shared_protocol.messages import RoundEnd, decode_message, encode_message
from shared_protocol.methods.fedavg import FedAvgUpdate, split_state
from shared_protocol.methods.fedgkt import GktFeatures, GktReusedMaps
from shared_protocol.methods.fedkd import FedKdUpdate, factor_state

from fedhelpers import distinct_resnet8_state

ONES = [1.0] * 5
POINTS = np.array([[0.0], [1.0], [2.0], [3.0], [100.0]])  # (5, 1): four honest, one far away


# -- the rules, by hand --------------------------------------------------------------------- #


def test_mean_is_sample_weighted() -> None:
    agg, used = aggregate_vectors(np.array([[0.0, 2.0], [4.0, 6.0]]), [1, 3], "mean", 0)
    np.testing.assert_allclose(agg, [3.0, 5.0])  # (1*0 + 3*4)/4, (1*2 + 3*6)/4
    assert used == [0, 1]


def test_median_and_trimmed_mean_by_hand() -> None:
    np.testing.assert_allclose(aggregate_vectors(POINTS, ONES, "median", 1)[0], [2.0])
    # f = 1: drop 0 and 100, mean of 1, 2, 3.
    np.testing.assert_allclose(aggregate_vectors(POINTS, ONES, "trimmed_mean", 1)[0], [2.0])
    # Coordinate-wise, unweighted; an even count takes the mean of the two middle values.
    v = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [100.0, -5.0]])
    np.testing.assert_allclose(aggregate_vectors(v, [1, 1, 1, 100], "median", 1)[0], [2.5, 15.0])
    np.testing.assert_allclose(aggregate_vectors(v, [1, 1, 1, 1], "trimmed_mean", 1)[0], [2.5, 15.0])
    # Ties: equal values are kept or dropped alike.
    np.testing.assert_allclose(aggregate_vectors(np.array([[1.0], [1.0], [1.0], [9.0]]), [1] * 4, "trimmed_mean", 1)[0], [1.0])


def test_krum_and_multi_krum_by_hand() -> None:
    # n = 5, f = 1: each score sums the 5 - 1 - 2 = 2 smallest squared distances.
    # 0: 1 + 4 = 5; 1: 1 + 1 = 2; 2: 1 + 1 = 2; 3: 1 + 4 = 5; 100: 97^2 + 98^2 = 19013.
    np.testing.assert_allclose(krum_scores(POINTS, 1), [5.0, 2.0, 2.0, 5.0, 19013.0])
    agg, used = aggregate_vectors(POINTS, ONES, "krum", 1)
    assert used == [1] and agg.tolist() == [1.0]  # a tie (1 and 2) goes to the first in agent order
    agg, used = aggregate_vectors(POINTS, ONES, "multi_krum", 1)
    assert used == [0, 1, 2, 3]  # m = n - f = 4 best scores
    np.testing.assert_allclose(agg, [1.5])
    agg, _ = aggregate_vectors(POINTS, [1, 1, 1, 5, 1], "multi_krum", 1)  # sample-weighted over the chosen
    np.testing.assert_allclose(agg, [(0 + 1 + 2 + 15) / 8])


@pytest.mark.parametrize("rule", ["mean", "median", "krum", "multi_krum"])
def test_a_single_agent_is_its_own_aggregate(rule: str) -> None:
    choice = choose_rule(rule, 1, 0)
    agg, used = aggregate_vectors(np.array([[3.0, -1.0]]), [7], choice.rule, choice.f)
    assert agg.tolist() == [3.0, -1.0] and used == [0]


def test_clip_rows_by_hand() -> None:
    rows, clipped = clip_rows(np.array([[3.0, 4.0], [0.3, 0.4]]), 1.0)
    np.testing.assert_allclose(rows, [[0.6, 0.8], [0.3, 0.4]])
    assert clipped == [(0, 5.0)]
    same, none = clip_rows(np.array([[3.0, 4.0]]), 0.0)  # 0: off
    assert same.tolist() == [[3.0, 4.0]] and none == []


# -- the bounds: refused configurations, round-time fallback ------------------------------ #


def test_tolerated_count_or_fraction() -> None:
    assert tolerated(10, 2) == 2 and tolerated(10, 0.25) == 2 and tolerated(3, 0.25) == 0 and tolerated(4, 0.25) == 1


@pytest.mark.parametrize("rule, tolerate, agents, ok", [
    ("krum", 1, 4, False),  # n <= 2f + 2
    ("krum", 1, 5, True),
    ("multi_krum", 2, 6, False),
    ("multi_krum", 0.2, 5, True),  # f = 1
    ("median", 2, 4, False),  # needs 2f + 1
    ("median", 2, 5, True),
    ("trimmed_mean", 1, 2, False),
    ("trimmed_mean", 1, 3, True),
    ("trimmed_mean", 0, 5, False),  # trims nothing: say so
    ("mean", 0.5, 5, False),  # a fraction must stay below a half
    ("median", 1.5, 5, False),  # a count is an integer
])
def test_configurations_the_rule_cannot_honour_are_refused(rule: str, tolerate: float, agents: int, ok: bool) -> None:
    if ok:
        RobustnessConfig(aggregation=rule, aggregation_tolerate=tolerate, expected_agents=agents)
        return
    with pytest.raises(ValueError, match="server.aggregation"):
        RobustnessConfig(aggregation=rule, aggregation_tolerate=tolerate, expected_agents=agents)


def test_the_server_config_refuses_krum_with_too_few_agents_naming_the_keys() -> None:
    with pytest.raises(ValueError, match=r"aggregation = 'krum'.*aggregation_tolerate.*expected_agents is 3"):
        ServerConfig(aggregation="krum", aggregation_tolerate=1, expected_agents=3)
    with pytest.raises(ValueError, match="unknown"):
        ServerConfig.from_dict({"server": {"agregation": "median"}})
    assert ServerConfig.from_dict({"server": {"aggregation": "krum", "aggregation_tolerate": 1, "expected_agents": 5}}).aggregation == "krum"


def test_a_round_below_the_bound_falls_back_to_the_median_and_says_so() -> None:
    assert choose_rule("krum", 5, 1).fallback == ""
    choice = choose_rule("krum", 4, 1)  # an agent dropped out
    assert choice.rule == "median" and "krum with f = 1 needs 5" in choice.fallback
    assert choose_rule("trimmed_mean", 2, 1).rule == "median"
    assert "fewer than f = 2" in choose_rule("median", 4, 2).fallback  # the median still runs, flagged


# -- robust aggregation of model states (the FedAvg family) -------------------------------- #


def _ctx(**robust) -> ServerContext:
    cfg = RobustnessConfig(**robust)
    return ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0, robustness=cfg)


def _update(agent: str, state: dict[str, np.ndarray], n: int) -> FedAvgUpdate:
    weights, ints = split_state(state)
    msg = FedAvgUpdate(run="u", round=1, sender=agent, instance=f"{agent}-i", num_samples=n, model_version=0,
                       int_buffers=ints, weights=weights)
    return decode_message(encode_message(msg))  # type: ignore[return-value]


def _end(agent: str, n: int, round_: int = 1) -> RoundEnd:
    return RoundEnd(run="u", round=round_, sender=agent, num_samples=n, instance=f"{agent}-i", metrics={"train_loss": 1.0})


def test_median_of_states_is_the_coordinate_median_and_recorded() -> None:
    server = FedAvgServer(_ctx(aggregation="median", expected_agents=3), {"model": "resnet8"})
    states = [distinct_resnet8_state(s) for s in (1, 2, 3)]
    for k, s in enumerate(states):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", s, 10 * (k + 1)))
    outcome = server.complete(1, {f"agent-{k}": _end(f"agent-{k}", 10 * (k + 1)) for k in range(3)}, evaluate=False)
    assert outcome.used_agents == ["agent-0", "agent-1", "agent-2"]
    for name, first in states[0].items():
        if first.dtype.kind == "f":
            np.testing.assert_allclose(server.global_state[name], np.median(np.stack([s[name] for s in states]), axis=0),
                                       rtol=1e-5, atol=1e-5, err_msg=name)
    section, warnings = server.ctx.ledger.take(1)
    assert section["aggregation"]["rule"] == "median" and section["aggregation"]["used"] == ["agent-0", "agent-1", "agent-2"]


def test_robust_state_aggregate_clips_updates_and_keeps_counters() -> None:
    glob = {"w": np.zeros(2, np.float32), "n": np.asarray(4, np.int64)}
    states = [{"w": np.array([3.0, 4.0], np.float32), "n": np.asarray(10, np.int64)},
              {"w": np.array([0.0, 0.0], np.float32), "n": np.asarray(20, np.int64)}]
    new, figures = robust_state_aggregate(glob, states, [1, 1], RobustnessConfig(clip_update_norm=1.0))
    np.testing.assert_allclose(new["w"], [0.3, 0.4], rtol=1e-6)  # mean of (0.6, 0.8) and 0
    assert int(new["n"]) == 15 and new["n"].dtype == np.int64 and figures["clipped"] == [(0, 5.0)]


# -- plausibility ----------------------------------------------------------------------------- #


def test_implausible_norms_against_the_global_model_and_the_peers() -> None:
    cfg = RobustnessConfig()
    refused = implausible_norms({"a": 1.0, "b": 1.2, "c": 1000.0}, 10.0, cfg)
    assert list(refused) == ["c"] and refused["c"][0] == "implausible_norm" and "1000" in refused["c"][1]
    assert implausible_norms({"a": 1.0, "b": 1.1, "c": 1.3}, 10.0, cfg) == {}
    # No global reference (0): the peers alone, with three or more agents.
    assert list(implausible_norms({"a": 1.0, "b": 1.2, "c": 200.0, "d": 0.9}, 0.0, cfg)) == ["c"]
    assert implausible_norms({"a": 1.0, "b": 200.0}, 0.0, cfg) == {}  # two agents: no majority to compare with
    assert implausible_norms({"a": 1.0, "b": 1.0, "c": 3.0}, 10.0, cfg) == {}  # 3x an honest peer is fine
    # Honest agents under strong skew: FedAvg at Dirichlet(0.1), 4 of 20 agents a round, an honest
    # update reached 12.6x the other three's median (the old default of 5 refused 15 of 120).
    assert implausible_norms({"a": 5.163, "b": 0.99, "c": 0.75, "d": 1.2}, 0.0, cfg) == {}
    assert implausible_norms({"a": 12.6, "b": 1.0, "c": 0.9, "d": 1.1}, 0.0, cfg) == {}


def test_fedavg_refuses_a_scaled_update_and_averages_the_honest_ones() -> None:
    server = FedAvgServer(_ctx(), {"model": "resnet8"})  # default: the mean, checks on
    honest = [distinct_resnet8_state(s) for s in (1, 2)]
    bad = {k: (v * 1000).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in distinct_resnet8_state(3).items()}
    for k, s in enumerate([*honest, bad]):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", s, 10))
    outcome = server.complete(1, {f"agent-{k}": _end(f"agent-{k}", 10) for k in range(3)}, evaluate=False)
    assert outcome.used_agents == ["agent-0", "agent-1"] and outcome.excluded["agent-2"].startswith("implausible_norm")
    for name, first in honest[0].items():
        if first.dtype.kind == "f":
            np.testing.assert_allclose(server.global_state[name], (honest[0][name] + honest[1][name]) / 2, rtol=1e-5, atol=1e-6)
    section, warnings = server.ctx.ledger.take(1)
    assert section["refused"]["agent-2"]["implausible_norm"]["count"] == 1
    assert any("agent-2" in w for w in warnings)


# -- the direction check, by hand ------------------------------------------------------------------- #


def test_direction_cosines_by_hand_over_blocks() -> None:
    updates = np.array([[1.0, 0.0, 2.0], [2.0, 1.0, 1.0], [-4.0, -2.0, -4.0]])  # (3, 3): the third flipped
    # The coordinate-wise median (the agent's own included) is [1, 0, 1], |m|^2 = 2:
    # a.m = 3, |a|^2 = 5; b.m = 3, |b|^2 = 6; c.m = -8, |c|^2 = 36.
    expected = [3 / np.sqrt(10), 3 / np.sqrt(12), -8 / np.sqrt(72)]
    np.testing.assert_allclose(direction_cosines([updates]), expected)
    # Split into tensors (one block each) the figures are the same.
    np.testing.assert_allclose(direction_cosines([updates[:, :2], updates[:, 2:]]), expected)
    cfg = RobustnessConfig(plausible_min_cosine=0.0)
    refused = implausible_directions(dict(zip("abc", expected)), cfg)
    assert list(refused) == ["c"] and refused["c"][0] == "implausible_direction"
    assert "-0.943 < plausible_min_cosine 0" in refused["c"][1] and "3 updates" in refused["c"][1]
    # Off (-1, the default until measured): no cosine is below it.
    assert implausible_directions(dict(zip("abc", expected)), RobustnessConfig(plausible_min_cosine=-1.0)) == {}


def test_direction_cosines_with_ties_and_an_even_count() -> None:
    # Identical updates: the median is each of them.
    np.testing.assert_allclose(direction_cosines([np.array([[1.0, 2.0]] * 3)]), [1.0, 1.0, 1.0])
    # Four agents: each coordinate's median is the mean of the two middle values, ties included:
    # [-6, 1, 2, 3] -> 1.5, [-4, 0, 2, 2] -> 1; m = [1.5, 1], |m|^2 = 3.25.
    four = np.array([[1.0, 0.0], [3.0, 2.0], [2.0, 2.0], [-6.0, -4.0]])
    np.testing.assert_allclose(direction_cosines([four]), [1.5 / np.sqrt(3.25), 6.5 / np.sqrt(13 * 3.25),
                                                           5 / np.sqrt(8 * 3.25), -1.0])
    # A cosine exactly at the threshold is plausible; just below it is not. The median of
    # [1, 1, 0] and [0, 0, 1] is [1, 0]: the third update is orthogonal to it.
    orthogonal = direction_cosines([np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])])
    np.testing.assert_allclose(orthogonal, [1.0, 1.0, 0.0])
    cosines = dict(zip("abc", orthogonal.tolist()))
    assert implausible_directions(cosines, RobustnessConfig(plausible_min_cosine=0.0)) == {}
    assert list(implausible_directions(cosines, RobustnessConfig(plausible_min_cosine=0.01))) == ["c"]


def test_direction_check_needs_three_agents_and_a_direction() -> None:
    cfg = RobustnessConfig(plausible_min_cosine=0.5)
    # One agent is its own median (cosine 1); nothing is judged.
    np.testing.assert_allclose(direction_cosines([np.array([[3.0, -1.0]])]), [1.0])
    assert implausible_directions({"a": 1.0}, cfg) == {}
    # Two agents: the median is their mean, which the larger update sets whatever its sign; an
    # honest update next to one flipped x4 would be the one pointing away. So no check.
    two = direction_cosines([np.array([[1.0, 0.0], [-4.0, 0.0]])])
    np.testing.assert_allclose(two, [-1.0, 1.0])
    assert implausible_directions({"honest": -1.0, "flipped": 1.0}, cfg) == {}
    # A zero update has no direction (NaN, not judged); a zero median leaves every figure NaN.
    zero = direction_cosines([np.array([[1.0, 1.0], [2.0, 1.0], [0.0, 0.0]])])
    assert np.isnan(zero[2]) and np.all(np.isfinite(zero[:2]))
    assert implausible_directions(dict(zip("abc", zero.tolist())), cfg) == {}
    assert np.all(np.isnan(direction_cosines([np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])])))
    with pytest.raises(ValueError, match="plausible_min_cosine"):
        RobustnessConfig(plausible_min_cosine=1.0)
    with pytest.raises(ValueError, match="plausible_min_cosine"):
        RobustnessConfig(plausible_min_cosine=-1.5)


def _trained(base: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """``base`` moved as local training would: a small step shared by every agent (seed 0's)
    plus the agent's own, smaller."""
    common, own = np.random.default_rng(0), np.random.default_rng(seed)
    return {k: (v + 1e-2 * common.normal(size=v.shape) + 5e-3 * own.normal(size=v.shape)).astype(v.dtype)
            if v.dtype.kind == "f" else v for k, v in base.items()}


def _flipped(state: dict[str, np.ndarray], base: dict[str, np.ndarray], scale: float = 4.0) -> dict[str, np.ndarray]:
    """``base - scale (state - base)``: the bench's sign flip."""
    return {k: (base[k] - scale * (v.astype(np.float64) - base[k])).astype(v.dtype) if v.dtype.kind == "f" else v
            for k, v in state.items()}


@pytest.mark.parametrize("threshold", [-1.0, 0.0])
def test_fedavg_refuses_a_sign_flipped_update_by_its_direction(threshold: float, caplog) -> None:  # type: ignore[no-untyped-def]
    server = FedAvgServer(_ctx(plausible_min_cosine=threshold, quarantine_after=2), {"model": "resnet8"})
    base = {k: v.copy() for k, v in server.global_state.items()}
    honest = [_trained(base, s) for s in (1, 2)]
    states = [*honest, _flipped(honest[0], base)]  # the norm is 4x an honest one: plausible
    for k, s in enumerate(states):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", s, 10))
    with caplog.at_level("WARNING", logger="cloud_server.robust"):
        outcome = server.complete(1, {f"agent-{k}": _end(f"agent-{k}", 10) for k in range(3)}, evaluate=False)
    ledger = server.ctx.ledger
    ledger.close_round(1, [f"agent-{k}" for k in range(3)])
    section, warnings = ledger.take(1)
    assert "implausible_norm" not in str(section.get("refused"))
    # The figures by hand: each update's cosine with the coordinate-wise median of the three.
    floats = [n for n, a in base.items() if a.dtype.kind == "f"]
    rows = np.stack([np.concatenate([(s[n].astype(np.float64) - base[n]).ravel() for n in floats]) for s in states])
    med = np.median(rows, axis=0)
    expected = rows @ med / np.linalg.norm(rows, axis=1) / np.linalg.norm(med)
    assert expected[2] < 0 < min(expected[:2])
    recorded = section["update_directions"]
    assert recorded["threshold"] == threshold
    np.testing.assert_allclose([recorded["agents"][f"agent-{k}"] for k in range(3)], expected, atol=1e-6)
    if threshold == -1.0:
        assert outcome.used_agents == ["agent-0", "agent-1", "agent-2"] and "refused" not in section
        return
    assert outcome.used_agents == ["agent-0", "agent-1"]
    assert outcome.excluded["agent-2"].startswith("implausible_direction")
    assert section["refused"]["agent-2"]["implausible_direction"]["count"] == 1
    assert any("agent-2" in w and "implausible_direction" in w for w in warnings)
    # One log line naming the figure and the threshold; counted towards quarantine like any refusal.
    lines = [r.getMessage() for r in caplog.records if "implausible_direction" in r.getMessage()]
    assert len(lines) == 1 and f"{expected[2]:.3f} < plausible_min_cosine 0" in lines[0], lines
    assert ledger.streaks["agent-2"] == 1 and ledger.streaks["agent-0"] == 0


def test_fedavg_direction_check_skips_two_agents_and_judges_among_plausible_norms() -> None:
    server = FedAvgServer(_ctx(plausible_min_cosine=0.0), {"model": "resnet8"})
    base = {k: v.copy() for k, v in server.global_state.items()}
    honest = _trained(base, 1)
    for k, s in enumerate([honest, _flipped(honest, base)]):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", s, 10))
    outcome = server.complete(1, {f"agent-{k}": _end(f"agent-{k}", 10) for k in range(2)}, evaluate=False)
    assert outcome.used_agents == ["agent-0", "agent-1"]  # two agents: no direction check
    section, _ = server.ctx.ledger.take(1)
    assert "update_directions" not in section and "refused" not in section
    # Three uploads of which one is refused for its norm: two are left, no direction check.
    server = FedAvgServer(_ctx(plausible_min_cosine=0.0), {"model": "resnet8"})
    big = {k: (v * 1000).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in distinct_resnet8_state(3).items()}
    for k, s in enumerate([honest, _flipped(honest, base), big]):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", s, 10))
    outcome = server.complete(1, {f"agent-{k}": _end(f"agent-{k}", 10) for k in range(3)}, evaluate=False)
    assert outcome.used_agents == ["agent-0", "agent-1"] and outcome.excluded["agent-2"].startswith("implausible_norm")
    assert "update_directions" not in server.ctx.ledger.take(1)[0]


def test_fedkd_refuses_a_sign_flipped_rebuilt_update() -> None:
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0, rounds=2,
                        robustness=RobustnessConfig(plausible_min_cosine=0.0))
    server = FedKdServer(ctx, {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32})
    t = server.threshold(1)
    rng = np.random.default_rng(0)
    common = {k: 1e-2 * rng.normal(size=v.shape) for k, v in server.global_state.items()}
    deltas = [{k: (c + 5e-3 * rng.normal(size=c.shape)).astype(np.float32) for k, c in common.items()} for _ in range(2)]
    deltas.append({k: (-4 * v).astype(np.float32) for k, v in deltas[0].items()})  # agent-2: agent-0's, flipped x4
    ends = {}
    for k, delta in enumerate(deltas):
        agent = f"agent-{k}"
        layout, factors, _ = factor_state(delta, t)
        server.on_upload(agent, FedKdUpdate(run="u", round=1, sender=agent, instance=f"{agent}-i", num_samples=10,
                                            base_version=server.version, payload=server.config.upload, threshold=t,
                                            layout=layout, factors=factors))
        ends[agent] = RoundEnd(run="u", round=1, sender=agent, num_samples=10, instance=f"{agent}-i",
                               metrics={"train_loss": 1.0})
    outcome = server.complete(1, ends, evaluate=False)
    assert outcome.used_agents == ["agent-0", "agent-1"]
    assert outcome.excluded["agent-2"].startswith("implausible_direction")
    cosines = ctx.ledger.take(1)[0]["update_directions"]["agents"]
    assert cosines["agent-2"] < 0 < min(cosines["agent-0"], cosines["agent-1"])


def test_server_config_defaults_match_the_robustness_defaults() -> None:
    fields = {f.name for f in dataclasses.fields(RobustnessConfig)} - {"expected_agents"}
    ours, theirs = ServerConfig().robustness_config(), RobustnessConfig()
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}


def test_svd_factors_that_no_svd_produces_are_refused() -> None:
    rng = np.random.default_rng(0)
    packed = svd.factorize(rng.normal(size=(16, 8)).astype(np.float32) @ rng.normal(size=(8, 72)).astype(np.float32), 0.9)
    assert packed.mode == "factored"
    _check_factors("w", packed)  # honest factors pass
    bad = svd.SvdTensor(packed.shape, packed.mode, packed.rank, np.full_like(packed.values, 1e10))
    with pytest.raises(ImplausibleUploadError, match="implausible_factors.*U"):
        _check_factors("w", bad)


def _gkt_features(agent: str, seed: int, scale: float = 1.0, logit_scale: float = 1.0, seq: int = 0) -> GktFeatures:
    rng = np.random.default_rng(seed)
    return GktFeatures(run="u", round=1, sender=agent, split="train", seq=seq, instance=f"{agent}-i",
                       features=(np.maximum(rng.normal(size=(8, 16, 8, 8)), 0) * scale).astype(np.float32),
                       logits=(rng.normal(size=(8, 10)) * logit_scale).astype(np.float32),
                       labels=rng.integers(0, 10, 8).astype(np.int64), sample_ids=np.arange(8, dtype=np.int64) + 100 * seed)


def _gkt_end(agent: str) -> RoundEnd:
    return RoundEnd(run="u", round=1, sender=agent, num_samples=8, instance=f"{agent}-i",
                    uploads={"train": {"batches": 1, "samples": 8}})


def test_fedgkt_refuses_out_of_range_maps_and_logits_at_the_door_and_wild_statistics_at_the_close() -> None:
    server = FedGktServer(_ctx(), {"server_batch_size": 8})
    with pytest.raises(ImplausibleUploadError, match="out_of_range.*feature maps reach"):
        server.on_upload("bad", _gkt_features("bad", 9, scale=6e4))
    with pytest.raises(ImplausibleUploadError, match="out_of_range.*logits"):
        server.on_upload("bad", _gkt_features("bad", 9, logit_scale=1e30))
    # Refused batches arrived: they are not asked for again.
    assert server.missing_uploads("bad", _gkt_end("bad")) == []
    for k in range(3):
        server.on_upload(f"a{k}", _gkt_features(f"a{k}", k))
    server.on_upload("loud", _gkt_features("loud", 7, scale=300.0))  # in range, but 300x everyone else
    ends = {a: _gkt_end(a) for a in ("a0", "a1", "a2", "loud", "bad")}
    outcome = server.complete(1, ends, evaluate=False)
    assert outcome.used_agents == ["a0", "a1", "a2"]
    assert "implausible_statistics" in outcome.excluded["loud"] and "refused" in outcome.excluded["bad"]
    assert server.ctx.ledger.take(1)[0]["refused"]["loud"]["implausible_statistics"]["count"] == 1


def test_fedgkt_judges_a_loud_agent_against_peers_whose_maps_are_held_not_sent_again() -> None:
    """With maps sent once, the honest agents' later rounds carry logits and sample ids only:
    their maps count in the comparison with the figure they had when accepted, so a loud agent
    that sends its maps again (refused, so never held) is refused in every round, not only the
    first. Positive control: without the held figure (the reused batches carry logits alone)
    fewer than three agents have a map figure and the loud maps would pass."""
    server = FedGktServer(_ctx(), {"server_batch_size": 8, "lr_schedule": "none"})
    digests = {a: f"{k:x}" * 64 for k, a in enumerate(("a0", "a1", "a2", "loud"), start=1)}

    def upload(agent: str, round_: int, seed: int, scale: float = 1.0, reuse: bool = False) -> None:
        full = dataclasses.replace(_gkt_features(agent, seed, scale=scale), round=round_, maps_digest=digests[agent])
        if reuse:
            server.on_upload(agent, GktReusedMaps(run="u", round=round_, sender=agent, split="train", seq=0,
                                                  instance=full.instance, maps_digest=digests[agent],
                                                  logits=full.logits, sample_ids=full.sample_ids))
        else:
            server.on_upload(agent, full)

    for round_ in (1, 2, 3):
        for k in range(3):
            upload(f"a{k}", round_, k, reuse=round_ > 1)
        upload("loud", round_, 7, scale=300.0)
        ends = {a: dataclasses.replace(_gkt_end(a), round=round_) for a in ("a0", "a1", "a2", "loud")}
        outcome = server.complete(round_, ends, evaluate=False)
        assert outcome.used_agents == ["a0", "a1", "a2"], round_
        assert "implausible_statistics" in outcome.excluded["loud"] and "channel" in outcome.excluded["loud"]
        if round_ > 1:
            assert server.round_report(round_)["maps_reused_batches"] == 3
    assert ("loud", "train") not in server.held and set(server.accepted_map_ms) == {"a0", "a1", "a2"}
    # The control: the held figures forgotten, round 4's reused batches carry no map figure.
    server.accepted_map_ms.clear()
    for k in range(3):
        upload(f"a{k}", 4, k, reuse=True)
    upload("loud", 4, 7, scale=300.0)
    judged, refusals = server._implausible_statistics(4, ["a0", "a1", "a2", "loud"])
    assert judged == ["a0", "a1", "a2", "loud"] and "loud" not in refusals


# -- the ledger and quarantine --------------------------------------------------------------------- #


@pytest.mark.parametrize("release", ["plausible", "never"])
def test_quarantine_after_k_refused_rounds_and_release(release: str) -> None:
    ledger = RobustnessLedger(RobustnessConfig(quarantine_after=2, quarantine_release=release))
    for round_ in (1, 2):
        ledger.refuse(round_, "bad", "out_of_range", "|H| = 6e4")
        ledger.close_round(round_, ["good", "bad"])
        section, warnings = ledger.take(round_)
        assert section["refused"]["bad"]["out_of_range"]["detail"] == "|H| = 6e4"
    assert ledger.is_quarantined("bad") and not ledger.is_quarantined("good")
    assert section["quarantine_events"][0]["event"] == "quarantined" and section["quarantined"]["bad"]["since"] == 3
    assert section["quarantined"]["bad"]["checks"] == ["out_of_range"]
    assert "quarantined" in ledger.exclude_quarantined(3, "bad")
    # Round 3: nothing refused, but the check that refused it did not judge it (only another did): no evidence.
    ledger.examined(3, "implausible_norm", ["good", "bad"])
    ledger.close_round(3, ["good", "bad"])
    section, warnings = ledger.take(3)
    assert section["quarantine_excluded"] == ["bad"] and any("quarantined" in w for w in warnings)
    assert ledger.is_quarantined("bad") and "quarantine_events" not in section
    # Round 4: its uploads passed the door check that refused it.
    ledger.examined(4, "out_of_range", ["good", "bad"])
    ledger.close_round(4, ["good", "bad"])
    section, _ = ledger.take(4)
    assert ledger.is_quarantined("bad") == (release == "never")
    if release == "plausible":
        assert [e["event"] for e in section["quarantine_events"]] == ["released"]
        assert "out_of_range" in section["quarantine_events"][0]["why"] and "quarantined" not in section
    # Checkpointed and restored.
    again = RobustnessLedger(ledger.cfg)
    again.load_state(ledger.state())
    assert again.is_quarantined("bad") == (release == "never") and again.streaks == ledger.streaks
    assert again.state() == ledger.state()


def test_one_refused_round_does_not_quarantine_and_a_plausible_one_resets_the_streak() -> None:
    ledger = RobustnessLedger(RobustnessConfig(quarantine_after=2))
    for round_, refused in ((1, True), (2, False), (3, True)):
        if refused:
            ledger.refuse(round_, "x", "implausible_norm", "big")
        else:  # judged by the norm check, and plausible
            ledger.examined(round_, "implausible_norm", ["x"])
        ledger.close_round(round_, ["x"])
    assert not ledger.is_quarantined("x") and ledger.streaks["x"] == 1
    off = RobustnessLedger(RobustnessConfig(quarantine_after=0))
    for round_ in range(1, 6):
        off.refuse(round_, "x", "implausible_norm", "big")
        off.close_round(round_, ["x"])
    assert not off.is_quarantined("x")


def test_a_round_the_checks_could_not_judge_an_agent_in_neither_breaks_nor_extends_its_streak() -> None:
    ledger = RobustnessLedger(RobustnessConfig(quarantine_after=2))
    ledger.refuse(1, "x", "implausible_direction", "cosine -0.9")
    ledger.close_round(1, ["x"])
    # Round 2: two agents, no direction judged; the norm check passed it (not what refused it).
    ledger.examined(2, "implausible_norm", ["x"])
    ledger.close_round(2, ["x"])
    assert ledger.streaks["x"] == 1 and not ledger.is_quarantined("x")
    ledger.refuse(3, "x", "implausible_direction", "cosine -0.8")
    ledger.close_round(3, ["x"])
    assert ledger.is_quarantined("x") and ledger.quarantined["x"]["checks"] == ["implausible_direction"]


def test_release_takes_the_configured_consecutive_judged_clean_rounds_of_every_check_that_refused_it() -> None:
    ledger = RobustnessLedger(RobustnessConfig(quarantine_after=1, quarantine_release_after=2))
    ledger.refuse(1, "x", "implausible_labels", "agrees with 0%")
    ledger.close_round(1, ["x"])
    assert ledger.quarantined["x"]["checks"] == ["implausible_labels"]

    def close(round_: int, examined: tuple[str, ...] = (), refused: str | None = None) -> bool:
        for reason in examined:
            ledger.examined(round_, reason, ["x"])
        if refused:
            ledger.refuse(round_, "x", refused, "again")
        ledger.close_round(round_, ["x"])
        ledger.take(round_)
        return ledger.is_quarantined("x")

    assert close(2, ("implausible_labels",)) and ledger.quarantined["x"]["clean_rounds"] == 1
    assert close(3, refused="implausible_statistics")  # refused again: the count starts over, and this check is owed too
    q = ledger.quarantined["x"]
    assert (q["clean_rounds"], q["checks"]) == (0, ["implausible_labels", "implausible_statistics"])
    assert close(4, ("implausible_labels", "implausible_statistics"))
    assert close(5, ("implausible_labels",))  # the statistics were not judged (two agents): no evidence, no reset
    assert close(6, ()) and ledger.quarantined["x"]["clean_rounds"] == 1
    ledger.close_round(7, [])  # it did not finish round 7: its state stands
    assert ledger.quarantined["x"]["clean_rounds"] == 1
    assert not close(8, ("implausible_labels", "implausible_statistics"))
    assert ledger.history[-1]["event"] == "released" and ledger.history[-1]["round"] == 8
    assert ledger.streaks["x"] == 0 and "x" not in ledger.streak_reasons


def test_a_checkpoint_from_before_the_evidence_rule_releases_as_it_did() -> None:
    ledger = RobustnessLedger(RobustnessConfig(quarantine_after=2))
    ledger.load_state({"streaks": {"x": 1, "y": 3}, "quarantined": {"y": {"since": 4, "why": "refused"}}, "history": []})
    assert ledger.quarantined["y"] == {"since": 4, "why": "refused", "checks": [], "clean_rounds": 0}
    ledger.close_round(4, ["x", "y"])  # nothing refused: as before, the streak ends and the quarantine lifts
    assert ledger.streaks["x"] == 0 and not ledger.is_quarantined("y")


def test_quarantine_release_after_is_a_count_of_rounds() -> None:
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="quarantine_release_after"):
            RobustnessConfig(quarantine_release_after=bad)  # type: ignore[arg-type]
    assert RobustnessConfig(quarantine_release_after=3).quarantine_release_after == 3


# -- the server step's guard --------------------------------------------------------------------- #


def test_a_guarded_step_is_skipped_without_touching_the_model_and_gradients_are_clipped() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    step = Step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy)
    step.max_grad_norm = 1e-3
    x = torch.randn(6, 4)
    y = torch.randint(0, 3, (6,))
    seen: list[int] = []

    def guard(loss: torch.Tensor) -> None:
        if len(seen) == 1:
            raise StepSkipped("the second batch")
        seen.append(1)

    trainer = Trainer(step, guard=guard)
    skipped: list[str] = []
    trainer.add_callback("on_batch_skipped", lambda t: skipped.append(t.skip_reason))
    before = [p.detach().clone() for p in model.parameters()]
    wild = Batch(x * 1e6, (y,))
    result = trainer.run(1, lambda epoch: [Batch(x, (y,)), wild])
    assert skipped == ["the second batch"] and trainer.skipped == 1 and result.steps == 1 and result.samples == 6
    moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert float(moved) <= 0.1 * 1e-3 + 1e-7  # lr x the clipped norm: the first step only, clipped
    assert step.clipped == 1


# -- the report --------------------------------------------------------------------------------------- #


def test_the_round_record_console_line_and_summary_show_refusals() -> None:
    ledger = RobustnessLedger(RobustnessConfig())
    ledger.refuse(2, "agent-2", "out_of_range", "feature maps reach |H| = 6e+04, above server.feature_abs_limit = 1e+04")
    ledger.refuse(2, "agent-2", "out_of_range", "again")
    ledger.clip(2, "agent-1", "update_norm")
    ledger.close_round(2, ["agent-0", "agent-1", "agent-2"])
    section, warnings = ledger.take(2)
    record = RoundRecord(round=2, status="ok", participants=["agent-0", "agent-1", "agent-2"], completed=["agent-0", "agent-1"],
                         missing=["agent-2"], robustness=section, warnings=warnings).to_json()
    back = RoundRecord.from_json(record, "round")
    assert back.robustness["refused"]["agent-2"]["out_of_range"]["count"] == 2
    line = format_summary_line(record, 3)
    assert "[warning: refused agent-2; clipped agent-1]" in line
    md = "\n".join(_robustness_md([record]))
    assert "## Robustness" in md and "out_of_range x2" in md and "6e+04" in md
    clean = RoundRecord(round=1, status="ok").to_json()
    assert "robustness" not in clean and "warning" not in format_summary_line(clean, 3)
    assert _robustness_md([clean]) == []


# -- wiring: the coordinator, the round-time fallback, FedGKT's guarded step ------------------- #


def test_a_method_that_does_not_aggregate_weights_refuses_a_robust_rule(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shared_protocol.transport import InMemoryBroker, InMemoryTransport

    from fedhelpers import make_server, server_config

    cfg = dataclasses.replace(server_config(tmp_path, agents=3), aggregation="median")
    with pytest.raises(ValueError, match="server.aggregation = 'median'.*fedgkt does not"):
        make_server(cfg, InMemoryTransport(InMemoryBroker(), "server"))


def test_fedavg_krum_with_an_agent_short_falls_back_to_the_median_and_warns() -> None:
    server = FedAvgServer(_ctx(aggregation="krum", aggregation_tolerate=1, expected_agents=5), {"model": "resnet8"})
    states = [distinct_resnet8_state(s) for s in (1, 2, 3, 4)]  # 4 of the 5 expected: krum with f = 1 needs 5
    for k, s in enumerate(states):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", s, 10))
    server.complete(1, {f"agent-{k}": _end(f"agent-{k}", 10) for k in range(4)}, evaluate=False)
    name = "classifier.fc.weight"
    np.testing.assert_allclose(server.global_state[name], np.median(np.stack([s[name] for s in states]), axis=0), rtol=1e-5, atol=1e-6)
    section, warnings = server.ctx.ledger.take(1)
    assert section["aggregation"]["rule"] == "median" and "krum with f = 1 needs 5" in section["aggregation"]["fallback"]
    assert any("the median instead" in w for w in warnings)


def test_fedgkt_guarded_server_step_skips_a_non_finite_batch_and_names_the_agent() -> None:
    server = FedGktServer(_ctx(plausibility_checks=False, server_grad_clip_norm=1.0),
                          {"server_batch_size": 8, "server_order": "per_agent"})
    honest = _gkt_features("a0", 0)
    wild = _gkt_features("bad", 1, scale=1e30)  # staged as float16: inf, so the loss is not finite
    server.on_upload("a0", honest)
    server.on_upload("bad", wild)
    outcome = server.complete(1, {"a0": _gkt_end("a0"), "bad": _gkt_end("bad")}, evaluate=False)
    assert outcome.used_agents == ["a0", "bad"]
    assert all(torch.isfinite(p).all() for p in server.model.parameters())
    assert all(torch.isfinite(b).all() for m in server.norms for b in (m.running_mean, m.running_var))
    section, warnings = server.ctx.ledger.take(1)
    assert section["skipped_steps"] == {"bad": 1}
    assert server.round_report(1)["server_steps_skipped"] == 1
    # Unguarded (the default, the paper's step), the same batch poisons the model.
    plain = FedGktServer(_ctx(plausibility_checks=False), {"server_batch_size": 8, "server_order": "per_agent"})
    plain.on_upload("a0", honest)
    plain.on_upload("bad", wild)
    plain.complete(1, {"a0": _gkt_end("a0"), "bad": _gkt_end("bad")}, evaluate=False)
    assert not all(torch.isfinite(p).all() for p in plain.model.parameters())


def test_a_quarantined_agent_is_judged_but_not_used_until_released() -> None:
    server = FedAvgServer(_ctx(quarantine_after=1), {"model": "resnet8"})
    ledger = server.ctx.ledger
    ledger.refuse(1, "agent-2", "implausible_norm", "update norm 1e5 > 300")
    ledger.close_round(1, ["agent-0", "agent-1", "agent-2"])
    ledger.take(1)
    assert ledger.is_quarantined("agent-2")
    states = [distinct_resnet8_state(s) for s in (1, 2, 3)]
    for k, s in enumerate(states):  # round 2: agent-2's update is plausible now
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", s, 10))
    outcome = server.complete(1, {f"agent-{k}": _end(f"agent-{k}", 10) for k in range(3)}, evaluate=False)
    assert outcome.used_agents == ["agent-0", "agent-1"] and "quarantined since round 2" in outcome.excluded["agent-2"]
    ledger.close_round(1, ["agent-0", "agent-1", "agent-2"])
    section, _ = ledger.take(1)
    assert section["quarantine_excluded"] == ["agent-2"] and section["quarantine_events"][-1]["event"] == "released"
    assert not ledger.is_quarantined("agent-2")  # used again from the next round


#: Every public name the single module cloud_server.robust defined before it was split, and the module that holds it now.
ROBUST_NAMES = {
    "config": ("AGGREGATION_RULES", "QUARANTINE_RELEASES", "MAD_TO_SD", "PLAUSIBLE_MIN_COSINE", "DIRECTION_MIN_AGENTS",
               "ImplausibleUploadError", "RobustnessConfig", "tolerated"),
    "rules": ("RuleChoice", "choose_rule", "krum_scores", "aggregate_vectors", "clip_rows", "flatten", "unflatten",
              "robust_state_aggregate"),
    "checks": ("robust_median", "implausible_norms", "direction_cosines", "implausible_directions"),
    "screening": ("UpdateBlocks", "screen_uploads"),
    "ledger": ("RobustnessLedger",),
}


def test_the_old_import_path_gives_every_name_from_the_module_that_holds_it() -> None:
    import importlib

    import cloud_server.robust as facade

    for module, names in ROBUST_NAMES.items():
        home = importlib.import_module(f"cloud_server.robust.{module}")
        for name in names:
            assert getattr(facade, name) is getattr(home, name), f"cloud_server.robust.{name} is not {module}.{name}"
            assert name in facade.__all__
    # The ledger logs under the name its lines always had.
    import cloud_server.robust.ledger as ledger_module

    assert ledger_module.log.name == "cloud_server.robust"
