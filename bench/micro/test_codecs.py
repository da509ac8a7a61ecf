"""Tensor codecs on real ResNet-8 feature maps and trained model updates: encode and decode time,
with size, ratio and error in ``extra_info``.

What the FedGKT edge uploads every round is the ResNet-8 extractor's output, post-ReLU float32
maps ``(N, 16, 32, 32)`` in batches of ``upload_batch_samples``, plus the edge logits ``(N, 10)``.
Fashion-MNIST images go through a ResNet-8 in eval mode twice: freshly initialised, and after one
epoch of training on other images (trained maps are what agents really send). Each timed call is
one pass over all batches as the agent encodes them; the error is per batch, since the codec sees
one batch at a time. Logits are coded by the lossless codecs only.

``svd`` (FedKD's truncated SVD) is made for model updates and is measured on those: the change of a
ResNet-8 (FedKD's mentee) and of a ResNet-56 (a mentor-sized model) over a first and a second
epoch, every float tensor of the state one codec call; its squared error must equal the discarded
singular-value energy computed independently with numpy. Also timed: whole ``fedgkt.features``
frames, and fp16 + zstd with other parameters than the registered codec's.

    make bench-micro MICRO=codecs     # or: pytest bench/micro/test_codecs.py [--quick]
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zstandard

from edge_agent.costs import RoundMeter
from edge_agent.trainer import train_epochs
from fldata import ArrayDataset, load_dataset, take
from fldata.torch_data import make_loader
from models import build_model
from models.training import logits_of
from shared_protocol import codecs as wire_codecs
from shared_protocol import svd as svd_math
from shared_protocol.mqtt.chunking import DEFAULT_CHUNK_SIZE_BYTES
from shared_protocol.messages import encode_message
from shared_protocol.methods.fedgkt import GktFeatures, GktRoundConfig

DATASET = "fashion-mnist"
NUM_CLASSES, IN_CHANNELS = 10, 1
BATCH_SAMPLES = GktRoundConfig().upload_batch_samples  # what the agent sends per frame
STATES = ("fresh", "trained")
#: (measured images, training images, timed passes), full and --quick.
SIZES = {False: (1024, 3072, 7), True: (64, 256, 2)}
#: The bounds the codecs document (shared_protocol/codecs.py, docs/protocol.md), max |error| / max |x| per tensor.
DOCUMENTED_REL_ERROR_BOUNDS = {"fp16-zstd": 1e-3, "u8-zstd": 1e-2}
#: Codecs for model updates, not activations, and FedKD's T_start and T_end (Eq. 9) with one either side.
UPDATE_CODECS = ("svd",)
SVD_THRESHOLDS = {False: (0.9, 0.95, 0.98, 0.99), True: (0.95, 0.98)}
#: (model, training images per epoch): the update FedKD sends, and one of a mentor-sized model.
UPDATE_MODELS = {False: (("resnet8", 3072), ("resnet56", 512)), True: (("resnet8", 128),)}
#: |squared error - discarded energy| / tensor energy: float32 rounding leaves about 1e-7; 1e-4 would be a real gap.
ENERGY_GAP_TOLERANCE = 1e-4


def plain_codecs() -> list[str]:
    """The registered codecs that take an array alone (the update codecs are measured on updates)."""
    return [n for n in wire_codecs.list_codecs() if n not in UPDATE_CODECS]


@dataclass(frozen=True)
class Extracted:
    """One model's outputs on the measured images, batch by batch as uploaded."""

    features: list[np.ndarray]  # each (B, 16, 32, 32) float32, post-ReLU
    logits: list[np.ndarray]  # each (B, 10) float32
    labels: list[np.ndarray]  # each (B,) int64
    sample_ids: list[np.ndarray]  # each (B,) int64


def _cross_entropy(output: Any, labels: torch.Tensor, _sample_ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(output), labels)


