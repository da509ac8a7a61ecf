"""Tensor codecs on real ResNet-8 feature maps and trained model updates: size, speed and error.

What the FedGKT edge uploads every round is the ResNet-8 extractor's output H,
``(N, 16, 32, 32)`` post-ReLU float32 maps, in batches of
``upload_batch_samples`` (256) samples, plus the edge logits ``(N, 10)``. This
benchmark runs Fashion-MNIST images through a ResNet-8 (``in_channels=1``) in
eval mode, twice: freshly initialised, and after about one epoch of training on
a few thousand other images (trained maps are what agents really send), and
measures every registered codec on those maps, batch by batch as the agent
encodes them:

* encoded bytes and ratio = raw float32 bytes / encoded bytes;
* encode and decode throughput in MB/s (10^6 bytes) *of raw float32 bytes*,
  the median over repetitions of one pass over all batches;
* max absolute error, and max relative error = max over batches of
  (max |decoded - x| / max |x|) of that batch: the codec sees one batch at a
  time, so its bound is per batch.

Logits are measured with the lossless codecs only. For the record it also
encodes whole ``fedgkt.features`` frames (features + logits + labels + sample
ids, default codecs) to show the frame overhead, and, outside ``--quick``,
a few fp16 + zstd variants that are *not* registered codecs (byte shuffle on
or off, zstd level), to judge the codec's parameters.

The ``svd`` codec (FedKD's truncated SVD, ``shared_protocol/svd.py``) is made
for model *updates*, not feature maps, and is measured on those
(``results.model_updates``): the change of a seeded ResNet-8 (the FedKD
mentee) and of a ResNet-56 (a mentor-sized model) over one epoch of training
from initialisation, and over a second epoch; every float tensor of the state
(parameters and BatchNorm statistics) is one codec call, as FedKD factors
them. Per energy threshold T: ratio, encode/decode MB/s, how many matrices
went factored and at what rank, and the squared reconstruction error next to
the discarded singular-value energy computed independently with numpy's SVD
(they must agree up to float32 rounding). The other codecs that accept the
data are measured on the same updates for comparison.

Writes ``bench/results/codecs.json`` with the versions, CPU, date, dataset and
sample counts, and a ``claims`` section that checks the design's claim
(fp16-zstd at least 4x smaller than fp32 on trained maps), and the svd codec's
error = discarded energy and never-larger payload, against the numbers.
MB/s are single-threaded and noisy on a shared machine (the load average
before and after is recorded).

Usage::

    python bench/codecs.py [--samples 1024] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import inspect
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
import zstandard

# Run from a checkout without installing the package. Never put bench/ itself
# on the path: this file's name would shadow the standard library's codecs.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from fldata import ArrayDataset, load_dataset, take  # noqa: E402  (needs the path above)
from fldata.torch_data import make_loader  # noqa: E402
from edge_agent.costs import RoundMeter  # noqa: E402
from edge_agent.trainer import train_epochs  # noqa: E402
from models import build_model  # noqa: E402
from models.training import logits_of  # noqa: E402
from shared_protocol import codecs as wire_codecs  # noqa: E402
from shared_protocol import svd as svd_math  # noqa: E402
from shared_protocol.chunking import DEFAULT_CHUNK_SIZE_BYTES  # noqa: E402
from shared_protocol.hostinfo import cpu_model  # noqa: E402
from shared_protocol.messages import encode_message  # noqa: E402
from shared_protocol.methods.fedgkt import GktFeatures, GktRoundConfig  # noqa: E402

DATASET = "fashion-mnist"
SPLIT = "train"
MODEL = "resnet8"
NUM_CLASSES = 10
IN_CHANNELS = 1
BATCH_SAMPLES = GktRoundConfig().upload_batch_samples  # what the agent sends per frame (256)
TRAIN_BATCH_SIZE = GktRoundConfig().batch_size  # 64, as the edge trains
TRAIN_LR = GktRoundConfig().edge_lr  # Adam 1e-3, the edge's default optimiser
DEFAULT_SAMPLES = 1024
DEFAULT_TRAIN_SAMPLES = 3072
QUICK_TRAIN_SAMPLES = 256
DEFAULT_REPS = 7
QUICK_REPS = 2
DEFAULT_SEED = 0

# The bounds the codecs document (shared_protocol/codecs.py, docs/protocol.md),
# as max |error| / max |x| over one encoded tensor. fp16 keeps 11 significant
# bits (relative step 2^-11 ~ 4.9e-4); u8 stores x / (max_c / 255) rounded, so
# |error| <= max_c / 510 <= max |x| / 510 ~ 2.0e-3.
DOCUMENTED_REL_ERROR_BOUNDS: dict[str, float] = {"fp16-zstd": 1e-3, "u8-zstd": 1e-2}

# The floor the design relies on: fp16-zstd at least this many times smaller than fp32 on
# ResNet-8 feature maps (the measured ratio is the JSON's ``claims``).
CLAIM_FP16_MIN_RATIO = 4.0

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "codecs.json"

MODEL_STATES = ("fresh", "trained")

# Codecs for model updates, not activations: measured in results.model_updates only.
UPDATE_CODECS = ("svd",)
# FedKD's T_start and T_end (Eq. 9), and two either side.
SVD_THRESHOLDS = (0.9, 0.95, 0.98, 0.99)
# (model, training images per epoch, why): the update FedKD sends, and one of a mentor-sized model.
UPDATE_MODELS = (("resnet8", 3072, "the FedKD mentee"), ("resnet56", 512, "a mentor-sized model (FedAvg's)"))
QUICK_UPDATE_IMAGES = 128
QUICK_SVD_THRESHOLDS = (0.95, 0.98)
# |squared error - discarded energy| / tensor energy: float32 factors and reconstruction
# leave a relative residue around 1e-7 per value; anything near 1e-4 would be a real gap.
ENERGY_GAP_TOLERANCE = 1e-4


# --------------------------------------------------------------------------- #
# Data and feature maps
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Extracted:
    """One model's outputs on the measured images, batch by batch as uploaded."""

    features: list[np.ndarray]  # each (B, 16, 32, 32) float32, post-ReLU
    logits: list[np.ndarray]  # each (B, 10) float32
    labels: list[np.ndarray]  # each (B,) int64
    sample_ids: list[np.ndarray]  # each (B,) int64


