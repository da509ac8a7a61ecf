"""The shared server training step (cloud_server/server_step.py) and its rows staged on the
device (cloud_server/row_bank.py): modes, fallbacks, staging.

Tolerances: the compiled and captured steps run the same arithmetic as the eager one in
another kernel order, so per-step losses and logits agree to float32 rounding accumulated
over a few steps: rtol 1e-4, atol 1e-5 here (observed differences are ~1e-6).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cloud_server import row_bank
from cloud_server import server_step as ss
from cloud_server.feature_store import ArrayStaging, RowSource
from cloud_server.server_step import DeviceSum, RowBank, TrainStep, resolve_server_step
from models.training import make_optimizer

RTOL, ATOL = 1e-4, 1e-5


class Tiny(nn.Module):
    """Conv + BatchNorm + linear: the kinds of layer the server models have, small enough to compile quickly."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4, 8, 8)
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))  # (B, 5)


def _loss(logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels) + F.kl_div(F.log_softmax(logits, 1), F.softmax(teacher, 1), reduction="batchmean")


def _batches(sizes: list[int], seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.relu(torch.randn(n, 4, 8, 8, generator=g)), torch.randint(0, 5, (n,), generator=g),
             torch.randn(n, 5, generator=g)) for n in sizes]


def _run(mode: str, batches: list[tuple[torch.Tensor, ...]], optimizer: str = "adam") -> tuple[TrainStep, list[float], list[np.ndarray], nn.Module]:
    torch.manual_seed(0)
    model = Tiny()
    opt = make_optimizer(optimizer, model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    step = TrainStep(model, opt, _loss, mode)
    losses, logits = [], []
    model.train()
    with step.session():
        for x, y, t in batches:
            out = step(x, y, t)
            losses.append(float(out.loss))
            logits.append(out.logits.clone().numpy())
    return step, losses, logits, model


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="server_step"):
        resolve_server_step("fast", "cpu")
    with pytest.raises(ValueError, match="server_step"):
        TrainStep(Tiny(), torch.optim.SGD(Tiny().parameters(), lr=0.1), _loss, "fast")


def test_auto_and_graph_resolve_per_device() -> None:
    assert resolve_server_step("auto", "cpu") == ("eager", "")  # length unknown: no compilation
    assert resolve_server_step("auto", "cpu", ss.AUTO_CPU_COMPILE_MIN_STEPS - 1) == ("eager", "")
    assert resolve_server_step("auto", "cpu", ss.AUTO_CPU_COMPILE_MIN_STEPS) == (ss.AUTO_STEP["cpu"], "")
    assert resolve_server_step("eager", "cpu") == ("eager", "")
    mode, why = resolve_server_step("graph", "cpu")
    assert mode == "eager" and "CUDA" in why
    assert resolve_server_step("auto", "cuda")[0] == ss.AUTO_STEP["cuda"]


def test_auto_on_a_cpu_compiles_only_training_calls_long_enough_to_repay_it(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Tiny()
    step = TrainStep(model, make_optimizer("adam", model.parameters(), lr=0.01), _loss, "auto")
    with step.session(planned_steps=20):
        assert step.mode == "eager"
    with step.session(planned_steps=ss.AUTO_CPU_COMPILE_MIN_STEPS):
        assert step.mode == ss.AUTO_STEP["cpu"] == "compiled"
    # After a failed compilation auto stays eager, whatever the length.
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (lambda *a: (_ for _ in ()).throw(RuntimeError("no compiler"))))
    x, y, t = _batches([8])[0]
    with step.session(planned_steps=10_000):
        step(x, y, t)
        assert step.mode == "eager" and "no compiler" in step.fallback_reason
    with step.session(planned_steps=10_000):
        assert step.mode == "eager"


