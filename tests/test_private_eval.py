"""Private models are scored where they live (cloud_server/evaluation.py): FedKD's mentor
and FedGKT's and split learning's private extractors never leave the device; the agents score them on the run's
public global test set (named by its digests, loaded locally or downloaded once) and the
figures equal the ones the server computes centrally from the same models."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cloud_server.audit.audit_run import server_knowledge
from cloud_server.audit.kept import load_kept_run
from cloud_server.audit.registry import attacks_for
from cloud_server.evaluation import EvalModel, EvalSet, EvalSetSpec, Evaluator, check_global_results
from cloud_server.methods.fedgkt_config import FedGktConfig
from cloud_server.methods.splitnn import SplitNNConfig
from edge_agent.methods.splitnn import SplitNNEdge
from cloud_server.report import validate_report
from cloud_server.rounds import OpenRound
from edge_agent.config import DataConfig
from edge_agent.costs import RoundMeter
from edge_agent.public_set import PublicSetMismatchError, PublicTestSet
from fldata.public_set import load_public_test_set
from fldata.torch_data import make_loader
from models import build_model
from models.batchnorm import load_bn_statistics, restoring_bn_statistics
from models.mentor import forward_with_hidden
from shared_protocol.errors import UnknownEvalSetError, ValueRangeError
from shared_protocol.messages import EvalReport, EvalSetData, Message, decode_message, encode_message
from shared_protocol.transport import InMemoryBroker, InMemoryTransport

from fedhelpers import (FAST_GKT, agent_config, in_memory_federation, make_server, method_server_config, mqtt_federation,
                        server_config)

FAST_KD = {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32}


def _capture_decoded(coordinator) -> list[tuple[str, Message]]:  # type: ignore[no-untyped-def]
    """Every message the server decodes from an agent, as (agent, message)."""
    seen: list[tuple[str, Message]] = []
    receive = coordinator.transport.receive

    def spy(*args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        delivery = receive(*args, **kwargs)
        agent = coordinator.topics.agent_of(delivery.topic) if delivery is not None else None
        if agent is not None:
            seen.append((agent, decode_message(delivery.payload, coordinator.limits)))
        return delivery

    coordinator.transport.receive = spy
    return seen


def _tensor_names(msg: Message) -> set[str]:
    """The names of every array a message carries (tensor fields, tensor dicts, layouts)."""
    names: set[str] = set()
    for key, value in vars(msg).items():
        if isinstance(value, dict):
            names |= {str(k) for k in value}
        elif isinstance(value, np.ndarray):
            names.add(key)
    return names


def _last_evaluation(report: dict) -> dict:
    return report["rounds"][-1]["evaluation"]


@torch.no_grad()
def _central(evaluator: Evaluator, forward) -> float:  # type: ignore[no-untyped-def]
    correct, total = evaluator.score(EvalModel(forward))
    return correct / total


@torch.no_grad()
def _on_shard(forward, data) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    correct = total = 0
    for images, labels, _ in make_loader(data, 256):
        correct += int((forward(images).argmax(1) == labels).sum())
        total += int(labels.shape[0])
    return correct, total


# --------------------------------------------------------------------------- #
# FedKD over mosquitto: the mentor never leaves; the figures are the central ones
# --------------------------------------------------------------------------- #


@pytest.mark.broker
@pytest.mark.slow
def test_fedkd_mentor_never_leaves_and_figures_equal_central(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = replace(server_config(tmp_path, run_id="kd-private", audit=True), method="fedkd", method_config=dict(FAST_KD))
    fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)], mosquitto.url)
    seen = _capture_decoded(fed.coordinator)
    report = fed.start().join(300)
    assert report["status"] == "finished"

    mentor_only = set()
    for agent in fed.agents:
        method = agent.method
        mentor_only |= {f"{k}" for k in method.mentor.state_dict()} - {f"{k}" for k in method.mentee.state_dict()}
    assert mentor_only
    types = {msg.TYPE for _, msg in seen}
    assert "eval_report" in types and "fedkd.update" in types
    for _, msg in seen:
        assert not (_tensor_names(msg) & mentor_only), f"{msg.TYPE} carries mentor weights"
        if isinstance(msg, EvalReport):
            assert msg.models == {} and set(msg.global_results) == {"model"}
    kept = json.loads((tmp_path / "run" / "audit" / "kept.json").read_text())
    assert kept["eval_models"] == {}

    # The reported figures are the server's old central scoring of the same mentors.
    ev = _last_evaluation(report)
    evaluator = fed.coordinator.evaluator
    per_agent = {a.config.agent_id: _central(evaluator, lambda x, m=a.method.mentor: forward_with_hidden(m.eval(), x).logits)
                 for a in fed.agents}
    assert ev["accuracy"]["model"] == pytest.approx(float(np.mean(list(per_agent.values()))), abs=1e-12)
    for agent, value in per_agent.items():
        assert ev["per_agent"][agent]["accuracy"]["model"] == pytest.approx(value, abs=1e-12)
    shards = [_on_shard(lambda x, m=a.method.mentor: forward_with_hidden(m.eval(), x).logits, a.test) for a in fed.agents]
    assert ev["local_accuracy"]["model"] == pytest.approx(sum(c for c, _ in shards) / sum(t for _, t in shards), abs=1e-12)
    # Scoring the public set is evaluation's cost, metered as such.
    assert report["rounds"][-1]["evaluation"]["edge_eval_flops"] > 0


# --------------------------------------------------------------------------- #
# FedGKT with a private extractor over mosquitto
# --------------------------------------------------------------------------- #


def test_private_extractor_follows_edge_init_and_train_extractor() -> None:
    assert not FedGktConfig().private_extractor  # server-made and frozen: no secret
    assert FedGktConfig(edge_init="per_agent").private_extractor
    assert FedGktConfig.from_dict({"train_extractor": True}).private_extractor
    assert FedGktConfig.from_dict({"preset": "paper-iid"}).private_extractor  # Algorithm 1 trains the extractor


@pytest.mark.broker
@pytest.mark.slow
def test_fedgkt_private_extractor_never_leaves_and_figures_equal_central(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = server_config(tmp_path, run_id="gkt-private", audit=True,
                        method_config={**FAST_GKT, "train_extractor": True, "personalised_eval": "final"})
    fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, 2, train_samples=96, test_samples=48) for i in range(2)],
                          mosquitto.url)
    seen = _capture_decoded(fed.coordinator)
    report = fed.start().join(300)
    assert report["status"] == "finished"

    edge_names = set(fed.agents[0].method.model.state_dict())
    for _, msg in seen:
        assert not (_tensor_names(msg) & edge_names), f"{msg.TYPE} carries the ResNet-8"
        if msg.TYPE == "fedgkt.features":
            assert msg.split == "train"  # no test maps: the agent scores its shard itself
        if isinstance(msg, EvalReport):
            assert msg.models == {} and msg.uploads == {}
    kept = json.loads((tmp_path / "run" / "audit" / "kept.json").read_text())
    assert kept["eval_models"] == {}

    server = fed.coordinator.method.model.eval()
    evaluator = fed.coordinator.evaluator
    ev = _last_evaluation(report)
    assert set(ev["accuracy"]) == {"model", "edge", "personalised_bn"}
    central: dict[str, list[float]] = {"model": [], "edge": [], "personalised_bn": []}
    local: dict[str, list[tuple[int, int]]] = {"model": [], "edge": [], "personalised_bn": []}
    for agent in fed.agents:
        edge = agent.method.model.eval()
        bn = fed.coordinator.method.agent_bn[agent.config.agent_id]

        def personalised(x, e=edge, stats=bn):  # type: ignore[no-untyped-def]
            with restoring_bn_statistics(server):
                load_bn_statistics(server, stats)
                return server(e.extract(x))

        for label, forward in (("model", lambda x, e=edge: server(e.extract(x))), ("edge", lambda x, e=edge: e(x)[0]),
                               ("personalised_bn", personalised)):
            central[label].append(_central(evaluator, forward))
            local[label].append(_on_shard(forward, agent.test))
    for label in central:
        assert ev["accuracy"][label] == pytest.approx(float(np.mean(central[label])), abs=1e-12), label
        assert ev["local_accuracy"][label] == pytest.approx(sum(c for c, _ in local[label]) / sum(t for _, t in local[label]),
                                                            abs=1e-12), label
    # The server model went down for evaluation: evaluation's bytes, not the round's.
    assert ev["bytes"]["down_payload"] > 2 * sum(v.nbytes for v in fed.coordinator.method.model.state_dict().values()) * 0.5


# --------------------------------------------------------------------------- #
# The public set: downloaded when the agent holds no copy, refused when its copy differs
# --------------------------------------------------------------------------- #


def test_an_agent_without_the_dataset_downloads_the_set_once_as_evaluation_bytes(tmp_path: Path) -> None:
    cfg = replace(server_config(tmp_path, run_id="kd-download", eval_samples=40), method="fedkd", method_config=dict(FAST_KD))
    fed = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2, train_samples=64, test_samples=32) for i in range(2)])
    for agent in fed.agents:  # as a device whose own data is another dataset
        agent.public_test_set.data_config = replace(agent.config.data, dataset="imagefolder")
    seen = _capture_decoded(fed.coordinator)
    report = fed.start().join(300)
    assert report["status"] == "finished"
    assert all(a.public_test_set.source == "download" for a in fed.agents)
    requests = [msg for _, msg in seen if msg.TYPE == "eval_set_request"]
    assert len(requests) == 2  # once per agent and run, though two rounds were evaluated
    set_bytes = fed.coordinator.eval_set.data.images.nbytes
    first, second = (r["evaluation"]["bytes"]["down_payload"] for r in report["rounds"])
    assert first > second + set_bytes // 4  # zstd may shrink the images; they were evaluation's bytes
    evaluator = fed.coordinator.evaluator
    expected = np.mean([_central(evaluator, lambda x, m=a.method.mentor: forward_with_hidden(m.eval(), x).logits)
                        for a in fed.agents])
    assert _last_evaluation(report)["accuracy"]["model"] == pytest.approx(float(expected), abs=1e-12)


def _eval_set(samples: int = 30) -> EvalSet:
    loaded = EvalSet.load(EvalSetSpec("synthetic", samples=samples, seed=0))
    assert loaded is not None
    return loaded


def test_a_local_copy_that_differs_is_refused_by_name() -> None:
    ref = _eval_set().public()
    other = replace(ref, images_sha256="0" * 64)
    holder = PublicTestSet(DataConfig(dataset="synthetic"), request=lambda *a, **k: None, base=lambda r: {})
    assert len(holder.get(ref, RoundMeter(), 1)) == ref.samples and holder.source == "local"
    fresh = PublicTestSet(DataConfig(dataset="synthetic"), request=lambda *a, **k: None, base=lambda r: {})
    with pytest.raises(PublicSetMismatchError, match="gives another global test set than the server's"):
        fresh.get(other, RoundMeter(), 1)


def test_a_downloaded_set_that_is_not_the_named_one_is_refused() -> None:
    ref = _eval_set().public()
    data = load_public_test_set("synthetic", 30, seed=1)  # another draw: other ids

    def request(msg, meter, is_reply, timeout_s):  # type: ignore[no-untyped-def]
        return EvalSetData(run="r", round=1, sender="server", name=data.name, num_classes=data.num_classes,
                           images=data.images, labels=data.labels, sample_ids=data.sample_ids)

    holder = PublicTestSet(DataConfig(dataset="imagefolder"), request=request, base=lambda r: {"run": "r", "round": r, "sender": "a"})
    with pytest.raises(UnknownEvalSetError, match="not the"):
        holder.get(ref, RoundMeter(), 1)


# --------------------------------------------------------------------------- #
# Bad reports: specific errors, and the server goes on
# --------------------------------------------------------------------------- #


def _unchecked_frame(msg: Message) -> bytes:
    """``msg`` encoded without its own checks: what a broken or hostile agent could send."""
    msg.validate = lambda: None  # type: ignore[method-assign]
    return encode_message(msg)


def _report(eval_set: EvalSet, **global_results: dict) -> EvalReport:
    return EvalReport(run="t1", round=1, sender="agent-0", results={"model": {"correct": 3, "total": 10}},
                      global_results=global_results, public_set_sha256=eval_set.images_sha256)


def test_check_global_results_refuses_a_wrong_total_an_unknown_set_and_no_set() -> None:
    eval_set = _eval_set()
    check_global_results(_report(eval_set, model={"correct": 7, "total": 30}), eval_set)
    with pytest.raises(ValueRangeError, match="the global test set has 30 images"):
        check_global_results(_report(eval_set, model={"correct": 7, "total": 29}), eval_set)
    unknown = replace(_report(eval_set, model={"correct": 7, "total": 30}), public_set_sha256="f" * 64)
    with pytest.raises(UnknownEvalSetError, match="this run's is"):
        check_global_results(unknown, eval_set)
    with pytest.raises(UnknownEvalSetError, match="no global test set"):
        check_global_results(_report(eval_set, model={"correct": 7, "total": 30}), None)


@pytest.mark.parametrize("figures, match", [
    ({"correct": 31, "total": 30}, "0 <= correct <= total"),
    ({"correct": -1, "total": 30}, "0 <= correct <= total"),
    ({"correct": 3.5, "total": 30}, "must be ints"),
    ({"correct": 3, "total": 30, "loss_sum": -1.0}, "loss_sum"),
])
def test_out_of_range_global_figures_do_not_decode(figures: dict, match: str) -> None:
    blob = _unchecked_frame(_report(_eval_set(), model=figures))
    with pytest.raises(ValueRangeError, match=match):
        decode_message(blob)


def test_global_figures_without_the_set_they_were_scored_on_do_not_decode() -> None:
    blob = _unchecked_frame(replace(_report(_eval_set(), model={"correct": 3, "total": 30}), public_set_sha256=""))
    with pytest.raises(ValueRangeError, match="public_set_sha256"):
        decode_message(blob)


def test_the_server_rejects_bad_reports_and_keeps_running(tmp_path: Path) -> None:
    cfg = replace(server_config(tmp_path, run_id="t1", eval_samples=30), method="fedkd", method_config=dict(FAST_KD))
    broker = InMemoryBroker()
    coord = make_server(cfg, InMemoryTransport(broker, "server"))
    coord.transport.subscribe(coord.topics.up_any)
    coord.transport.connect()
    agent = InMemoryTransport(broker, "agent-0")
    agent.connect()
    now = time.monotonic()
    rnd = coord.open_rounds[1] = OpenRound(1, True, now, now + 60)
    eval_set = coord.eval_set
    bad = {
        "value_range": _report(eval_set, model={"correct": 3, "total": 29}),
        "unknown_eval_set": replace(_report(eval_set, model={"correct": 3, "total": 30}), public_set_sha256="e" * 64),
    }
    for code, report in bad.items():
        rnd.eval_requested["agent-0"] = now + 60
        coord._on_evaluation_message("agent-0", report)
        assert coord.rejected[code] == 1 and "agent-0" not in rnd.eval_reports
        assert "agent-0" not in rnd.eval_waiting()  # answered wrongly: counted missing, not awaited
    # A frame whose figures are out of range never decodes: rejected, and the server goes on.
    agent.publish(coord.topics.up("agent-0"), _unchecked_frame(_report(eval_set, model={"correct": 40, "total": 30})))
    coord.pump(1.0)
    assert coord.rejected["value_range"] == 2
    rnd.eval_requested["agent-0"] = time.monotonic() + 60
    coord._on_evaluation_message("agent-0", _report(eval_set, model={"correct": 3, "total": 30}))
    assert rnd.eval_reports["agent-0"].global_results == {"model": {"correct": 3, "total": 30}}


# --------------------------------------------------------------------------- #
# Split learning with private extractors over mosquitto
# --------------------------------------------------------------------------- #


def _arrays(msg: Message) -> list[np.ndarray]:
    """Every array a message carries, tensor dicts' included."""
    found: list[np.ndarray] = []
    for value in vars(msg).values():
        if isinstance(value, np.ndarray):
            found.append(value)
        elif isinstance(value, dict):
            found += [v for v in value.values() if isinstance(v, np.ndarray)]
    return found


