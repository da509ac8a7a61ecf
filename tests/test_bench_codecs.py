"""bench/codecs.py in quick mode: report structure, exactness and error bounds."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from shared_protocol import codecs as wire_codecs

BENCH = Path(__file__).resolve().parents[1] / "bench" / "codecs.py"


def load_bench() -> ModuleType:
    # bench/ is not a package, and putting it on sys.path would let this file
    # shadow the standard library's ``codecs``: load it by path, under another name.
    spec = importlib.util.spec_from_file_location("edgesplit_bench_codecs", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench()


@pytest.fixture(scope="module")
def quick_report(bench: ModuleType) -> tuple[dict[str, Any], float]:
    try:
        report = bench.run(samples=64, quick=True)
    except FileNotFoundError as exc:
        pytest.skip(f"Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist): {exc}")
    return report, 0.0


def test_quick_run_does_the_quick_work(bench: ModuleType, quick_report: tuple[dict[str, Any], float]) -> None:
    """--quick must stay the small run (a behaviour, not a timing: timings belong in bench/)."""
    config = quick_report[0]["config"]
    assert config["quick"] is True
    assert config["reps"] == bench.QUICK_REPS < bench.DEFAULT_REPS
    assert config["svd_thresholds"] == list(bench.QUICK_SVD_THRESHOLDS)
    assert list(config["update_models"]) == [bench.UPDATE_MODELS[0][0]]  # the mentee only
    assert all(m["train_images_per_epoch"] == bench.QUICK_UPDATE_IMAGES for m in config["update_models"].values())


def test_report_structure(quick_report: tuple[dict[str, Any], float]) -> None:
    report, _ = quick_report
    for key in ("benchmark", "config", "dataset", "models", "environment", "codecs", "stats", "results", "frames", "claims"):
        assert key in report, key
    env = report["environment"]
    for key in ("torch_version", "numpy_version", "zstandard_version", "cpu_model", "date_utc"):
        assert isinstance(env[key], str) and env[key], key
    assert report["dataset"]["name"] == "fashion-mnist"
    assert report["dataset"]["measured_samples"] == 64
    assert report["config"]["quick"] is True
    assert "fp16_variants_trained" not in report  # quick mode skips them
    json.dumps(report, allow_nan=False)  # the report is plain, finite JSON


def test_every_registered_codec_is_measured_or_skipped(quick_report: tuple[dict[str, Any], float]) -> None:
    report, _ = quick_report
    registered = set(wire_codecs.list_codecs())
    assert set(report["codecs"]["registered"]) == registered
    for state in ("fresh", "trained"):
        measured = set(report["results"]["features"][state])
        assert measured | set(report["codecs"]["skipped"]) >= registered
        assert {"raw", "zstd", "fp16-zstd", "u8-zstd"} <= measured
        lossless = {n for n in registered if wire_codecs.get_codec(n).lossless}
        assert lossless <= set(report["results"]["logits"][state])


@pytest.mark.parametrize("kind", ["features", "logits"])
@pytest.mark.parametrize("state", ["fresh", "trained"])
def test_sizes_errors_and_speeds(quick_report: tuple[dict[str, Any], float], kind: str, state: str) -> None:
    report, _ = quick_report
    raw_bytes = report["stats"][kind][state]["raw_bytes"]
    shape = report["stats"][kind][state]["shape_per_sample"]
    assert raw_bytes == 64 * 4 * math.prod(shape)
    bounds = report["codecs"]["documented_rel_error_bounds"]
    for name, r in report["results"][kind][state].items():
        assert r["raw_bytes"] == raw_bytes, name
        assert r["ratio"] == pytest.approx(raw_bytes / r["encoded_bytes"], rel=1e-3), name
        assert r["encode_mb_per_s"] > 0 and r["decode_mb_per_s"] > 0, name
        if r["lossless"]:
            assert r["exact"], name
            assert r["max_abs_error"] == 0 and r["max_rel_error"] == 0, name
        else:
            assert 0 <= r["max_rel_error"] < bounds.get(name, math.inf), name
        if name == "raw":
            assert r["encoded_bytes"] == raw_bytes
        elif kind == "features":
            assert r["ratio"] > 1, name  # every compressing codec shrinks ReLU maps


def test_lossy_bounds_are_the_documented_ones(quick_report: tuple[dict[str, Any], float]) -> None:
    report, _ = quick_report
    bounds = report["codecs"]["documented_rel_error_bounds"]
    assert bounds == {"fp16-zstd": 1e-3, "u8-zstd": 1e-2}
    for state in ("fresh", "trained"):
        features = report["results"]["features"][state]
        assert features["fp16-zstd"]["max_rel_error"] < 1e-3
        assert features["u8-zstd"]["max_rel_error"] < 1e-2
        assert not features["fp16-zstd"]["lossless"] and not features["u8-zstd"]["lossless"]


def test_claims_report_the_measured_ratio(quick_report: tuple[dict[str, Any], float]) -> None:
    report, _ = quick_report
    claim = report["claims"]["fp16_zstd_ratio_ge_4_trained"]
    assert claim["primary"] is True
    ratio = report["results"]["features"]["trained"]["fp16-zstd"]["ratio"]
    assert claim["measured_ratio"] == ratio
    assert claim["holds"] is (ratio >= 4.0)  # reported honestly, whichever way it goes


def test_frames_cover_every_feature_codec(quick_report: tuple[dict[str, Any], float]) -> None:
    report, _ = quick_report
    frames = report["frames"]
    assert set(report["results"]["features"]["trained"]) <= set(frames)
    assert frames["fp16-zstd"]["frame_bytes"] < frames["raw-everything"]["frame_bytes"]


def test_cli_writes_json(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    canned = {"results": {"features": {}, "logits": {}}, "claims": {}}
    monkeypatch.setattr(bench, "run", lambda samples, quick, seed: {**canned, "args": [samples, quick, seed]})
    out = tmp_path / "codecs.json"
    assert bench.main(["--samples", "8", "--quick", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["args"] == [8, True, 0]


def test_needs_parameters_skips_codecs_that_take_more_than_the_array(bench: ModuleType) -> None:
    class NeedsRank:
        name, lossless = "svd-like", False

        def encode(self, array: Any, threshold: float) -> Any: ...

    assert bench.needs_parameters(NeedsRank()) is not None
    assert bench.needs_parameters(wire_codecs.get_codec("fp16-zstd")) is None


def test_svd_on_model_updates(quick_report: tuple[dict[str, Any], float]) -> None:
    """The svd codec is measured on trained model updates (not feature maps): ratio and speed per
    T, and its squared error equals the discarded singular-value energy from numpy's SVD."""
    report, _ = quick_report
    assert "svd" in report["codecs"]["skipped"] and "svd" not in report["results"]["features"]["trained"]
    thresholds = report["config"]["svd_thresholds"]
    assert thresholds == [0.95, 0.98]
    updates = report["results"]["model_updates"]["resnet8"]
    for key in ("epoch1_update", "epoch2_update"):
        entry = updates[key]
        assert entry["raw_bytes"] == 4 * entry["float_values"] > 0
        assert {"raw", "zstd", "fp16-zstd"} <= set(entry["other_codecs"])
        assert set(entry["svd"]) == {f"T={t:g}" for t in thresholds}
        previous_size = 0
        for t in sorted(thresholds, reverse=True):
            r = entry["svd"][f"T={t:g}"]
            assert r["raw_bytes"] == entry["raw_bytes"]
            assert r["encoded_bytes"] <= r["raw_bytes"]  # dense fallback: never larger
            assert r["ratio"] == pytest.approx(r["raw_bytes"] / r["encoded_bytes"], rel=1e-3)
            assert r["encode_mb_per_s"] > 0 and r["decode_mb_per_s"] > 0
            assert 0 <= r["matrices_factored"] <= r["matrices"] == 9  # ResNet-8: 8 convs + the head
            assert r["max_tensor_gap_rel"] < 1e-4 and r["error_equals_discarded_energy"]
            assert r["sq_error"] == pytest.approx(r["discarded_energy"], rel=1e-3, abs=1e-12)
            assert r["max_tensor_rel_sq_error"] < 1 - t  # each factored tensor keeps more than T of its energy
            assert r["exact"] is (r["matrices_factored"] == 0)
            if previous_size:
                assert r["encoded_bytes"] <= previous_size  # a lower T never keeps more
            previous_size = r["encoded_bytes"]
    claims = report["claims"]
    assert claims["svd_error_equals_discarded_energy"]["holds"] is True
    assert claims["svd_never_larger_than_raw"]["holds"] is True
