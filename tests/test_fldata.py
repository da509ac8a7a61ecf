"""Unit tests for fldata: loaders, synthetic data, partitions, npz files, torch views."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fldata import (
    SPLIT_ID_OFFSETS,
    ArrayDataset,
    PartitionSpec,
    agent_shard,
    class_count_table,
    class_counts_per_agent,
    compute_stats,
    dataset_stats,
    load_dataset,
    load_npz,
    make_synthetic,
    partition_indices,
    partition_test_indices,
    read_count_table,
    save_npz,
    take,
    test_shard_for_agent,
)

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(
    not FASHION_DIR.is_dir(),
    reason=f"{FASHION_DIR} absent: `apt-get install dataset-fashion-mnist` to run Fashion-MNIST tests",
)


@pytest.fixture(scope="module")
def synth() -> ArrayDataset:
    return make_synthetic(600, seed=7)


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    # 10 balanced classes, 4000 samples: big enough for skew to be measurable.
    return np.repeat(np.arange(10, dtype=np.int64), 400)


def _assert_disjoint(parts: list[np.ndarray], n: int | None = None) -> None:
    joined = np.concatenate(parts)
    assert np.unique(joined).size == joined.size, "partitions overlap"
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "each part must be sorted"
    if n is not None:
        assert np.array_equal(np.sort(joined), np.arange(n)), "partitions must cover the dataset"


# --------------------------------------------------------------------------- #
# ArrayDataset
# --------------------------------------------------------------------------- #


def _tiny(n: int = 4) -> dict[str, object]:
    return dict(
        images=np.zeros((n, 1, 32, 32), dtype=np.uint8),
        labels=np.arange(n, dtype=np.int64) % 2,
        sample_ids=np.arange(n, dtype=np.int64),
        num_classes=2,
        name="tiny",
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"images": np.zeros((4, 32, 32), dtype=np.uint8)}, "images must be 4-D"),
        ({"images": np.zeros((4, 1, 32, 32), dtype=np.float32)}, "images must have dtype uint8"),
        ({"labels": np.zeros(4, dtype=np.int32)}, "labels must have dtype int64"),
        ({"labels": np.array([0, 1, 2, 0], dtype=np.int64)}, r"labels must lie in \[0, 2\)"),
        ({"sample_ids": np.zeros(4, dtype=np.int64)}, "sample_ids must be unique"),
        ({"sample_ids": np.arange(3, dtype=np.int64)}, "same length"),
        ({"num_classes": 0}, "num_classes must be >= 1"),
        ({"name": ""}, "name must be a non-empty str"),
        ({"classes": ("a",)}, "classes must name each of the 2 classes"),
    ],
)
def test_array_dataset_validation(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArrayDataset(**{**_tiny(), **change})  # type: ignore[arg-type]


def test_array_dataset_basics(synth: ArrayDataset) -> None:
    assert len(synth) == 600
    assert synth.in_channels == 3
    assert synth.image_shape == (3, 32, 32)
    assert synth.class_counts().tolist() == [60] * 10
    assert ArrayDataset(**_tiny()).classes == ("0", "1")  # type: ignore[arg-type]
    sub = synth.subset(np.array([5, 2, 9]))
    assert sub.sample_ids.tolist() == synth.sample_ids[[5, 2, 9]].tolist()
    assert np.array_equal(sub.images, synth.images[[5, 2, 9]])
    assert sub.num_classes == synth.num_classes and sub.name == synth.name
    mask = synth.labels == 3
    assert np.array_equal(synth.subset(mask).sample_ids, synth.sample_ids[mask])
    with pytest.raises(ValueError, match="sample_ids must be unique"):
        synth.subset([1, 1])
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 600\)"):
        synth.subset([600])
    assert len(synth.subset([])) == 0


# --------------------------------------------------------------------------- #
# Loaders
# --------------------------------------------------------------------------- #


@needs_fashion
def test_fashion_mnist_loads() -> None:
    train = load_dataset("fashion-mnist", "train")
    test = load_dataset("fashion-mnist", "test")
    assert len(train) == 60000 and len(test) == 10000
    assert train.images.shape == (60000, 1, 32, 32) and test.images.shape == (10000, 1, 32, 32)
    assert train.images.dtype == np.uint8
    assert set(np.unique(train.labels).tolist()) == set(range(10))
    assert train.class_counts().tolist() == [6000] * 10
    # 2-pixel zero border from padding 28x28 to 32x32.
    assert not train.images[:, :, :2, :].any() and not train.images[:, :, :, -2:].any()
    assert train.classes[0] == "T-shirt/top" and train.num_classes == 10
    # Train ids are positions; test ids live in their own range.
    assert np.array_equal(train.sample_ids, np.arange(60000))
    assert test.sample_ids[0] == SPLIT_ID_OFFSETS["test"]
    assert np.intersect1d(train.sample_ids, test.sample_ids).size == 0
    mean, std = compute_stats(take(train, 6000, seed=0))
    expected_mean, expected_std = dataset_stats("fashion-mnist")
    assert mean[0] == pytest.approx(expected_mean[0], abs=0.01)
    assert std[0] == pytest.approx(expected_std[0], abs=0.01)


def test_fashion_mnist_missing_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", root=tmp_path)


def test_cifar_missing_without_download(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="download=True"):
        load_dataset("cifar10", root=tmp_path)


def test_load_dataset_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="unknown split 'val'"):
        load_dataset("synthetic", "val")
    with pytest.raises(ValueError, match="no 'valid' split"):
        load_dataset("fashion-mnist", "valid")


def test_image_folder_and_cinic_layout(tmp_path: Path) -> None:
    pil = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    written: dict[str, list[np.ndarray]] = {}
    for split in ("train", "test"):
        for cls in ("cat", "airplane"):
            d = tmp_path / split / cls
            d.mkdir(parents=True)
            for i in range(3):
                arr = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
                pil.fromarray(arr).save(d / f"{i}.png")
                written.setdefault(f"{split}/{cls}", []).append(arr)
    ds = load_dataset("imagefolder", "train", root=tmp_path)
    assert ds.classes == ("airplane", "cat")  # sorted folder names
    assert ds.images.shape == (6, 3, 32, 32)
    assert ds.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert np.array_equal(ds.images[0], written["train/airplane"][0].transpose(2, 0, 1))
    cinic = load_dataset("cinic10", "test", root=tmp_path)
    assert cinic.name == "cinic10" and cinic.sample_ids[0] == SPLIT_ID_OFFSETS["test"]
    # 28x28 grayscale folders are padded like Fashion-MNIST.
    gray = tmp_path / "gray" / "a"
    gray.mkdir(parents=True)
    pil.fromarray(np.full((28, 28), 200, dtype=np.uint8)).save(gray / "x.png")
    g = load_dataset("imagefolder", root=tmp_path / "gray")
    assert g.images.shape == (1, 1, 32, 32) and g.images[0, 0, 2, 2] == 200 and g.images[0, 0, 0, 0] == 0
    with pytest.raises(FileNotFoundError, match="split"):
        load_dataset("cinic10", "valid", root=tmp_path)


def test_the_synthetic_splits_are_made_once_and_shared_read_only() -> None:
    # Every agent of a simulation, the server's evaluation set and FedBE's unlabeled pool load
    # the same split: it is made once per process, and nobody can change it for the others.
    train = load_dataset("synthetic", "train")
    assert load_dataset("synthetic", "train") is train and len(train) == 5000
    assert np.array_equal(train.images[:50], make_synthetic(50, split="train").images)
    with pytest.raises(ValueError, match="read-only"):
        train.images[0, 0, 0, 0] = 0
    assert train.subset(np.arange(10)).images.flags.writeable  # a subset is the caller's own copy


def test_synthetic_is_deterministic_and_seeded() -> None:
    a = make_synthetic(200, seed=1)
    b = make_synthetic(200, seed=1)
    c = make_synthetic(200, seed=2)
    assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)
    assert not np.array_equal(a.images, c.images)
    # A smaller set is a prefix of a larger one.
    assert np.array_equal(make_synthetic(50, seed=1).images, a.images[:50])
    gray = make_synthetic(20, in_channels=1, size=28, num_classes=3)
    assert gray.images.shape == (20, 1, 28, 28) and gray.num_classes == 3
    default = load_dataset("synthetic", "test")
    assert len(default) == 1000 and default.sample_ids[0] == SPLIT_ID_OFFSETS["test"]
    with pytest.raises(ValueError, match="num_samples must be an int >= 0"):
        make_synthetic(-1)


def test_synthetic_is_learnable_and_stats_match() -> None:
    # Nearest class mean (train) on the test split: the class signal is shared
    # across splits and strong; a CNN reaches >90% in a few epochs.
    train = make_synthetic(1000, seed=4)
    test = make_synthetic(300, seed=4, split="test")
    x_train = train.images.reshape(len(train), -1).astype(np.float32)
    x_test = test.images.reshape(len(test), -1).astype(np.float32)
    centroids = np.stack([x_train[train.labels == c].mean(axis=0) for c in range(10)])
    dists = ((x_test[:, None, :] - centroids[None]) ** 2).sum(axis=2)
    accuracy = float((dists.argmin(axis=1) == test.labels).mean())
    assert accuracy > 0.5, accuracy  # chance is 0.1
    mean, std = compute_stats(train)
    ref_mean, ref_std = dataset_stats("synthetic", 3)
    assert np.allclose(mean, ref_mean, atol=0.05) and np.allclose(std, ref_std, atol=0.05)


def test_take_is_seeded_and_stratified(synth: ArrayDataset) -> None:
    a = take(synth, 100, seed=3)
    assert len(a) == 100 and a.class_counts().tolist() == [10] * 10
    assert np.array_equal(a.sample_ids, take(synth, 100, seed=3).sample_ids)
    assert not np.array_equal(a.sample_ids, take(synth, 100, seed=4).sample_ids)
    assert np.all(np.diff(a.sample_ids) > 0)  # original order kept
    assert len(take(synth, 37, seed=0, stratified=False)) == 37
    with pytest.raises(ValueError, match="cannot take 601"):
        take(synth, 601)


def test_dataset_stats() -> None:
    assert dataset_stats("cifar10")[0] == pytest.approx((0.4914, 0.4822, 0.4465))
    assert len(dataset_stats("fashion-mnist")[0]) == 1
    with pytest.raises(ValueError, match="compute_stats"):
        dataset_stats("imagefolder")
    with pytest.raises(ValueError, match="1 channel"):
        dataset_stats("fashion-mnist", in_channels=3)


def test_npz_round_trip_is_exact(tmp_path: Path, synth: ArrayDataset) -> None:
    shard = synth.subset(np.arange(0, 600, 7))
    path = tmp_path / "shard.data"  # any name: numpy must not append ".npz"
    save_npz(shard, path)
    back = load_npz(path)
    for field in ("images", "labels", "sample_ids"):
        original, loaded = getattr(shard, field), getattr(back, field)
        assert loaded.dtype == original.dtype and np.array_equal(loaded, original)
    assert (back.num_classes, back.name, back.classes) == (shard.num_classes, shard.name, shard.classes)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not an EdgeSplit dataset file"):
        load_npz(tmp_path / "other.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(ValueError, match="single .npy array"):
        load_npz(tmp_path / "single.npy")


# --------------------------------------------------------------------------- #
# Partitions
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("iid", PartitionSpec("iid", 5, 3)),
        ("dirichlet:0.5", PartitionSpec("dirichlet", 5, 3, alpha=0.5)),
        ("step:2", PartitionSpec("step", 5, 3, major_classes=2)),
        ("step:2:0.1", PartitionSpec("step", 5, 3, major_classes=2, minor_share=0.1)),
        ("table:dir/counts.csv", PartitionSpec("table", 5, 3, table_path="dir/counts.csv")),
    ],
)
def test_parse(text: str, expected: PartitionSpec) -> None:
    assert PartitionSpec.parse(text, 5, 3) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "non-empty"),
        ("zipf:2", "unknown partition scheme 'zipf'"),
        ("iid:3", "'iid' takes no parameter"),
        ("dirichlet", "bad dirichlet alpha"),
        ("dirichlet:abc", "bad dirichlet alpha"),
        ("dirichlet:0", "alpha must be a finite number > 0"),
        ("dirichlet:nan", "alpha must be a finite number > 0"),
        ("step", "bad step spec"),
        ("step:x", "bad step parameters"),
        ("step:0", "major_classes must be an int >= 1"),
        ("step:2:1.5", r"minor_share must be a number in \[0, 1\)"),
        ("table:", "'table' needs a CSV path"),
    ],
)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PartitionSpec.parse(text, 4)


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="num_agents must be an int >= 1"):
        PartitionSpec("iid", 0)
    with pytest.raises(ValueError, match="scheme 'dirichlet' needs alpha"):
        PartitionSpec("dirichlet", 3)
    with pytest.raises(ValueError, match="alpha applies to scheme 'dirichlet' only"):
        PartitionSpec("iid", 3, alpha=0.5)
    assert str(PartitionSpec.parse("dirichlet:0.5", 3)) == "dirichlet:0.5"


@pytest.mark.parametrize("text", ["iid", "dirichlet:0.5", "dirichlet:0.01", "step:2", "step:3:0.1"])
def test_partitions_deterministic_disjoint_covering(labels: np.ndarray, text: str) -> None:
    spec = PartitionSpec.parse(text, 7, seed=11)
    parts = partition_indices(labels, spec)
    assert len(parts) == 7
    _assert_disjoint(parts, n=labels.size)
    again = partition_indices(labels, spec)
    assert all(np.array_equal(p, q) for p, q in zip(parts, again))
    # Another seed picks other samples (for step the counts stay, the picks change).
    other = partition_indices(labels, PartitionSpec.parse(text, 7, seed=12))
    assert not all(np.array_equal(p, q) for p, q in zip(parts, other))


def test_iid_is_balanced(labels: np.ndarray) -> None:
    sizes = [p.size for p in partition_indices(labels, PartitionSpec("iid", 7, 0))]
    assert max(sizes) - min(sizes) <= 1


def _label_skew(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each agent's label mix and the global one."""
    counts = class_counts_per_agent(labels, parts, 10).astype(np.float64)
    local = counts / counts.sum(axis=1, keepdims=True)
    global_mix = np.bincount(labels, minlength=10) / labels.size
    return float(0.5 * np.abs(local - global_mix).sum(axis=1).mean())


