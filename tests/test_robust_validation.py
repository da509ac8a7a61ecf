"""The checks that need the server's own judgement (cloud_server/robust/validation.py,
validation_screen.py, the label check in methods/fedgkt.py): the rules by hand, the validation set's
carving, FedAvg's and FedKD's updates judged on it, FedGKT's label agreement, the config and
what the report shows. No broker: tests/test_robust_mqtt.py runs the federations."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cloud_server.config import ServerConfig
from cloud_server.methods import ServerContext
from cloud_server.methods.fedavg import FedAvgServer
from cloud_server.methods.fedgkt import FedGktServer
from cloud_server.methods.fedkd import FedKdServer
from cloud_server.records import RoundRecord
from cloud_server.report.markdown import _robustness_md
from cloud_server.robust import MAD_TO_SD, RobustnessConfig
from cloud_server.robust.validation import DefenceConfig, implausible_labels, implausible_validation
from cloud_server.robust.validation_screen import ValidationScreen, load_validation_set
from fldata.datasets import load_dataset, take
from models import load_arrays_into, state_dict_to_arrays
from models.training import logits_of
from shared_protocol.messages import RoundEnd, decode_message, encode_message
from shared_protocol.methods.fedavg import FedAvgUpdate, split_state
from shared_protocol.methods.fedgkt import GktFeatures
from shared_protocol.methods.fedkd import FedKdUpdate, factor_state

# -- the rules, by hand -------------------------------------------------------------------------- #


def test_implausible_validation_by_hand() -> None:
    rises = {"a": -0.2, "b": -0.1, "c": -0.15, "d": 3.0}
    out = implausible_validation(rises, margin=0.5, mad_factor=6.0, global_loss=2.0)
    assert set(out) == {"d"}
    # d's yardstick: the others' median -0.15, MAD 0.05, 6 x 1.4826 x 0.05 = 0.445 < margin 0.5: limit 0.35.
    reason, detail = out["d"]
    assert reason == "implausible_validation"
    assert "validation loss 5" in detail and "+3 from the global model's 2" in detail and "limit +0.35" in detail
    # The MAD term wins when the others spread: others (-1, 0, 1), MAD 1: limit 0 + 8.8956.
    limit = 6.0 * MAD_TO_SD * 1.0
    spread = {"a": -1.0, "b": 0.0, "c": 1.0}
    assert implausible_validation({**spread, "d": limit - 1e-9}, 0.5, 6.0, 2.0) == {}
    assert set(implausible_validation({**spread, "d": limit + 1e-6}, 0.5, 6.0, 2.0)) == {"d"}
    # Exactly at the limit is plausible (others 0 and 0: limit 0.5); a non-finite figure is not.
    assert implausible_validation({"a": 0.0, "b": 0.0, "c": 0.5}, 0.5, 6.0, 2.0) == {}
    assert set(implausible_validation({"a": 0.0, "b": math.nan, "c": 0.1}, 0.5, 6.0, 2.0)) == {"b"}
    # Fewer than three agents are not judged: one has no yardstick, and of two honest agents under
    # label skew the one whose update alone costs more would be judged by the other alone.
    assert implausible_validation({"a": 100.0}, 0.5, 6.0, 2.0) == {}
    assert implausible_validation({"honest": 0.3, "skewed": 2.5}, 0.5, 6.0, 2.0) == {}


def test_implausible_labels_by_hand() -> None:
    agreement = {"a": 0.8, "b": 0.7, "c": 0.75, "d": 0.1}
    out = implausible_labels(agreement, floor=0.3, mad_factor=6.0)
    # d: the others' median 0.75, MAD 0.05: limit 0.75 - 6 x 1.4826 x 0.05 = 0.305; 0.1 is below it and the floor.
    assert set(out) == {"d"} and out["d"][0] == "implausible_labels"
    assert "10.0% of its labels" in out["d"][1] and "30.5%" in out["d"][1]
    # Below the floor but not far below a fleet that is low too (the server has not learnt their classes).
    assert implausible_labels({"a": 0.25, "b": 0.2, "c": 0.3, "d": 0.1}, 0.3, 6.0) == {}
    # Far below the others but above the floor.
    assert implausible_labels(agreement, floor=0.05, mad_factor=6.0) == {}
    # One other agent is no majority; async mode's peers (latest figures of agents not judged now) count.
    assert implausible_labels({"a": 0.8, "d": 0.1}, 0.3, 6.0) == {}
    assert set(implausible_labels({"d": 0.1}, 0.3, 6.0, peers={"a": 0.8, "b": 0.7, "c": 0.75})) == {"d"}
    assert implausible_labels({"d": 0.1}, 0.3, 6.0, peers={"a": 0.8}) == {}


def test_defence_config_bounds_and_server_defaults() -> None:
    with pytest.raises(ValueError, match="validation_agent_train_samples"):
        DefenceConfig(validation_samples=100)
    with pytest.raises(ValueError, match="never the test split"):
        DefenceConfig(validation_split="test")
    with pytest.raises(ValueError, match="validation_loss_margin"):
        DefenceConfig(validation_loss_margin=0)
    with pytest.raises(ValueError, match="plausible_min_label_agreement"):
        DefenceConfig(plausible_min_label_agreement=1.5)
    with pytest.raises(ValueError, match="validation_samples"):
        ServerConfig(validation_samples=-1)
    ours, theirs = ServerConfig().defence_config(), DefenceConfig()
    fields = {f.name for f in dataclasses.fields(DefenceConfig)} - {"validation_dataset"}  # "": the run's dataset
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert not theirs.validates and not theirs.checks_labels  # the papers' server: off
    assert ServerConfig(dataset="synthetic").defence_config().validation_dataset == "synthetic"


def test_the_validation_set_is_held_out_of_the_agents_data_and_the_test_split() -> None:
    cfg = DefenceConfig(validation_samples=300, validation_dataset="synthetic", validation_agent_train_samples=1000, seed=3)
    val = load_validation_set(cfg)
    train = load_dataset("synthetic", "train")
    agents = take(train, 1000, 3)  # what every agent's data.train_samples = 1000, seed 3 takes before partitioning
    assert len(val) == 300 and not np.isin(val.sample_ids, agents.sample_ids).any()
    assert np.isin(val.sample_ids, train.sample_ids).all()  # the training split: never the test split's images
    counts = val.class_counts()
    assert counts.max() - counts.min() <= 1  # stratified
    again = load_validation_set(cfg)
    assert np.array_equal(again.sample_ids, val.sample_ids)  # seeded
    with pytest.raises(ValueError, match="validation_samples = 4500"):
        load_validation_set(dataclasses.replace(cfg, validation_samples=4500))
    with pytest.raises(ValueError, match="nothing is left to hold out"):
        load_validation_set(dataclasses.replace(cfg, validation_agent_train_samples=5000))


# -- FedAvg and FedKD: updates judged on the validation set ------------------------------------------ #


def _val_screen(n: int = 64, seed: int = 0, **cfg: float) -> ValidationScreen:
    """A learnable task: each class its own pattern, plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 32, 32, generator=g)
    labels = torch.arange(n) % 10
    images = patterns[labels] + 0.5 * torch.randn(n, 1, 32, 32, generator=g)
    return ValidationScreen.from_tensors(DefenceConfig(**cfg), images, labels)


