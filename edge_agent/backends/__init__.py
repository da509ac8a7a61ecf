"""Local training backends of the edge agent.

``torch`` is the default and lives in :mod:`edge_agent.methods` (one edge step per
method). ``ort`` trains with onnxruntime-training and numpy only, for devices
where torch is too big or unavailable. Which methods a backend implements is in
each method's registry entry (``MethodSpec.backends``). Nothing here is imported
unless the agent runs with ``--backend ort``, so the torch agent never needs
onnxruntime and the ort agent never needs torch.
"""

from __future__ import annotations

from shared_protocol.registry import import_part, method_names, registered_methods

BACKENDS = ("torch", "ort")


def backend_methods(backend: str) -> tuple[str, ...]:
    """The methods ``backend`` implements: every registered one for torch, else those whose
    registry entry names an edge step for it."""
    if backend == "torch":
        return method_names()
    return tuple(name for name, spec in registered_methods().items() if backend in spec.backends)


def get_backend_method(backend: str, method: str):  # type: ignore[no-untyped-def]
    """The edge-step class of ``method`` for a non-torch ``backend``."""
    spec = registered_methods().get(method)
    if spec is None or backend not in spec.backends:
        raise ValueError(f"backend {backend!r} does not implement method {method!r}; it implements {backend_methods(backend)}")
    return import_part(spec.backends[backend])


def describe_backend(backend: str, torch_methods: tuple[str, ...] | None = None) -> tuple[list[str], dict[str, str]]:
    """(methods this agent can run, software versions) for the Hello message.

    Imports torch only for the torch backend: an ort agent must neither need it
    nor pay for loading it. ``torch_methods``: the torch agent's methods (default:
    every registered one).
    """
    if backend == "torch":
        try:
            import torch

            version = str(torch.__version__)
        except ImportError:
            version = "none"
        return list(backend_methods("torch") if torch_methods is None else torch_methods), {"torch": version}
    from .ort import ort_version

    return list(backend_methods(backend)), {"onnxruntime": ort_version() or "none"}