def test_dirichlet_small_alpha_is_skewed(labels: np.ndarray) -> None:
    iid = _label_skew(labels, partition_indices(labels, PartitionSpec("iid", 10, 0)))
    dir_small = _label_skew(labels, partition_indices(labels, PartitionSpec("dirichlet", 10, 0, alpha=0.1)))
    dir_one = _label_skew(labels, partition_indices(labels, PartitionSpec("dirichlet", 10, 0, alpha=1.0)))
    assert iid < 0.1
    assert dir_small > 0.5
    assert iid < dir_one < dir_small


def test_dirichlet_min_size_and_termination() -> None:
    # Tiny data and tiny alpha: no draw satisfies the minimum, the repair does.
    tiny = np.arange(60, dtype=np.int64) % 3
    parts = partition_indices(tiny, PartitionSpec("dirichlet", 20, 0, alpha=0.001))
    _assert_disjoint(parts, n=60)
    assert min(p.size for p in parts) >= 3  # min(10, 60 // 20)
    big = partition_indices(np.repeat(np.arange(10), 100), PartitionSpec("dirichlet", 10, 0, alpha=0.05))
    assert min(p.size for p in big) >= 10
    with pytest.raises(ValueError, match="cannot give each of 20 agents"):
        partition_indices(tiny[:10], PartitionSpec("iid", 20, 0))


