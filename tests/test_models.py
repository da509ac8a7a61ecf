"""Unit tests for the models package: architectures, registry, cost counting, weight arrays."""

from __future__ import annotations

import ast
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from models.resnet_cut import STAGE1_CHANNELS, ResNet8Stage1Edge
import torch
import torch.nn as nn

import models
from models import (
    FEATURE_CHANNELS,
    ResNet8Edge,
    StageLayout,
    WeightsMismatchError,
    build_model,
    count_parameters,
    flops_of,
    forward_flops_per_sample,
    get_model_spec,
    list_models,
    load_arrays_into,
    register_model,
    state_dict_to_arrays,
    training_flops_per_sample,
)
from models import registry as registry_module

# resnet20: the small FedKD mentor (models/mentor.py).
# simplecnn / convnet: the KD papers' plain CNNs (models/convnet.py).
EXPECTED_MODELS = {"resnet8", "resnet8_gn", "resnet20", "resnet20_gn", "cifar_resnet8_gn", "cifar_resnet20_gn", "resnet55_server", "resnet109_server", "resnet56", "resnet110",
                   "simplecnn", "convnet", "resnet8_stage1", "resnet55_server_stage1", "resnet109_server_stage1"}

# FedML's FedGKT variants, CIFAR-10 head, 3 input channels (the paper's 54x / 105x).
# The server counts are the full models' minus the stem (conv 3*16*9 + BN 2*16 = 464).
EXPECTED_PARAMS = {
    "resnet8": 10_586,
    "resnet8_stage1": 10_586,  # resnet8 cut later: the same layers
    "resnet8_gn": 10_586,  # GroupNorm's affine weight and bias replace BatchNorm's, one for one
    # He et al.'s CIFAR ResNet-8 (their "0.078M"): stem 432 + 32, stage 1 2 x 2,304 + 64,
    # stage 2 4,608 + 9,216 + shortcut 512 + 192, stage 3 18,432 + 36,864 + 2,048 + 384, fc 650.
    "cifar_resnet8_gn": 78_042,
    "resnet56": 591_322,
    "resnet110": 1_147_738,
    "resnet55_server": 591_322 - 464,
    "resnet109_server": 1_147_738 - 464,
    # FedDistill's SimpleCNN (MOON's CIFAR one): conv 3*6*25 + 6, conv 6*16*25 + 16, fc (16*5*5)*120 + 120, 120*84 + 84, 84*10 + 10.
    "simplecnn": 456 + 2_416 + 48_120 + 10_164 + 850,
    # FedBE's ConvNet (its CIFAR one): conv 3*32*9 + 32, 32*64*9 + 64, 64*64*9 + 64, fc (64*4*4)*64 + 64, 64*10 + 10.
    "convnet": 896 + 18_496 + 36_928 + 65_600 + 650,
}


def _input_batch(name: str, in_channels: int, batch_size: int = 2, size: int = 32) -> torch.Tensor:
    shape = get_model_spec(name).input_shape(in_channels=in_channels, image_size=size)
    return torch.randn(batch_size, *shape, generator=torch.Generator().manual_seed(1))  # (B, C, H, W)


# --- architectures and registry ------------------------------------------------


def test_registry_lists_every_model() -> None:
    assert set(list_models()) == EXPECTED_MODELS
    assert list_models() == sorted(list_models())


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_parameter_counts_match_fedml_exactly(name: str) -> None:
    assert count_parameters(build_model(name, num_classes=10, in_channels=3)) == EXPECTED_PARAMS[name]