def test_graph_on_cpu_falls_back_to_the_eager_step_exactly() -> None:
    batches = _batches([8, 8, 8, 3])
    eager, eager_losses, eager_logits, eager_model = _run("eager", batches)
    graph, graph_losses, graph_logits, graph_model = _run("graph", batches)
    assert graph.mode == "eager" and "CUDA" in graph.fallback_reason
    assert graph.steps == {"eager": 4, "compiled": 0, "graph": 0}
    assert graph_losses == eager_losses
    for a, b in zip(graph_logits, eager_logits):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_compiled_step_gives_the_eager_losses_and_logits(optimizer: str) -> None:
    """Four full batches through torch.compile and a last partial batch run eagerly (another
    shape): every step's loss and logits, and the weights after, match the eager path."""
    batches = _batches([8, 8, 8, 8, 3])
    _, eager_losses, eager_logits, eager_model = _run("eager", batches, optimizer)
    compiled, losses, logits, model = _run("compiled", batches, optimizer)
    assert compiled.mode == "compiled", compiled.fallback_reason
    assert compiled.steps == {"eager": 1, "compiled": 4, "graph": 0}
    np.testing.assert_allclose(losses, eager_losses, rtol=RTOL, atol=ATOL)
    for a, b in zip(logits, eager_logits):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.state_dict().items(), eager_model.state_dict().values()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)


def test_a_failing_compilation_falls_back_to_eager_and_trains_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_compile(fn, **kwargs):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            raise RuntimeError("inductor: no working C++ compiler\nmore detail")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    batches = _batches([8, 8, 3])
    _, eager_losses, _, eager_model = _run("eager", batches)
    step, losses, _, model = _run("compiled", batches)
    assert step.mode == "eager" and "no working C++ compiler" in step.fallback_reason
    assert losses == eager_losses
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_input_gradient_step_matches_autograd_and_checks_before_updating() -> None:
    torch.manual_seed(0)
    model = Tiny()
    reference = copy.deepcopy(model)
    opt = make_optimizer("sgd", model.parameters(), lr=0.1)
    step = TrainStep(model, opt, lambda logits, y: F.cross_entropy(logits, y), "auto")
    x, y, _ = _batches([6])[0]
    out, grad = step.step_with_input_grad(x, y)
    h = x.clone().requires_grad_(True)
    F.cross_entropy(reference(h), y).backward()
    torch.testing.assert_close(grad, h.grad)
    assert out.logits.shape == (6, 5) and out.loss.shape == ()

    def refuse(loss: torch.Tensor) -> None:
        raise ValueError("refused")

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="refused"):
        step.step_with_input_grad(x, y, check=refuse)
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_device_sum_reads_once() -> None:
    total = DeviceSum("cpu")
    total.add(torch.tensor(1.5), 4)
    total.add(torch.tensor(0.25, requires_grad=True) * 2, 2)
    assert total.item() == pytest.approx(7.0)


# --------------------------------------------------------------------------- #
# staging rows on the device
# --------------------------------------------------------------------------- #


def test_rows_are_staged_on_the_device_when_they_fit_else_gathered_on_the_host() -> None:
    rows = np.random.default_rng(0).normal(size=(20, 16, 4, 4)).astype(np.float16)  # 10,240 bytes
    index = torch.tensor([3, 0, 19, 7])
    fits = RowBank(torch.from_numpy(rows), "cpu", budget_bytes=rows.nbytes)
    too_big = RowBank(torch.from_numpy(rows), "cpu", budget_bytes=rows.nbytes - 1)
    unlimited = RowBank(torch.from_numpy(rows), "cpu")
    assert fits.placement == "device" and unlimited.placement == "device"
    assert too_big.placement == "host" and "do not fit" in too_big.why_host and str(rows.nbytes) in too_big.why_host
    expected = torch.from_numpy(rows[index.numpy()]).float()
    for bank in (fits, too_big, unlimited):
        got = bank.gather(index, torch.float32)
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The budget counts the dtype rows are staged in (float32 doubles float16).
    assert RowBank(torch.from_numpy(rows), "cpu", budget_bytes=rows.nbytes, dtype=torch.float32).placement == "host"