def _trained(base: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """``base`` moved as local training would: a small step shared by every agent plus its own
    (tests/test_robust.py's)."""
    common, own = np.random.default_rng(0), np.random.default_rng(seed)
    return {k: (v + 1e-2 * common.normal(size=v.shape) + 5e-3 * own.normal(size=v.shape)).astype(v.dtype)
            if v.dtype.kind == "f" else v for k, v in base.items()}


def _flipped(state: dict[str, np.ndarray], base: dict[str, np.ndarray], scale: float = 40.0) -> dict[str, np.ndarray]:
    """The bench's sign flip of the weights, scaled so that the model is far off (the synthetic honest
    steps barely move the loss); BatchNorm's running statistics kept as the agent's (the bench flips
    them too, which can make a variance negative and the loss NaN: refused as well, but here the
    loss must stay finite to be compared by hand)."""
    return {k: (base[k] - scale * (v.astype(np.float64) - base[k])).astype(v.dtype)
            if v.dtype.kind == "f" and "running" not in k else v for k, v in state.items()}


def _update(agent: str, state: dict[str, np.ndarray], round_: int = 1, version: int = 0) -> FedAvgUpdate:
    weights, ints = split_state(state)
    msg = FedAvgUpdate(run="u", round=round_, sender=agent, instance=f"{agent}-i", num_samples=10, model_version=version,
                       int_buffers=ints, weights=weights)
    return decode_message(encode_message(msg))  # type: ignore[return-value]


def _end(agent: str, round_: int = 1) -> RoundEnd:
    return RoundEnd(run="u", round=round_, sender=agent, num_samples=10, instance=f"{agent}-i", metrics={"train_loss": 1.0})


def test_fedavg_refuses_a_sign_flipped_update_on_the_validation_set(caplog) -> None:  # type: ignore[no-untyped-def]
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0,
                        robustness=RobustnessConfig(quarantine_after=2))
    screen = ctx.validation = _val_screen()
    server = FedAvgServer(ctx, {"model": "resnet8"})
    base = {k: v.copy() for k, v in server.global_state.items()}
    honest = [_trained(base, 1), _trained(base, 2)]
    states = [*honest, _flipped(honest[0], base)]
    for k, s in enumerate(states):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", s))
    with caplog.at_level("WARNING", logger="cloud_server.robust"):
        outcome = server.complete(1, {f"agent-{k}": _end(f"agent-{k}") for k in range(3)}, evaluate=False)
    # The figures by hand: the validation loss of each state, less the global model's.
    work = FedAvgServer(ServerContext(run_id="v", num_classes=10, in_channels=1, device="cpu"), {"model": "resnet8"}).model

    def loss(state: dict[str, np.ndarray]) -> float:
        load_arrays_into(work, state)
        work.eval()
        with torch.no_grad():
            return float(F.cross_entropy(logits_of(work(screen.images)), screen.labels))

    rises = [loss(s) - loss(base) for s in states]
    assert rises[2] > max(rises[:2]) + 0.5  # the flip raises the loss far more than the honest steps
    ledger = ctx.ledger
    ledger.close_round(1, [f"agent-{k}" for k in range(3)])
    section, warnings = ledger.take(1)
    recorded = section["update_validation"]
    assert recorded["samples"] == 64 and recorded["forward_passes"] == 7 * 64 and recorded["margin"] == 0.5
    np.testing.assert_allclose(recorded["global_loss"], loss(base), atol=1e-5)
    np.testing.assert_allclose([recorded["agents"][f"agent-{k}"] for k in range(3)], rises, atol=1e-5)
    assert outcome.used_agents == ["agent-0", "agent-1"]
    assert outcome.excluded["agent-2"].startswith("implausible_validation")
    assert section["refused"] == {"agent-2": {"implausible_validation": {"count": 1, "detail": section["refused"]["agent-2"]
                                                                        ["implausible_validation"]["detail"]}}}
    assert any("agent-2" in w and "implausible_validation" in w for w in warnings)
    lines = [r.getMessage() for r in caplog.records if "implausible_validation" in r.getMessage()]
    assert len(lines) == 1 and "validation_loss_margin 0.5" in lines[0], lines
    assert ledger.streaks == {"agent-0": 0, "agent-1": 0, "agent-2": 1}  # counted towards quarantine
    # The global model is the mean of the two honest states: the flip took no part.
    for k, v in server.global_state.items():
        if v.dtype.kind == "f":
            np.testing.assert_allclose(v, (honest[0][k].astype(np.float64) + honest[1][k]) / 2, atol=1e-5, err_msg=k)