@pytest.mark.parametrize("name", ["resnet8_gn", "resnet20_gn", "cifar_resnet8_gn", "cifar_resnet20_gn"])
def test_group_norm_models_have_no_batch_statistics(name: str) -> None:
    """The GroupNorm variants (FedGKD's ResNet-8) keep no running statistics: the same
    parameters give the same outputs in train and eval mode, whatever data trained them, so
    an averaged model needs no BatchNorm statistics from any agent."""
    model = build_model(name, num_classes=10, in_channels=1)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert any(isinstance(m, torch.nn.GroupNorm) for m in model.modules())
    assert list(model.buffers()) == []
    if not name.startswith("cifar_"):  # a BatchNorm twin: the same layers, GroupNorm where it had BatchNorm
        plain = build_model(name.removesuffix("_gn"), num_classes=10, in_channels=1)
        assert sum(isinstance(m, torch.nn.GroupNorm) for m in model.modules()) == sum(
            isinstance(m, torch.nn.BatchNorm2d) for m in plain.modules())
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = _input_batch(name, 1, batch_size=4)
    with torch.no_grad():
        train_out = model.train()(x)
        eval_out = model.eval()(x)
        single = model(x[:1])
    first = (lambda out: out[0] if isinstance(out, tuple) else out)
    assert torch.equal(first(train_out), first(eval_out))
    # Per-sample normalisation: a sample's output does not depend on the rest of its batch.
    assert torch.allclose(first(single), first(eval_out)[:1], atol=1e-5)


def test_cifar_resnets_are_he_et_al_s_6n_plus_2_layers() -> None:
    from models.resnet import CIFAR_RESNET8_LAYOUT, CIFAR_RESNET20_LAYOUT, StageLayout
    # stem + 2 convs per basic block + fc: 8 and 20 weighted layers
    assert 1 + CIFAR_RESNET8_LAYOUT.conv_layers + 1 == 8 and 1 + CIFAR_RESNET20_LAYOUT.conv_layers + 1 == 20
    model = build_model("cifar_resnet8_gn", in_channels=3)
    with torch.no_grad():
        stages = model.classifier.stages(model.extract(_input_batch("cifar_resnet8_gn", 3)))
    assert stages.shape == (2, 64, 8, 8)  # 16 -> 32 -> 64 channels, 32 -> 16 -> 8 pixels
    with pytest.raises(ValueError, match="block must be one of"):
        StageLayout(blocks=(1,), planes=(16,), strides=(1,), block="wide")


@pytest.mark.parametrize("size", [28, 32])
@pytest.mark.parametrize("name", sorted(n for n in EXPECTED_MODELS if get_model_spec(n).input_kind == "image"))
def test_every_image_model_is_head_of_embed_of_feature_map(name: str, size: int) -> None:
    """The linear-head view every KD method reads (models/heads.py: FedDistill's E and FC,
    FedKD's hidden states) is the model's own forward, cut in two places, for every image
    model of the registry at Fashion-MNIST's and CIFAR's sizes."""
    from models.heads import LinearHeadModel, features_and_logits, linear_head, map_features_and_logits
    from models.mentor import forward_with_hidden, hidden_dim

    model = build_model(name, num_classes=10, in_channels=1).eval()
    assert isinstance(model, LinearHeadModel)
    x = _input_batch(name, in_channels=1, batch_size=3, size=size)
    with torch.no_grad():
        out = model(x)
        own = out[0] if isinstance(out, tuple) else out
        feature_map, features, logits = map_features_and_logits(model, x)
        assert feature_map.dim() == 4 and feature_map.shape[0] == 3
        assert features.shape == (3, linear_head(model).in_features) == (3, hidden_dim(model))
        assert torch.equal(logits, own) and torch.equal(linear_head(model)(features), own)
        assert torch.equal(features_and_logits(model, x)[0], features)
        hidden = forward_with_hidden(model, x)
        assert torch.equal(hidden.logits, own) and torch.equal(hidden.hidden, features) and torch.equal(hidden.feature_map, feature_map)


def test_a_model_without_the_head_view_is_refused_by_name() -> None:
    from models.heads import linear_head

    with pytest.raises(TypeError, match="linear head view.*ResNetTrunk"):
        linear_head(build_model("resnet55_server"))


