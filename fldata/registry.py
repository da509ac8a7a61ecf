"""Registry of dataset loaders, keyed by name.

Configs on both sides name their data (``dataset = "cifar10"``); this module
turns such a name into its loader. The built-in datasets register themselves in
:mod:`fldata.loaders`; a deployment adds its own with :func:`register_dataset`
rather than editing a chain of ``if name == ...``.

A duplicate name is an error rather than a silent override: two loaders under
one name would give agents of one run different data under one label.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, TypeVar

if TYPE_CHECKING:
    from fldata.array_dataset import ArrayDataset

__all__ = ["DatasetLoader", "DatasetSpec", "get_dataset_spec", "list_datasets", "register_dataset"]

#: Every split a dataset may have; each gives its samples a distinct id range.
KNOWN_SPLITS = ("train", "test", "valid")


class DatasetLoader(Protocol):
    """Signature every registered loader has: one split into memory (or memory-mapped)."""

    def __call__(self, split: str, root: str | os.PathLike[str] | None, download: bool) -> "ArrayDataset": ...


_LoaderT = TypeVar("_LoaderT", bound=Callable[..., "ArrayDataset"])


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset.

    Attributes:
        name: Registry key, as configs write it.
        loader: ``loader(split, root, download) -> ArrayDataset``.
        splits: The splits it has (``"valid"`` only where the data defines one).
        description: One line for listings and error messages.
    """

    name: str
    loader: DatasetLoader
    splits: tuple[str, ...]
    description: str


_REGISTRY: dict[str, DatasetSpec] = {}


def register_dataset(
    name: str, *, splits: tuple[str, ...] = ("train", "test"), description: str = ""
) -> Callable[[_LoaderT], _LoaderT]:
    """Decorator registering ``loader(split, root, download)`` under ``name``.

    Raises:
        ValueError: ``name`` is empty or already registered, or ``splits`` names
            a split other than train / test / valid.
    """
    if not name:
        raise ValueError("dataset name must be a non-empty string")
    unknown = [s for s in splits if s not in KNOWN_SPLITS]
    if unknown or not splits:
        raise ValueError(f"dataset {name!r}: splits must be among {KNOWN_SPLITS}, got {splits!r}")

    def decorator(loader: _LoaderT) -> _LoaderT:
        if name in _REGISTRY:
            raise ValueError(f"dataset {name!r} is already registered")
        doc_line = (getattr(loader, "__doc__", None) or "").strip().splitlines()
        _REGISTRY[name] = DatasetSpec(name, loader, tuple(splits), description or (doc_line[0] if doc_line else ""))
        return loader

    return decorator


def get_dataset_spec(name: str) -> DatasetSpec:
    """The registered spec for ``name``; ValueError listing the known names."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(list_datasets())}")
    return spec


def list_datasets() -> tuple[str, ...]:
    """Registered dataset names, in registration order."""
    return tuple(_REGISTRY)