def test_without_a_validation_set_nothing_is_judged_and_the_flip_is_averaged_in() -> None:
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)
    server = FedAvgServer(ctx, {"model": "resnet8"})
    base = {k: v.copy() for k, v in server.global_state.items()}
    honest = [_trained(base, 1), _trained(base, 2)]
    for k, s in enumerate([*honest, _flipped(honest[0], base)]):
        server.on_upload(f"agent-{k}", _update(f"agent-{k}", s))
    outcome = server.complete(1, {f"agent-{k}": _end(f"agent-{k}") for k in range(3)}, evaluate=False)
    assert outcome.used_agents == ["agent-0", "agent-1", "agent-2"]
    assert "update_validation" not in ctx.ledger.take(1)[0]


def test_fedkd_judges_the_global_mentee_plus_each_rebuilt_update() -> None:
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0, rounds=2)
    screen = ctx.validation = _val_screen()
    server = FedKdServer(ctx, {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32})
    rng = np.random.default_rng(0)
    common = {k: 1e-2 * rng.normal(size=v.shape) for k, v in server.global_state.items()}
    deltas = [{k: (c + 5e-3 * rng.normal(size=c.shape)).astype(np.float32) for k, c in common.items()} for _ in range(2)]
    deltas.append({k: (-4 * v).astype(np.float32) for k, v in deltas[0].items()})
    t = server.threshold(1)
    ends = {}
    for k, delta in enumerate(deltas):
        agent = f"agent-{k}"
        layout, factors, packed = factor_state(delta, t)
        deltas[k] = {n: p.reconstruct() for n, p in packed.items()}  # what the server rebuilds
        server.on_upload(agent, FedKdUpdate(run="u", round=1, sender=agent, instance=f"{agent}-i", num_samples=10,
                                            base_version=server.version, payload=server.config.upload, threshold=t,
                                            layout=layout, factors=factors))
        ends[agent] = RoundEnd(run="u", round=1, sender=agent, num_samples=10, instance=f"{agent}-i", metrics={"train_loss": 1.0})
    base = {k: v.copy() for k, v in server.global_state.items()}
    server.complete(1, ends, evaluate=False)
    recorded = ctx.ledger.take(1)[0]["update_validation"]
    from models import build_model
    from models.mentor import forward_with_hidden

    mentee = build_model("resnet8", 10, 1)
    ints = {k: v for k, v in state_dict_to_arrays(mentee).items() if v.dtype.kind != "f"}

    def loss(state: dict[str, np.ndarray]) -> float:
        load_arrays_into(mentee, {**state, **ints})
        mentee.eval()
        with torch.no_grad():
            return float(F.cross_entropy(forward_with_hidden(mentee, screen.images).logits, screen.labels))

    expected = [loss({n: base[n] + d[n] for n in base}) - loss(base) for d in deltas]
    np.testing.assert_allclose([recorded["agents"][f"agent-{k}"] for k in range(3)], expected, atol=1e-4)