def test_the_convnets_are_the_papers_layer_stacks() -> None:
    """SimpleCNN (FedDistill's Table I; MOON's layers) and ConvNet (FedBE's Table 1: "3
    convolutional and 2 fully-connected layers"): the conv / fc stacks, the map sizes on
    EdgeSplit's 32 x 32 images, and no normalisation layer (no buffers: an average of agents'
    models needs no batch statistics)."""
    from models.convnet import CONVNET_LAYOUT, SIMPLECNN_LAYOUT

    for name, convs, fcs, (channels, side) in (("simplecnn", 2, 3, (16, 5)), ("convnet", 3, 2, (64, 4))):
        model = build_model(name, in_channels=1)
        assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == convs
        assert sum(isinstance(m, nn.Linear) for m in model.modules()) == fcs
        assert not any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules()) and list(model.buffers()) == []
        with torch.no_grad():
            feature_map = model.feature_map(torch.zeros(1, 1, 32, 32))
            assert feature_map.shape == (1, channels, side, side) and torch.equal(model.pool(feature_map), feature_map)  # the identity at 32
    assert SIMPLECNN_LAYOUT.map_size(28) == 4 and SIMPLECNN_LAYOUT.map_size(32) == 5
    assert CONVNET_LAYOUT.map_size(28) == 3 and CONVNET_LAYOUT.map_size(32) == 4
    # The smallest image each takes, and a clear refusal below it.
    assert (SIMPLECNN_LAYOUT.min_image_size, CONVNET_LAYOUT.min_image_size) == (16, 18)
    with pytest.raises(ValueError, match="at least 16 x 16"):
        build_model("simplecnn", in_channels=1)(torch.zeros(1, 1, 12, 12))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"channels": ()}, "at least one conv"),
        ({"kernels": (5,)}, "one entry per conv"),
        ({"channels": (6, 0)}, "positive integer"),
        ({"pools": (True, 1)}, "booleans"),
        ({"pooled_size": 0}, "positive integer"),
    ],
)
def test_conv_layout_is_validated(kwargs: dict[str, object], message: str) -> None:
    from models.convnet import SIMPLECNN_LAYOUT, ConvLayout

    fields = {"channels": SIMPLECNN_LAYOUT.channels, "kernels": SIMPLECNN_LAYOUT.kernels, "pools": SIMPLECNN_LAYOUT.pools,
              "pooled_size": SIMPLECNN_LAYOUT.pooled_size, "hidden": SIMPLECNN_LAYOUT.hidden}
    with pytest.raises(ValueError, match=message):
        ConvLayout(**{**fields, **kwargs})  # type: ignore[arg-type]


def test_trainable_only_excludes_frozen_parameters() -> None:
    model = build_model("resnet8")
    model.extractor.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 10_586 - 464
    assert count_parameters(model) == 10_586


@pytest.mark.parametrize("in_channels", [1, 3])
@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_every_model_builds_and_runs_forward(name: str, in_channels: int) -> None:
    model = build_model(name, num_classes=7, in_channels=in_channels)
    x = _input_batch(name, in_channels)

    output = model(x)

    if isinstance(model, ResNet8Edge):
        logits, features = output
        assert features.shape == (2, FEATURE_CHANNELS, 32, 32)
    elif isinstance(model, ResNet8Stage1Edge):  # the deeper cut: the stage's 64-channel maps
        logits, features = output
        assert features.shape == (2, STAGE1_CHANNELS, 32, 32)
        server = build_model("resnet55_server_stage1", num_classes=7)
        assert server(features).shape == (2, 7)
    else:
        logits = output
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()


def test_server_input_shape_is_feature_map_regardless_of_image_channels() -> None:
    assert get_model_spec("resnet55_server").input_shape(in_channels=1) == (FEATURE_CHANNELS, 32, 32)
    assert get_model_spec("resnet8").input_shape(in_channels=1, image_size=28) == (1, 28, 28)