def _carries_values_of(msg: Message, params: list[np.ndarray]) -> bool:
    """Whether an array of ``msg`` equals one of ``params`` (those of more than a handful of entries)."""
    return any(a.size == p.size and np.array_equal(a.ravel(), p.ravel())
               for a in _arrays(msg) for p in params if p.size > 16)


def _split_run(tmp_path: Path, mosquitto, monkeypatch, extractor: str):  # type: ignore[no-untyped-def]
    """A 2-agent, 2-round run over mosquitto: its report, every message the server decoded, and
    every extractor each agent held (its first draw, after each of its turns)."""
    run_id = f"sl-{extractor}"
    held: dict[str, list[list[np.ndarray]]] = {}  # agent -> one list of arrays per extractor it held
    run_round = SplitNNEdge.run_round

    def recording(self, start, meter):  # type: ignore[no-untyped-def]
        result = run_round(self, start, meter)
        held.setdefault(self.ctx.agent_id, []).append([v.detach().numpy().copy() for v in self.extractor.state_dict().values()])
        return result

    monkeypatch.setattr(SplitNNEdge, "run_round", recording)
    cfg = method_server_config(tmp_path, "splitnn", {"batch_size": 32, "extractor": extractor}, run_id=run_id,
                               eval_samples=40, audit=True)
    agents = [agent_config(run_id, i, 2, train_samples=64, test_samples=32, private_seed=i + 1) for i in range(2)]
    fed = mqtt_federation(cfg, agents, mosquitto.url)
    seen = _capture_decoded(fed.coordinator)
    report = fed.start().join(300)
    assert report["status"] == "finished"
    final = {a.config.agent_id: [p.detach().numpy().copy() for p in a.method.extractor.state_dict().values()]
             for a in fed.agents}
    # Where a private extractor started: drawn again from the agent's own key.
    for a in fed.agents:
        held[a.config.agent_id].insert(0, [p.detach().numpy() for p in build_model(
            a.method.edge_model, a.method.num_classes, a.method.ctx.train.in_channels,
            generator=a.method.ctx.private_generator()).extractor.state_dict().values()])
    return fed, report, seen, held, final