def test_step_gives_k_major_classes(labels: np.ndarray) -> None:
    spec = PartitionSpec.parse("step:2", 10, seed=0)
    counts = class_counts_per_agent(labels, partition_indices(labels, spec), 10)
    for a in range(10):
        majors = {(2 * a) % 10, (2 * a + 1) % 10}
        top2 = set(np.argsort(-counts[a], kind="stable")[:2].tolist())
        assert top2 == majors
        # FedBE's rule: minor classes get floor(0.02 * 400 / 8) = 1 each.
        assert all(counts[a, c] == 1 for c in range(10) if c not in majors)
        assert all(counts[a, c] == (400 - 8) // 2 for c in majors)
    with pytest.raises(ValueError, match="only 10"):
        partition_indices(labels, PartitionSpec.parse("step:11", 3))


def _write_table(path: Path, rows: list[list[int]], header: str | None = None) -> None:
    lines = [header] if header else []
    lines += [",".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")


def test_table_matches_exactly(tmp_path: Path, labels: np.ndarray) -> None:
    rows = [[i * 10 + c for c in range(10)] for i in range(3)]
    csv_path = tmp_path / "counts.csv"
    # FedGKT Table 6 style: a comment, a header and an agent-label column.
    csv_path.write_text(
        "# counts per agent\nagent," + ",".join(f"c{c}" for c in range(10)) + "\n"
        + "\n".join(f"k={i}," + ",".join(str(v) for v in row) for i, row in enumerate(rows)) + "\n"
    )
    assert read_count_table(csv_path).tolist() == rows
    spec = PartitionSpec.parse(f"table:{csv_path}", 3, seed=5)
    parts = partition_indices(labels, spec, num_classes=10)
    _assert_disjoint(parts)
    assert class_counts_per_agent(labels, parts, 10).tolist() == rows
    plain = tmp_path / "plain.csv"
    _write_table(plain, rows)
    parts_plain = partition_indices(labels, PartitionSpec.parse(f"table:{plain}", 3, seed=5))
    assert all(np.array_equal(p, q) for p, q in zip(parts, parts_plain))


def test_table_errors(tmp_path: Path, labels: np.ndarray) -> None:
    over = tmp_path / "over.csv"
    _write_table(over, [[300] * 10, [200] * 10])  # 500 > 400 per class
    with pytest.raises(ValueError, match="class 0: 500 asked, 400 available"):
        partition_indices(labels, PartitionSpec.parse(f"table:{over}", 2))
    shape = tmp_path / "shape.csv"
    _write_table(shape, [[1] * 10])
    with pytest.raises(ValueError, match="expected 2 x 10"):
        partition_indices(labels, PartitionSpec.parse(f"table:{shape}", 2))
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("1,2,3\n1,2\n")
    with pytest.raises(ValueError, match="expected 3 columns, got 2"):
        read_count_table(ragged)
    negative = tmp_path / "negative.csv"
    negative.write_text("1,-2\n")
    with pytest.raises(ValueError, match="must be >= 0"):
        read_count_table(negative)
    with pytest.raises(FileNotFoundError):
        read_count_table(tmp_path / "missing.csv")


def test_agent_shards_keep_sample_ids(synth: ArrayDataset) -> None:
    spec = PartitionSpec.parse("dirichlet:0.3", 4, seed=2)
    shards = [agent_shard(synth, spec, a) for a in range(4)]
    ids = np.concatenate([s.sample_ids for s in shards])
    assert np.array_equal(np.sort(ids), np.sort(synth.sample_ids))
    position = {int(sid): i for i, sid in enumerate(synth.sample_ids)}
    for s in shards:
        for image, sid in zip(s.images[:5], s.sample_ids[:5]):
            assert np.array_equal(image, synth.images[position[int(sid)]])
    with pytest.raises(ValueError, match=r"agent_index must be an int in \[0, 4\)"):
        agent_shard(synth, spec, 4)


def test_test_shards(synth: ArrayDataset) -> None:
    test = make_synthetic(300, seed=7, split="test")
    spec = PartitionSpec.parse("step:1:0.05", 5, seed=0)
    iid_parts = partition_test_indices(test.labels, spec)
    _assert_disjoint(iid_parts, n=300)
    mirrored = partition_test_indices(test.labels, spec, synth.labels, num_classes=10)
    _assert_disjoint(mirrored, n=300)
    train_counts = class_counts_per_agent(synth.labels, partition_indices(synth.labels, spec, 10), 10)
    test_counts = class_counts_per_agent(test.labels, mirrored, 10)
    # Each agent's most frequent test classes are its training majors.
    assert np.array_equal(test_counts.argmax(axis=1), train_counts.argmax(axis=1))
    shard = test_shard_for_agent(test, spec, 2, train_labels=synth.labels)
    assert np.array_equal(shard.sample_ids, test.sample_ids[mirrored[2]])
    assert np.all(shard.sample_ids >= SPLIT_ID_OFFSETS["test"])


def test_class_count_table_has_totals(labels: np.ndarray) -> None:
    parts = partition_indices(labels, PartitionSpec.parse("dirichlet:0.5", 3, seed=0))
    names = [f"class{c}" for c in range(10)]
    text = class_count_table(labels, parts, 10, names)
    lines = text.splitlines()
    assert lines[0].split() == ["agent", *names, "total"]
    assert lines[-1].split()[0] == "total" and lines[-1].split()[-1] == str(labels.size)
    assert lines[-1].split()[1:-1] == ["400"] * 10
    for a, line in enumerate(lines[2:5]):
        assert line.split()[-1] == str(parts[a].size)
    assert len({len(line) for line in lines}) == 1  # aligned: every line equally wide


# --------------------------------------------------------------------------- #
# torch views
# --------------------------------------------------------------------------- #


def test_core_does_not_import_torch() -> None:
    code = "import sys, fldata; assert 'torch' not in sys.modules, 'fldata imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_torch_dataset_items_and_ids(synth: ArrayDataset) -> None:
    torch = pytest.importorskip("torch")
    from fldata.torch_data import TorchArrayDataset

    tds = TorchArrayDataset(synth, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    x, y, sid = tds[3]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and sid.dtype == torch.int64
    assert int(y) == synth.labels[3] and int(sid) == synth.sample_ids[3]
    expected = (synth.images[3].astype(np.float32) / 255.0 - 0.5) / 0.25
    assert np.allclose(x.numpy(), expected, atol=1e-5)
    with pytest.raises(ValueError, match="need 3 values"):
        TorchArrayDataset(synth, mean=(0.5,), std=(0.5,))


def test_loader_keeps_sample_ids_under_shuffle_and_augment(synth: ArrayDataset) -> None:
    torch = pytest.importorskip("torch")
    from fldata.torch_data import make_loader

    shard = agent_shard(synth, PartitionSpec("iid", 3, 0), 1)
    by_id = {int(s): (int(lbl), img) for s, lbl, img in zip(shard.sample_ids, shard.labels, shard.images)}
    loader = make_loader(shard, batch_size=32, shuffle=True, augment=False, seed=0)
    seen = []
    mean, std = dataset_stats("synthetic", 3)
    for images, labels, ids in loader:
        assert images.shape[1:] == (3, 32, 32) and labels.shape == ids.shape
        for image, label, sid in zip(images, labels, ids):
            true_label, raw = by_id[int(sid)]
            assert int(label) == true_label
            expected = (raw.astype(np.float32) / 255.0 - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
            assert np.allclose(image.numpy(), expected, atol=1e-5)
        seen.extend(ids.tolist())
    assert sorted(seen) == sorted(shard.sample_ids.tolist())
    assert seen != sorted(seen)  # actually shuffled

    def batches(seed: int) -> list[tuple[object, object]]:
        return [(x.clone(), i.clone()) for x, _, i in make_loader(shard, 50, shuffle=True, augment=True, seed=seed)]

    first, second, other = batches(1), batches(1), batches(2)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))
    # Augmented ids still match labels: ids are never re-ordered apart from images.
    for _, labels, ids in make_loader(shard, 50, shuffle=True, augment=True, seed=3):
        assert all(int(lbl) == by_id[int(s)][0] for lbl, s in zip(labels, ids))


def test_augmentation_is_crop_and_flip(synth: ArrayDataset) -> None:
    torch = pytest.importorskip("torch")
    from fldata.torch_data import TorchArrayDataset

    gen = torch.Generator().manual_seed(0)
    tds = TorchArrayDataset(synth, mean=(0.0,) * 3, std=(1.0 / 255.0,) * 3, augment=True, generator=gen)
    raw = synth.images[0].astype(np.float32)  # with this mean/std, x == raw pixels
    padded = np.pad(raw, ((0, 0), (4, 4), (4, 4)))
    candidates = [
        view
        for top in range(9)
        for left in range(9)
        for view in (padded[:, top : top + 32, left : left + 32], padded[:, top : top + 32, left : left + 32][:, :, ::-1])
    ]
    for _ in range(5):
        x = tds[0][0].numpy()
        assert any(np.array_equal(x, c) for c in candidates)


def test_empty_shard_loader() -> None:
    pytest.importorskip("torch")
    from fldata.torch_data import make_loader

    empty = make_synthetic(10).subset([])
    assert list(make_loader(empty, 4, shuffle=True)) == []