def train_one_epoch(model: torch.nn.Module, data: ArrayDataset, seed: int) -> None:
    """One epoch with the edge's optimiser and batch, through the edge's own training loop."""
    cfg = GktRoundConfig()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.edge_lr)
    train_epochs(model, make_loader(data, cfg.batch_size, shuffle=True, seed=seed), optimizer, _cross_entropy,
                 epochs=1, meter=RoundMeter())


@torch.no_grad()
def extract(model: torch.nn.Module, data: ArrayDataset) -> Extracted:
    model.eval()
    out = Extracted([], [], [], [])
    for images, labels, sample_ids in make_loader(data, BATCH_SAMPLES, shuffle=False):
        features = model.extract(images)
        out.features.append(features.numpy().astype(np.float32, copy=False))
        out.logits.append(model.classify(features).numpy().astype(np.float32, copy=False))
        out.labels.append(labels.numpy().astype(np.int64))
        out.sample_ids.append(sample_ids.numpy().astype(np.int64))
    return out


@pytest.fixture(scope="module")
def training(quick: bool) -> tuple[ArrayDataset, ArrayDataset]:
    """Disjoint seeded, class-stratified subsets of the training split: (measured, training)."""
    samples, train_samples, _ = SIZES[quick]
    try:
        pool = take(load_dataset(DATASET, "train"), samples + train_samples, 0)
    except FileNotFoundError as exc:
        pytest.skip(f"Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist): {exc}")
    order = np.random.default_rng(0).permutation(len(pool))
    return pool.subset(np.sort(order[:samples])), pool.subset(np.sort(order[samples:]))


@pytest.fixture(scope="module")
def maps(training: tuple[ArrayDataset, ArrayDataset]) -> dict[str, Extracted]:
    measured, train = training
    torch.manual_seed(0)
    fresh = build_model("resnet8", num_classes=NUM_CLASSES, in_channels=IN_CHANNELS)
    trained = copy.deepcopy(fresh)  # same initial weights, then one epoch
    train_one_epoch(trained, train, 0)
    return {"fresh": extract(fresh, measured), "trained": extract(trained, measured)}


@pytest.fixture(scope="module")
def updates(training: tuple[ArrayDataset, ArrayDataset], quick: bool) -> dict[tuple[str, int], list[np.ndarray]]:
    """Per (model, epoch): the change of every float tensor of the state over that epoch."""
    out = {}
    for name, images in UPDATE_MODELS[quick]:
        data = training[1].subset(np.arange(min(images, len(training[1]))))
        torch.manual_seed(0)
        model = build_model(name, num_classes=NUM_CLASSES, in_channels=IN_CHANNELS)

        def state() -> dict[str, np.ndarray]:
            return {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items() if v.is_floating_point()}

        states = [state()]
        for epoch in (1, 2):
            train_one_epoch(model, data, epoch - 1)
            states.append(state())
            out[(name, epoch)] = [states[epoch][k] - states[epoch - 1][k] for k in states[0]]
    return out


def code(codec: Any, batches: list[np.ndarray]) -> tuple[list[tuple[bytes, dict[str, Any], str, tuple[int, ...]]], dict[str, Any]]:
    """Encode and decode every batch once: the payloads, and size and error figures."""
    encoded, max_abs, max_rel, exact = [], 0.0, 0.0, True
    for batch in batches:
        payload, params, dtype = codec.encode(batch)
        decoded = codec.decode(memoryview(payload), dtype, batch.shape, params)
        assert decoded.shape == batch.shape and decoded.dtype == batch.dtype, codec.name
        exact = exact and bool(np.array_equal(decoded, batch))
        err = float(np.max(np.abs(decoded.astype(np.float64) - batch))) if batch.size else 0.0
        scale = float(np.max(np.abs(batch))) if batch.size else 0.0
        max_abs, max_rel = max(max_abs, err), max(max_rel, err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))
        encoded.append((payload, params, dtype, batch.shape))
    raw, size = sum(b.nbytes for b in batches), sum(len(p) for p, *_ in encoded)
    return encoded, {"raw_bytes": raw, "encoded_bytes": size, "ratio": raw / size, "exact": exact, "lossless": codec.lossless,
                     "max_abs_error": max_abs, "max_rel_error": max_rel, "batches": len(batches),
                     "params_json_bytes": sum(len(json.dumps(p, separators=(",", ":"))) for _, p, _, _ in encoded)}


