"""The light layer FLOP counter (models.layer_flops.layer_flops_per_sample) against FlopCounterMode.

The light counter exists so an agent never enters FlopCounterMode (which keeps
sympy, torch._dynamo & co. resident); it is only worth having if its numbers
are FlopCounterMode's exactly, for every registered model, or it refuses and
the caller falls back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from models import (
    FlopsPerSample,
    NotLayerCountableError,
    build_model,
    flops_of,
    flops_per_sample,
    forward_flops_per_sample,
    get_model_spec,
    layer_flops_per_sample,
    list_models,
    state_dict_to_arrays,
    training_flops_per_sample,
)
from models.memory import checkpoint_bottlenecks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Counts do not depend on threads, but two OpenMP threads on a shared two-core
    runner spin against each other: the registry comparison took minutes instead of seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

# Per-sample image shapes (C, H, W); a server model sees the edge's (16, H, W) maps instead.
IMAGE_SHAPES = [(1, 28, 28), (3, 32, 32), (1, 32, 32)]


def _cases() -> list[tuple[str, int, tuple[int, ...]]]:
    """(model, in_channels, per-sample input shape), without repeating a server
    model's input (in_channels does not change it)."""
    cases: dict[tuple[str, tuple[int, ...]], int] = {}
    for name in list_models():
        spec = get_model_spec(name)
        for channels, height, _width in IMAGE_SHAPES:
            cases.setdefault((name, spec.input_shape(in_channels=channels, image_size=height)), channels)
    return [(name, channels, shape) for (name, shape), channels in cases.items()]


def _reference(model: nn.Module, shape: tuple[int, ...], loss: str) -> FlopsPerSample:
    """FlopCounterMode's numbers, the project's convention."""
    return FlopsPerSample(
        training=training_flops_per_sample(model, shape, loss=loss, light=False),  # type: ignore[arg-type]
        forward=forward_flops_per_sample(model, shape, light=False),
    )


def _assert_matches_flop_counter(model: nn.Module, shape: tuple[int, ...], loss: str = "ce") -> FlopsPerSample:
    expected = _reference(model, shape, loss)
    assert expected.training > 0 and expected.forward > 0
    try:
        light = layer_flops_per_sample(model, shape, loss=loss)  # type: ignore[arg-type]
    except NotLayerCountableError:
        light = None
    if light is not None:
        assert light == expected
    # Whatever the light counter says, every front gives FlopCounterMode's numbers.
    assert flops_per_sample(model, shape, loss=loss) == expected  # type: ignore[arg-type]
    assert training_flops_per_sample(model, shape, loss=loss) == expected.training  # type: ignore[arg-type]
    assert forward_flops_per_sample(model, shape) == expected.forward
    return expected


# --- every registered model ------------------------------------------------------


@pytest.mark.parametrize(("name", "in_channels", "shape"), _cases(), ids=lambda v: str(v).replace(" ", ""))
def test_light_counter_equals_flop_counter_mode_on_the_registry(name: str, in_channels: int, shape: tuple[int, ...]) -> None:
    model = build_model(name, num_classes=10, in_channels=in_channels)
    light = {loss: layer_flops_per_sample(model, shape, loss=loss) for loss in ("ce", "sum")}  # refusing here fails the test
    forward = forward_flops_per_sample(model, shape, light=False)
    for loss, counted in light.items():
        assert counted == FlopsPerSample(training=training_flops_per_sample(model, shape, loss=loss, light=False), forward=forward)
        assert flops_per_sample(model, shape, loss=loss) == counted