# -- FedGKT: the server model's agreement with the agents' labels ------------------------------------ #


def _gkt_ctx(floor: float) -> ServerContext:
    return ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0,
                         defence=DefenceConfig(plausible_min_label_agreement=floor))


def _maps(seed: int) -> np.ndarray:
    return np.maximum(np.random.default_rng(seed).normal(size=(8, 16, 8, 8)), 0).astype(np.float32)


def _gkt_upload(agent: str, maps: np.ndarray, labels: np.ndarray, logits: np.ndarray, round_: int) -> GktFeatures:
    return GktFeatures(run="u", round=round_, sender=agent, split="train", seq=0, instance=f"{agent}-i", features=maps,
                       logits=logits.astype(np.float32), labels=labels.astype(np.int64),
                       sample_ids=np.arange(8, dtype=np.int64) + 100 * int(agent[-1]))


def _gkt_round(server: FedGktServer, round_: int, shuffled: str | None) -> tuple[object, dict[str, tuple[float, float]]]:
    """One round of four agents whose labels are the server model's own predictions on their maps
    (it agrees with all of them), but ``shuffled``'s, moved one class on (it agrees with none);
    edge logits that agree with half of each agent's labels. Returns the outcome and, per agent,
    (server, edge) agreement by hand."""
    server.model.eval()
    expected, ends = {}, {}
    for k in range(4):
        agent = f"a{k}"
        maps = _maps(10 * round_ + k)
        with torch.no_grad():
            predicted = server.model(torch.from_numpy(maps)).argmax(1).numpy()
        labels = (predicted + 1) % 10 if agent == shuffled else predicted
        logits = np.zeros((8, 10))
        logits[np.arange(8), np.where(np.arange(8) < 4, labels, (labels + 1) % 10)] = 5.0  # half agree
        server.on_upload(agent, _gkt_upload(agent, maps, labels, logits, round_))
        expected[agent] = (0.0 if agent == shuffled else 1.0, 0.5)
        ends[agent] = RoundEnd(run="u", round=round_, sender=agent, num_samples=8, instance=f"{agent}-i",
                               uploads={"train": {"batches": 1, "samples": 8}})
    server.model.train()
    return server.complete(round_, ends, evaluate=False), expected


