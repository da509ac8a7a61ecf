"""The interface between the agent (connection, rounds, costs) and a method's edge step."""

from __future__ import annotations

import math

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

from fldata import ArrayDataset
from shared_protocol.messages import EvalRequest, Message, RoundStart

from ..config import MemoryConfig
from ..costs import RoundMeter


def _no_request(*args: Any, **kwargs: Any) -> Message:
    raise NotImplementedError("this context cannot make requests (no agent behind it)")


def _no_public_set(*args: Any, **kwargs: Any) -> ArrayDataset:
    raise NotImplementedError("this context holds no public test set (no agent behind it)")


@dataclass
class EdgeContext:
    """What a method's edge step may use. It never sees the transport itself."""

    agent_id: str
    run_id: str
    instance: str
    train: ArrayDataset
    test: ArrayDataset
    settings: dict[str, Any]  # from the server's Welcome: num_classes, models, ...
    send: Callable[..., None]  # send(msg, meter, codecs=None): encode + publish on our up topic, metered
    resend_round_end: Callable[[], None] = lambda: None  # publish the last RoundEnd again
    # request(msg, meter, is_reply, timeout_s, codecs=None, attempts=3) -> the server's answer:
    # send and wait within the round (split learning's per-batch exchange); see EdgeAgent.request.
    request: Callable[..., Message] = _no_request
    # public_set(ref: PublicEvalSet, meter, round) -> the run's public global test set, loaded or
    # downloaded once and checked against ref's digests (edge_agent/public_set.py): for a method
    # that scores its private model on it (EvalRequest.public_set, EvalAnswer.global_results).
    public_set: Callable[..., ArrayDataset] = _no_public_set
    device: str = "cpu"
    progress: bool = False
    seed: int = 0
    augment: bool = False
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # how to trade speed for resident memory
    # The agent's private key (edge_agent/activation_guard.py): never derived from what the server
    # knows; b"": none given (a test's context), drawn here on first use.
    private_key: bytes = field(default=b"", repr=False)
    _weights_generator: Any = field(default=None, init=False, repr=False)

    def key(self) -> bytes:
        if not self.private_key:
            from ..activation_guard import agent_key

            self.private_key = agent_key()
        return self.private_key

    def private_generator(self) -> Any:
        """A ``torch.Generator`` for weights the server must not be able to reproduce (a
        private initialisation): seeded from :meth:`key`, not from the run's seed."""
        import torch

        from ..activation_guard import key_seed

        return torch.Generator().manual_seed(key_seed(self.key(), "init"))

    def weights_generator(self) -> Any:
        """The ``torch.Generator`` every initial weight of this agent's models is drawn from
        (``models.build_model(..., generator=...)``), seeded with ``seed``; the same one on every
        call, so that a method's models take consecutive draws of one stream. Never torch's
        global RNG: simulated agents are threads of one process and share it, so what an agent
        drew from it depended on the other threads' schedule (the run did too)."""
        if self._weights_generator is None:
            import torch  # lazily: a torch-free agent (--backend ort) never asks

            self._weights_generator = torch.Generator().manual_seed(self.seed)
        return self._weights_generator


@dataclass
class RoundResult:
    num_samples: int
    uploads: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalAnswer:
    """What a method's edge step answers to an evaluation request (``EvalReport``).

    ``results[label]``: ``{"correct", "total"}`` (and optionally ``"loss_sum"``) of a model
    the agent holds, on its own test shard; label ``"model"`` is the method's deployed model.
    ``global_results[label]``: the same figures of a model the method keeps private, or one
    that lives here, scored here on the public global test set the request names
    (``EvalRequest.public_set``).
    ``models[label]``: arrays of a model the server needs to score on the global test set
    (never a private one).
    ``uploads``: what was streamed for evaluation before the answer (split methods)."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    global_results: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    uploads: dict[str, Any] = field(default_factory=dict)


def shard_result(correct: int, total: int, loss_sum: float | None = None, **extra: Any) -> dict[str, Any]:
    """One ``EvalAnswer.results`` entry. A loss that is not a finite number (a model whose
    logits overflow) is left out: the counts still say what the model scored, and the wire
    refuses NaN."""
    out: dict[str, Any] = {"correct": int(correct), "total": int(total), **extra}
    if loss_sum is not None and math.isfinite(loss_sum):
        out["loss_sum"] = float(loss_sum)
    return out


_EDGE_METHODS: dict[str, type["EdgeMethod"]] = {}


def register_edge_method(cls: type["EdgeMethod"]) -> type["EdgeMethod"]:
    if cls.name in _EDGE_METHODS:
        raise ValueError(f"edge method {cls.name!r} is already registered")
    _EDGE_METHODS[cls.name] = cls
    return cls


def registered_edge_methods() -> dict[str, type["EdgeMethod"]]:
    return dict(_EDGE_METHODS)


class EdgeMethod(ABC):
    name: ClassVar[str]

    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx

    def on_message(self, msg: Message) -> bool:
        """A method-specific download (e.g. server logits). Return True if handled."""
        return False

    @abstractmethod
    def run_round(self, start: RoundStart, meter: RoundMeter) -> RoundResult:
        """Train, send what the method sends, and say what was done. Training goes through
        :func:`edge_agent.trainer.train_epochs` with ``meter``, which counts its samples, FLOPs
        (of what the method declares it trains, :class:`edge_agent.trainer.Trains`) and time;
        forward passes outside training go to ``meter.forward``."""

    @abstractmethod
    def evaluate(self, request: EvalRequest, meter: RoundMeter) -> EvalAnswer:
        """Answer the server's evaluation request for ``request.round`` (after that round's
        downloads): evaluate the deployed model(s) held here on the local test shard, and
        return what the server needs to score them on the global set. ``meter`` counts the
        evaluation's own FLOPs (``meter.forward``: forward passes here), time and bytes."""

    def held_global(self, version: int) -> dict[str, np.ndarray] | None:
        """The global model of ``version`` as this agent received it (name -> array), for a
        weight-sharing method; None when it holds none (what a fault on purpose flips against,
        edge_agent/faults.py)."""
        return None

    def state_arrays(self) -> dict[str, np.ndarray]:
        """What to persist locally so a restarted agent resumes where it was."""
        return {}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from :meth:`state_arrays`."""