def test_spilled_rows_stay_on_the_host(tmp_path) -> None:  # type: ignore[no-untyped-def]
    staging = ArrayStaging(0, tmp_path)  # nothing in memory: every array spills to a mapped file
    rows = np.random.default_rng(1).normal(size=(10, 16, 4, 4)).astype(np.float32)
    staged = staging.stage(rows)
    assert staged.spilled
    bank = RowBank(RowSource(staged), "cpu")
    assert bank.placement == "host" and "spilled" in bank.why_host
    index = torch.tensor([9, 1])
    torch.testing.assert_close(bank.gather(index, torch.float32), torch.from_numpy(rows[[9, 1]].astype(np.float16)).float())
    staging.release(staged)


def test_uploads_are_copied_to_the_device_as_they_arrive_until_the_device_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """copy_to_device on a CPU stands in for a GPU here: the bookkeeping is the same."""
    rng = np.random.default_rng(2)
    arrays = [rng.normal(size=(6, 16, 4, 4)).astype(np.float32) for _ in range(4)]
    one = arrays[0].size * 2  # float16 bytes of one upload
    staging = ArrayStaging(1 << 30, tmp_path, device="cpu", device_bytes=2 * one, copy_to_device=True)
    staged = [staging.stage(a) for a in arrays[:3]]
    assert [s.device_copy is not None for s in staged] == [True, True, False]  # the third does not fit: host only
    assert staging.on_device_bytes == 2 * one and staging.device_refusals == 1
    for s, a in zip(staged[:2], arrays):
        assert s.device_copy.dtype == torch.float16
        np.testing.assert_array_equal(s.device_copy.numpy(), a.astype(np.float16))
    staging.release(staged[0])
    assert staging.on_device_bytes == one and staged[0].device_copy is None
    assert staging.stage(arrays[3]).device_copy is not None  # room again
    # A bank over a staged array with a device copy uses it as it is.
    bank = RowBank(RowSource(staged[1]), "cpu", device_rows=staged[1].device_copy, budget_bytes=0)
    assert bank.placement == "device"
    torch.testing.assert_close(bank.gather(torch.tensor([5, 0]), torch.float32),
                               torch.from_numpy(arrays[1][[5, 0]].astype(np.float16)).float())
    with pytest.raises(ValueError, match="device_bytes"):
        ArrayStaging(0, device="cpu", device_bytes=-1)
    with pytest.raises(ValueError, match="needs a device"):
        ArrayStaging(0, copy_to_device=True)
    assert not ArrayStaging(0, device="cpu").copy_to_device  # on a CPU the host copy is the device's


def test_the_device_budget_is_capped_by_free_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    assert row_bank.staging_budget_bytes("cpu") is None
    assert row_bank.staging_budget_bytes("cpu", 123) == 123
    assert row_bank.device_free_bytes("cpu") is None
    # Patched where staging_budget_bytes looks it up (cloud_server/row_bank.py).
    monkeypatch.setattr(row_bank, "device_free_bytes", lambda device: 1000)
    assert row_bank.staging_budget_bytes("cuda", None) == int(1000 * row_bank.DEVICE_STAGING_FRACTION)
    assert row_bank.staging_budget_bytes("cuda", 100) == 100
    # The old import path is the same function.
    assert ss.staging_budget_bytes is row_bank.staging_budget_bytes and ss.RowBank is row_bank.RowBank


def test_server_optimizer_is_unchanged_on_cpu() -> None:
    model = Tiny()
    adam = make_optimizer("adam", model.parameters(), lr=0.001, weight_decay=5e-4)
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["amsgrad"] and not adam.defaults.get("fused")
    sgd = make_optimizer("sgd", model.parameters(), lr=0.1, momentum=0.9)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    with pytest.raises(ValueError, match="optimizer"):
        make_optimizer("lamb", model.parameters(), lr=0.1)