def test_fedgkt_refuses_labels_its_model_does_not_agree_with_from_round_2() -> None:
    server = FedGktServer(_gkt_ctx(0.3), {"server_batch_size": 8, "server_epochs": 1})
    outcome, _ = _gkt_round(server, 1, shuffled="a3")
    assert outcome.used_agents == ["a0", "a1", "a2", "a3"]  # round 1: the model has not trained, nothing judged
    assert "label_agreement" not in server.ctx.ledger.take(1)[0]
    before = {k: v.clone() for k, v in server.model.state_dict().items()}
    outcome, expected = _gkt_round(server, 2, shuffled="a3")
    assert outcome.used_agents == ["a0", "a1", "a2"]
    assert outcome.excluded["a3"].startswith("implausible_labels")
    section, warnings = server.ctx.ledger.take(2)
    figures = section["label_agreement"]
    assert figures["threshold"] == 0.3
    assert {a: (f["server"], f["edge"]) for a, f in figures["agents"].items()} == expected
    assert all(f["samples"] == 8 for f in figures["agents"].values())
    detail = section["refused"]["a3"]["implausible_labels"]["detail"]
    assert "agrees with 0.0% of its labels" in detail and "plausible_min_label_agreement 0.3" in detail
    assert any("a3" in w and "implausible_labels" in w for w in warnings)
    assert any(not torch.equal(before[k], v) for k, v in server.model.state_dict().items())  # trained on the others
    assert "a3" not in {a for a, _ in outcome.downloads}  # no server logits for refused maps


def test_fedgkt_label_check_is_off_by_default_and_trains_on_every_agent() -> None:
    server = FedGktServer(ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0),
                          {"server_batch_size": 8, "server_epochs": 1})
    _gkt_round(server, 1, shuffled="a3")
    outcome, _ = _gkt_round(server, 2, shuffled="a3")
    assert outcome.used_agents == ["a0", "a1", "a2", "a3"]
    assert "label_agreement" not in server.ctx.ledger.take(2)[0]


