"""A Pi-sized agent: its shard as uint8 (memory-mapped source), extraction in slices,
and no torch in the ort backend's process."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fldata import load_dataset, take

ROOT = Path(__file__).resolve().parents[1]


def _write_idx_pair(directory: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with gzip.open(directory / f"{prefix}-images-idx3-ubyte.gz", "wb", compresslevel=1) as f:
        f.write(struct.pack(">4B3I", 0, 0, 8, 3, *images.shape) + images.tobytes())
    with gzip.open(directory / f"{prefix}-labels-idx1-ubyte.gz", "wb", compresslevel=1) as f:
        f.write(struct.pack(">4BI", 0, 0, 8, 1, labels.shape[0]) + labels.tobytes())


@pytest.fixture
def idx_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, np.ndarray, np.ndarray]:
    monkeypatch.setenv("EDGESPLIT_DATA_DIR", str(tmp_path / "cache-home"))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(3000, 28, 28), dtype=np.uint8)
    labels = (np.arange(3000) % 10).astype(np.uint8)
    _write_idx_pair(tmp_path / "fm", "train", images, labels)
    return tmp_path / "fm", images, labels


def test_idx_images_are_cached_once_and_memory_mapped(idx_root: tuple[Path, np.ndarray, np.ndarray], tmp_path: Path) -> None:
    root, images, labels = idx_root
    ds = load_dataset("fashion-mnist", "train", root=root)
    assert isinstance(ds.images, np.memmap)
    assert ds.images.shape == (3000, 1, 32, 32) and not ds.images.flags.writeable
    np.testing.assert_array_equal(ds.images[:, 0, 2:30, 2:30], images)
    assert not ds.images[:, :, :2].any() and not ds.images[:, :, :, 30:].any()  # zero padding
    np.testing.assert_array_equal(ds.labels, labels.astype(np.int64))
    cached = list((tmp_path / "cache-home" / "cache").glob("*.npy"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    again = load_dataset("fashion-mnist", "train", root=root)
    assert cached[0].stat().st_mtime_ns == stamp  # read from the cache, not written again
    np.testing.assert_array_equal(np.asarray(again.images), np.asarray(ds.images))


def test_a_subset_of_a_mapped_split_is_an_in_memory_copy_of_those_rows(idx_root: tuple[Path, np.ndarray, np.ndarray]) -> None:
    root, images, _ = idx_root
    ds = load_dataset("fashion-mnist", "train", root=root)
    idx = np.array([2999, 5, 1700, 0, 2048, 2047])  # unsorted, across the gather blocks
    sub = ds.subset(idx)
    assert type(sub.images) is np.ndarray and sub.images.flags.writeable
    np.testing.assert_array_equal(sub.images[:, 0, 2:30, 2:30], images[idx])
    np.testing.assert_array_equal(sub.sample_ids, idx)
    shard = take(ds, 500, seed=1)
    assert type(shard.images) is np.ndarray and shard.images.dtype == np.uint8
    np.testing.assert_array_equal(shard.images[:, 0, 2:30, 2:30], images[shard.sample_ids])


def test_a_corrupt_idx_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESPLIT_DATA_DIR", str(tmp_path / "cache-home"))
    d = tmp_path / "fm"
    images = np.zeros((10, 28, 28), np.uint8)
    _write_idx_pair(d, "train", images, np.zeros(10, np.uint8))
    with gzip.open(d / "train-images-idx3-ubyte.gz", "wb") as f:  # announces 10 images, holds 9
        f.write(struct.pack(">4B3I", 0, 0, 8, 3, 10, 28, 28) + images[:9].tobytes())
    with pytest.raises(ValueError, match="header announces 10 images"):
        load_dataset("fashion-mnist", "train", root=d)
    assert not list((tmp_path / "cache-home" / "cache").glob("*.npy"))  # no half-written cache left


_SHARD_RSS = """
import json, sys
import numpy as np
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))
from fldata import load_dataset, take
base = hwm()
ds = load_dataset('fashion-mnist', 'train', root=sys.argv[1])
shard = take(ds, int(sys.argv[2]), seed=0)
del ds
print(json.dumps({'base': base, 'peak': hwm(), 'shard_bytes': int(shard.images.nbytes)}))
"""


def test_taking_a_shard_does_not_make_the_whole_split_resident(tmp_path: Path) -> None:
    # 20,000 images = 20 MB once padded; the shard is 1,000 of them (1 MB).
    rng = np.random.default_rng(1)
    _write_idx_pair(tmp_path / "fm", "train", rng.integers(0, 256, size=(20000, 28, 28), dtype=np.uint8),
                    (np.arange(20000) % 10).astype(np.uint8))
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDGESPLIT_DATA_DIR=str(tmp_path / "cache-home"))
    for _ in range(2):  # the first run writes the cache, the second maps it
        out = subprocess.run([sys.executable, "-c", _SHARD_RSS, str(tmp_path / "fm"), "1000"],
                             capture_output=True, text=True, env=env, check=True)
        result = json.loads(out.stdout)
        grown = result["peak"] - result["base"]
        assert result["shard_bytes"] == 1000 * 1024
        assert grown < 12e6, f"loading a 1,000-image shard of a 20 MB split grew the peak RSS by {grown / 1e6:.1f} MB"


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="needs onnxruntime-training")
def test_the_ort_backend_never_imports_torch_even_where_torch_is_installed() -> None:
    code = (
        "import sys\n"
        "from edge_agent.backends.ort import _ort, ort_version\n"
        "assert ort_version()\n"
        "_ort()\n"
        "import edge_agent.agent, edge_agent.backends.ort_fedgkt\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "[]"


def test_feature_extraction_in_slices_matches_one_pass() -> None:
    torch = pytest.importorskip("torch")
    from edge_agent.methods.base import EdgeContext
    from edge_agent.methods.fedgkt import FedGktEdge
    from edge_agent.teacher import EXTRACT_BATCH_SAMPLES
    from fldata import make_synthetic

    data = make_synthetic(8, in_channels=1)
    ctx = EdgeContext(agent_id="a", run_id="r", instance="i", train=data, test=data, settings={"num_classes": 10}, send=lambda *a, **k: None)
    torch.manual_seed(0)
    edge = FedGktEdge(ctx)
    edge.model.eval()
    images = torch.randn(EXTRACT_BATCH_SAMPLES * 2 + 3, 1, 32, 32)  # two full slices and a remainder
    features, logits = edge._extract(images)
    with torch.no_grad():
        whole_features = edge.model.extract(images)
        whole_logits = edge.model.classify(whole_features)
    assert features.shape == (images.shape[0], 16, 32, 32) and features.dtype == np.float32
    np.testing.assert_allclose(features, whole_features.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, whole_logits.numpy(), rtol=1e-4, atol=1e-4)
