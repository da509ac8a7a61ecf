"""One evaluation for every method (cloud_server/evaluation.py): every registered method
reports a global and a local accuracy through the same path, on the same global test set;
FedGKT scores every agent's pipeline on the whole balanced set, whatever its shard holds;
evaluation's bytes and FLOPs are kept apart from training's; bad evaluation reports are
refused without stopping anything."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cloud_server.methods as server_methods
from cloud_server.methods.fedgkt_config import FedGktConfig
from cloud_server.centralized import CentralizedTrainer
from cloud_server.evaluation import EvalModel, EvalSet, EvalSetSpec, Evaluation, Evaluator, module_digest
from cloud_server.report import validate_report
from edge_agent.agent import EdgeAgent
from edge_agent.fedgkt_edge import FedGktEdgeBase
from fldata import ArrayDataset, load_agent_subset
from fldata.subsets import AgentDataSpec
from models import build_model, load_arrays_into, training_flops_per_sample
from shared_protocol.errors import ValueRangeError
from shared_protocol.messages import EvalReport, decode_message, encode_message
from shared_protocol.records import EvalCosts
from shared_protocol.transport import InMemoryBroker, InMemoryTransport

from fedhelpers import FAST_GKT, Federation, agent_config, in_memory_federation, make_server, server_config

# Each method at its smallest: ResNet-8 wherever the method lets the model be chosen.
SMALL: dict[str, dict[str, Any]] = {
    "fedgkt": FAST_GKT,
    "fedavg": {"model": "resnet8", "batch_size": 32},
    "fedgkd": {"model": "resnet8", "batch_size": 32},
    "feddistill": {"model": "resnet8", "batch_size": 32},
    "fedbe": {"model": "resnet8", "batch_size": 32, "unlabeled_dataset": "synthetic", "agent_train_samples": 160,
              "unlabeled_samples": 64, "sampled_models": 2, "distill_steps": 6, "distill_batch_size": 16,
              "swa_warmup_steps": 2, "swa_cycle_steps": 2},
    "fedkd": {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 32},
    "splitnn": {"batch_size": 32},
}


def _run(tmp: Path, method: str, rounds: int = 2, **kw: Any) -> dict[str, Any]:
    cfg = dataclasses.replace(server_config(tmp / method, run_id=f"ev-{method}", rounds=rounds, **kw), method=method,
                              method_config=dict(SMALL[method]))
    fed = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)]).start()
    return fed.join(timeout_s=600)


#: The synthetic set's images (fldata's "synthetic": 3 x 32 x 32, 10 classes), which the agents train on.
SYNTHETIC_SHAPE = (3, 32, 32)


def _trained_on_the_edge(method: str, method_config: dict[str, Any]) -> list[tuple[torch.nn.Module, str]]:
    """What an agent of ``method`` trains each round, built from the registry independently of
    the method's own code: (module, loss kind) for the reference FLOP count."""
    c = SYNTHETIC_SHAPE[0]
    if method == "fedkd":
        return [(build_model(method_config[k], 10, c), "ce") for k in ("mentor_model", "mentee_model")]
    if method == "fedgkt":
        return [(build_model(method_config.get("edge_model", "resnet8"), 10, c), "ce")]
    if method == "splitnn":  # the stem alone; its output gradient comes from the server
        return [(build_model(method_config.get("edge_model", "resnet8"), 10, c).extractor, "sum")]
    return [(build_model(method_config["model"], 10, c), "ce")]


def _assert_metered(method: str, report: dict[str, Any], shard_samples: int) -> None:
    """The shared loop's metering, checked against FlopCounterMode (not the layer counter the
    agents use): every agent of every round reports the samples it trained, compute time, and
    training FLOPs per sample at least those of the models it trains and at most 1.5x them
    (teacher forward passes, KD heads), evaluation FLOPs where the round was evaluated, and
    the coordinator's seconds in the method's server hooks: a method that forgets to meter
    fails here."""
    config = report["config"]["method_config"]
    epochs = int(config.get("local_epochs", config.get("edge_epochs", 1)))
    reference = sum(training_flops_per_sample(m, SYNTHETIC_SHAPE, loss=loss, light=False)
                    for m, loss in _trained_on_the_edge(method, config))
    for record in report["rounds"]:
        assert record["per_agent"], method
        for agent, costs in record["per_agent"].items():
            assert costs["samples"] == shard_samples * epochs, (method, agent, costs["samples"])
            assert costs["compute_s"] > 0, (method, agent)
            per_sample = costs["train_flops"] / costs["samples"]
            assert reference <= per_sample <= 1.5 * reference, (method, agent, per_sample, reference)
        assert record["edge_train_flops"] == sum(c["train_flops"] for c in record["per_agent"].values()), method
        if record.get("evaluation"):
            assert record["evaluation"]["edge_eval_flops"] > 0, method  # the agents' evaluation forward passes
        hooks = record["server_hooks_s"]
        assert hooks.get("complete", 0) > 0 and hooks.get("round_config", 0) > 0, (method, hooks)
        assert hooks.get("on_upload", 0) + hooks.get("answer", 0) > 0, (method, hooks)