def test_a_quarantined_fedgkt_agent_is_judged_every_round_and_released_only_once_its_labels_pass() -> None:
    """Quarantine used to skip the label check: a quarantined agent was not judged, so it was
    "plausible" the next round, released, and refused again (refused, quarantined, released...).
    Its maps are scored while it is quarantined (never trained on) and only a judged clean round
    releases it."""
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0,
                        robustness=RobustnessConfig(quarantine_after=1),
                        defence=DefenceConfig(plausible_min_label_agreement=0.3))
    server = FedGktServer(ctx, {"server_batch_size": 8, "server_epochs": 1})
    ledger, agents = ctx.ledger, ["a0", "a1", "a2", "a3"]

    def play(round_: int, shuffled: str | None) -> tuple[object, dict]:  # type: ignore[type-arg]
        outcome, _ = _gkt_round(server, round_, shuffled)
        ledger.close_round(round_, agents)
        return outcome, ledger.take(round_)[0]

    play(1, "a3")  # round 1: the model has not trained, nothing judged
    outcome, _ = play(2, "a3")
    assert outcome.excluded["a3"].startswith("implausible_labels")
    assert ledger.is_quarantined("a3") and ledger.quarantined["a3"]["since"] == 3
    assert ledger.quarantined["a3"]["checks"] == ["implausible_labels"]
    # Four more rounds on shuffled labels, where it used to be released after one: scored every
    # round, refused every round, never released, never trained on.
    for round_ in range(3, 7):
        outcome, section = play(round_, "a3")
        assert outcome.used_agents == ["a0", "a1", "a2"], round_
        assert outcome.excluded["a3"].startswith("implausible_labels"), round_
        assert section["label_agreement"]["agents"]["a3"]["server"] == 0.0, round_
        assert set(section["refused"]) == {"a3"}, round_
        assert "quarantine_events" not in section and ledger.is_quarantined("a3"), round_
        assert section["quarantined"]["a3"]["clean_rounds"] == 0
    # It turns honest: judged clean, released; the maps it sent while quarantined are not used.
    outcome, section = play(7, None)
    assert outcome.used_agents == ["a0", "a1", "a2"] and "quarantined since round 3" in outcome.excluded["a3"]
    assert section["label_agreement"]["agents"]["a3"]["server"] == 1.0 and "refused" not in section
    assert section["quarantine_excluded"] == ["a3"] and "a3" not in {a for a, _ in outcome.downloads}
    assert [(e["agent"], e["event"]) for e in section["quarantine_events"]] == [("a3", "released")]
    assert not ledger.is_quarantined("a3")
    outcome, section = play(8, None)
    assert outcome.used_agents == agents and "a3" in {a for a, _ in outcome.downloads}


# -- wiring: the coordinator, the report ---------------------------------------------------------- #


def test_a_method_that_does_not_share_weights_refuses_a_validation_set(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shared_protocol.transport import InMemoryBroker, InMemoryTransport

    from fedhelpers import make_server, server_config

    cfg = dataclasses.replace(server_config(tmp_path, agents=3), validation_samples=100, validation_agent_train_samples=500)
    with pytest.raises(ValueError, match="validation_samples judges weight updates; fedgkt"):
        make_server(cfg, InMemoryTransport(InMemoryBroker(), "server"))


def test_the_summary_names_the_new_reasons_and_not_the_figures_alone() -> None:
    from cloud_server.robust import RobustnessLedger

    ledger = RobustnessLedger(RobustnessConfig())
    ledger.record(1, "update_validation", {"agents": {"agent-0": -0.1}})
    ledger.record(1, "label_agreement", {"agents": {"agent-0": {"server": 0.8, "edge": 0.7, "samples": 8}}})
    figures_only = RoundRecord(round=1, status="ok", robustness=ledger.take(1)[0]).to_json()
    assert _robustness_md([figures_only]) == []  # every screened round records them: nothing to show
    ledger.refuse(2, "agent-2", "implausible_validation", "validation loss 9.1, +6.8 ...: limit +0.5")
    ledger.refuse(2, "agent-1", "implausible_labels", "the server model agrees with 9.0% of its labels ...")
    section, warnings = ledger.take(2)
    md = "\n".join(_robustness_md([RoundRecord(round=2, status="ok", robustness=section, warnings=warnings).to_json()]))
    assert "implausible_validation x1: validation loss 9.1" in md and "implausible_labels x1" in md
    assert "- `implausible_validation`: the global model plus the update does far worse" in md
    assert "- `implausible_labels`: FedGKT: the server model agrees" in md
