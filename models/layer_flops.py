"""The light FLOP counter: :func:`layer_flops_per_sample` gives ``FlopCounterMode``'s
numbers for models built from standard layers, from forward hooks on their Conv /
Linear modules and FlopCounterMode's own formulas, without entering the mode (which
imports hundreds more modules and keeps tens of MiB more resident: see
:mod:`models.cost` and bench/results/step_memory.json's ``test_import_cost``)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from math import prod
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from models.flop_probe import (
    FlopsPerSample,
    LossKind,
    NotLayerCountableError,
    _check_loss,
    _dummy_batch,
    _logits_of,
    _objective,
)

# --- the light counter ---------------------------------------------------------
#
# FlopCounterMode (torch/utils/flop_counter.py) counts only mm, addmm, bmm,
# baddbmm, _scaled_mm, the convolution ops, convolution_backward and attention
# kernels, at 2 FLOPs per multiply-accumulate, from the shapes each op sees. In a
# model built from nn.Linear and nn.Conv*d only those two layers reach those ops,
# so their formulas applied to the shapes a forward hook records reproduce its
# total exactly; every other known layer below contributes zero there too.

#: Layers that reach no op FlopCounterMode counts (element-wise, normalisation,
#: pooling, indexing, reshaping), looked up by name so an older torch without one
#: of them still imports this module. Exact types only: a subclass may override
#: ``forward`` with a matmul.
_FLOP_FREE_LAYER_NAMES = (
    # containers
    "Sequential", "ModuleList", "ModuleDict",
    # normalisation (BatchNorm's affine transform is element-wise)
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "GroupNorm", "LayerNorm", "RMSNorm",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm",
    # activations
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish",
    "Sigmoid", "Tanh", "Hardtanh", "Hardswish", "Hardsigmoid", "Hardshrink", "Softshrink", "Tanhshrink",
    "Softplus", "Softsign", "LogSigmoid", "Threshold", "GLU", "Softmax", "Softmin", "LogSoftmax", "Softmax2d",
    # pooling
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "LPPool1d", "LPPool2d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
    # shape, regularisation, padding, resampling
    "Identity", "Flatten", "Unflatten", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
    "FeatureAlphaDropout", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d",
    "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d",
    "ReplicationPad2d", "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d",
    "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d", "PixelShuffle", "PixelUnshuffle", "ChannelShuffle",
)
_FLOP_FREE_LAYERS: frozenset[type] = frozenset(
    layer for layer in (getattr(nn, name, None) for name in _FLOP_FREE_LAYER_NAMES) if isinstance(layer, type)
)

#: The layers the counter has formulas for; a subclass counts only if it keeps the
#: base class's ``forward`` (``NonDynamicallyQuantizableLinear`` does, a custom one may not).
_CONV_LAYERS: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSE_LAYERS: tuple[type[nn.Module], ...] = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_COUNTED_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, *_CONV_LAYERS, *_CONV_TRANSPOSE_LAYERS)


def _counted_base(module: nn.Module) -> type[nn.Module] | None:
    """The standard layer whose formula counts ``module``, or None."""
    for base in _COUNTED_LAYERS:
        if isinstance(module, base) and type(module).forward is base.forward:
            return base
    return None


def _functions_doing_flops() -> frozenset[Any]:
    """Python entry points that reach an op FlopCounterMode counts (or might: ``mv``
    and ``addbmm`` are not counted there, but refusing them only costs the fallback)."""
    names = {
        torch: ("matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "vdot", "inner",
                "einsum", "tensordot", "chain_matmul", "bilinear", "convolution", "_convolution", "conv_tbc",
                "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "_scaled_mm"),
        torch.linalg: ("matmul", "multi_dot", "vecdot"),
        F: ("linear", "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
            "conv_transpose3d", "scaled_dot_product_attention", "multi_head_attention_forward"),
        torch._C.TensorBase: ("matmul", "__matmul__", "__rmatmul__", "__imatmul__", "mm", "bmm", "addmm", "addmm_",
                              "baddbmm", "baddbmm_", "addbmm", "addbmm_", "mv", "addmv", "addmv_", "dot", "vdot", "inner"),
        torch.Tensor: ("matmul", "__matmul__", "__rmatmul__", "__imatmul__"),
    }
    found = (getattr(owner, name, None) for owner, owned in names.items() for name in owned)
    return frozenset(function for function in found if function is not None)


_FLOP_FUNCTIONS = _functions_doing_flops()


class _OutOfLayerFlopGuard(TorchFunctionMode):
    """Refuses a matmul / convolution called outside a counted layer, e.g. a
    container whose ``forward`` does ``x @ self.fc.weight.t()``: hooks cannot see it.

    A ``TorchFunctionMode`` sits above autograd and imports nothing (unlike a
    ``TorchDispatchMode``), so it keeps the light counter light. It catches the
    Python entry points listed in :data:`_FLOP_FUNCTIONS` and any direct
    ``torch.ops`` call; a C++ extension's op is beyond it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # > 0 while a counted layer's forward runs

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.depth == 0:
            is_op = isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            try:
                doing_flops = is_op or func in _FLOP_FUNCTIONS
            except TypeError:  # an unhashable callable: not one of ours
                doing_flops = False
            if doing_flops:
                raise NotLayerCountableError(
                    f"the forward calls {getattr(func, '__qualname__', func)!r} outside an nn.Linear / nn.Conv layer; "
                    "expected such work inside counted layers only, so count with FlopCounterMode"
                )
        return func(*args, **(kwargs or {}))


