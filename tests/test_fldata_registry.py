"""Datasets are a registry by name, like the models: a duplicate name is an error, an
unknown one lists the known, and a deployment adds its own loader without editing fldata."""

from __future__ import annotations

import numpy as np
import pytest

from fldata import registry
from fldata import DATASET_NAMES, ArrayDataset, get_dataset_spec, list_datasets, load_dataset, make_synthetic, register_dataset


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations in a test go to a copy of the registry, gone after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_the_built_in_datasets_are_registered() -> None:
    assert DATASET_NAMES == ("fashion-mnist", "cifar10", "cifar100", "cinic10", "imagefolder", "npz", "synthetic")
    assert set(DATASET_NAMES) <= set(list_datasets())


@pytest.mark.parametrize("name", list_datasets())
def test_every_registered_dataset_has_a_loader_and_its_splits(name: str) -> None:
    spec = get_dataset_spec(name)
    assert spec.name == name and callable(spec.loader)
    assert {"train", "test"} <= set(spec.splits) <= {"train", "test", "valid"}


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'mnist'; expected one of fashion-mnist, cifar10, .*synthetic"):
        get_dataset_spec("mnist")
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        load_dataset("mnist")


def test_a_duplicate_name_is_refused(scratch_registry: None) -> None:
    with pytest.raises(ValueError, match="dataset 'synthetic' is already registered"):
        register_dataset("synthetic")(lambda split, root, download: make_synthetic(10))
    with pytest.raises(ValueError, match="non-empty"):
        register_dataset("")
    with pytest.raises(ValueError, match="splits must be among"):
        register_dataset("odd", splits=("train", "holdout"))


def test_a_registered_loader_is_what_load_dataset_uses(scratch_registry: None) -> None:
    calls: list[tuple] = []

    @register_dataset("tiny", description="ten synthetic samples")
    def tiny(split: str, root: object, download: bool) -> ArrayDataset:
        calls.append((split, root, download))
        return make_synthetic(10, split=split)

    ds = load_dataset("tiny", "test", root="/data", download=True)
    assert len(ds) == 10 and calls == [("test", "/data", True)]
    assert get_dataset_spec("tiny").description == "ten synthetic samples"
    assert "tiny" in list_datasets() and "tiny" not in DATASET_NAMES
    with pytest.raises(ValueError, match="tiny has no 'valid' split; expected 'train' or 'test'"):
        load_dataset("tiny", "valid")


def test_splits_are_checked_before_loading() -> None:
    with pytest.raises(ValueError, match="no 'valid' split"):
        load_dataset("cifar10", "valid")
    train = load_dataset("synthetic", "train")
    assert len(train) == 5000 and np.all(train.sample_ids < 10_000_000)