@pytest.mark.broker
@pytest.mark.slow
def test_split_learning_private_extractor_never_leaves_and_figures_equal_central(mosquitto, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fed, report, seen, held, final = _split_run(tmp_path, mosquitto, monkeypatch, "private")
    names = set(fed.agents[0].method.extractor.state_dict())
    # Each agent's own draw, from its private key: not the other's.
    assert not np.array_equal(held["agent-0"][0][0], held["agent-1"][0][0])
    types = {msg.TYPE for _, msg in seen}
    assert {"splitnn.activations", "eval_report"} <= types and "splitnn.extractor" not in types
    for agent, msg in seen:
        assert not (_tensor_names(msg) & names), f"{msg.TYPE} carries extractor weights"
        assert not _carries_values_of(msg, [p for state in held[agent] for p in state]), f"{msg.TYPE} carries an extractor's values"
        if msg.TYPE == "splitnn.activations":
            assert msg.split == "train"  # no test activations: the agent scores its shard itself
        if isinstance(msg, EvalReport):
            assert msg.models == {} and msg.uploads == {} and set(msg.global_results) == {"model"}
    assert fed.coordinator.method.extractor_state == {}
    assert report["defences"]["private_extractor"] is True and report["defences"]["extractor"] == "private"
    validate_report(report)
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "| extractor private to the agent | yes |" in summary

    server = fed.coordinator.method.model.eval()
    evaluator = fed.coordinator.evaluator
    ev = _last_evaluation(report)
    central = {a.config.agent_id: _central(evaluator, lambda x, e=a.method.extractor.eval(): server(e(x))) for a in fed.agents}
    assert ev["accuracy"]["model"] == pytest.approx(float(np.mean(list(central.values()))), abs=1e-12)
    for agent, value in central.items():
        assert ev["per_agent"][agent]["accuracy"]["model"] == pytest.approx(value, abs=1e-12)
    shards = [_on_shard(lambda x, e=a.method.extractor: server(e(x)), a.test) for a in fed.agents]
    assert ev["local_accuracy"]["model"] == pytest.approx(sum(c for c, _ in shards) / sum(t for _, t in shards), abs=1e-12)
    # The server's part went down for evaluation: evaluation's bytes and FLOPs, on the device.
    server_bytes = sum(v.nbytes for v in server.state_dict().values())
    assert ev["bytes"]["down_payload"] > server_bytes  # a copy to each of two agents, zstd-compressed
    assert ev["edge_eval_flops"] > 0

    # The audit assumes no extractor: the white-box and inverse-network attacks do not apply.
    run_dir = tmp_path / "run"
    assert all(not maps.extractor for maps in load_kept_run(run_dir).maps.values())
    knowledge, notes = server_knowledge(load_kept_run(run_dir))
    assert not knowledge.holds("extractor_weights") and "private" in knowledge.note
    plan = attacks_for("splitnn", knowledge)
    assert plan.attacks and not any("extractor_weights" in a.needs for a in plan.attacks)
    assert "white_box_inversion" not in plan.attack_names and "white_box_inversion" in attacks_for("splitnn").attack_names


@pytest.mark.broker
@pytest.mark.slow
def test_split_learning_ring_extractor_is_seen_by_the_same_checks(mosquitto, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The positive control: in the ring the same capture finds the extractor, by name and by value."""
    fed, report, seen, held, final = _split_run(tmp_path, mosquitto, monkeypatch, "ring")
    names = set(fed.agents[0].method.extractor.state_dict())
    by_name = [msg.TYPE for _, msg in seen if _tensor_names(msg) & names]
    assert "splitnn.extractor" in by_name
    last = fed.coordinator.method.turn_order[-1][1]  # its uploaded extractor is the one it still holds
    assert any(_carries_values_of(msg, final[last]) for agent, msg in seen if agent == last)
    for agent, states in held.items():  # and every turn's extractor went up, by value (the first: a private draw, unused here)
        assert len(states) >= 3 and all(any(_carries_values_of(msg, state) for a, msg in seen if a == agent) for state in states[1:])
    assert server_knowledge(load_kept_run(tmp_path / "run"))[0].holds("extractor_weights")


def test_split_learning_extractor_mode_is_checked() -> None:
    assert not SplitNNConfig().private_extractor
    assert SplitNNConfig.from_dict({"extractor": "private"}).private_extractor
    with pytest.raises(ValueError, match=r"splitnn.extractor must be one of \('ring', 'private'\), got 'agent'"):
        SplitNNConfig.from_dict({"extractor": "agent"})
    assert SplitNNConfig().defences_report() is None  # nothing on by default
    assert SplitNNConfig(extractor="private").defences_report()["private_extractor"] is True