def test_every_method_is_evaluated_the_same_way(tmp_path: Path) -> None:
    assert set(SMALL) == set(server_methods.KNOWN_METHODS), "a new method needs its small settings here"
    eval_sets = {}
    for method in sorted(SMALL):
        report = _run(tmp_path, method)
        validate_report(report)
        assert report["status"] == "finished", method
        _assert_metered(method, report, shard_samples=80)  # 160 training images over 2 agents
        eval_sets[method] = report["eval_set"]
        for record in report["rounds"]:
            assert record["status"] == "ok", method
            ev = record["evaluation"]
            assert record["accuracy"] is not None and record["accuracy"] == ev["accuracy"]["model"], method
            assert record["local_accuracy"] is not None and record["local_accuracy"] == ev["local_accuracy"]["model"], method
            assert "model" in ev["labels"], method
            assert ev["missing"] == [], method
            # Evaluation's messages are counted apart from the round's training bytes.
            assert ev["bytes"]["down_payload"] > 0, method  # the evaluation requests at least
            assert ev["bytes"]["up_payload"] > 0, method  # and the reports
    # One global test set: the same images, in the same order, for every method of these runs.
    first = eval_sets["fedavg"]
    assert first["samples"] == 80 and len(first["class_counts"]) == 10
    for method, es in eval_sets.items():
        assert es == first, method
    # Centralized training is scored on the same images too.
    central = server_config(tmp_path / "central", run_id="ev-central", rounds=1)
    central = dataclasses.replace(central, method="centralized", method_config={
        "model": "resnet8", "train_samples": 160, "test_samples": 80, "batch_size": 32})
    report = CentralizedTrainer(central).run()
    assert report["eval_set"] == first
    assert report["rounds"][0]["accuracy"] is not None and report["rounds"][0]["local_accuracy"] is not None


