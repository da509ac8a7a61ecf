"""The onnxruntime-training backend: artifacts, parity with the torch backend, weights format."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime.training", reason="onnxruntime-training is not installed (pip install 'edgesplit[edge-lite]')")
torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from edge_agent.backends.optim import make_numpy_optimizer  # noqa: E402
from edge_agent.backends.ort import ArtifactMeta, OrtEdgeModel  # noqa: E402
from models.training import Step, make_optimizer  # noqa: E402
from fldata import make_synthetic  # noqa: E402
from fldata.numpy_data import iterate_batches  # noqa: E402
from models import build_model, load_arrays_into, state_dict_to_arrays  # noqa: E402
from models.losses import kd_loss  # noqa: E402
from models.onnx_export import export_edge_artifacts  # noqa: E402

TOL = 1e-4
LR = {"sgd": 0.001, "adam": 0.0003}
# Adam's normalised steps amplify float32 rounding: torch against *itself*, with the
# initial weights perturbed by 1e-7 (relative), drifts by ~4e-4 in parameters and
# ~3e-3 in eval feature maps after 20 steps (SGD lr 0.01: 8e-5 / 1.2e-3). The ort
# backend's drift from torch is the same size, so those settings are checked at
# the tolerance float32 allows; SGD at lr 0.001 must agree to 1e-4 everywhere.
WEIGHT_TOL = {"sgd": TOL, "adam": 1e-3}
EVAL_TOL = {"sgd": TOL, "adam": 5e-3}


def meta_of(a) -> ArtifactMeta:  # type: ignore[no-untyped-def]
    return ArtifactMeta(a.trainable, a.bn_stats, a.bn_counters, a.state_names, a.input_shape, a.num_classes)


def torch_loss(logits, labels, teacher, mask, temperature, alpha):  # type: ignore[no-untyped-def]
    """The torch backend's FedGKT edge loss (edge_agent/methods/fedgkt.py)."""
    value = F.cross_entropy(logits, labels)
    if mask.any():
        value = value + alpha * kd_loss(logits[mask], teacher[mask], temperature)
    return value


@pytest.mark.parametrize("optimizer,micro_batch,train_extractor", [
    ("sgd", None, True), ("adam", None, True), ("sgd", 12, True), ("adam", 12, True), ("sgd", None, False), ("adam", 12, False)])
def test_twenty_steps_match_the_torch_backend(tmp_path: Path, optimizer: str, micro_batch: int | None, train_extractor: bool) -> None:
    """Same initial weights, same batches (CE + KD with a partial teacher mask): the ort
    backend's losses, logits, weights (BN statistics included) and eval outputs match torch's.
    With ``micro_batch`` (32-sample batches as 11 + 11 + 10) both backends accumulate
    micro-batches the same way ([memory] micro_batch_samples). ``train_extractor = False``
    (fedgkt.train_extractor): torch trains the classifier with the extractor frozen in eval
    mode; the ort artifacts freeze it the same way, and its state stays the initial one."""
    torch.manual_seed(0)
    ds = make_synthetic(640, num_classes=10, in_channels=3, seed=1)
    model = build_model("resnet8", 10, 3)
    initial_stem = {k: v.clone() for k, v in model.extractor.state_dict().items()}
    artifacts = export_edge_artifacts(copy.deepcopy(model), 10, 3, train_extractor=train_extractor)
    ort_model = OrtEdgeModel(artifacts.write(tmp_path / "art"), meta_of(artifacts))
    assert set(ort_model.arrays()) == set(state_dict_to_arrays(model))  # one weights format

    rng = np.random.default_rng(0)
    teacher_all = rng.normal(size=(len(ds), 10)).astype(np.float32) * 3
    has_teacher = rng.random(len(ds)) < 0.6  # some samples have no server logit yet
    if not train_extractor:
        model.extractor.requires_grad_(False)
    params = model.parameters() if train_extractor else model.classifier.parameters()
    t_opt = make_optimizer(optimizer, params, lr=LR[optimizer], momentum=0.9, weight_decay=5e-4)
    n_opt = make_numpy_optimizer(optimizer, lr=LR[optimizer], momentum=0.9, weight_decay=5e-4)
    temperature, alpha = 3.0, 0.7
    step = Step(model, t_opt, lambda logits, labels, teacher, mask: torch_loss(logits, labels, teacher, mask, temperature, alpha),
                micro_batch=micro_batch)
    steps = 0
    while steps < 20:
        for images, labels, ids in iterate_batches(ds, 32, shuffle=True, seed=steps):
            teacher, mask = teacher_all[ids], has_teacher[ids]
            model.train()
            if not train_extractor:
                model.extractor.eval()
            out = step(torch.from_numpy(images), torch.from_numpy(labels), torch.from_numpy(teacher), torch.from_numpy(mask))
            o_loss, o_logits = ort_model.train_step(images, labels, teacher, mask.astype(np.float32), temperature, alpha, n_opt,
                                                    micro_batch=micro_batch)
            assert abs(o_loss - out.loss.item()) < TOL, (steps, o_loss, out.loss.item())
            np.testing.assert_allclose(o_logits, out.logits.numpy(), atol=WEIGHT_TOL[optimizer], err_msg=f"step {steps}")
            steps += 1
            if steps == 20:
                break

    theirs, ours = state_dict_to_arrays(model), ort_model.arrays()
    for name, value in theirs.items():
        assert ours[name].dtype.kind == value.dtype.kind, name
        np.testing.assert_allclose(ours[name], value, atol=WEIGHT_TOL[optimizer], err_msg=name)
    if not train_extractor:
        for name, value in initial_stem.items():
            np.testing.assert_array_equal(ours[f"extractor.{name}"], value.numpy(), err_msg=name)
            assert torch.equal(model.extractor.state_dict()[name], value), name

    model.eval()
    images, _, _ = next(iterate_batches(ds, 64))
    with torch.no_grad():
        logits, features = model(torch.from_numpy(images))
    o_logits, o_features = ort_model.forward_eval(images)
    np.testing.assert_allclose(o_features, features.numpy(), atol=EVAL_TOL[optimizer])
    np.testing.assert_allclose(o_logits, logits.numpy(), atol=EVAL_TOL[optimizer])


