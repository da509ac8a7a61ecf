"""Local training backends of the edge agent.

``torch`` is the default and lives in :mod:`edge_agent.methods` (one edge step per
method). ``ort`` trains with onnxruntime-training and numpy only, for devices
where torch is too big or unavailable; it implements FedGKT. Nothing here is
imported unless the agent runs with ``--backend ort``, so the torch agent never
needs onnxruntime and the ort agent never needs torch.
"""

from __future__ import annotations

BACKENDS = ("torch", "ort")
#: Methods each non-torch backend implements.
BACKEND_METHODS = {"ort": ("fedgkt",)}


def get_backend_method(backend: str, method: str):  # type: ignore[no-untyped-def]
    """The edge-step class of ``method`` for a non-torch ``backend``."""
    if backend == "ort" and method == "fedgkt":
        from .ort_fedgkt import OrtFedGktEdge

        return OrtFedGktEdge
    raise ValueError(f"backend {backend!r} does not implement method {method!r}; it implements {BACKEND_METHODS.get(backend, ())}")


def describe_backend(backend: str, torch_methods: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """(methods this agent can run, software versions) for the Hello message.

    Imports torch only for the torch backend: an ort agent must neither need it
    nor pay for loading it.
    """
    if backend == "torch":
        try:
            import torch

            version = str(torch.__version__)
        except ImportError:
            version = "none"
        return list(torch_methods), {"torch": version}
    from .ort import ort_version

    return list(BACKEND_METHODS.get(backend, ())), {"onnxruntime": ort_version() or "none"}
