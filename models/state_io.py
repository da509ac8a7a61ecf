"""Save nested training state (model, optimizer, scheduler) without pickle.

A state tree of dicts, lists, scalars, strings, tensors and arrays is split into
a JSON skeleton and a flat name -> array mapping (saved with ``np.savez``);
loading uses ``allow_pickle=False``. This replaces ``torch.save`` for
checkpoints, whose loader unpickles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ARRAY = "__array__"
_TENSOR = "__tensor__"


def flatten_state(tree: Any, prefix: str = "s") -> tuple[Any, dict[str, np.ndarray]]:
    arrays: dict[str, np.ndarray] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            arrays[path] = node.detach().cpu().numpy()
            return {_TENSOR: path}
        if isinstance(node, np.ndarray):
            arrays[path] = node
            return {_ARRAY: path}
        if isinstance(node, dict):
            # JSON keys are strings: remember int keys (optimizer state is keyed by param index).
            return {"__dict__": [[k, walk(v, f"{path}/{k}")] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        if isinstance(node, (bool, int, float, str)) or node is None:
            return node
        if isinstance(node, (np.integer, np.floating)):
            return node.item()
        raise TypeError(f"cannot save {type(node).__name__} at {path}")

    return walk(tree, prefix), arrays


def unflatten_state(skeleton: Any, arrays: dict[str, np.ndarray]) -> Any:
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if _TENSOR in node:
                return torch.from_numpy(np.array(arrays[node[_TENSOR]]))
            if _ARRAY in node:
                return np.array(arrays[node[_ARRAY]])
            return {k: walk(v) for k, v in node["__dict__"]}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(skeleton)


def save_state(directory: str | os.PathLike[str], name: str, tree: Any) -> None:
    """Write ``name.json`` and ``name.npz`` atomically into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    skeleton, arrays = flatten_state(tree)
    tmp_npz = directory / f".{name}.tmp.npz"
    tmp_json = directory / f".{name}.tmp.json"
    np.savez(tmp_npz, **arrays)
    tmp_json.write_text(json.dumps(skeleton))
    os.replace(tmp_npz, directory / f"{name}.npz")
    os.replace(tmp_json, directory / f"{name}.json")


def load_state(directory: str | os.PathLike[str], name: str) -> Any:
    directory = Path(directory)
    skeleton = json.loads((directory / f"{name}.json").read_text())
    with np.load(directory / f"{name}.npz", allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    return unflatten_state(skeleton, arrays)
