"""EdgeSplit model zoo: architectures, a registry by name, cost counting, weight arrays,
and what both sides train with: the one training loop and optimiser factory
(:mod:`models.training`), losses, SWA and BatchNorm-statistics helpers.

Architectures: the split ResNets (:mod:`models.resnet`, :mod:`models.mentor`) and the
KD papers' plain CNNs (:mod:`models.convnet`), every one with the linear-head view of
:mod:`models.heads`.

Depends on torch and numpy only; it never imports the protocol, data, agent or
server packages, so both sides of a run (and a Pi) can install it alone.

Typical use::

    from models import build_model, training_flops_per_sample

    edge = build_model("resnet8", num_classes=10, in_channels=1)
    logits, features = edge(images)            # (B, 10), (B, 16, H, W)
    server = build_model("resnet55_server", num_classes=10)
    server_logits = server(features)           # (B, 10)
    flops = training_flops_per_sample(edge, (1, 28, 28))
"""

from models.cost import (
    FlopsPerSample,
    LossKind,
    NotLayerCountableError,
    architecture_key,
    cached_flops_per_sample,
    cached_forward_flops_per_sample,
    clear_flops_cache,
    count_parameters,
    flops_of,
    flops_per_sample,
    forward_flops_per_sample,
    layer_flops_per_sample,
    training_flops_per_sample,
)
from models.registry import (
    InputKind,
    ModelBuilder,
    ModelSpec,
    build_model,
    check_cut_pair,
    get_model_spec,
    list_models,
    register_model,
)

# Importing the architectures registers their builders.
from models.resnet import (
    FEATURE_CHANNELS,
    RESNET8_LAYOUT,
    RESNET56_LAYOUT,
    RESNET110_LAYOUT,
    Bottleneck,
    ConvStem,
    ResNet,
    ResNet8Edge,
    ResNetTrunk,
    SplitResNet,
    StageLayout,
    resnet8,
    resnet55_server,
    resnet56,
    resnet109_server,
    resnet110,
)
# Registers the FedKD mentor architectures (resnet20) so the registry is complete on import.
import models.mentor  # noqa: E402,F401
import models.resnet_cut  # noqa: E402,F401  (the deeper cut: resnet8_stage1 and its server models)
from models.convnet import CONVNET_LAYOUT, SIMPLECNN_LAYOUT, ConvLayout, ConvNet, convnet, simplecnn  # noqa: E402
from models.weights import WeightsMismatchError, load_arrays_into, state_dict_to_arrays

__all__ = [
    "CONVNET_LAYOUT",
    "FEATURE_CHANNELS",
    "RESNET8_LAYOUT",
    "RESNET56_LAYOUT",
    "RESNET110_LAYOUT",
    "SIMPLECNN_LAYOUT",
    "Bottleneck",
    "ConvLayout",
    "ConvNet",
    "ConvStem",
    "FlopsPerSample",
    "InputKind",
    "LossKind",
    "ModelBuilder",
    "ModelSpec",
    "NotLayerCountableError",
    "ResNet",
    "ResNet8Edge",
    "ResNetTrunk",
    "SplitResNet",
    "StageLayout",
    "WeightsMismatchError",
    "architecture_key",
    "build_model",
    "check_cut_pair",
    "cached_flops_per_sample",
    "cached_forward_flops_per_sample",
    "clear_flops_cache",
    "convnet",
    "count_parameters",
    "flops_of",
    "flops_per_sample",
    "forward_flops_per_sample",
    "get_model_spec",
    "layer_flops_per_sample",
    "list_models",
    "load_arrays_into",
    "register_model",
    "resnet8",
    "resnet55_server",
    "resnet56",
    "resnet109_server",
    "resnet110",
    "simplecnn",
    "state_dict_to_arrays",
    "training_flops_per_sample",
]