def _check_countable(model: nn.Module) -> None:
    """Raise :class:`NotLayerCountableError` unless every module is a counted layer,
    a known FLOP-free layer, or a parameterless user-defined container.

    A user-defined container's own ``forward`` is watched by
    :class:`_OutOfLayerFlopGuard` at count time; an unknown leaf, a module
    holding parameters of its own, or a module whose ``forward`` is replaced on
    the instance is refused outright, since its work is invisible to the hooks.
    """
    for name, module in model.named_modules():
        kind = type(module)
        where = f"module {name or '<root>'!r} ({kind.__module__}.{kind.__qualname__})"
        if "forward" in vars(module):
            # Set on the instance (models.memory.checkpoint_bottlenecks does so): not the
            # class's forward that the checks here and the formulas assume.
            raise NotLayerCountableError(
                f"{where} has its forward replaced on the instance (activation checkpointing?); "
                "expected the class's own forward"
            )
        if _counted_base(module) is not None or kind in _FLOP_FREE_LAYERS:
            continue
        expected = "expected nn.Linear, nn.Conv*d, a known FLOP-free layer, or a parameterless container"
        if any(p is not None for p in module._parameters.values()):
            raise NotLayerCountableError(f"{where} holds parameters of its own; {expected}")
        if kind.__module__.startswith("torch."):
            raise NotLayerCountableError(f"{where} is a torch layer without a formula here; {expected}")
        if next(module.children(), None) is None:
            raise NotLayerCountableError(f"{where} is a leaf of unknown type; {expected}")


@dataclass(frozen=True)
class _LayerCall:
    """FLOPs of one counted layer call, as FlopCounterMode would count them.

    ``node`` is the output's autograd node when the call ran (None without
    autograd); captured at once because an in-place op after the layer (ReLU)
    rebinds the output tensor's ``grad_fn``.
    """

    forward: int
    grad_input: int  # 0 when the input needs no gradient: autograd then skips it
    grad_weight: int  # 0 when the weight is frozen
    node: Any


