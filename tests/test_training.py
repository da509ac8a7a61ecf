"""The one training loop (models/training.py): the edge trainer and the server loops run it.

The edge trainer must train exactly as the plain per-step loop it replaced (the same
operations in the same order: losses and weights equal bit for bit) and meter what it
trained; callbacks see each batch and its step; a non-finite loss is refused before it
touches the model.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from edge_agent.costs import RoundMeter
from edge_agent.trainer import train_epochs
from models import training_flops_per_sample
from models.training import OPTIMIZERS, Batch, NonFiniteLossError, Step, Trainer, make_optimizer


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, 1, 6, 6)
        features = F.relu(self.conv(x))  # (B, 4, 6, 6)
        return self.fc(features.mean((2, 3))), features  # (B, 3), like ResNet-8's (logits, features)


def _loader(n: int = 20, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    ids = torch.arange(n)
    return [(images[i : i + batch], labels[i : i + batch], ids[i : i + batch]) for i in range(0, n, batch)]


def _edge_loss(output: object, labels: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
    logits, _features = output  # the whole output reaches the loss
    return F.cross_entropy(logits, labels)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_edge_trainer_trains_exactly_as_the_plain_loop(optimizer: str) -> None:
    loader = _loader()
    torch.manual_seed(0)
    model = Tiny()
    reference = Tiny()
    reference.load_state_dict(model.state_dict())
    meter = RoundMeter()
    result = train_epochs(model, loader, make_optimizer(optimizer, model.parameters(), 0.05, 0.9, 1e-4), _edge_loss, epochs=2,
                          meter=meter)

    opt = make_optimizer(optimizer, reference.parameters(), 0.05, 0.9, 1e-4)
    total, samples = 0.0, 0
    for _epoch in range(2):
        for images, labels, ids in loader:
            opt.zero_grad(set_to_none=True)
            loss = _edge_loss(reference(images), labels, ids)
            loss.backward()
            opt.step()
            total += float(loss.item()) * len(labels)
            samples += len(labels)
    assert (result.samples, result.steps) == (40, 6)
    assert result.mean_loss == total / samples
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # Metered without a word from the caller: the model it trained, by FlopCounterMode's count.
    assert meter.samples_trained == 40 and meter.seconds["compute"] > 0
    assert meter.train_flops == 40 * training_flops_per_sample(Tiny(), (1, 6, 6), light=False) > 0


def test_a_non_finite_loss_is_refused_before_it_updates_the_model() -> None:
    loader = _loader()
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]

    def nan_at_second_step(output: object, labels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        loss = _edge_loss(output, labels, ids)
        return loss * float("nan") if int(ids[0]) == 8 else loss * 0.0  # step 0 changes nothing (zero gradient)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteLossError, match="edge round 3: loss is nan at step 1"):
        train_epochs(model, loader, opt, nan_at_second_step, epochs=1, meter=RoundMeter(), desc="edge round 3")
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_callbacks_see_every_batch_and_may_stop_the_run() -> None:
    model = Tiny()
    step = Step(model, make_optimizer("sgd", model.parameters(), 0.01), lambda logits, y: F.cross_entropy(logits, y))
    seen: list[tuple[str, int, int, bool]] = []
    trainer = Trainer(step)
    trainer.add_callback("on_batch_start", lambda t: seen.append(("start", t.epoch, t.batch.meta, t.last_epoch)))
    trainer.add_callback("on_batch_end", lambda t: seen.append(("end", t.steps_done, t.out.logits.shape[0], t.last_epoch)))
    trainer.add_callback("on_epoch_end", lambda t: seen.append(("epoch", t.epoch, t.steps_done, t.last_epoch)))

    def batches(epoch: int):  # -> Iterator[Batch]: two batches of 4 and 2 rows
        for i, n in enumerate((4, 2)):
            yield Batch(torch.randn(n, 1, 6, 6), (torch.zeros(n, dtype=torch.long),), meta=i)

    result = trainer.run(2, batches)
    assert seen[:5] == [("start", 0, 0, False), ("end", 1, 4, False), ("start", 0, 1, False), ("end", 2, 2, False), ("epoch", 0, 2, False)]
    assert seen[-1] == ("epoch", 1, 4, True)
    assert (result.samples, result.steps, result.last_epoch_samples) == (12, 4, 6)
    assert math.isfinite(result.mean_loss) and math.isfinite(result.last_epoch_loss)

    stopper = Trainer(step).add_callback("on_batch_end", lambda t: t.stop() if t.steps_done == 3 else None)
    assert stopper.run(5, batches).steps == 3
    with pytest.raises(ValueError, match="on_batch_start"):
        Trainer(step).add_callback("on_step", lambda t: None)
    with pytest.raises(ValueError, match="check_finite"):
        Trainer(step, check_finite="always")


def test_one_optimiser_factory_for_every_name_the_configs_accept() -> None:
    from shared_protocol.configs import OPTIMIZERS as CONFIG_OPTIMIZERS

    assert OPTIMIZERS == CONFIG_OPTIMIZERS  # the torch-free configs validate against the same names
    model = Tiny()
    adam = make_optimizer("adam", model.parameters(), lr=0.001, weight_decay=5e-4)
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["amsgrad"]
    assert isinstance(make_optimizer("sgd", model.parameters(), lr=0.1), torch.optim.SGD)
    with pytest.raises(ValueError, match=r"optimizer must be one of \('sgd', 'adam'\), got 'lamb'"):
        make_optimizer("lamb", model.parameters(), lr=0.1)


def test_the_progress_bar_is_the_callers_and_counts_every_step() -> None:
    made: list[dict] = []

    class Bar:
        def __init__(self, **kwargs: object) -> None:
            made.append({**kwargs, "updates": 0, "closed": False})

        def update(self, n: int = 1) -> None:
            made[-1]["updates"] += n

        def close(self) -> None:
            made[-1]["closed"] = True

    torch.manual_seed(0)
    model = Tiny()
    step = Step(model, make_optimizer("sgd", model.parameters(), 0.05, 0.0, 0.0),
                lambda logits, labels, ids: F.cross_entropy(logits, labels))  # the default forward hands on the logits
    batches = [Batch(images, (labels, ids)) for images, labels, ids in _loader()]  # 3 batches
    Trainer(step, desc="bar", progress=Bar).run(2, lambda epoch: batches, planned_steps=6)
    assert made == [{"total": 6, "desc": "bar", "leave": False, "dynamic_ncols": True, "updates": 6, "closed": True}]
    made.clear()
    Trainer(step, desc="quiet").run(1, lambda epoch: batches)
    assert made == []


# --------------------------------------------------------------------------- #
# micro-batches ([memory] micro_batch_samples)
# --------------------------------------------------------------------------- #


def test_micro_batches_are_near_equal_and_cover_the_batch() -> None:
    from models.training import micro_batch_slices

    assert [(s.start, s.stop) for s in micro_batch_slices(32, 12)] == [(0, 11), (11, 22), (22, 32)]
    assert [s.stop - s.start for s in micro_batch_slices(64, 16)] == [16] * 4
    assert [s.stop - s.start for s in micro_batch_slices(17, 16)] == [9, 8]  # never a 1-sample BatchNorm batch
    assert micro_batch_slices(5, 16) == [slice(0, 5)]
    # the ort backend splits with numpy: the same sizes in the same order
    for n, m in ((32, 12), (40, 16), (17, 16), (100, 7)):
        k = -(-n // m)
        assert [s.stop - s.start for s in micro_batch_slices(n, m)] == [len(p) for p in np.array_split(np.arange(n), k)]


def test_an_accumulated_step_is_the_whole_batch_step_without_batchnorm() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    whole = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    micro = copy.deepcopy(whole)
    sizes: list[int] = []
    micro[0].register_forward_hook(lambda module, inputs, output: sizes.append(inputs[0].shape[0]))
    loss = lambda logits, labels: F.cross_entropy(logits, labels)  # noqa: E731
    out_whole = Step(whole, torch.optim.SGD(whole.parameters(), lr=0.5), loss)(x, y)
    out_micro = Step(micro, torch.optim.SGD(micro.parameters(), lr=0.5), loss, micro_batch=16)(x, y)
    assert sizes == [14, 13, 13]  # no forward pass saw more than 16 samples
    assert torch.allclose(out_micro.loss, out_whole.loss, atol=1e-6)
    assert torch.allclose(out_micro.logits, out_whole.logits, atol=1e-6)
    for a, b in zip(whole.parameters(), micro.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_ghost_batches_normalise_each_micro_batch_and_keep_the_running_statistics_memory() -> None:
    torch.manual_seed(0)
    x = torch.randn(48, 4) * 3 + 1
    bn = nn.BatchNorm1d(4)
    step = Step(bn, torch.optim.SGD(bn.parameters(), lr=0.0), lambda out: (out ** 2).mean(),
                forward=lambda model, inputs: model(inputs), micro_batch=16)
    step(x)
    k, m = 3, 0.1
    m_micro = 1 - (1 - m) ** (1 / k)
    mean, var = torch.zeros(4), torch.ones(4)
    for part in x.split(16):  # what the running statistics must be after three ghost batches
        mean = (1 - m_micro) * mean + m_micro * part.mean(0)
        var = (1 - m_micro) * var + m_micro * part.var(0, unbiased=True)
    assert torch.allclose(bn.running_mean, mean, atol=1e-6) and torch.allclose(bn.running_var, var, atol=1e-5)
    assert bn.momentum == m and int(bn.num_batches_tracked) == k  # momentum restored
    # constant input per micro-batch, different across them: ghost batches see zero variance
    # in each (output 0); one whole-batch normalisation would not
    y = torch.cat([torch.full((16, 4), float(i)) for i in range(3)])
    outs: list[torch.Tensor] = []
    bn.register_forward_hook(lambda module, inputs, output: outs.append(output.detach()))
    step(y)
    assert all(torch.allclose(o, torch.zeros_like(o), atol=1e-3) for o in outs)


def test_a_non_finite_micro_batch_refuses_the_whole_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(32, 3)
    x[20] = float("nan")  # in the second micro-batch: the first one's backward has run

    def check(loss: torch.Tensor) -> None:
        if not torch.isfinite(loss):
            raise NonFiniteLossError("loss is nan")

    step = Step(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda logits: logits.sum(), micro_batch=16)
    with pytest.raises(NonFiniteLossError):
        step(x, check=check)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_micro_batch_must_hold_two_samples() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="micro_batch must be >= 2"):
        Step(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda o: o.sum(), micro_batch=1)


# --------------------------------------------------------------------------- #
# lean optimisers (the edge's: no torch._dynamo)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
def test_lean_optimisers_take_torch_optims_steps(name: str, weight_decay: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    twin = copy.deepcopy(model)
    reference = make_optimizer(name, model.parameters(), lr=0.01, momentum=0.9, weight_decay=weight_decay)
    lean = make_optimizer(name, twin.parameters(), lr=0.01, momentum=0.9, weight_decay=weight_decay, lean=True)
    assert isinstance(reference, torch.optim.Optimizer) and not isinstance(lean, torch.optim.Optimizer)
    for step in range(20):
        x, y = torch.randn(8, 2, 8, 8), torch.randint(0, 3, (8,))
        for m, opt in ((model, reference), (twin, lean)):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            opt.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b), (name, step)  # the same arithmetic in the same order: bit for bit


def test_lean_optimisers_only_run_on_a_cpu() -> None:
    with pytest.raises(ValueError, match="lean optimisers run on a CPU"):
        make_optimizer("adam", nn.Linear(2, 2).parameters(), lr=0.1, device="cuda", lean=True)


def test_an_edge_training_round_never_imports_torch_dynamo() -> None:
    """torch.optim's step imports torch._dynamo (~80 MB resident); the edge's lean step and
    FLOP count must not (checked in a fresh process, with a control that it would)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch\n"
        "from models import build_model, flops_per_sample\n"
        "from models.training import make_optimizer\n"
        "from edge_agent.costs import RoundMeter\n"
        "from edge_agent.trainer import train_epochs\n"
        "import torch.nn.functional as F\n"
        "model = build_model('resnet8', 10, 1)\n"
        "flops_per_sample(model, (1, 32, 32))\n"
        "opt = make_optimizer(sys.argv[1], model.parameters(), 1e-3, lean=sys.argv[2] == 'lean')\n"
        "batches = [(torch.randn(16, 1, 32, 32), torch.randint(0, 10, (16,)), torch.arange(16))] * 2\n"
        "train_epochs(model, batches, opt, lambda out, y, ids: F.cross_entropy(out[0], y), 1, meter=RoundMeter(), micro_batch=8)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}

    def imports_dynamo(*args: str) -> bool:
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()[-1] == "True"

    assert not imports_dynamo("adam", "lean") and not imports_dynamo("sgd", "lean")
    assert imports_dynamo("adam", "torch")  # the control: torch.optim's step does