def test_the_light_counter_leaves_the_model_untouched() -> None:
    model = build_model("resnet8").eval()
    before = state_dict_to_arrays(model)
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    layer_flops_per_sample(model, (3, 32, 32))

    after = state_dict_to_arrays(model)
    assert not model.training
    assert all((before[k] == after[k]).all() for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks_before


def test_the_light_counter_validates_like_the_public_functions() -> None:
    model = build_model("resnet8")
    with pytest.raises(ValueError, match="loss"):
        layer_flops_per_sample(model, (3, 32, 32), loss="mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        layer_flops_per_sample(model, (3, 32, 32), batch_size=0)


# --- layers beyond the registry's, each against FlopCounterMode -----------------------


class _Heads(nn.Module):
    """Two heads on one trunk, only the first in the loss: the second has no backward."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.used = nn.Linear(32, 10)
        self.unused = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.trunk(x)
        return self.used(z), self.unused(z)


class _Shared(nn.Module):
    """One conv called twice: each call is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=True)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(torch.relu(self.conv(x))))


class _Tokens(nn.Module):
    """A Linear on a (B, T, D) input, as a token mixer would have."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.out = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 6)
        return self.out(self.norm(self.proj(x)).mean(dim=1))


def _frozen_stem() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    for p in model[0].parameters():
        p.requires_grad_(False)
    for p in model[3].parameters():  # a frozen middle layer still passes its input gradient back
        p.requires_grad_(False)
    return model


LAYER_CASES = {
    "grouped-strided-conv2d": (lambda: nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.Conv2d(8, 16, 3, groups=4, padding=2, dilation=2),
                                                     nn.Conv2d(16, 16, 3, groups=16, padding=1, padding_mode="reflect"),
                                                     nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(16, 10)), (4, 13, 11)),
    "conv-transpose2d": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1),
                                               nn.ConvTranspose2d(6, 4, 4, groups=2, stride=2), nn.Flatten(), nn.LazyLinear(10)), (3, 9, 9)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(2, 6, 5, stride=2), nn.BatchNorm1d(6), nn.GELU(), nn.ConvTranspose1d(6, 3, 3),
                                     nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(3, 4)), (2, 40)),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(1, 4, 3), nn.ReLU(), nn.ConvTranspose3d(4, 2, 2, stride=2), nn.Flatten(), nn.LazyLinear(5)), (1, 6, 6, 6)),
    "unused-head": (_Heads, (3, 8, 8)),
    "shared-conv": (_Shared, (4, 8, 8)),
    "linear-on-tokens": (_Tokens, (7, 6)),
    "frozen-layers": (_frozen_stem, (3, 12, 12)),
}


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
@pytest.mark.parametrize("loss", ["ce", "sum"])
def test_light_counter_equals_flop_counter_mode_on_other_layers(case: str, loss: str) -> None:
    build, shape = LAYER_CASES[case]
    torch.manual_seed(0)
    model = build()
    model(torch.zeros(2, *shape))  # materialise the lazy layers
    expected = _reference(model, shape, loss)
    assert layer_flops_per_sample(model, shape, loss=loss) == expected  # type: ignore[arg-type]


# --- what it refuses -------------------------------------------------------------------


class _MatmulLayer(nn.Module):
    """A layer of its own: the hooks cannot see its matmul."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight.t())