def _layer_call(module: nn.Module, base: type[nn.Module], args: tuple, output: object) -> _LayerCall:
    """Apply FlopCounterMode's formulas (conv_flop_count, conv_backward_flop,
    mm_flop) to one recorded call of a counted layer."""
    if not args or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
        raise NotLayerCountableError(
            f"{base.__name__} was called with {type(args[0]).__name__ if args else 'no positional input'} -> "
            f"{type(output).__name__}; expected one positional tensor in and a tensor out"
        )
    x = args[0]
    weight = module.weight
    x_grad = x.requires_grad
    w_grad = weight.requires_grad
    if base is nn.Linear:
        if x.dim() < 2:
            # A 1-D input runs as mv, which FlopCounterMode does not count at all.
            raise NotLayerCountableError(f"nn.Linear got a {x.dim()}-D input; expected (..., in_features)")
        # addmm / mm (y = x W^T), grad_x = g W (mm), grad_W = g^T x (mm); the bias gradient is a sum.
        rows = x.numel() // x.shape[-1]
        mm = 2 * rows * weight.shape[0] * weight.shape[1]
        return _LayerCall(mm, mm if x_grad else 0, mm if w_grad else 0, output.grad_fn)
    spatial_dims = weight.dim() - 2
    if x.dim() != spatial_dims + 2:
        raise NotLayerCountableError(
            f"{base.__name__} got a {x.dim()}-D input; expected a batched ({spatial_dims + 2}-D) one"
        )
    kernel = prod(weight.shape[2:])
    if base in _CONV_LAYERS:
        # weight (C_out, C_in / groups, *k): forward and grad_input both cost
        # 2 * B * C_out * prod(out spatial) * C_in/groups * prod(k); grad_weight is
        # counted by FlopCounterMode with the full C_in (x's channels), groups or not.
        forward = 2 * output.numel() * prod(weight.shape[1:])
        grad_weight = 2 * output.numel() * kernel * x.shape[1]
    else:
        # Transposed, weight (C_in, C_out / groups, *k): the formulas run over the
        # input's spatial points instead of the output's.
        forward = 2 * x.numel() * prod(weight.shape[1:])
        grad_weight = 2 * x.numel() * kernel * output.shape[1]
    return _LayerCall(forward, forward if x_grad else 0, grad_weight if w_grad else 0, output.grad_fn)


@dataclass(frozen=True)
class _Recorder:
    """What :func:`_hooked` records: one :class:`_LayerCall` per counted layer call,
    and the guard to enter around the forward."""

    calls: list[_LayerCall]
    guard: _OutOfLayerFlopGuard


@contextmanager
def _hooked(model: nn.Module) -> Iterator[_Recorder]:
    """Every counted layer of ``model`` hooked while the block runs; the hooks are removed after."""
    recorder = _Recorder(calls=[], guard=_OutOfLayerFlopGuard())
    handles = []

    def enter(_module: nn.Module, _args: tuple) -> None:
        recorder.guard.depth += 1

    def leave_with(base: type[nn.Module]) -> Callable[[nn.Module, tuple, object], None]:
        def leave(module: nn.Module, args: tuple, output: object) -> None:
            recorder.guard.depth -= 1
            recorder.calls.append(_layer_call(module, base, args, output))
        return leave

    try:
        for module in model.modules():
            base = _counted_base(module)
            if base is not None:
                handles.append(module.register_forward_pre_hook(enter))
                handles.append(module.register_forward_hook(leave_with(base)))
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


def _graph_nodes(root: Any) -> dict[int, Any]:
    """Every autograd node ``loss.backward()`` would reach from ``root``, by id
    (the values keep the nodes alive, so an id cannot be reused meanwhile)."""
    seen: dict[int, Any] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(next_node for next_node, _index in node.next_functions)
    return seen


def _layer_forward_total(model: nn.Module, x: torch.Tensor) -> int:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _hooked(model) as recorder, recorder.guard:
            model(x)
    finally:
        model.train(was_training)
    return sum(call.forward for call in recorder.calls)


def _layer_training_total(model: nn.Module, x: torch.Tensor, loss: LossKind) -> int:
    return sum(call.forward + call.grad_input + call.grad_weight for call in _layer_training_calls(model, x, loss))


