"""Training artifacts for the on-device onnxruntime-training backend (``--backend ort``).

The server (which has torch) exports the edge model once and generates what
``onnxruntime.training.api`` needs to train it on a device that has no torch:

* ``training_model.onnx`` -- forward, the FedGKT edge loss and the gradient graph;
* ``eval_model.onnx``     -- forward and loss with BatchNorm in inference mode;
* ``optimizer_model.onnx``-- an ORT optimizer graph (AdamW); shipped for clients
  that want it, see below;
* ``checkpoint``          -- the initial parameters and the frozen BN statistics.

The loss is a custom onnxblock (:class:`GktEdgeLoss`): FedGKT's Eq. 7,
``CE(z_c, y) + alpha * T^2 * KL(softmax(z_s / T) || softmax(z_c / T))`` with the
KD term averaged over the samples that have a server logit (``kd_mask``), and
temperature and alpha as rank-0 runtime inputs, so one set of artifacts serves
every round config. The feature maps H and the logits are extra outputs of both
models (H is what FedGKT uploads).

BatchNorm running statistics are *frozen* parameters (no gradient), but the
training graph exposes each BN node's updated running mean and variance as an
extra output: the agent writes them back after every step, with torch's
semantics (momentum 0.1, unbiased batch variance), so eval-mode feature maps
match the torch backend's.

Exporter fixes onnxruntime-training 1.19.2 needs with current torch/onnx: the TorchScript exporter (``dynamo=False``) in
``TrainingMode.TRAINING`` with ``do_constant_folding=False`` (constant folding
would fold the BN statistics away); ``ir_version`` capped at 10 (onnx 1.23 writes
newer IR versions than ORT 1.19 loads); BN nodes of the eval model switched to
inference mode and their extra outputs stripped; the loss is rank-0.

Weights travel in the torch backend's format (state-dict names, numpy arrays,
:mod:`models.weights`): the ONNX initializers carry the state-dict names, so
:func:`checkpoint_arrays` / the agent's ``load_arrays`` map one to one.
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from models.registry import build_model

__all__ = [
    "ARTIFACT_FILES",
    "LOSS_INPUTS",
    "MAX_IR_VERSION",
    "OrtArtifacts",
    "OrtExportError",
    "export_edge_artifacts",
    "export_forward_onnx",
]

#: Highest ONNX IR version onnxruntime 1.19 loads.
MAX_IR_VERSION = 10
#: Opset of the exported graphs (BatchNormalization with training_mode needs >= 15).
OPSET = 17
ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")
#: Extra graph inputs the loss adds, after ``images``: name -> (dtype, shape description).
LOSS_INPUTS = {
    "labels": ("int64", "(B,)"),
    "teacher_logits": ("float32", "(B, K)"),
    "kd_mask": ("float32", "(B,) 1 where a server logit exists"),
    "temperature": ("float32", "()"),
    "alpha": ("float32", "()"),
}
#: Suffix of the training graph outputs that carry a BN node's updated running statistic.
BN_UPDATED_SUFFIX = "__updated"
#: State-dict prefix of the edge model's extractor (``SplitResNet.extractor``).
EXTRACTOR_PREFIX = "extractor."


class OrtExportError(RuntimeError):
    """The artifacts could not be generated (onnxruntime-training or onnx missing, or an exporter failure)."""


@dataclass(frozen=True)
class OrtArtifacts:
    """Everything an ort agent needs, as bytes (they travel in a protocol message).

    ``bn_stats`` lists the frozen running statistics (state-dict names) in the
    order the training model outputs their updated values, after ``loss``,
    ``logits`` and ``features``. ``bn_counters`` are the ``num_batches_tracked``
    buffers, which ONNX does not have and the agent counts itself.
    """

    training_model: bytes
    eval_model: bytes
    optimizer_model: bytes
    checkpoint: bytes
    trainable: tuple[str, ...]
    bn_stats: tuple[str, ...]
    bn_counters: tuple[str, ...]
    input_shape: tuple[int, int, int]  # (C, H, W)
    num_classes: int
    state_names: tuple[str, ...] = field(default=())  # the torch state-dict order

    def files(self) -> dict[str, bytes]:
        return {
            "training_model.onnx": self.training_model,
            "eval_model.onnx": self.eval_model,
            "optimizer_model.onnx": self.optimizer_model,
            "checkpoint": self.checkpoint,
        }

    def write(self, directory: str | os.PathLike[str]) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name, blob in self.files().items():
            (out / name).write_bytes(blob)
        return out


def _require_onnx():  # type: ignore[no-untyped-def]
    try:
        import onnx
        from onnxruntime.training import artifacts, onnxblock
    except ImportError as exc:
        raise OrtExportError(
            f"generating ort artifacts needs onnx and onnxruntime-training ({exc}); "
            "install them with: pip install 'edgesplit[server-ort]'"
        ) from None
    return onnx, artifacts, onnxblock


def export_forward_onnx(model: nn.Module, input_shape: tuple[int, int, int]) -> bytes:
    """``images (B, C, H, W) -> logits (B, K), features (B, 16, H, W)`` as ONNX, training-mode BN."""
    was_training = model.training
    model.train()
    dummy = torch.zeros((2, *input_shape), dtype=torch.float32)
    f = io.BytesIO()
    try:
        # The TorchScript exporter: the dynamo exporter's graphs do not train under ORT 1.19.
        # It drops BN's num_batches_tracked increments (and says so per layer); the ort
        # backend counts them itself.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*num_batches_tracked.*", category=UserWarning)
            torch.onnx.export(
                model, (dummy,), f,
                input_names=["images"], output_names=["logits", "features"],
                dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}, "features": {0: "batch"}},
                training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False, opset_version=OPSET,
            )
    finally:
        model.train(was_training)
    return f.getvalue()


def _make_loss_block(onnxblock, onnx):  # type: ignore[no-untyped-def]
    from onnx import TensorProto, helper

    class GktEdgeLoss(onnxblock.Block):
        """FedGKT edge loss (Eq. 7) with temperature and alpha as rank-0 inputs."""

        def build(self, logits: str, features: str, *_: str) -> str:  # type: ignore[override]
            graph = self.base.graph
            graph.input.extend([
                helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"]),
                helper.make_tensor_value_info("teacher_logits", TensorProto.FLOAT, ["batch", "classes"]),
                helper.make_tensor_value_info("kd_mask", TensorProto.FLOAT, ["batch"]),
                helper.make_tensor_value_info("temperature", TensorProto.FLOAT, []),
                helper.make_tensor_value_info("alpha", TensorProto.FLOAT, []),
            ])
            graph.initializer.extend([
                helper.make_tensor("gkt_axis1", TensorProto.INT64, [1], [1]),
                helper.make_tensor("gkt_one", TensorProto.FLOAT, [], [1.0]),
            ])
            n = lambda op, ins, outs, **kw: graph.node.append(helper.make_node(op, ins, outs, **kw))  # noqa: E731
            n("SoftmaxCrossEntropyLoss", [logits, "labels"], ["gkt_ce"], reduction="mean")
            n("Div", [logits, "temperature"], ["gkt_s_scaled"])
            n("LogSoftmax", ["gkt_s_scaled"], ["gkt_log_ps"], axis=1)
            n("Div", ["teacher_logits", "temperature"], ["gkt_t_scaled"])
            n("LogSoftmax", ["gkt_t_scaled"], ["gkt_log_pt"], axis=1)
            n("Exp", ["gkt_log_pt"], ["gkt_pt"])
            n("Sub", ["gkt_log_pt", "gkt_log_ps"], ["gkt_log_ratio"])
            n("Mul", ["gkt_pt", "gkt_log_ratio"], ["gkt_kl_terms"])  # (B, K)
            n("ReduceSum", ["gkt_kl_terms", "gkt_axis1"], ["gkt_kl"], keepdims=0)  # (B,)
            n("Mul", ["gkt_kl", "kd_mask"], ["gkt_kl_masked"])
            n("ReduceSum", ["gkt_kl_masked"], ["gkt_kl_sum"], keepdims=0)  # ()
            n("ReduceSum", ["kd_mask"], ["gkt_mask_sum"], keepdims=0)
            n("Max", ["gkt_mask_sum", "gkt_one"], ["gkt_mask_den"])
            n("Div", ["gkt_kl_sum", "gkt_mask_den"], ["gkt_kl_mean"])
            n("Mul", ["temperature", "temperature"], ["gkt_t2"])
            n("Mul", ["gkt_kl_mean", "gkt_t2"], ["gkt_kd"])
            n("Mul", ["alpha", "gkt_kd"], ["gkt_kd_weighted"])
            n("Add", ["gkt_ce", "gkt_kd_weighted"], ["loss"])
            graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
            return "loss"

    return GktEdgeLoss()


def _cap_ir(onnx, blob: bytes) -> bytes:  # type: ignore[no-untyped-def]
    model = onnx.load_from_string(blob)
    if model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION
    return model.SerializeToString()


def _eval_fix(onnx, blob: bytes, bn_outputs: set[str]) -> bytes:  # type: ignore[no-untyped-def]
    """BN in inference mode (running statistics), without its training-only outputs."""
    model = onnx.load_from_string(blob)
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            for attr in list(node.attribute):
                if attr.name == "training_mode":
                    node.attribute.remove(attr)
            del node.output[1:]
    keep = [o for o in model.graph.output if o.name not in bn_outputs]
    del model.graph.output[:]
    model.graph.output.extend(keep)
    if model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION
    return model.SerializeToString()


def _freeze_batchnorms(model, prefix: str) -> None:  # type: ignore[no-untyped-def]
    """BatchNorm layers whose parameters start with ``prefix`` become the inference-mode
    formula in plain ops, ``(x - running_mean) / sqrt(running_var + eps) * weight + bias``:
    onnxruntime-training turns every BatchNormalization node of a training graph into a
    training-mode one (batch statistics), whatever its ``training_mode``."""
    from onnx import TensorProto, helper

    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.initializer.append(helper.make_tensor("gkt_bn_axes", TensorProto.INT64, [2], [1, 2]))
    for node in nodes:
        if node.op_type != "BatchNormalization" or not node.input[1].startswith(prefix):
            model.graph.node.append(node)
            continue
        x, weight, bias, mean, var = node.input
        eps = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"), 1e-5)
        tag = f"gkt_frozen_{weight}"
        model.graph.initializer.append(helper.make_tensor(f"{tag}_eps", TensorProto.FLOAT, [], [eps]))
        add = lambda op, ins, out: model.graph.node.append(helper.make_node(op, ins, [out], name=out))  # noqa: E731
        for name, source in (("w", weight), ("b", bias), ("m", mean), ("v", var)):
            add("Unsqueeze", [source, "gkt_bn_axes"], f"{tag}_{name}")  # (C,) -> (C, 1, 1)
        add("Add", [f"{tag}_v", f"{tag}_eps"], f"{tag}_ve")
        add("Sqrt", [f"{tag}_ve"], f"{tag}_sd")
        add("Sub", [x, f"{tag}_m"], f"{tag}_xc")
        add("Div", [f"{tag}_xc", f"{tag}_sd"], f"{tag}_xn")
        add("Mul", [f"{tag}_xn", f"{tag}_w"], f"{tag}_xs")
        add("Add", [f"{tag}_xs", f"{tag}_b"], node.output[0])  # the layer's own output name


def export_edge_artifacts(
    model: nn.Module | str,
    num_classes: int,
    in_channels: int,
    image_size: int = 32,
    train_extractor: bool = True,
) -> OrtArtifacts:
    """Generate the ort training artifacts for an edge model (``forward(x) -> (logits, features)``).

    ``model`` is a module (its current weights become the checkpoint) or a registry name.
    ``train_extractor = False`` (FedGKT's ``fedgkt.train_extractor``): the extractor's
    parameters are frozen and its BatchNorm runs in inference mode in the training graph too
    (its running statistics neither used from the batch nor updated), as the torch backend
    trains with the extractor in eval mode.
    """
    onnx, artifacts, onnxblock = _require_onnx()
    if isinstance(model, str):
        model = build_model(model, num_classes, in_channels)
    input_shape = (in_channels, image_size, image_size)
    # Tracing runs a training-mode forward, which moves the BN running statistics:
    # export a copy and write the real state into the initializers afterwards.
    state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    base = onnx.load_from_string(export_forward_onnx(copy.deepcopy(model), input_shape))
    from onnx import numpy_helper

    initializers = {i.name for i in base.graph.initializer}
    missing = [k for k in state if not k.endswith("num_batches_tracked") and k not in initializers]
    if missing:
        raise OrtExportError(f"exported graph lacks state-dict entries {missing[:5]}; the exporter renamed them")
    for init in base.graph.initializer:
        if init.name in state:
            init.CopyFrom(numpy_helper.from_array(state[init.name].astype(numpy_helper.to_array(init).dtype), init.name))

    bn_stats: list[str] = []
    bn_updated: list[str] = []
    frozen_prefix = EXTRACTOR_PREFIX if not train_extractor else None
    if frozen_prefix:
        _freeze_batchnorms(base, frozen_prefix)
    for node in base.graph.node:
        if node.op_type == "BatchNormalization" and len(node.output) == 3:
            for state_name, position in ((node.input[3], 1), (node.input[4], 2)):
                updated = state_name + BN_UPDATED_SUFFIX
                node.output[position] = updated
                bn_stats.append(state_name)
                bn_updated.append(updated)
    trainable = [name for name, p in model.named_parameters()
                 if p.requires_grad and not (frozen_prefix and name.startswith(frozen_prefix))]
    frozen = sorted(initializers - set(trainable))

    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # generate_artifacts logs every graph pass at INFO
    with tempfile.TemporaryDirectory(prefix="edgesplit-ort-") as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)  # onnxblock writes temporary files into the working directory
        try:
            artifacts.generate_artifacts(
                base,
                requires_grad=trainable,
                frozen_params=frozen,
                loss=_make_loss_block(onnxblock, onnx),
                optimizer=artifacts.OptimType.AdamW,
                artifact_directory=tmp,
                additional_output_names=["logits", "features", *bn_updated],
            )
        except (RuntimeError, ValueError, OSError) as exc:  # name the failing step (onnxruntime raises RuntimeError subclasses)
            raise OrtExportError(f"generate_artifacts failed: {exc}") from exc
        finally:
            os.chdir(cwd)
        d = Path(tmp)
        checkpoint_path = d / "checkpoint"
        if checkpoint_path.is_dir():
            raise OrtExportError("onnxruntime-training wrote a checkpoint directory; expected the 1.19 single-file format")
        return OrtArtifacts(
            training_model=_cap_ir(onnx, (d / "training_model.onnx").read_bytes()),
            eval_model=_eval_fix(onnx, (d / "eval_model.onnx").read_bytes(), set(bn_updated)),
            optimizer_model=_cap_ir(onnx, (d / "optimizer_model.onnx").read_bytes()),
            checkpoint=checkpoint_path.read_bytes(),
            trainable=tuple(trainable),
            bn_stats=tuple(bn_stats),
            bn_counters=tuple(k for k in state if k.endswith("num_batches_tracked")),
            input_shape=input_shape,
            num_classes=num_classes,
            state_names=tuple(state),
        )