# --------------------------------------------------------------------------- #
# on a GPU (skipped without one)
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["graph", "compiled"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_captured_step_on_cuda_gives_the_eager_losses_and_logits(mode: str, optimizer: str) -> None:
    batches = [tuple(t.cuda() for t in b) for b in _batches([8] * 6 + [3])]

    def run(m: str) -> tuple[TrainStep, list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = Tiny().cuda().train()
        opt = make_optimizer(optimizer, model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, device="cuda")
        step = TrainStep(model, opt, _loss, m)
        losses, logits = [], []
        with step.session():
            for i, (x, y, t) in enumerate(batches):
                if i == 4:
                    for g in opt.param_groups:
                        g["lr"] = 0.005  # a scheduler's change between steps must reach the captured step
                out = step(x, y, t)
                losses.append(out.loss.clone())
                logits.append(out.logits.clone())
        assert all(not isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)
        return step, [float(v) for v in losses], logits

    _, eager_losses, eager_logits = run("eager")
    step, losses, logits = run(mode)
    assert step.mode == mode, step.fallback_reason
    assert step.steps[mode] >= 1
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-3, atol=1e-4)
    for a, b in zip(logits, eager_logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


# --------------------------------------------------------------------------- #
# the methods use it
# --------------------------------------------------------------------------- #


def _central(tmp_path, server_step: str = "auto"):  # type: ignore[no-untyped-def]
    from cloud_server.centralized import CentralizedTrainer
    from cloud_server.config import ServerConfig

    config = ServerConfig(run_id="central", method="centralized", out_dir=str(tmp_path / "run"), rounds=1, dataset="synthetic",
                          seed=3, progress=False, server_step=server_step,
                          method_config={"model": "resnet8", "batch_size": 32, "train_samples": 80, "test_samples": 16})
    return CentralizedTrainer(config)


def test_server_step_is_a_validated_server_setting(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cloud_server.config import ServerConfig

    with pytest.raises(ValueError, match="server_step"):
        ServerConfig(server_step="fast")
    assert ServerConfig(server_step="graph").method_context("cpu").server_step == "graph"
    trainer = _central(tmp_path, "graph")
    assert trainer.step.requested == "graph" and trainer.step.mode == "eager" and "CUDA" in trainer.step.fallback_reason


def test_centralized_training_is_the_same_whether_its_images_are_staged_on_the_device_or_not(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from cloud_server import centralized

    staged = _central(tmp_path / "a")
    loss, samples = staged._train_round(1)
    assert staged._bank is not None and staged._bank.placement == "device" and samples == 80
    monkeypatch.setattr(centralized, "staging_budget_bytes", lambda device: 1)  # nothing fits on the device
    host = _central(tmp_path / "b")
    host_loss, host_samples = host._train_round(1)
    assert host._bank is not None and host._bank.placement == "host" and "do not fit" in host._bank.why_host
    assert (host_loss, host_samples) == (loss, samples)
    for p, q in zip(staged.model.parameters(), host.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    figures = staged.device_meter.take().to_json()
    assert figures["device"] == "cpu" and figures["train_s"] > 0


def test_the_cpu_default_follows_the_recorded_compile_measurement() -> None:
    """server_step = "auto" on a CPU is what bench/micro/test_server_loop.py::test_compile measured to
    help; re-measure (make bench-micro MICRO=server_loop) before changing AUTO_STEP or the threshold."""
    from fedhelpers import ROOT
    from test_micro_benchmarks import micro_docs

    docs = micro_docs()
    check = docs.compile_verdict(docs.load_micro(ROOT / "bench" / "results" / "server_loop.json"))
    assert check["auto_cpu_step"] == ss.AUTO_STEP["cpu"]
    assert check["auto_cpu_compile_min_steps"] == ss.AUTO_CPU_COMPILE_MIN_STEPS
    if check["helps"]:
        assert ss.AUTO_STEP["cpu"] == "compiled" and ss.AUTO_CPU_COMPILE_MIN_STEPS >= check["break_even_steps"]
    else:
        assert ss.AUTO_STEP["cpu"] != "compiled"
    assert check["auto_follows_verdict"]