def test_weights_round_trip_between_backends(tmp_path: Path) -> None:
    """A torch agent's state loads into an ort model and back, unchanged."""
    torch.manual_seed(1)
    source = build_model("resnet8", 10, 1)
    artifacts = export_edge_artifacts("resnet8", 10, 1)
    ort_model = OrtEdgeModel(artifacts.write(tmp_path / "art"), meta_of(artifacts))
    weights = state_dict_to_arrays(source)
    weights["extractor.bn.running_mean"] += 0.5
    ort_model.load_arrays(weights)
    back = build_model("resnet8", 10, 1)
    load_arrays_into(back, ort_model.arrays())
    for name, value in state_dict_to_arrays(back).items():
        np.testing.assert_array_equal(value, weights[name], err_msg=name)
    x = np.random.default_rng(0).normal(size=(4, 1, 32, 32)).astype(np.float32)
    back.eval()
    with torch.no_grad():
        logits, features = back(torch.from_numpy(x))
    o_logits, o_features = ort_model.forward_eval(x)
    np.testing.assert_allclose(o_features, features.numpy(), atol=TOL)
    np.testing.assert_allclose(o_logits, logits.numpy(), atol=TOL)
    with pytest.raises(ValueError, match="missing"):
        ort_model.load_arrays({k: v for k, v in weights.items() if "fc" not in k})


def test_artifacts_meet_ort_1_19_constraints() -> None:
    import onnx

    artifacts = export_edge_artifacts("resnet8", 10, 3)
    for name, blob in artifacts.files().items():
        if name.endswith(".onnx"):
            assert onnx.load_from_string(blob).ir_version <= 10, name
    eval_model = onnx.load_from_string(artifacts.eval_model)
    assert [o.name for o in eval_model.graph.output] == ["loss", "logits", "features"]
    for node in eval_model.graph.node:
        if node.op_type == "BatchNormalization":
            assert len(node.output) == 1 and all(a.name != "training_mode" for a in node.attribute)
    training = onnx.load_from_string(artifacts.training_model)
    inputs = [i.name for i in training.graph.input][:6]
    assert inputs == ["images", "labels", "teacher_logits", "kd_mask", "temperature", "alpha"]
    rank = {i.name: len(i.type.tensor_type.shape.dim) for i in training.graph.input}
    assert rank["temperature"] == rank["alpha"] == 0
    loss = next(o for o in training.graph.output if o.name == "loss")
    assert len(loss.type.tensor_type.shape.dim) == 0  # rank-0 loss


# --------------------------------------------------------------------------- #
# Federations: a torch agent and an ort agent in one FedGKT run
# --------------------------------------------------------------------------- #

from dataclasses import replace  # noqa: E402

from cloud_server.report import validate_report  # noqa: E402
from fldata.export import export_partition  # noqa: E402
from no_torch import write_blocker  # noqa: E402

from fedhelpers import ROOT, agent_config, in_memory_federation, make_server, server_config, write_agent_toml  # noqa: E402


def _check_mixed_report(report: dict) -> None:  # type: ignore[type-arg]
    validate_report(report)
    assert report["status"] == "finished", report["status"]
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    for record in report["rounds"]:
        assert record["status"] == "ok", record
        assert record["completed"] == ["agent-0", "agent-1"]
        assert record["accuracy"] is not None
    assert report["totals"]["rejected_messages"] == 0
    assert report["agents"]["agent-1"]["backend"] == "ort" and report["agents"]["agent-0"]["backend"] == "torch"


