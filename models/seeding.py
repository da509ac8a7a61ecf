"""Initial weights drawn from a caller's own ``torch.Generator``, never from torch's global RNG.

Why: torch's default generator is one per process. Simulated agents (``edge-agent
simulate``, the benchmarks, the in-memory test federations) are threads of one process,
so an agent that seeds the global RNG and then builds its models draws whatever the
other threads leave of that stream: its initial mentor (FedKD), edge model (FedGKT) or
extractor (split learning) depended on the thread schedule, and so did the whole run.
With a generator per agent, what an agent draws depends on its seed alone.

``build_seeded(factory, generator)`` builds the module on the ``meta`` device (no
values, no draws), allocates its memory, and replays every random initialisation the module's
constructors would have made, in the same order and with the same calls, on
``generator``. So a module built with ``torch.Generator().manual_seed(s)`` is bit for
bit the one ``torch.manual_seed(s)`` followed by the plain constructor gives (the
runs recorded before this module existed stay reproducible); ``tests/test_models.py``
checks that for every registered model.

The replay visits the module tree in post-order, the order in which constructors run:
a module's children (in registration order), then the module's own layer
initialisation (PyTorch's default for convolutions and linear layers; the
deterministic reset of normalisation layers), then the module's own rule, if it has
one: a method ``init_weights(generator)`` (e.g. :class:`models.resnet.ConvStem`'s
He-normal convolutions). A layer type this module does not know, with parameters or
buffers of its own, is refused (``TypeError``) rather than left with uninitialised
memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn as nn

__all__ = ["build_seeded", "draw_initial_values"]

M = TypeVar("M", bound=nn.Module)

#: Layers whose constructor draws ``kaiming_uniform_(weight, a=sqrt(5))`` and a uniform bias
#: in +-1/sqrt(fan_in) (``reset_parameters`` of ``nn.Linear`` and ``nn.modules.conv._ConvNd``).
_DEFAULT_DRAWN = (nn.Linear, nn.modules.conv._ConvNd)
#: Layers whose initial state is deterministic (ones, zeros, reset running statistics).
_DETERMINISTIC = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def _draw_default(layer: nn.Module, generator: torch.Generator) -> None:
    """What ``layer.reset_parameters()`` draws, on ``generator`` (torch's own formulas)."""
    weight = layer.weight
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    bias = getattr(layer, "bias", None)
    if bias is not None:
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(bias, -bound, bound, generator=generator)


@torch.no_grad()
def draw_initial_values(module: nn.Module, generator: torch.Generator) -> None:
    """Give ``module`` (allocated, e.g. by ``to_empty``) its initial values, every random one
    drawn from ``generator`` in the order its constructors draw them (see the module docstring)."""
    for child in module.children():
        draw_initial_values(child, generator)
    if isinstance(module, _DEFAULT_DRAWN):
        _draw_default(module, generator)
    elif isinstance(module, _DETERMINISTIC):
        module.reset_parameters()  # ones / zeros, running statistics reset: no draws
    else:
        own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
        if own:
            raise TypeError(f"{type(module).__name__} has its own parameters or buffers {own}: models.seeding does not "
                            "know how its constructor initialises them (add the layer type there)")
    rule = getattr(module, "init_weights", None)
    if callable(rule):
        rule(generator)


def _allocate(module: nn.Module, device: torch.device | str) -> None:
    """Give every parameter and buffer of ``module`` (built on ``meta``) uninitialised memory on
    ``device``, shared parameters staying shared. Not ``Module.to_empty``: its ``empty_like``
    of a meta tensor imports sympy, which an agent on a small device does not load
    (tests/test_models_cost_light.py)."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(tuple(t.shape), dtype=t.dtype, device=device)

    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(empty(p), requires_grad=p.requires_grad)
                m._parameters[name] = made[id(p)]  # type: ignore[assignment]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = empty(b)


def build_seeded(factory: Callable[[], M], generator: torch.Generator, device: torch.device | str = "cpu") -> M:
    """``factory()`` on ``device`` with every initial value drawn from ``generator``; torch's
    global RNG is neither read nor advanced."""
    with torch.device("meta"):
        module = factory()
    _allocate(module, device)
    draw_initial_values(module, generator)
    return module