def split_images(ds: ArrayDataset, samples: int, train_samples: int, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """Disjoint seeded, class-stratified subsets: (measured images, training images)."""
    pool = take(ds, samples + train_samples, seed)
    order = np.random.default_rng(seed).permutation(len(pool))
    measured = pool.subset(np.sort(order[:samples]))
    training = pool.subset(np.sort(order[samples:]))
    return measured, training


def _cross_entropy(output: Any, labels: torch.Tensor, _sample_ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(output), labels)  # ResNet-8's output is (logits (B, 10), features)


def train_one_epoch(model: torch.nn.Module, data: ArrayDataset, seed: int) -> float:
    """One epoch of CE training with the edge's optimiser, as the edge's first FedGKT round
    does, through the edge's shared training loop (any classifier of the registry); mean loss."""
    optimizer = torch.optim.Adam(model.parameters(), lr=TRAIN_LR)
    loader = make_loader(data, TRAIN_BATCH_SIZE, shuffle=True, seed=seed)
    return train_epochs(model, loader, optimizer, _cross_entropy, epochs=1, meter=RoundMeter()).mean_loss


@torch.no_grad()
def extract(model: torch.nn.Module, data: ArrayDataset, batch_samples: int) -> Extracted:
    """Eval-mode extractor outputs and logits, in upload batches (no shuffle)."""
    model.eval()
    out = Extracted([], [], [], [])
    for images, labels, sample_ids in make_loader(data, batch_samples, shuffle=False):
        features = model.extract(images)  # (B, 16, 32, 32)
        logits = model.classify(features)  # (B, 10)
        out.features.append(features.numpy().astype(np.float32, copy=False))
        out.logits.append(logits.numpy().astype(np.float32, copy=False))
        out.labels.append(labels.numpy().astype(np.int64))
        out.sample_ids.append(sample_ids.numpy().astype(np.int64))
    return out


def map_stats(batches: list[np.ndarray]) -> dict[str, Any]:
    values = np.concatenate([b.reshape(-1) for b in batches])
    return {
        "shape_per_sample": list(batches[0].shape[1:]),
        "samples": int(sum(len(b) for b in batches)),
        "raw_bytes": int(sum(b.nbytes for b in batches)),
        "min": float(values.min()),
        "max": float(values.max()),
        "mean": float(values.mean()),
        "zero_fraction": float(np.mean(values == 0)),
    }


# --------------------------------------------------------------------------- #
# Codec measurement
# --------------------------------------------------------------------------- #


def needs_parameters(codec: Any) -> str | None:
    """Why ``codec.encode(array)`` cannot be called with the array alone, or None."""
    try:
        signature = inspect.signature(codec.encode)
    except (TypeError, ValueError):
        return None
    required = [
        p.name
        for p in list(signature.parameters.values())[1:]
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return f"encode needs parameters {required}" if required else None


def _median_seconds(fn: Callable[[], None], reps: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def measure_codec(codec: Any, batches: list[np.ndarray], reps: int) -> dict[str, Any]:
    """Encode + decode every batch: sizes, exactness, errors, then timed passes."""
    raw_bytes = sum(b.nbytes for b in batches)
    encoded: list[tuple[bytes, dict[str, Any], str, tuple[int, ...]]] = []
    max_abs = 0.0
    max_rel = 0.0
    exact = True
    for batch in batches:
        payload, params, dtype = codec.encode(batch)
        decoded = codec.decode(memoryview(payload), dtype, batch.shape, params)
        if decoded.shape != batch.shape:
            raise AssertionError(f"{codec.name}: decoded shape {decoded.shape}, expected {batch.shape}")
        if decoded.dtype != batch.dtype:
            raise AssertionError(f"{codec.name}: decoded dtype {decoded.dtype}, expected {batch.dtype}")
        exact = exact and bool(np.array_equal(decoded, batch))
        err = float(np.max(np.abs(decoded.astype(np.float64) - batch.astype(np.float64)))) if batch.size else 0.0
        scale = float(np.max(np.abs(batch))) if batch.size else 0.0
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))
        encoded.append((payload, params, dtype, batch.shape))
    encoded_bytes = sum(len(p) for p, _, _, _ in encoded)
    params_json_bytes = sum(len(json.dumps(params, separators=(",", ":"))) for _, params, _, _ in encoded)

    def encode_all() -> None:
        for batch in batches:
            codec.encode(batch)

    def decode_all() -> None:
        for payload, params, dtype, shape in encoded:
            codec.decode(memoryview(payload), dtype, shape, params)

    encode_s, encode_times = _median_seconds(encode_all, reps)
    decode_s, decode_times = _median_seconds(decode_all, reps)
    return {
        "lossless": bool(codec.lossless),
        "batches": len(batches),
        "raw_bytes": int(raw_bytes),
        "encoded_bytes": int(encoded_bytes),
        "params_json_bytes": int(params_json_bytes),
        "ratio": round(raw_bytes / encoded_bytes, 4) if encoded_bytes else None,
        "bytes_per_sample": round(encoded_bytes / max(sum(len(b) for b in batches), 1), 1),
        "encode_mb_per_s": round(raw_bytes / encode_s / 1e6, 1),
        "decode_mb_per_s": round(raw_bytes / decode_s / 1e6, 1),
        "encode_s_median": round(encode_s, 6),
        "decode_s_median": round(decode_s, 6),
        "encode_s_samples": [round(t, 6) for t in encode_times],
        "decode_s_samples": [round(t, 6) for t in decode_times],
        "exact": exact,
        "max_abs_error": max_abs,
        "max_rel_error": max_rel,
    }


def measure_all(batches: list[np.ndarray], names: list[str], reps: int, skipped: dict[str, str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in names:
        codec = wire_codecs.get_codec(name)
        try:
            results[name] = measure_codec(codec, batches, reps)
        except (ValueError, TypeError) as exc:  # e.g. u8-zstd on negative values
            skipped.setdefault(name, f"refused this data: {exc}")
    return results


def fp16_variants(batches: list[np.ndarray], reps: int) -> dict[str, Any]:
    """fp16 + zstd with other parameters than the registered codec's (not on the wire)."""
    raw_bytes = sum(b.nbytes for b in batches)
    out: dict[str, Any] = {}
    for shuffle in (True, False):
        for level in (1, 3, 9):
            compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)

            def encode_all() -> int:
                total = 0
                for batch in batches:
                    half = batch.astype("<f2").tobytes()
                    total += len(compressor.compress(wire_codecs.byte_shuffle(half, 2) if shuffle else half))
                return total

            encoded_bytes = encode_all()
            encode_s, _ = _median_seconds(encode_all, reps)
            out[f"fp16{'-shuffle' if shuffle else ''}-zstd{level}"] = {
                "byte_shuffle": shuffle,
                "zstd_level": level,
                "encoded_bytes": int(encoded_bytes),
                "ratio": round(raw_bytes / encoded_bytes, 4),
                "encode_mb_per_s": round(raw_bytes / encode_s / 1e6, 1),
                "registered_as": "fp16-zstd" if shuffle and level == 1 else None,
            }
    return out


def frame_sizes(data: Extracted, feature_codecs: list[str]) -> dict[str, Any]:
    """Whole ``fedgkt.features`` frames per features codec (other tensors: default codecs)."""
    out: dict[str, Any] = {}
    samples = sum(len(b) for b in data.labels)
    for name in ["raw-everything", *feature_codecs]:
        total = header_total = chunks = 0
        for seq, (features, logits, labels, ids) in enumerate(zip(data.features, data.logits, data.labels, data.sample_ids)):
            msg = GktFeatures(
                run="bench", round=1, sender="agent-0", split="train", seq=seq, instance="0123456789ab",
                features=features, logits=logits, labels=labels, sample_ids=ids,
            )
            if name == "raw-everything":
                codecs_for = {"features": "raw", "logits": "raw", "labels": "raw", "sample_ids": "raw"}
            else:
                codecs_for = {"features": name}
            blob = encode_message(msg, codecs=codecs_for)
            header_len = int.from_bytes(blob[6:10], "big")
            total += len(blob)
            header_total += 18 + header_len
            chunks += max(1, -(-len(blob) // DEFAULT_CHUNK_SIZE_BYTES))
        out[name] = {
            "frames": len(data.labels),
            "frame_bytes": int(total),
            "prefix_and_header_bytes": int(header_total),
            "bytes_per_sample": round(total / max(samples, 1), 1),
            "chunks_at_default_chunk_size": int(chunks),
        }
    return out


# --------------------------------------------------------------------------- #
# Model updates (the svd codec)
# --------------------------------------------------------------------------- #


def float_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The float entries of the state dict (parameters, BatchNorm statistics) as float32 copies."""
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items() if v.is_floating_point()}


def svd_energy_check(tensors: list[np.ndarray], threshold: float) -> dict[str, Any]:
    """Encode + decode each tensor with the svd codec at ``threshold``; the squared error vs
    the discarded singular-value energy from numpy's SVD of the same 2-D view."""
    codec = wire_codecs.get_codec("svd").with_threshold(threshold)  # type: ignore[attr-defined]
    sq_error = discarded = energy = matrix_energy = 0.0
    max_gap = max_rel = 0.0
    ranks: list[int] = []
    matrices = factored = 0
    for x in tensors:
        payload, params, dtype = codec.encode(x)
        decoded = codec.decode(memoryview(payload), dtype, x.shape, params).astype(np.float64)
        x64 = x.astype(np.float64)
        err = float(np.sum((decoded - x64) ** 2))
        total = float(np.sum(x64**2))
        dims = svd_math.matrix_shape(x.shape)
        lost = 0.0
        if dims is not None:
            matrices += 1
            matrix_energy += total
        if params["mode"] == "factored":
            factored += 1
            ranks.append(int(params["rank"]))
            s = np.linalg.svd(x64.reshape(dims), compute_uv=False)  # (min(P, Q),), float64
            lost = float(np.sum(s[params["rank"]:] ** 2))
        sq_error += err
        discarded += lost
        energy += total
        if total > 0:
            max_gap = max(max_gap, abs(err - lost) / total)
            max_rel = max(max_rel, err / total)
    return {
        "matrices": matrices,
        "matrices_factored": factored,
        "rank_mean": round(float(np.mean(ranks)), 2) if ranks else None,
        "rank_max": max(ranks) if ranks else None,
        "update_energy": energy,
        "matrices_energy": matrix_energy,
        "sq_error": sq_error,
        "discarded_energy": discarded,
        # Vectors (biases, BatchNorm statistics) are exact and can hold most of an update's energy
        # (running variances move a lot): the error relative to the matrices' energy says more.
        "rel_sq_error_of_matrices": sq_error / matrix_energy if matrix_energy > 0 else 0.0,
        "max_tensor_rel_sq_error": max_rel,  # < 1 - T: the retained share is > T (Eq. 8)
        "max_tensor_gap_rel": max_gap,
        "error_equals_discarded_energy": max_gap < ENERGY_GAP_TOLERANCE,
    }


def model_updates(training: ArrayDataset, seed: int, reps: int, quick: bool) -> dict[str, Any]:
    """Per model: the state's change over a first and a second epoch of training, coded by every
    codec that takes it, and by svd at each of SVD_THRESHOLDS."""
    others = [n for n in wire_codecs.list_codecs() if n not in UPDATE_CODECS and needs_parameters(wire_codecs.get_codec(n)) is None]
    out: dict[str, Any] = {}
    for name, images, role in UPDATE_MODELS[:1] if quick else UPDATE_MODELS:  # quick: the mentee only
        data = training.subset(np.arange(min(QUICK_UPDATE_IMAGES if quick else images, len(training))))
        torch.manual_seed(seed)
        model = build_model(name, num_classes=NUM_CLASSES, in_channels=IN_CHANNELS)
        states = [float_state(model)]
        for epoch in range(2):
            train_one_epoch(model, data, seed + epoch)
            states.append(float_state(model))
        per_model: dict[str, Any] = {"role": role, "train_images": len(data)}
        for epoch in (1, 2):
            update = [states[epoch][k] - states[epoch - 1][k] for k in states[0]]  # float32, one per tensor
            skipped: dict[str, str] = {}
            entry: dict[str, Any] = {
                "tensors": len(update),
                "float_values": int(sum(u.size for u in update)),
                "raw_bytes": int(sum(u.nbytes for u in update)),
                "other_codecs": measure_all(update, others, reps, skipped),
                "other_codecs_refused": skipped,
                "svd": {},
            }
            for threshold in QUICK_SVD_THRESHOLDS if quick else SVD_THRESHOLDS:
                codec = wire_codecs.get_codec("svd").with_threshold(threshold)  # type: ignore[attr-defined]
                measured = measure_codec(codec, update, reps)
                for key in ("encode_s_samples", "decode_s_samples", "batches", "lossless"):
                    measured.pop(key)
                entry["svd"][f"T={threshold:g}"] = {**measured, **svd_energy_check(update, threshold)}
            per_model[f"epoch{epoch}_update"] = entry
        out[name] = per_model
    return out


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #


def run(
    samples: int = DEFAULT_SAMPLES,
    quick: bool = False,
    seed: int = DEFAULT_SEED,
    batch_samples: int = BATCH_SAMPLES,
    train_samples: int | None = None,
    reps: int | None = None,
) -> dict[str, Any]:
    """Measure every registered codec; return the report (see the module docstring)."""
    if samples < 1 or batch_samples < 1:
        raise ValueError(f"samples and batch_samples must be >= 1, got {samples} and {batch_samples}")
    train_samples = train_samples if train_samples is not None else (QUICK_TRAIN_SAMPLES if quick else DEFAULT_TRAIN_SAMPLES)
    reps = reps if reps is not None else (QUICK_REPS if quick else DEFAULT_REPS)
    if train_samples < 1 or reps < 1:
        raise ValueError(f"train_samples and reps must be >= 1, got {train_samples} and {reps}")
    started = time.perf_counter()
    load_before = os.getloadavg()

    full = load_dataset(DATASET, SPLIT)
    if samples + train_samples > len(full):
        raise ValueError(f"{samples} + {train_samples} samples requested, {DATASET} {SPLIT} has {len(full)}")
    measured, training = split_images(full, samples, train_samples, seed)

    torch.manual_seed(seed)
    fresh = build_model(MODEL, num_classes=NUM_CLASSES, in_channels=IN_CHANNELS)
    trained = copy.deepcopy(fresh)  # same initial weights, then one epoch
    train_start = time.perf_counter()
    train_loss = train_one_epoch(trained, training, seed)
    train_s = time.perf_counter() - train_start
    extracted = {"fresh": extract(fresh, measured, batch_samples), "trained": extract(trained, measured, batch_samples)}
    accuracy = {
        state: float(np.mean(np.concatenate([l.argmax(1) for l in ex.logits]) == np.concatenate(ex.labels)))
        for state, ex in extracted.items()
    }

    skipped: dict[str, str] = {}
    usable: list[str] = []
    for name in wire_codecs.list_codecs():
        why = needs_parameters(wire_codecs.get_codec(name))
        if name in UPDATE_CODECS:
            skipped[name] = "a model-update codec: measured on trained model updates (results.model_updates), not on feature maps"
        elif why is None:
            usable.append(name)
        else:
            skipped[name] = why
    lossless = [n for n in usable if wire_codecs.get_codec(n).lossless]

    results: dict[str, Any] = {"features": {}, "logits": {}}
    stats: dict[str, Any] = {"features": {}, "logits": {}}
    for state in MODEL_STATES:
        ex = extracted[state]
        stats["features"][state] = map_stats(ex.features)
        stats["logits"][state] = map_stats(ex.logits)
        results["features"][state] = measure_all(ex.features, usable, reps, skipped)
        results["logits"][state] = measure_all(ex.logits, lossless, reps, skipped)

    updates_started = time.perf_counter()
    results["model_updates"] = model_updates(training, seed, reps, quick)
    updates_s = time.perf_counter() - updates_started

    feature_codecs = list(results["features"]["trained"])
    report: dict[str, Any] = {
        "benchmark": "codecs",
        "description": (
            "Registered tensor codecs on ResNet-8 feature maps (N, 16, 32, 32) and logits (N, 10) of "
            "Fashion-MNIST images, encoded per upload batch as the FedGKT edge sends them"
        ),
        "config": {
            "quick": quick,
            "seed": seed,
            "batch_samples": batch_samples,
            "reps": reps,
            "model": MODEL,
            "num_classes": NUM_CLASSES,
            "in_channels": IN_CHANNELS,
            "model_mode_for_extraction": "eval",
            "mb": "10^6 bytes of raw float32 input (encode) / output (decode)",
            "throughput": "median over reps of one pass over all batches, single thread, in-process",
            "rel_error": "max over batches of max|decoded - x| / max|x| of that batch",
            "model_updates": "per tensor of the update (each tensor is one 'batch' above); svd at each T in svd_thresholds",
            "svd_thresholds": list(QUICK_SVD_THRESHOLDS if quick else SVD_THRESHOLDS),
            "update_models": {name: {"train_images_per_epoch": QUICK_UPDATE_IMAGES if quick else n, "role": why}
                              for name, n, why in (UPDATE_MODELS[:1] if quick else UPDATE_MODELS)},
        },
        "dataset": {
            "name": DATASET,
            "split": SPLIT,
            "split_samples": len(full),
            "image_shape": list(full.image_shape),
            "note": "28x28 images zero-padded to 32x32 by fldata; normalised with the dataset's mean/std",
            "measured_samples": len(measured),
            "training_samples": len(training),
            "selection": "fldata.take(train, measured + training, seed), stratified; split by a seeded permutation; disjoint",
        },
        "models": {
            "fresh": {"description": "freshly initialised (seeded)", "accuracy_on_measured": accuracy["fresh"]},
            "trained": {
                "description": f"same init, 1 epoch Adam lr {TRAIN_LR} batch {TRAIN_BATCH_SIZE}, CE, on the training samples",
                "epochs": 1,
                "train_loss_mean": round(train_loss, 4),
                "train_s": round(train_s, 2),
                "accuracy_on_measured": accuracy["trained"],
            },
        },
        "environment": {
            "torch_version": torch.__version__,
            "numpy_version": np.__version__,
            "zstandard_version": zstandard.__version__,
            "zstd_library_version": ".".join(map(str, zstandard.ZSTD_VERSION)),
            "python_version": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "cpu_model": cpu_model(),
            "machine": platform.machine(),
            "platform": platform.platform(),
            "load_average_1m_before": round(load_before[0], 2),
            "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        },
        "codecs": {
            "registered": wire_codecs.list_codecs(),
            "measured": usable,
            "skipped": skipped,
            "documented_rel_error_bounds": DOCUMENTED_REL_ERROR_BOUNDS,
        },
        "stats": stats,
        "results": results,
        "frames": frame_sizes(extracted["trained"], feature_codecs),
    }
    if not quick:
        report["fp16_variants_trained"] = fp16_variants(extracted["trained"].features, max(3, reps // 2))
    report["claims"] = check_claims(results)
    report["design_figures"] = design_figures(results)
    report["notes"] = [
        f"{stats['features']['trained']['zero_fraction']:.0%} of the trained feature values are exactly 0 "
        "(post-ReLU, and Fashion-MNIST's black background plus the 28->32 zero padding give flat regions); "
        "natural images such as CIFAR-10 will likely compress less. Not measured here.",
        "Throughputs are single-threaded and depend on the machine's load; see load_average_1m_*.",
    ]
    report["notes"].append(
        "svd: ratio = dense float32 bytes / factor bytes of the whole update; matrices_factored counts the 2-D "
        "tensors that went factored (the rest, and every vector, went dense); sq_error and discarded_energy are "
        "summed over the update's tensors (float64), the latter from numpy's SVD of each 2-D view."
    )
    report["environment"]["model_updates_s"] = round(updates_s, 2)
    report["environment"]["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    shared = shared_machine_note(report["environment"])
    if shared:
        report["notes"].append(shared)
    report["environment"]["wall_s"] = round(time.perf_counter() - started, 2)
    return report


def shared_machine_note(env: dict[str, Any]) -> str | None:
    """A warning for the report when other work shared the CPU (MB/s then say little)."""
    cores = env.get("cpu_count") or 1
    load = max(env["load_average_1m_before"], env["load_average_1m_after"])
    if load <= 0.5 * cores:
        return None
    return (f"The machine was shared during this run (1-min load average {env['load_average_1m_before']} before, "
            f"{env['load_average_1m_after']} after, on {cores} cores): MB/s are noisy and lower than on an idle machine; "
            "sizes, ratios and errors are unaffected.")


def check_claims(results: dict[str, Any]) -> dict[str, Any]:
    """The design's compression claim, checked on both model states."""
    out: dict[str, Any] = {}
    for state in MODEL_STATES:
        entry = results["features"][state].get("fp16-zstd")
        out[f"fp16_zstd_ratio_ge_{CLAIM_FP16_MIN_RATIO:g}_{state}"] = {
            "claim": f"fp16-zstd is at least {CLAIM_FP16_MIN_RATIO:g}x smaller than fp32 on {state} ResNet-8 feature maps",
            "source": "the codec's design figure: about 4.6-5x smaller than fp32 on ResNet-8 feature maps",
            "primary": state == "trained",
            "measured_ratio": entry["ratio"] if entry else None,
            "holds": bool(entry and entry["ratio"] >= CLAIM_FP16_MIN_RATIO),
        }
    svd_entries = [(f"{model}/{update}/{t}", e) for model, per in results.get("model_updates", {}).items()
                   for update, u in per.items() if isinstance(u, dict) and "svd" in u for t, e in u["svd"].items()]
    if svd_entries:
        out["svd_error_equals_discarded_energy"] = {
            "claim": "svd's squared reconstruction error equals the discarded singular-value energy (numpy's SVD), per tensor",
            "source": "shared_protocol/svd.py, docs/protocol.md (svd codec)",
            "primary": True,
            "measured_max_gap_rel": max(e["max_tensor_gap_rel"] for _, e in svd_entries),
            "tolerance": ENERGY_GAP_TOLERANCE,
            "holds": all(e["error_equals_discarded_energy"] for _, e in svd_entries),
        }
        out["svd_never_larger_than_raw"] = {
            "claim": "svd's payload is never larger than the dense float32 tensor (dense fallback)",
            "source": "shared_protocol/svd.py",
            "primary": True,
            "measured_min_ratio": min(e["ratio"] for _, e in svd_entries),
            "holds": all(e["encoded_bytes"] <= e["raw_bytes"] for _, e in svd_entries),
        }
    for state in MODEL_STATES:
        for name, bound in DOCUMENTED_REL_ERROR_BOUNDS.items():
            entry = results["features"][state].get(name)
            out[f"{name}_rel_error_lt_{bound:g}_{state}"] = {
                "claim": f"{name} max relative error < {bound:g} on {state} maps",
                "source": "shared_protocol/codecs.py, docs/protocol.md",
                "primary": False,
                "measured_rel_error": entry["max_rel_error"] if entry else None,
                "holds": bool(entry and entry["max_rel_error"] < bound),
            }
    return out


def design_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The codecs' approximate design figures next to what was measured (no pass/fail: they say 'about')."""
    trained = results["features"]["trained"]
    fp16, u8 = trained.get("fp16-zstd"), trained.get("u8-zstd")
    return {
        "fp16_zstd_ratio": {"stated": "about 4.6-5x", "measured": fp16["ratio"] if fp16 else None},
        "fp16_zstd_speed": {
            "stated": "about 500 MB/s",
            "measured_encode_mb_per_s": fp16["encode_mb_per_s"] if fp16 else None,
            "measured_decode_mb_per_s": fp16["decode_mb_per_s"] if fp16 else None,
        },
        "u8_zstd_ratio": {"stated": "about 8x", "measured": u8["ratio"] if u8 else None},
    }


def print_table(report: dict[str, Any]) -> None:
    for kind in ("features", "logits"):
        for state, per_codec in report["results"][kind].items():
            print(f"{kind} ({state}):")
            for name, r in per_codec.items():
                print(
                    f"  {name:>10}: {r['encoded_bytes']:>10,} B  ratio {r['ratio']:6.2f}  "
                    f"enc {r['encode_mb_per_s']:7.1f} MB/s  dec {r['decode_mb_per_s']:7.1f} MB/s  "
                    f"max abs {r['max_abs_error']:.3g}  max rel {r['max_rel_error']:.3g}"
                )
    for model, per in report["results"].get("model_updates", {}).items():
        for update, entry in per.items():
            if not isinstance(entry, dict):
                continue
            print(f"{model} {update} ({entry['raw_bytes']:,} B dense):")
            for t, r in entry["svd"].items():
                print(
                    f"  svd {t:>6}: ratio {r['ratio']:6.2f}  enc {r['encode_mb_per_s']:7.1f} MB/s  dec {r['decode_mb_per_s']:7.1f} MB/s  "
                    f"{r['matrices_factored']}/{r['matrices']} factored  rel sq error (matrices) {r['rel_sq_error_of_matrices']:.4f}  "
                    f"gap {r['max_tensor_gap_rel']:.2g}"
                )
            for name, r in entry["other_codecs"].items():
                print(f"  {name:>10}: ratio {r['ratio']:6.2f}  enc {r['encode_mb_per_s']:7.1f} MB/s  dec {r['decode_mb_per_s']:7.1f} MB/s")
    for key, claim in report["claims"].items():
        if claim["primary"]:
            figure = {k: v for k, v in claim.items() if k.startswith("measured")}
            print(f"claim {key}: {'holds' if claim['holds'] else 'DOES NOT HOLD'} {figure}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help=f"images measured (default {DEFAULT_SAMPLES})")
    parser.add_argument("--quick", action="store_true", help="small training set, fewer repetitions, no variants")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"data and init seed (default {DEFAULT_SEED})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output JSON (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error("--samples must be >= 1")

    report = run(samples=args.samples, quick=args.quick, seed=args.seed)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)  # atomic: a reader never sees a half-written report
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
