"""The FedGKT edge model trained with onnxruntime-training and numpy (no torch).

:class:`OrtEdgeModel` wraps one set of artifacts (see :mod:`models.onnx_export`):
onnxruntime computes the forward pass, the FedGKT loss and the gradients; the
update is the torch backend's optimizer in numpy (:mod:`.optim`); BatchNorm
running statistics, frozen in the ONNX graphs, are updated here from the
training graph's extra outputs with torch's semantics. Weights are exchanged
as the torch backend's state-dict arrays (same names, shapes and dtypes, with
``num_batches_tracked`` counted here), so the two backends' local states and
checkpoints are interchangeable.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import json
import math
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .optim import NumpyAdam, NumpySGD

__all__ = ["ArtifactMeta", "OrtEdgeModel", "OrtUnavailableError", "ort_version"]

#: Torch's BatchNorm2d defaults, which the exported graphs use.
BN_MOMENTUM = 0.1


class OrtUnavailableError(ImportError):
    """onnxruntime-training is not installed in this environment."""


def import_training_api():  # type: ignore[no-untyped-def]
    """``onnxruntime.training.api``, also where torch is not installed.

    onnxruntime-training 1.19's ``onnxruntime/training/__init__.py`` imports its
    torch-only helpers (``amp``, ``optim``: ``import torch``) before anything
    else, so ``from onnxruntime.training import api`` fails without torch,
    although the on-device training API itself (checkpoint, module, optimizer)
    needs only the native library and numpy. Likewise ``artifacts`` needs onnx,
    which a lean install (``pip install --no-deps onnxruntime-training-cpu``)
    leaves out. When such a module is missing we load ``api`` under a bare
    parent package, which skips that ``__init__``.
    """
    try:
        from onnxruntime.training import api

        return api
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "onnxruntime":
            raise  # onnxruntime itself is broken or missing
    import onnxruntime

    for name in [m for m in sys.modules if m == "onnxruntime.training" or m.startswith("onnxruntime.training.")]:
        del sys.modules[name]  # the failed, half-imported package
    package = types.ModuleType("onnxruntime.training")
    package.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
    package.__package__ = "onnxruntime.training"
    sys.modules["onnxruntime.training"] = package
    return importlib.import_module("onnxruntime.training.api")


class _RefuseTorch(importlib.abc.MetaPathFinder):
    """Makes ``import torch`` fail while onnxruntime is being imported (see :func:`_torch_hidden`)."""

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name.split(".")[0] in ("torch", "torchvision"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from onnxruntime by the ort backend)", name=name)
        return None


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """onnxruntime-training's ``import onnxruntime`` checks its build by importing
    ``onnxruntime.training.ortmodule``, which imports torch whenever torch is
    installed: the whole of torch's RSS (bench/results/footprint.json, ``runtime_baseline``)
    for an agent that never uses it. With torch out
    of sight it takes its torch-free path, as on an install without torch. Once
    torch is already loaded in the process there is nothing left to save."""
    if "torch" in sys.modules:
        yield
        return
    finder = _RefuseTorch()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def _ort():  # type: ignore[no-untyped-def]
    try:
        with _torch_hidden():
            import onnxruntime

            api = import_training_api()
    except ImportError as exc:
        raise OrtUnavailableError(
            f"the ort backend needs onnxruntime-training ({exc}); install it with: pip install 'edgesplit[edge-lite]' "
            "(x86_64 Linux, macOS or Windows; there is no Linux aarch64 build, use --backend torch on a Pi)"
        ) from None
    return onnxruntime, api


def ort_version() -> str | None:
    try:
        with _torch_hidden():
            import onnxruntime
    except ImportError:
        return None
    return str(onnxruntime.__version__)


@dataclass(frozen=True)
class ArtifactMeta:
    """What the agent must know about a set of artifacts beyond the ONNX files."""

    trainable: tuple[str, ...]
    bn_stats: tuple[str, ...]  # frozen running stats, in the order of the extra training outputs
    bn_counters: tuple[str, ...]  # num_batches_tracked buffers
    state_names: tuple[str, ...]  # torch state-dict order
    input_shape: tuple[int, int, int]
    num_classes: int

    def to_json(self) -> str:
        return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()})

    @classmethod
    def from_json(cls, text: str) -> "ArtifactMeta":
        raw = json.loads(text)
        return cls(
            trainable=tuple(raw["trainable"]), bn_stats=tuple(raw["bn_stats"]), bn_counters=tuple(raw["bn_counters"]),
            state_names=tuple(raw["state_names"]), input_shape=tuple(raw["input_shape"]), num_classes=int(raw["num_classes"]),
        )


class OrtEdgeModel:
    """One edge model under onnxruntime-training: train steps, eval forward, weights as arrays."""

    def __init__(self, artifact_dir: str | os.PathLike[str], meta: ArtifactMeta, threads: int = 1) -> None:
        onnxruntime, api = _ort()
        d = Path(artifact_dir)
        for name in ("training_model.onnx", "eval_model.onnx", "checkpoint"):
            if not (d / name).is_file():
                raise FileNotFoundError(f"ort artifact {d / name} is missing")
        self.meta = meta
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # warnings and above; ORT's info log is very chatty
        # No CPU memory arena: it grows by doubling and never gives memory back, so a
        # ResNet-8 agent's training batches, then its eval batches of another size, each
        # claimed chunks of their own and the agent's RSS roughly doubled; without it the
        # time per batch is the same (bench/results/footprint.json).
        options.enable_cpu_mem_arena = False
        self.state = api.CheckpointState.load_checkpoint(str(d / "checkpoint"))
        self.module = api.Module(str(d / "training_model.onnx"), self.state, str(d / "eval_model.onnx"), session_options=options)
        self.counters = {name: 0 for name in meta.bn_counters}
        # Layers whose statistics the training graph updates count their batches (a BatchNorm
        # frozen in inference mode, e.g. a frozen extractor's, does not, as in torch's eval mode).
        updated = {name.rsplit(".", 1)[0] for name in meta.bn_stats}
        self._counted = [name for name in meta.bn_counters if name.rsplit(".", 1)[0] in updated]
        # Our copy of the BN statistics: ORT's training kernel may write into the frozen buffers.
        self.bn_values = {name: np.array(self.state.parameters[name].data, dtype=np.float32) for name in meta.bn_stats}

    # -- training ------------------------------------------------------------ #

    def _params(self) -> dict[str, np.ndarray]:
        return {name: np.array(self.state.parameters[name].data, dtype=np.float32) for name in self.meta.trainable}

    def train_step(
        self,
        images: np.ndarray,  # (B, C, H, W) float32
        labels: np.ndarray,  # (B,) int64
        teacher_logits: np.ndarray,  # (B, K) float32
        kd_mask: np.ndarray,  # (B,) float32
        temperature: float,
        alpha: float,
        optimizer: NumpySGD | NumpyAdam,
        micro_batch: int | None = None,
    ) -> tuple[float, np.ndarray]:
        """One forward/backward/update; returns (loss, logits (B, K)).

        ``micro_batch``: a larger batch runs as near-equal micro-batches (the torch
        backend's split, :class:`models.train_step.Step`) whose gradients, weighted by
        their share of the batch, make the one update; BatchNorm normalises each with
        its own statistics and its running statistics take one update per
        micro-batch at the momentum that keeps their memory in samples. Nothing is
        applied unless every micro-batch's loss is finite.
        """
        n = images.shape[0]
        k = 1 if micro_batch is None or n <= micro_batch else -(-n // micro_batch)
        parts = np.array_split(np.arange(n), k)  # sizes differ by at most one, larger first (as torch.tensor_split)
        self.module.train()
        fed = dict(self.bn_values)  # the statistics as torch has them before this step
        for name, value in fed.items():
            self.state.parameters[name] = value
        grads: dict[str, np.ndarray] = {}
        bn_outputs: list[tuple[tuple[np.ndarray, ...], int]] = []
        losses, logits_parts = [], []
        for rows in parts:
            part = slice(int(rows[0]), int(rows[-1]) + 1)
            outputs = self.module(
                np.ascontiguousarray(images[part], dtype=np.float32), np.ascontiguousarray(labels[part], dtype=np.int64),
                np.ascontiguousarray(teacher_logits[part], dtype=np.float32), np.ascontiguousarray(kd_mask[part], dtype=np.float32),
                np.array(temperature, dtype=np.float32), np.array(alpha, dtype=np.float32),
            )
            loss = float(outputs[0])
            losses.append(loss)
            logits_parts.append(outputs[1])
            if not math.isfinite(loss):
                break
            share = np.float32(len(rows) / n)
            for name in self.meta.trainable:
                grad = self.state.parameters[name].grad
                grads[name] = grad * share if name not in grads else grads[name] + grad * share
            bn_outputs.append((tuple(outputs[3:]), len(rows) * images.shape[2] * images.shape[3]))
            self.module.lazy_reset_grad()  # the next micro-batch's gradients start from zero
        logits = logits_parts[0] if len(logits_parts) == 1 else np.concatenate(logits_parts)
        self.module.lazy_reset_grad()
        if not all(math.isfinite(v) for v in losses):
            return next(v for v in losses if not math.isfinite(v)), logits
        new = optimizer.step(self._params(), grads)
        for name, value in new.items():
            self.state.parameters[name] = value
        momentum = 1.0 - (1.0 - BN_MOMENTUM) ** (1.0 / k)
        for updated, count in bn_outputs:
            self._update_bn(updated, count, fed, momentum)
        return float(sum(v * len(rows) / n for v, rows in zip(losses, parts))), logits

    def _update_bn(self, updated: tuple[np.ndarray, ...], n: int, fed: dict[str, np.ndarray], momentum: float = BN_MOMENTUM) -> None:
        """torch: running = (1 - m) running + m batch_stat, with the *unbiased* batch variance.

        ORT's outputs are ``(1 - 0.1) running + 0.1 batch_stat`` (the graph's momentum)
        with the biased variance, computed from the statistics the step was ``fed``; recover the batch statistic and redo
        the update as torch does, with ``momentum`` (a micro-batch's; see :meth:`train_step`).
        """
        m = np.float32(BN_MOMENTUM)
        for name, out in zip(self.meta.bn_stats, updated):
            batch = (out.astype(np.float32) - (np.float32(1) - m) * fed[name]) / m
            if name.endswith("running_var"):
                batch = batch * np.float32(n / max(n - 1, 1))
            before = self.bn_values[name]
            self.bn_values[name] = ((np.float32(1) - np.float32(momentum)) * before + np.float32(momentum) * batch).astype(np.float32)
        for name in self._counted:
            self.counters[name] += 1

    # -- inference ------------------------------------------------------------ #

    def forward_eval(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logits (B, K), features (B, 16, H, W)) with BN running statistics (eval mode)."""
        self.module.eval()
        for name, value in self.bn_values.items():
            self.state.parameters[name] = value
        b = images.shape[0]
        outputs = self.module(
            np.ascontiguousarray(images, dtype=np.float32), np.zeros(b, np.int64),
            np.zeros((b, self.meta.num_classes), np.float32), np.zeros(b, np.float32),
            np.array(1.0, np.float32), np.array(0.0, np.float32),
        )
        return outputs[1], outputs[2]

    # -- weights as the torch backend's arrays ---------------------------------- #

    def arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name in self.meta.state_names:
            if name in self.counters:
                out[name] = np.array(self.counters[name], dtype=np.int64)
            elif name in self.bn_values:
                out[name] = self.bn_values[name].copy()
            else:
                out[name] = np.array(self.state.parameters[name].data, dtype=np.float32)
        return out

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """All-or-nothing, like :func:`models.weights.load_arrays_into`."""
        current = self.arrays()
        missing = [k for k in current if k not in arrays]
        unexpected = [k for k in arrays if k not in current]
        if missing or unexpected:
            raise ValueError(f"weights do not match the edge model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, target in current.items():
            value = np.asarray(arrays[name])
            if value.shape != target.shape:
                raise ValueError(f"weight {name!r} has shape {value.shape}, model expects {target.shape}")
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise ValueError(f"weight {name!r} contains NaN or infinite values")
        for name in current:
            value = np.asarray(arrays[name])
            if name in self.counters:
                self.counters[name] = int(value)
            elif name in self.bn_values:
                self.bn_values[name] = np.array(value, dtype=np.float32)
            else:
                self.state.parameters[name] = np.ascontiguousarray(value, dtype=np.float32)