def test_edge_forward_equals_extract_then_classify() -> None:
    edge = build_model("resnet8", in_channels=1).eval()
    x = _input_batch("resnet8", in_channels=1, size=28)  # Fashion-MNIST size

    with torch.no_grad():
        logits, features = edge(x)
        assert torch.equal(features, edge.extract(x))
        assert torch.equal(logits, edge.classify(features))
    assert features.shape == (2, FEATURE_CHANNELS, 28, 28)


def test_server_models_consume_edge_features() -> None:
    edge = build_model("resnet8")
    server = build_model("resnet109_server", num_classes=10)
    features = edge.extract(_input_batch("resnet8", 3))  # (2, 16, 32, 32)

    assert server(features).shape == (2, 10)


def test_full_model_state_names_follow_the_split() -> None:
    names = list(build_model("resnet56").state_dict())
    assert names[0] == "extractor.conv.weight"
    assert all(n.startswith(("extractor.", "classifier.")) for n in names)


def test_duplicate_registration_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    def tiny(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
        return nn.Linear(in_channels, num_classes)

    register_model("tiny_for_test")(tiny)
    with pytest.raises(ValueError, match="already registered"):
        register_model("tiny_for_test")(tiny)
    with pytest.raises(ValueError, match="already registered"):
        register_model("resnet8")(tiny)
    assert isinstance(build_model("tiny_for_test", num_classes=4), nn.Linear)


def test_unknown_model_raises_with_known_names() -> None:
    with pytest.raises(ValueError, match="resnet8"):
        build_model("resnet9000")


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
@pytest.mark.parametrize("num_classes", [0, -3, 2.5, True, "10"])
def test_invalid_num_classes_raises(name: str, num_classes: object) -> None:
    with pytest.raises(ValueError, match="num_classes"):
        build_model(name, num_classes=num_classes)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
@pytest.mark.parametrize("in_channels", [0, -1, 1.0])
def test_invalid_in_channels_raises(name: str, in_channels: object) -> None:
    with pytest.raises(ValueError, match="in_channels"):
        build_model(name, in_channels=in_channels)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": ()}, "at least one stage"),
        ({"blocks": (2, 2)}, "one entry per stage"),
        ({"blocks": (2, 0, 2)}, "blocks"),
        ({"blocks": (2, 2, 2), "strides": (1, 0, 2)}, "strides"),
    ],
)
def test_stage_layout_is_validated(kwargs: dict[str, tuple[int, ...]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StageLayout(**kwargs)


# --- cost counting -----------------------------------------------------------


def test_training_flop_ratios_match_the_paper() -> None:
    flops = {name: training_flops_per_sample(build_model(name), (3, 32, 32), batch_size=2) for name in ("resnet8", "resnet56", "resnet110")}

    assert flops["resnet56"] / flops["resnet8"] >= 9
    assert flops["resnet110"] / flops["resnet8"] >= 17
    # Reference figures per image measured for this project (fwd + bwd): 56.8 M / 522.4 M / 1003.7 M.
    assert flops["resnet8"] == pytest.approx(56.8e6, rel=1e-3)
    assert flops["resnet56"] == pytest.approx(522.4e6, rel=1e-3)
    assert flops["resnet110"] == pytest.approx(1003.7e6, rel=1e-3)


def test_simplecnn_flops_are_its_layers_macs_counted_by_hand() -> None:
    """On a 32 x 32 x 1 image (padded Fashion-MNIST), MACs: conv1 28*28*6*25 = 117,600;
    conv2 10*10*16*150 = 240,000; fc 400*120 + 120*84 + 84*10 = 58,920. Forward = 2 x 416,520;
    training = 3 x forward less the first conv's input gradient (2 x 117,600). About 32x
    fewer than the GroupNorm ResNet-8's."""
    model = build_model("simplecnn", in_channels=1)
    forward = 2 * (117_600 + 240_000 + 58_920)
    assert forward_flops_per_sample(model, (1, 32, 32)) == forward == 833_040
    assert training_flops_per_sample(model, (1, 32, 32)) == 3 * forward - 2 * 117_600 == 2_263_920
    resnet8 = training_flops_per_sample(build_model("cifar_resnet8_gn", in_channels=1), (1, 32, 32))
    assert resnet8 / 2_263_920 > 30


def test_flops_per_sample_do_not_depend_on_batch_size() -> None:
    model = build_model("resnet8")
    assert training_flops_per_sample(model, batch_size=2) == training_flops_per_sample(model, batch_size=3)
    assert forward_flops_per_sample(model, batch_size=1) == forward_flops_per_sample(model, batch_size=4)


def test_forward_flops_are_about_a_third_of_training() -> None:
    model = build_model("resnet56")
    forward = forward_flops_per_sample(model)
    training = training_flops_per_sample(model)
    # Backward = grad wrt inputs + grad wrt weights, each about one forward;
    # only the stem conv skips its input gradient.
    assert 2.9 * forward < training <= 3 * forward


def test_flop_measurement_leaves_the_model_untouched() -> None:
    model = build_model("resnet8").eval()
    before = state_dict_to_arrays(model)

    training_flops_per_sample(model)
    forward_flops_per_sample(model)

    after = state_dict_to_arrays(model)
    assert not model.training
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_training_flops_with_sum_loss_match_ce() -> None:
    model = build_model("resnet55_server")
    shape = get_model_spec("resnet55_server").input_shape()
    assert training_flops_per_sample(model, shape, loss="sum") == training_flops_per_sample(model, shape, loss="ce")
    with pytest.raises(ValueError, match="loss"):
        training_flops_per_sample(model, shape, loss="mse")  # type: ignore[arg-type]


def test_flops_of_counts_two_flops_per_mac() -> None:
    a, b = torch.randn(4, 5), torch.randn(5, 6)
    assert flops_of(lambda: a @ b) == 2 * 4 * 5 * 6


def test_flops_of_a_real_training_step_matches_training_flops_per_sample() -> None:
    model = build_model("resnet8")
    x = torch.randn(4, 3, 32, 32)
    y = torch.randint(0, 10, (4,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        optimizer.zero_grad()
        logits, _features = model(x)
        nn.functional.cross_entropy(logits, y).backward()
        optimizer.step()

    assert flops_of(step) == 4 * training_flops_per_sample(model)


# --- weight arrays -------------------------------------------------------------


def _trained_resnet8() -> nn.Module:
    """A ResNet-8 whose BN running stats and counters differ from a fresh one."""
    model = build_model("resnet8")
    with torch.no_grad():
        model(torch.randn(4, 3, 32, 32))
    return model


def test_state_dict_arrays_round_trip_exactly() -> None:
    source = _trained_resnet8()
    arrays = state_dict_to_arrays(source)
    target = build_model("resnet8")

    load_arrays_into(target, arrays)

    assert list(arrays) == list(source.state_dict())
    assert arrays["extractor.bn.num_batches_tracked"].dtype == np.int64
    assert int(arrays["extractor.bn.num_batches_tracked"]) == 1
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, source.state_dict()[name]), name
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(source.eval()(x)[0], target.eval()(x)[0])


def test_arrays_are_independent_copies() -> None:
    model = build_model("resnet8")
    arrays = state_dict_to_arrays(model)
    arrays["classifier.fc.bias"] += 1.0
    assert not np.array_equal(arrays["classifier.fc.bias"], model.classifier.fc.bias.detach().numpy())
    assert all(a.flags.c_contiguous and a.flags.owndata for a in arrays.values())


def test_read_only_arrays_load_without_warning() -> None:
    arrays = state_dict_to_arrays(_trained_resnet8())
    for array in arrays.values():
        array.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_arrays_into(build_model("resnet8"), arrays)


def test_float16_arrays_are_cast_to_the_model_dtype() -> None:
    arrays = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in state_dict_to_arrays(build_model("resnet8")).items()}
    target = build_model("resnet8")
    load_arrays_into(target, arrays)
    assert target.classifier.fc.weight.dtype == torch.float32


def _assert_untouched(model: nn.Module, before: dict[str, np.ndarray]) -> None:
    after = state_dict_to_arrays(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_missing_and_unexpected_names_raise_and_are_listed() -> None:
    model = build_model("resnet8")
    before = state_dict_to_arrays(model)
    arrays = dict(before)
    del arrays["classifier.fc.weight"]
    arrays["classifier.fc2.weight"] = np.zeros((10, 64), dtype=np.float32)

    with pytest.raises(WeightsMismatchError, match=r"classifier\.fc\.weight.*classifier\.fc2\.weight") as info:
        load_arrays_into(model, arrays)

    assert isinstance(info.value, ValueError)
    assert info.value.missing == ("classifier.fc.weight",)
    assert info.value.unexpected == ("classifier.fc2.weight",)
    _assert_untouched(model, before)


def test_shape_mismatch_names_tensor_and_both_shapes() -> None:
    model = build_model("resnet8", num_classes=10)
    before = state_dict_to_arrays(model)
    arrays = state_dict_to_arrays(build_model("resnet8", num_classes=100))
    arrays["extractor.conv.weight"] = arrays["extractor.conv.weight"] * 0  # would be written first

    with pytest.raises(WeightsMismatchError, match=re.escape("'classifier.fc.weight' has shape (100, 64), model expects (10, 64)")):
        load_arrays_into(model, arrays)
    _assert_untouched(model, before)


@pytest.mark.parametrize(
    ("name", "bad_value", "message"),
    [
        ("classifier.fc.bias", np.full(10, np.nan, dtype=np.float32), "NaN or infinite"),
        ("extractor.bn.running_var", np.full(16, np.inf, dtype=np.float32), "NaN or infinite"),
        ("extractor.bn.num_batches_tracked", np.array(1.5), "dtype float64"),
        ("classifier.fc.bias", np.zeros(10, dtype=np.int32), "dtype int32"),
    ],
)
def test_bad_values_raise_before_anything_is_written(name: str, bad_value: np.ndarray, message: str) -> None:
    model = build_model("resnet8")
    before = state_dict_to_arrays(model)
    arrays = state_dict_to_arrays(_trained_resnet8())
    arrays[name] = bad_value

    with pytest.raises(WeightsMismatchError, match=message):
        load_arrays_into(model, arrays)
    _assert_untouched(model, before)


def test_non_array_value_raises_type_error() -> None:
    model = build_model("resnet8")
    arrays: dict[str, object] = dict(state_dict_to_arrays(model))
    arrays["classifier.fc.bias"] = [0.0] * 10
    with pytest.raises(TypeError, match="classifier.fc.bias"):
        load_arrays_into(model, arrays)  # type: ignore[arg-type]


def test_package_imports_only_torch_numpy_and_itself() -> None:
    # Checked statically: at runtime other tests may already have imported the
    # agent or server packages, which would hide an offending import.
    allowed = set(sys.stdlib_module_names) | {"numpy", "torch", "models"}
    # models/onnx_export.py (the ort backend's artifacts) imports these
    # lazily, inside the export function: the rest of the package never needs them.
    allowed |= {"onnx", "onnxruntime"}
    # models/privacy.py asks Opacus (the privacy extra) whether DP-SGD can train a model, lazily,
    # inside the check: only a run with DP-SGD on needs it.
    allowed |= {"opacus"}
    package_dir = Path(models.__file__).parent
    for source in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            assert set(roots) <= allowed, f"{source.name} imports {roots}"