def time_codec(benchmark: Any, codec: Any, batches: list[np.ndarray], direction: str, quick: bool) -> dict[str, Any]:
    """Time one pass of ``direction`` (encode or decode) over every batch; its figures in extra_info."""
    try:
        encoded, figures = code(codec, batches)
    except (ValueError, TypeError) as exc:  # e.g. u8-zstd refuses negative values
        pytest.skip(f"{codec.name} refused this data: {exc}")
    benchmark.extra_info.update(figures)
    def encode_all() -> None:
        for batch in batches:
            codec.encode(batch)

    def decode_all() -> None:
        for payload, params, dtype, shape in encoded:
            codec.decode(memoryview(payload), dtype, shape, params)

    benchmark.pedantic(encode_all if direction == "encode" else decode_all, rounds=SIZES[quick][2], iterations=1)
    return figures


@pytest.mark.parametrize("direction", ["encode", "decode"])
@pytest.mark.parametrize("codec", plain_codecs())
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("kind", ["features", "logits"])
def test_codec(benchmark: Any, maps: dict[str, Extracted], quick: bool, kind: str, state: str, codec: str, direction: str) -> None:
    coder = wire_codecs.get_codec(codec)
    if kind == "logits" and not coder.lossless:
        pytest.skip("logits are coded by the lossless codecs only")
    figures = time_codec(benchmark, coder, getattr(maps[state], kind), direction, quick)
    if coder.lossless:
        assert figures["exact"], codec
    else:
        assert figures["max_rel_error"] < DOCUMENTED_REL_ERROR_BOUNDS[codec], codec


def update_cases() -> list[tuple[str, int, str]]:
    cases = []
    for quick in (False, True):
        for model, _ in UPDATE_MODELS[quick]:
            for epoch in (1, 2):
                cases += [(model, epoch, c) for c in plain_codecs()]
                cases += [(model, epoch, f"svd@{t:g}") for t in SVD_THRESHOLDS[quick]]
    return list(dict.fromkeys(cases))


def svd_energy(threshold: float, tensors: list[np.ndarray]) -> dict[str, Any]:
    """The svd codec's squared error next to the discarded singular-value energy from numpy's SVD."""
    codec = wire_codecs.get_codec("svd").with_threshold(threshold)  # type: ignore[attr-defined]
    sq_error = discarded = matrix_energy = max_gap = max_rel = 0.0
    matrices = factored = 0
    for x in tensors:
        payload, params, dtype = codec.encode(x)
        x64 = x.astype(np.float64)
        err = float(np.sum((codec.decode(memoryview(payload), dtype, x.shape, params) - x64) ** 2))
        total, dims, lost = float(np.sum(x64**2)), svd_math.matrix_shape(x.shape), 0.0
        if dims is not None:
            matrices, matrix_energy = matrices + 1, matrix_energy + total
        if params["mode"] == "factored":
            factored += 1
            lost = float(np.sum(np.linalg.svd(x64.reshape(dims), compute_uv=False)[params["rank"]:] ** 2))
        sq_error, discarded = sq_error + err, discarded + lost
        if total > 0:
            max_gap, max_rel = max(max_gap, abs(err - lost) / total), max(max_rel, err / total)
    # Vectors (biases, BatchNorm statistics) go dense and exact: the error relative to the matrices' energy says more.
    return {"threshold": threshold, "matrices": matrices, "matrices_factored": factored, "sq_error": sq_error,
            "discarded_energy": discarded, "rel_sq_error_of_matrices": sq_error / matrix_energy if matrix_energy else 0.0,
            "max_tensor_rel_sq_error": max_rel, "max_tensor_gap_rel": max_gap}


