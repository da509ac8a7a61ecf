"""Make torch look uninstalled in a child process, as on an `edge-lite` install.

``write_blocker(dir)`` writes a ``sitecustomize.py`` that hides torch and
torchvision from the path finder: ``import torch`` raises ModuleNotFoundError
and ``importlib.util.find_spec("torch")`` returns None, exactly as when the
package is absent (libraries that probe for torch, like onnxruntime's tools,
then take their torch-free path). Put ``dir`` first on the child's PYTHONPATH.
"""

from __future__ import annotations

from pathlib import Path

SITECUSTOMIZE_TEMPLATE = '''\
import importlib.machinery
import sys

_HIDDEN = {hidden!r}


class _PathFinderWithoutTorch(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            return None
        return super().find_spec(name, path, target)


sys.meta_path = [_PathFinderWithoutTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


SITECUSTOMIZE = SITECUSTOMIZE_TEMPLATE.format(hidden=("torch", "torchvision", "torchaudio"))


def write_blocker(directory: Path, hidden: tuple[str, ...] = ("torch", "torchvision", "torchaudio")) -> Path:
    """``directory`` with a ``sitecustomize.py`` hiding the top-level packages ``hidden``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE_TEMPLATE.format(hidden=tuple(hidden)))
    return directory