def test_fedgkt_scores_every_agent_on_the_whole_balanced_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent whose shard holds one class is still scored on all ten (the global figure),
    with the edge model it sent; its local figure is its own one-class shard."""
    cfg = server_config(tmp_path, run_id="ev-oneclass", rounds=1)
    spec = AgentDataSpec("synthetic", "iid", num_agents=2, seed=0, train_samples=320, test_samples=160)
    shards = [load_agent_subset(spec, i) for i in range(2)]
    train0, test0 = shards[0]
    only = 3
    shards[0] = (train0.subset(np.flatnonzero(train0.labels == only)), test0.subset(np.flatnonzero(test0.labels == only)))
    assert set(shards[0][1].labels.tolist()) == {only}

    scored: list[tuple[int, list[int]]] = []
    original = Evaluator.score

    def spy(self: Evaluator, model: EvalModel) -> tuple[int, int]:
        correct, total = original(self, model)
        labels = np.concatenate([y.numpy() for _, y in self._global_batches()])
        scored.append((total, np.bincount(labels, minlength=10).tolist()))
        return correct, total

    on_device: dict[str, tuple[dict[str, np.ndarray], dict, list[int]]] = {}
    score_edge = FedGktEdgeBase._score_edge

    def device_spy(edge: FedGktEdgeBase, data: ArrayDataset, meter: object) -> dict:
        result = score_edge(edge, data, meter)
        on_device[edge.ctx.agent_id] = ({k: v.copy() for k, v in edge._model_arrays().items()}, result,
                                        np.bincount(data.labels, minlength=10).tolist())
        return result

    monkeypatch.setattr(Evaluator, "score", spy)
    monkeypatch.setattr(FedGktEdgeBase, "_score_edge", device_spy)
    broker = InMemoryBroker()
    coordinator = make_server(cfg, InMemoryTransport(broker, "server"))
    agents = [EdgeAgent(agent_config(cfg.run_id, i, 2), transport=InMemoryTransport(broker, f"agent-{i}"), data=shards[i])
              for i in range(2)]
    report = Federation(coordinator, agents).start().join()
    assert report["status"] == "finished"
    ev = report["rounds"][0]["evaluation"]
    # On the server, 2 agents x (pipeline with the server's statistics, with the agent's own), each over the
    # whole global set, every class present in equal numbers; the two agents' stems are the shared, frozen
    # one, so their pipelines with the server's statistics are one model, scored once: 3 passes. Each
    # ResNet-8 is scored where it lives, on the same set.
    assert len(scored) == 3 and ev["models_scored"] == 3 and ev["models_reused"] == 1
    for total, counts in scored:
        assert total == 80 and counts == [8] * 10
    assert sorted(on_device) == ["agent-0", "agent-1"]
    for agent, (arrays, result, counts) in on_device.items():
        assert counts == [8] * 10 and result["total"] == 80
        # The device's figure is the server's scoring of the same ResNet-8 on its own copy of the set.
        edge = build_model("resnet8", 10, 3)
        load_arrays_into(edge, arrays)
        edge.eval()
        assert Evaluator(coordinator.eval_set).score(EvalModel(lambda x, e=edge: e(x)[0]))[0] == result["correct"]
        assert ev["per_agent"][agent]["accuracy"]["edge"] == result["correct"] / 80
    one_class = ev["per_agent"]["agent-0"]
    assert set(one_class["accuracy"]) == {"model", "personalised_bn", "edge"}
    assert one_class["local_samples"] == len(shards[0][1])
    # The round's figure is the plain mean of the two agents' global figures.
    per_agent = [ev["per_agent"][a]["accuracy"]["model"] for a in ("agent-0", "agent-1")]
    assert per_agent[0] == per_agent[1]  # one pipeline
    assert report["rounds"][0]["accuracy"] == pytest.approx(sum(per_agent) / 2)
    assert report["rounds"][0]["edge_accuracy"] == pytest.approx(
        sum(ev["per_agent"][a]["accuracy"]["edge"] for a in ("agent-0", "agent-1")) / 2)


def test_fedgkt_scores_the_resnet8s_on_the_server_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``edge_scoring = "server"``: the request names no public set, no agent scores the global set,
    and the server scores each ResNet-8 from the copy it was sent: the same figures as on the devices."""
    figures = {}
    for where in ("device", "server"):
        calls: list[str] = []
        score_edge = FedGktEdgeBase._score_edge
        monkeypatch.setattr(FedGktEdgeBase, "_score_edge",
                            lambda edge, data, meter: calls.append(edge.ctx.agent_id) or score_edge(edge, data, meter))
        cfg = server_config(tmp_path / where, run_id=f"ev-{where}", rounds=1, method_config={"edge_scoring": where})
        report = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)]).start().join()
        ev = report["rounds"][0]["evaluation"]
        assert sorted(calls) == (["agent-0", "agent-1"] if where == "device" else [])
        # The server's passes: the shared stem's pipeline once and two personalised ones; plus the ResNet-8s here.
        assert ev["models_scored"] == (3 if where == "device" else 5)
        figures[where] = {a: ev["per_agent"][a]["accuracy"]["edge"] for a in ("agent-0", "agent-1")}
    assert figures["device"] == figures["server"]
    with pytest.raises(ValueError, match="fedgkt.edge_scoring"):
        FedGktConfig(edge_scoring="cloud")


def test_evaluation_costs_are_not_training_costs(tmp_path: Path) -> None:
    """The same FedGKT run evaluated every round and never (eval_every larger than the run,
    but the last round is always evaluated): training bytes of round 1 do not change."""
    every = _run(tmp_path / "every", "fedgkt", rounds=2)
    rare = _run(tmp_path / "rare", "fedgkt", rounds=2, eval_every=5)
    assert rare["rounds"][0]["accuracy"] is None and "evaluation" not in rare["rounds"][0]
    assert every["rounds"][0]["bytes"]["up_payload"] == pytest.approx(rare["rounds"][0]["bytes"]["up_payload"], rel=0.02)
    ev = every["rounds"][0]["evaluation"]
    # The test maps went up as evaluation (80 samples x 16 x 32 x 32 fp16, compressed at most ~10x).
    assert ev["bytes"]["up_payload"] > 80 * 16 * 32 * 32 * 2 / 10
    assert ev["edge_eval_flops"] > 0
    assert every["totals"]["eval_bytes"]["up_payload"] >= ev["bytes"]["up_payload"]