class _FunctionalHead(nn.Module):
    """A parameterless container whose forward multiplies by a child's weight itself."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x) @ self.fc.weight.t()


class _FunctionalConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(x, self.conv.weight).sum(dim=(2, 3))


class _Scale(nn.Module):
    """Parameterless and harmless, but a leaf the counter does not know."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _CheckpointedBlocks(nn.Module):
    """A forward that recomputes its blocks in the backward (torch.utils.checkpoint)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_() if self.reentrant else x  # reentrant checkpointing needs an input with grad
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def _checkpointed_resnet8() -> nn.Module:
    return checkpoint_bottlenecks(build_model("resnet8", 10, 3))


class _BilinearSelf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(6, 6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bilinear(x, x)


REFUSED = {
    "own-parameter-matmul": (lambda: nn.Sequential(nn.Flatten(), _MatmulLayer(12, 10)), (3, 2, 2), "holds parameters"),
    "functional-matmul": (_FunctionalHead, (3, 6, 6), "outside"),
    "functional-conv": (_FunctionalConv, (3, 6, 6), "outside"),
    "unknown-leaf": (lambda: nn.Sequential(nn.Flatten(), _Scale(), nn.Linear(12, 10)), (3, 2, 2), "leaf of unknown type"),
    "torch-attention": (lambda: nn.Sequential(nn.Flatten(1, 1), nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), nn.Flatten(), nn.Linear(24, 4)),
                        (3, 8), "torch layer"),
    "checkpoint-non-reentrant": (lambda: _CheckpointedBlocks(reentrant=False), (3, 6, 6), "ran again during the backward"),
    "checkpoint-reentrant": (lambda: _CheckpointedBlocks(reentrant=True), (3, 6, 6), "ran again during the backward"),
    "checkpointed-bottlenecks": (_checkpointed_resnet8, (3, 16, 16), "replaced on the instance"),
    "bilinear": (lambda: nn.Sequential(nn.Flatten(), _BilinearSelf(), nn.Linear(4, 3)), (3, 2), "holds parameters"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_light_counter_refuses_what_it_cannot_see_and_the_fronts_fall_back(case: str) -> None:
    build, shape, reason = REFUSED[case]
    torch.manual_seed(0)
    model = build()
    with pytest.raises(NotLayerCountableError, match=reason):
        layer_flops_per_sample(model, shape)
    expected = _assert_matches_flop_counter(model, shape)
    # The refused work is real: leaving it out would have undercounted.
    assert expected.forward > 0


def test_the_refusal_says_what_was_expected_and_what_came() -> None:
    model = nn.Sequential(nn.Flatten(), _MatmulLayer(12, 10))
    with pytest.raises(NotLayerCountableError) as info:
        layer_flops_per_sample(model, (3, 2, 2))
    message = str(info.value)
    assert "'1'" in message and "_MatmulLayer" in message and "expected nn.Linear" in message


def test_a_model_that_cannot_train_falls_back_to_autograds_own_error() -> None:
    model = build_model("resnet8")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(NotLayerCountableError, match="require grad"):
        layer_flops_per_sample(model, (3, 32, 32))
    with pytest.raises(RuntimeError, match="does not require grad"):
        flops_per_sample(model, (3, 32, 32))


# --- the point of it: an agent stays light ------------------------------------------


def _run_fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    return json.loads(out.stdout.strip().splitlines()[-1])


_FEDGKT_EDGE = """
import json, sys
from edge_agent.methods.base import EdgeContext
from edge_agent.methods.fedgkt import FedGktEdge
from fldata import make_synthetic
data = make_synthetic(8, in_channels=1)
ctx = EdgeContext(agent_id="a", run_id="r", instance="i", train=data, test=data, settings={"num_classes": 10},
                  send=lambda *a, **k: None)
edge = FedGktEdge(ctx)
print(json.dumps({"shape": list(data.images.shape[1:]), "training": edge.flops.training,
                  "forward": edge.flops.forward, "sympy": "sympy" in sys.modules}))
"""

_FLOP_COUNTER_MODE = """
import json, sys
from models import build_model, training_flops_per_sample
training = training_flops_per_sample(build_model("resnet8", 10, 1), (1, 32, 32), light=False)
print(json.dumps({"training": training, "sympy": "sympy" in sys.modules}))
"""


def test_the_fedgkt_edge_counts_its_flops_without_importing_sympy() -> None:
    edge = _run_fresh(_FEDGKT_EDGE)
    assert edge["sympy"] is False
    shape = tuple(edge["shape"])
    expected = _reference(build_model("resnet8", 10, shape[0]), shape, "ce")
    assert (edge["training"], edge["forward"]) == (expected.training, expected.forward)


def test_flop_counter_mode_does_import_sympy_so_the_check_above_can_fail() -> None:
    counted = _run_fresh(_FLOP_COUNTER_MODE)
    assert counted["sympy"] is True and counted["training"] > 0
