"""A partition exported as .npz for a device, and numpy batches for the torch-free backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fldata import PartitionSpec, agent_shard, load_dataset, make_synthetic, take
from fldata.export import export_partition, main
from fldata.numpy_data import Normalizer, iterate_batches


def test_exported_shard_is_the_simulated_agents_shard(tmp_path: Path) -> None:
    export_partition("synthetic", tmp_path, "dirichlet:0.5", num_agents=3, agent_index=2, seed=4, train_samples=300, test_samples=90)
    train = load_dataset("npz", "train", tmp_path)
    expected = agent_shard(take(load_dataset("synthetic", "train"), 300, 4), PartitionSpec.parse("dirichlet:0.5", 3, 4), 2)
    np.testing.assert_array_equal(train.sample_ids, expected.sample_ids)  # same samples, same ids
    np.testing.assert_array_equal(train.images, expected.images)
    assert load_dataset("npz", "test", tmp_path).sample_ids.min() >= 10_000_000
    assert load_dataset("npz", "train", tmp_path / "train.npz").name == "synthetic"  # a file as root


def test_npz_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="fldata.export"):
        load_dataset("npz", "train", tmp_path)
    with pytest.raises(ValueError, match="root"):
        load_dataset("npz", "train")


def test_export_cli(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--dataset", "synthetic", "--partition", "iid", "--agents", "2", "--index", "1", "--train-samples", "40",
                 "--test-samples", "20", "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "train.npz").exists() and "wrote" in capsys.readouterr().out
    assert main(["--dataset", "nope", "--out", str(tmp_path / "x")]) == 2


def test_numpy_batches_match_the_torch_loader() -> None:
    torch_data = pytest.importorskip("fldata.torch_data")
    ds = make_synthetic(70, in_channels=3, seed=2)
    ours = list(iterate_batches(ds, 32))
    theirs = list(torch_data.make_loader(ds, 32))
    assert len(ours) == len(theirs) == 3
    for (x, y, ids), (tx, ty, tids) in zip(ours, theirs):
        np.testing.assert_array_equal(x, tx.numpy())  # bit-identical normalisation
        np.testing.assert_array_equal(y, ty.numpy())
        np.testing.assert_array_equal(ids, tids.numpy())


def test_numpy_batches_shuffle_and_augment_deterministically() -> None:
    ds = make_synthetic(50, in_channels=1, seed=0)
    a = list(iterate_batches(ds, 16, shuffle=True, seed=3, augment=True))
    b = list(iterate_batches(ds, 16, shuffle=True, seed=3, augment=True))
    for (xa, _, ia), (xb, _, ib) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ia, ib)
    ids = np.concatenate([i for _, _, i in a])
    assert sorted(ids.tolist()) == sorted(ds.sample_ids.tolist()) and ids.tolist() != ds.sample_ids.tolist()
    with pytest.raises(ValueError):
        Normalizer([0.5], [0.0])


def test_image_folders_per_device_load_as_the_shards_they_came_from(tmp_path: Path) -> None:
    from fldata.export import class_folder_names, export_image_folders

    devices = export_image_folders("synthetic", tmp_path, "dirichlet:0.5", num_agents=2, seed=1, train_samples=80,
                                   test_samples=40, names=("pi-a", "pi-b"))
    assert [d.name for d in devices] == ["pi-a", "pi-b"]
    from fldata.subsets import AgentDataSpec, load_agent_subset

    for index, device in enumerate(devices):
        expected, _ = load_agent_subset(AgentDataSpec("synthetic", "dirichlet:0.5", 2, 1, None, train_samples=80, test_samples=40), index)
        loaded = load_dataset("imagefolder", "train", device)
        assert loaded.num_classes == expected.num_classes == 10  # every class folder, empty or not
        # Same images with the same labels (the folder orders them by class, then file name).
        np.testing.assert_array_equal(np.sort(loaded.labels), np.sort(expected.labels))
        assert sorted(map(bytes, loaded.images)) == sorted(map(bytes, expected.images))
        assert len(load_dataset("imagefolder", "test", device)) > 0
    meta = __import__("json").loads((tmp_path / "classes.json").read_text())
    assert [c["index"] for c in meta["classes"]] == list(range(10))
    names = class_folder_names(("T-shirt/top", "Trouser", "Ankle boot"), 3)
    assert names == ["0_T-shirt_top", "1_Trouser", "2_Ankle_boot"] and names == sorted(names)
    assert class_folder_names(tuple(f"c{i}" for i in range(12)), 12)[10] == "10_c10"
    assert sorted(class_folder_names(tuple("b" * (12 - i) for i in range(12)), 12)) == class_folder_names(tuple("b" * (12 - i) for i in range(12)), 12)


def test_export_cli_image_folders(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--dataset", "synthetic", "--format", "imagefolder", "--agents", "2", "--index", "1", "--train-samples", "40",
                 "--test-samples", "20", "--out", str(tmp_path / "one")]) == 0
    assert (tmp_path / "one" / "train").is_dir() and (tmp_path / "one" / "classes.json").exists()
    meta = __import__("json").loads((tmp_path / "one" / "classes.json").read_text())
    assert (meta["in_channels"], meta["image_size"], meta["num_classes"]) == (3, [32, 32], 10)  # synthetic: 3x32x32, 10 classes
    assert "--in-channels 3 --image-size 32x32 --num-classes 10" in capsys.readouterr().out
    assert main(["--dataset", "synthetic", "--format", "imagefolder", "--agents", "2", "--names", "x", "--out", str(tmp_path / "b")]) == 2
    assert "--names" in capsys.readouterr().err