def _layer_training_calls(model: nn.Module, x: torch.Tensor, loss: LossKind) -> list[_LayerCall]:
    """One training step's counted layer calls, their backward figures zeroed for a layer
    whose output is not on the loss's graph."""
    # A copy, as in the FlopCounterMode path: a train-mode forward moves BatchNorm statistics.
    probe = copy.deepcopy(model).train()
    with _hooked(probe) as recorder:
        with recorder.guard:
            output = probe(x)
        objective = _objective(_logits_of(output), loss)
        if objective.grad_fn is None:
            # Nothing to differentiate (grad mode off, everything frozen): the
            # FlopCounterMode path raises autograd's own error for it.
            raise NotLayerCountableError("the objective does not require grad; expected a trainable model under grad mode")
        reachable = _graph_nodes(objective.grad_fn)
        forward_calls = len(recorder.calls)
        # The backward runs for real (on the copy, at the dummy batch: cheap), hooks
        # still on: a layer that runs again inside it is recomputing activations
        # (torch.utils.checkpoint), work the formulas below do not cover.
        objective.backward()
        if len(recorder.calls) != forward_calls:
            raise NotLayerCountableError(
                f"{len(recorder.calls) - forward_calls} layer call(s) ran again during the backward pass "
                "(activation checkpointing); expected each layer to run in the forward only"
            )
    # A layer's backward runs only if its output's node is on the loss's graph
    # (an unused head costs no backward); which gradients it computes follows
    # requires_grad, exactly as convolution_backward's output_mask does.
    return [call if call.node is not None and id(call.node) in reachable else replace(call, grad_input=0, grad_weight=0)
            for call in recorder.calls[:forward_calls]]


def weight_gradient_flops_per_sample(model: nn.Module, input_shape: Sequence[int], batch_size: int = 2,
                                     loss: LossKind = "ce") -> int:
    """The weight-gradient part of :func:`layer_flops_per_sample`'s training figure, per sample:
    the products that DP-SGD's per-sample gradients (Opacus) compute once more for each sample
    on top of the usual backward. Refuses what :func:`layer_flops_per_sample` refuses."""
    _check_loss(loss)
    x = _dummy_batch(input_shape, batch_size, model)
    _check_countable(model)
    return sum(call.grad_weight for call in _layer_training_calls(model, x, loss)) // batch_size


def layer_flops_per_sample(
    model: nn.Module,
    input_shape: Sequence[int] = (3, 32, 32),
    batch_size: int = 2,
    loss: LossKind = "ce",
) -> FlopsPerSample:
    """Training and forward FLOPs per sample, as ``FlopCounterMode`` counts them,
    without entering it (see the module docstring for why).

    Runs the same dummy batch as :func:`training_flops_per_sample` (train mode,
    forward + loss + backward on a deep copy) and :func:`forward_flops_per_sample`
    (eval mode, no autograd) once each with forward hooks on every ``nn.Linear``,
    ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d``, and applies
    FlopCounterMode's formulas to the recorded shapes: 2 FLOPs per MAC; a
    backward counts grad_input only where the layer's input requires grad and
    grad_weight only where the weight does, bias gradients not at all, and only
    for layers on the loss's autograd graph. The caller's model is not modified.

    Refuses, with :class:`NotLayerCountableError`, a model with any module it
    cannot vouch for: a layer type outside the counted and known FLOP-free ones
    that holds parameters, is a leaf, or comes from torch (e.g.
    ``nn.MultiheadAttention``); a module whose ``forward`` is replaced on the
    instance (:func:`models.memory.checkpoint_bottlenecks`); a layer that runs
    again during the backward (activation checkpointing: recomputation is extra
    forward work FlopCounterMode counts). Hooks cannot see a matmul or convolution that a
    container's ``forward`` calls directly (``x @ self.fc.weight.t()``,
    ``F.conv2d(x, w)``); a ``TorchFunctionMode`` guard refuses the usual entry
    points to those (``torch.matmul``, ``@``, ``F.linear``, ``F.conv*d``,
    ``einsum``, ``torch.ops.*`` ...) but cannot promise to see every one (a C++
    extension's op), so the registry-wide equality test is the safety net.

    Raises:
        NotLayerCountableError: see above; count with :func:`flops_per_sample`,
            which falls back to ``FlopCounterMode``.
        ValueError: bad ``input_shape``, ``batch_size`` or ``loss``.
    """
    _check_loss(loss)
    x = _dummy_batch(input_shape, batch_size, model)
    _check_countable(model)
    training = _layer_training_total(model, x, loss)
    forward = _layer_forward_total(model, x)
    return FlopsPerSample(training=training // batch_size, forward=forward // batch_size)