def test_mixed_federation_in_memory(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("EDGESPLIT_ORT_CACHE", str(tmp_path / "cache"))
    cfg = server_config(tmp_path, run_id="mixed-mem")
    agents = [agent_config(cfg.run_id, 0, 2), agent_config(cfg.run_id, 1, 2, backend="ort")]
    fed = in_memory_federation(cfg, agents).start()
    report = fed.join()
    _check_mixed_report(report)
    ort_agent = fed.agents[1]
    assert type(ort_agent.method).__name__ == "OrtFedGktEdge"
    assert len(ort_agent.method.teacher) == 80  # server logits came back for every sample
    assert ort_agent.method.flops.training > 0


def test_micro_batching_agents_of_both_backends_send_smaller_uploads_and_learn_the_same_round(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """[memory] micro_batch_samples on a torch and an ort agent: the rounds complete, every
    upload message holds at most the cap's samples, and the server's logits reach every sample."""
    from edge_agent.config import MemoryConfig
    from shared_protocol.methods.fedgkt import GktFeatures

    monkeypatch.setenv("EDGESPLIT_ORT_CACHE", str(tmp_path / "cache"))
    # Maps sent every round (reuse off): each round's uploads show the cap.
    cfg = server_config(tmp_path, run_id="mixed-micro", method_config={"reuse_maps": False})
    memory = MemoryConfig(micro_batch_samples=16, upload_batch_samples_cap=32)
    agents = [agent_config(cfg.run_id, 0, 2, memory=memory), agent_config(cfg.run_id, 1, 2, backend="ort", memory=memory)]
    fed = in_memory_federation(cfg, agents)
    sizes: dict[str, list[int]] = {"agent-0": [], "agent-1": []}
    for agent in fed.agents:
        def send(msg, *args, _agent=agent, _send=agent.send, **kwargs):  # type: ignore[no-untyped-def]
            if isinstance(msg, GktFeatures) and msg.split == "train":
                sizes[_agent.config.agent_id].append(len(msg.sample_ids))
            return _send(msg, *args, **kwargs)
        agent.send = send
    report = fed.start().join()
    _check_mixed_report(report)
    for agent_id, seen in sizes.items():
        assert seen == [32, 32, 16] * 2, (agent_id, seen)  # 80 samples, two rounds; the server asked for 64
    for agent in fed.agents:
        assert len(agent.method.teacher) == 80
    # the report says which agents trained in micro-batches (BatchNorm saw 16-sample batches)
    assert all(report["agents"][a]["memory"]["micro_batch_samples"] == 16 for a in ("agent-0", "agent-1"))


@pytest.mark.broker
@pytest.mark.slow
def test_mixed_federation_over_mosquitto_with_a_torch_free_agent(tmp_path: Path, mosquitto) -> None:  # type: ignore[no-untyped-def]
    """One torch agent (thread) and one ort agent in a process where `import torch` fails,
    reading its shard from .npz files, complete 2 FedGKT rounds over a real broker."""
    import subprocess
    import sys
    import threading

    from edge_agent.agent import EdgeAgent
    from edge_agent.config import DataConfig
    from shared_protocol.transport import MqttTransport

    cfg = replace(server_config(tmp_path, run_id="mixed-mqtt"), broker_url=mosquitto.url)
    coordinator = make_server(cfg, MqttTransport(replace(cfg.transport_config(), connect_timeout_s=10)))
    torch_agent = EdgeAgent(agent_config(cfg.run_id, 0, 2, broker_url=mosquitto.url))

    shard = tmp_path / "shard"
    export_partition("synthetic", shard, "iid", num_agents=2, agent_index=1, seed=0, train_samples=160, test_samples=80)
    ort_cfg = replace(agent_config(cfg.run_id, 1, 2, broker_url=mosquitto.url),
                      data=DataConfig(dataset="npz", root=str(shard), partition="none"), state_dir=str(tmp_path / "state"))
    toml = write_agent_toml(tmp_path / "ort-agent.toml", ort_cfg)
    block = write_blocker(tmp_path / "no_torch")
    check = subprocess.run([sys.executable, "-c", "import torch"], env={**os.environ, "PYTHONPATH": f"{block}{os.pathsep}{ROOT}"},
                           capture_output=True, text=True)
    assert check.returncode != 0 and "No module named 'torch'" in check.stderr  # torch is gone
    env = {**os.environ, "PYTHONPATH": f"{block}{os.pathsep}{ROOT}", "PYTHONUNBUFFERED": "1",
           "EDGESPLIT_ORT_CACHE": str(tmp_path / "cache")}
    log_path = tmp_path / "ort-agent.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "run", "--config", str(toml), "--backend", "ort", "--no-progress"],
                                stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    result: dict = {}
    server = threading.Thread(target=lambda: result.update(coordinator.run()), daemon=True)
    agent_thread = threading.Thread(target=torch_agent.run, daemon=True)
    server.start()
    agent_thread.start()
    try:
        server.join(300)
        assert not server.is_alive(), "server did not finish in time:\n" + log_path.read_text()[-3000:]
        assert proc.wait(60) == 0, log_path.read_text()[-3000:]
    finally:
        torch_agent.stop()
        agent_thread.join(30)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _check_mixed_report(result)
    log_text = log_path.read_text()
    assert "ort artifacts" in log_text and "Traceback" not in log_text
    # The ort agent kept its state in the torch backend's format.
    import numpy as np_

    with np_.load(tmp_path / "state" / "agent-1.npz", allow_pickle=False) as saved:
        names = {k[6:] for k in saved.files if k.startswith("model/")}
    assert names == set(state_dict_to_arrays(build_model("resnet8", 10, 3)))