@pytest.mark.parametrize("direction", ["encode", "decode"])
@pytest.mark.parametrize(("model", "epoch", "codec"), update_cases())
def test_update(benchmark: Any, updates: dict[tuple[str, int], list[np.ndarray]], quick: bool, model: str, epoch: int,
                codec: str, direction: str) -> None:
    if (model, epoch) not in updates or (codec.startswith("svd@") and float(codec[4:]) not in SVD_THRESHOLDS[quick]):
        pytest.skip("not at this size (--quick)")
    tensors = updates[(model, epoch)]
    if not codec.startswith("svd@"):
        time_codec(benchmark, wire_codecs.get_codec(codec), tensors, direction, quick)
        return
    threshold = float(codec[4:])
    figures = time_codec(benchmark, wire_codecs.get_codec("svd").with_threshold(threshold), tensors, direction, quick)  # type: ignore[attr-defined]
    energy = svd_energy(threshold, tensors)
    benchmark.extra_info.update(energy)
    assert energy["max_tensor_gap_rel"] < ENERGY_GAP_TOLERANCE  # the error is the discarded energy
    assert energy["max_tensor_rel_sq_error"] < 1 - threshold  # each tensor keeps more than T of its energy
    assert figures["encoded_bytes"] <= figures["raw_bytes"]  # the dense fallback: never larger


@pytest.mark.parametrize("codec", ["raw-everything", *plain_codecs()])
def test_frame(benchmark: Any, maps: dict[str, Extracted], quick: bool, codec: str) -> None:
    """Whole ``fedgkt.features`` frames of the trained maps per features codec (other tensors: their defaults)."""
    data = maps["trained"]
    messages = [GktFeatures(run="bench", round=1, sender="agent-0", split="train", seq=seq, instance="0123456789ab",
                            features=f, logits=lg, labels=lb, sample_ids=ids)
                for seq, (f, lg, lb, ids) in enumerate(zip(data.features, data.logits, data.labels, data.sample_ids))]
    codecs = dict.fromkeys(("features", "logits", "labels", "sample_ids"), "raw") if codec == "raw-everything" else {"features": codec}
    blobs = [encode_message(m, codecs=codecs) for m in messages]
    benchmark.extra_info.update(
        frames=len(blobs), frame_bytes=sum(map(len, blobs)), samples=sum(len(b) for b in data.labels),
        prefix_and_header_bytes=sum(18 + int.from_bytes(b[6:10], "big") for b in blobs),
        chunks_at_default_chunk_size=sum(max(1, -(-len(b) // DEFAULT_CHUNK_SIZE_BYTES)) for b in blobs))
    benchmark.pedantic(lambda: [encode_message(m, codecs=codecs) for m in messages], rounds=SIZES[quick][2], iterations=1)


@pytest.mark.parametrize("level", [1, 3, 9])
@pytest.mark.parametrize("shuffle", [True, False])
def test_fp16_variant(benchmark: Any, maps: dict[str, Extracted], quick: bool, shuffle: bool, level: int) -> None:
    """fp16 + zstd with other parameters than the registered codec's (shuffled, level 1): not on the wire."""
    batches, compressor = maps["trained"].features, zstandard.ZstdCompressor(level=level, write_content_size=True)

    def encode_all() -> int:
        halves = (b.astype("<f2").tobytes() for b in batches)
        return sum(len(compressor.compress(wire_codecs.byte_shuffle(h, 2) if shuffle else h)) for h in halves)

    raw, size = sum(b.nbytes for b in batches), encode_all()
    benchmark.extra_info.update(raw_bytes=raw, encoded_bytes=size, ratio=raw / size)
    benchmark.pedantic(encode_all, rounds=SIZES[quick][2], iterations=1)