def test_eval_report_validation() -> None:
    def report(**kw: Any) -> EvalReport:
        base = dict(run="r", round=1, sender="a", instance="i", costs=EvalCosts())
        return EvalReport(**{**base, **kw})

    ok = report(results={"model": {"correct": 3, "total": 4, "loss_sum": 1.5}}, models={"edge/w": np.ones(3, np.float32)})
    back = decode_message(encode_message(ok))
    assert isinstance(back, EvalReport) and back.results == ok.results and np.array_equal(back.models["edge/w"], np.ones(3))
    bad = [
        report(results={"model": {"correct": 5, "total": 4}}),
        report(results={"model": {"correct": True, "total": 4}}),
        report(results={"model": {"correct": 1, "total": 4, "loss_sum": -1.0}}),
        report(results={"model": 3}),
        report(models={"w": np.ones(3, np.float32)}),
        report(models={"edge/w": np.array([1.0, np.nan], np.float32)}),
    ]
    for msg in bad:
        with pytest.raises(ValueRangeError):
            decode_message(encode_message(msg))


def test_evaluator_means_over_agents_and_weights_local_by_samples() -> None:
    eval_set = EvalSet.load(EvalSetSpec("synthetic", samples=40, seed=0))
    assert eval_set is not None and len(eval_set) == 40

    def constant(k: int) -> EvalModel:
        return EvalModel(lambda x: torch.nn.functional.one_hot(torch.full((x.shape[0],), k), 10).float())

    ev = Evaluation(global_models={"model": {"a": constant(0), "b": constant(1)}},
                    local={"model": {"a": (1, 4), "b": (30, 36)}})
    figures = Evaluator(eval_set).run(ev)
    assert figures.accuracy["model"] == pytest.approx(0.1)  # 4 of 40 per class, either constant
    assert figures.local_accuracy["model"] == pytest.approx(31 / 40)  # sample-weighted, not a mean of 0.25 and 0.83
    assert figures.per_agent["b"]["local_accuracy"]["model"] == pytest.approx(30 / 36)
    assert Evaluator(None).run(ev).accuracy == {}  # no global set: local figures only


def test_models_with_the_same_identity_are_scored_once_per_round() -> None:
    eval_set = EvalSet.load(EvalSetSpec("synthetic", samples=40, seed=0))
    calls: dict[str, int] = {}

    def counted(name: str, k: int, identity: str | None) -> EvalModel:
        def forward(x: torch.Tensor) -> torch.Tensor:
            calls[name] = calls.get(name, 0) + 1
            return torch.nn.functional.one_hot(torch.full((x.shape[0],), k), 10).float()
        return EvalModel(forward, identity=identity)

    ev = Evaluation(global_models={"model": {"a": counted("a", 0, "same"), "b": counted("b", 0, "same"),
                                             "c": counted("c", 1, "other"), "d": counted("d", 2, None)},
                                   "edge": {"a": counted("e", 0, "same")}})
    figures = Evaluator(eval_set).run(ev)
    assert "b" not in calls and "e" not in calls and calls["a"] >= 1 and calls["c"] >= 1 and calls["d"] >= 1
    assert figures.per_agent["b"]["accuracy"]["model"] == figures.per_agent["a"]["accuracy"]["model"]
    assert figures.per_agent["a"]["accuracy"]["edge"] == figures.per_agent["a"]["accuracy"]["model"]
    assert (figures.models_scored, figures.models_reused) == (3, 2)
    # The digest tells equal weights from different ones, buffers included.
    one, two = build_model("resnet8", 10, 1), build_model("resnet8", 10, 1)
    two.load_state_dict(one.state_dict())
    assert module_digest(one) == module_digest(two)
    next(iter(b for name, b in two.named_buffers() if name.endswith("running_mean"))).add_(1.0)
    assert module_digest(one) != module_digest(two)
