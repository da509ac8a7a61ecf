"""The interface between the coordinator (rounds, deadlines, quorum, failures)
and a method's server step, the size of Flower's ``Strategy``.

:class:`ServerMethod` is the core every method implements: six required hooks
(``welcome_settings``, ``round_config``: configure a round; ``on_upload``: consume an
upload; ``complete``: finish the round; ``evaluation``: the one evaluation path;
``model_info``: what the report's cost table shows) and optional ones with defaults.
What only some methods need is a mixin the coordinator looks for:
:class:`StreamedUploads` (uploads in batches, bounded in size, re-requested when some
never arrived) and :class:`AnswersUploads` (uploads answered at once within the
round, e.g. split learning's gradients). A method never touches the transport: the
coordinator sends, encodes (with the codecs the method declares in
``download_codecs``) and bounds what agents may send.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from shared_protocol.messages import EvalReport, Message, RoundEnd

from ..evaluation import Evaluation


@dataclass
class ServerContext:
    run_id: str
    num_classes: int
    in_channels: int
    device: str
    seed: int = 0
    progress: bool = False
    rounds: int = 0  # the run's planned number of rounds (0: not known, e.g. a unit test)
    out_dir: str = ""  # the run directory (report, checkpoint); "" when there is none (unit tests)
    server_step: str = "auto"  # how the server's training step runs (cloud_server/server_step.py)
    # The device's figures per round (name, training seconds, peak memory, utilisation): methods wrap
    # their server-side training in device_meter.training(); the coordinator takes them as a round closes.
    device_meter: Any = None  # cloud_server.device_meter.DeviceMeter, made from ``device`` when not given
    # Robustness to a bad device (cloud_server/robust/): the [server] settings, and the ledger of
    # refusals, clips, skipped steps and quarantine that methods and the coordinator write.
    robustness: Any = None  # cloud_server.robust.RobustnessConfig; default: the defaults
    ledger: Any = None  # cloud_server.robust.RobustnessLedger, made from ``robustness`` when not given
    # The checks that need the server's judgement (cloud_server/robust/validation.py): their settings,
    # and the validation set that judges weight updates (None: [server] validation_samples = 0).
    defence: Any = None  # cloud_server.robust.validation.DefenceConfig; default: off
    validation: Any = None  # cloud_server.robust.validation_screen.ValidationScreen
    # Differential privacy (cloud_server/privacy.py): the [server] dp_* settings, the noised mean of
    # clipped updates the weight-sharing methods call, and the accountant. Default: off.
    privacy: Any = None  # cloud_server.privacy.PrivacyLedger
    # Secure aggregation's parameters (shared_protocol.secagg.SecAggParams); None: off.
    secagg: Any = None

    def __post_init__(self) -> None:
        from ..robust.config import RobustnessConfig
        from ..robust.ledger import RobustnessLedger
        from ..robust.validation import DefenceConfig

        if self.robustness is None:
            self.robustness = RobustnessConfig()
        if self.ledger is None:
            self.ledger = RobustnessLedger(self.robustness)
        if self.defence is None:
            self.defence = DefenceConfig()
        if self.privacy is None:
            from ..privacy import PrivacyLedger

            self.privacy = PrivacyLedger()
        if self.device_meter is None:
            from ..device_meter import DeviceMeter  # imports torch: only when a context is made

            self.device_meter = DeviceMeter(self.device)


@dataclass
class RoundOutcome:
    """What a method's ``complete`` returns for one round (or one agent's round, async)."""

    downloads: list[tuple[str, Message]] = field(default_factory=list)  # (agent id, message)
    server_loss: float | None = None
    server_train_s: float = 0.0
    samples: int = 0
    used_agents: list[str] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)  # agent -> why its upload was not used


_SERVER_METHODS: dict[str, type["ServerMethod"]] = {}


def register_server_method(cls: type["ServerMethod"]) -> type["ServerMethod"]:
    if cls.name in _SERVER_METHODS:
        raise ValueError(f"server method {cls.name!r} is already registered")
    _SERVER_METHODS[cls.name] = cls
    return cls


def registered_server_methods() -> dict[str, type["ServerMethod"]]:
    return dict(_SERVER_METHODS)


class ServerMethod(ABC):
    """A method's server step. Subclasses set ``name`` (the registry's name) and
    ``upload_types`` and implement the six abstract hooks; the others have defaults."""

    name: ClassVar[str]
    upload_types: ClassVar[tuple[type[Message], ...]] = ()
    # Whether the method aggregates the agents' weights or updates (and so honours
    # [server] aggregation and clip_update_norm, cloud_server/robust/).
    aggregates_weights: ClassVar[bool] = False
    # The [server] dp_fedavg modes (cloud_server/privacy.py) this method's aggregation honours; a
    # method that reads the agents' individual updates for more than their mean (an ensemble sampled around them)
    # holds only for noise the agents add themselves.
    dp_fedavg_modes: ClassVar[tuple[str, ...]] = ("central", "client_clipping", "local")
    # Whether the server step is a weighted sum of the agents' models, so that secure aggregation
    # can stand in for it (shared_protocol.secagg.SUMMING_METHODS names these methods).
    sums_updates: ClassVar[bool] = False
    # How the coordinator runs this method's rounds (cloud_server/schedulers.py), read once
    # when the run starts: "sync" (every participant at once, one barrier per round),
    # "sequential" (agents take turns within a sync round, e.g. split learning; a late joiner
    # waits for the next round) or "async" (no barrier: each agent's round is completed on
    # its own). A method whose schedule is a config choice declares a property reading it.
    schedule: ClassVar[str] = "sync"
    # Whether every round is evaluated whatever [server] eval_every says (a method that needs
    # the agents' evaluation answers to run, e.g. validation losses that weigh teachers).
    evaluate_every_round: ClassVar[bool] = False
    # Whether the agents score model(s) on the run's global test set themselves
    # (cloud_server/evaluation.py): a model the method keeps private never leaves the device,
    # and a model that lives on the device is scored where it lives. Their evaluation requests
    # then name the set (EvalRequest.public_set). A method whose choice depends on its config
    # declares a property reading it.
    scores_on_device: ClassVar[bool] = False
    # Codec per tensor field of the messages the server sends, by message type
    # ({"round_start": {"weights": "fp16-zstd"}}); a type not named travels with its defaults.
    download_codecs: ClassVar[Mapping[str, Mapping[str, str]]] = {}

    def __init__(self, ctx: ServerContext, method_config: dict[str, Any]) -> None:
        self.ctx = ctx

    # -- the core ------------------------------------------------------------------- #

    @abstractmethod
    def welcome_settings(self) -> dict[str, Any]:
        """Fixed run settings every agent receives when it joins."""

    @abstractmethod
    def round_config(self, round_: int, agent: str, evaluate: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(RoundStart.config, RoundStart.weights) for one agent."""

    @abstractmethod
    def on_upload(self, agent: str, msg: Message) -> None:
        """Stage one upload message (one of ``upload_types``); raise a ProtocolError
        subclass to reject it."""

    @abstractmethod
    def complete(self, round_: int, ends: dict[str, RoundEnd], evaluate: bool) -> RoundOutcome:
        """Everything needed from ``ends``' agents has arrived: do the server's step."""

    @abstractmethod
    def evaluation(self, round_: int, reports: dict[str, EvalReport]) -> Evaluation:
        """The one evaluation hook (cloud_server/evaluation.py): for an evaluated round, after
        ``complete``, its downloads and the agents' answers to the evaluation request
        (``reports``, by agent; a split method's test activations went to ``on_upload``
        first), the deployed model(s) to score on the global test set and the agents' local
        figures. The evaluator scores; a method never computes a headline accuracy itself."""

    @abstractmethod
    def model_info(self) -> dict[str, Any]:
        """The models the run report's cost table shows: ``{role: {"name", "params",
        "train_flops_per_sample"} or None}`` (roles such as ``"edge"`` and ``"server"``)."""

    # -- optional hooks --------------------------------------------------------------- #

    def resolved_config(self) -> dict[str, Any]:
        """The method's config as the table it reads back from (reports, checkpoints).
        Default: ``self.config.to_table()``, or the fields of ``self.config`` (a dataclass)."""
        config = getattr(self, "config", None)
        if hasattr(config, "to_table"):
            return dict(config.to_table())
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return dataclasses.asdict(config)
        return {}

    def defences(self, rounds: int) -> dict[str, Any] | None:
        """The run report's ``defences`` (what protected the uploads, its parameters); None when
        nothing did. Default: the config's ``defences_report(rounds)``, where it has one."""
        report = getattr(getattr(self, "config", None), "defences_report", None)
        return report(rounds) if callable(report) else None

    def evaluation_downloads(self, round_: int, agent: str) -> list[Message]:
        """What ``agent`` needs, besides the round's downloads, to score its private model(s)
        on the global set itself (e.g. the server-side half of a split model), sent just before its
        :class:`~shared_protocol.messages.EvalRequest`; their bytes are evaluation's (such a
        message's ``for_evaluation`` is true). Default: nothing."""
        return []

    def discard(self, agent: str) -> None:
        """Forget what ``agent`` staged in its current round (it failed or timed out)."""

    def due_messages(self) -> list[tuple[str, Message]]:
        """What the method sends now, unasked, within an open round (agent, message): asked after
        every message the coordinator handles and at least once a second, so an exchange among the
        agents through the server (secure aggregation's stages) moves on when a stage is complete
        or its time is up. Default: nothing."""
        return []

    def secagg_report(self, round_: int) -> dict[str, Any]:
        """``{"secagg": figures}`` of ``round_``'s secure aggregation for its record's method
        section (cloud_server/secagg_server.py); empty when it is off."""
        return {}

    def end_round(self, round_: int) -> None:
        """``round_`` closed (after its evaluation, before its record and checkpoint): per-round
        bookkeeping that must not run per arrival, e.g. a learning-rate schedule stepped with the
        round's loss (async calls :meth:`complete` once per agent). Default: nothing."""

    def round_report(self, round_: int) -> dict[str, Any]:
        """Method-specific figures of ``round_`` for the run report (small, JSON-able:
        scalars, short lists, small dicts), stored as the round record's ``"method"``.

        Called when the round closes, after :meth:`complete` (and, async, after the
        last agent's ``complete`` of that round). Empty: nothing to add.
        """
        return {}

    def state(self) -> Any:
        """Checkpointable state (a tree of dicts, lists, scalars, tensors)."""
        return {}

    def load_state(self, state: Any) -> None:
        """Restore :meth:`state`."""


class StreamedUploads:
    """Mixin for a method whose agents stream an upload in numbered batches: it bounds
    their size and names the batches that never arrived, and the coordinator asks the
    agent for them (at most ``Coordinator.MAX_COMPLETION_REQUESTS`` times a round)."""

    def max_upload_bytes(self, agent: str) -> int | None:
        """The largest single message (frame bytes) ``agent`` may upload in a round, as far as
        the method knows now; None: it cannot say. The coordinator refuses a transfer on the
        agent's topic that declares more before holding any of it, and asks again at every
        round start, so a method may tighten its answer as it learns (e.g. from a first upload)."""
        return None

    def missing_uploads(self, agent: str, end: RoundEnd) -> list[Message]:
        """Called when ``agent`` says its round is done: the requests (to that agent) for the
        batches it says it sent that never arrived, holding its round open; empty when complete."""
        return []


class AnswersUploads:
    """Mixin for a method that answers some uploads at once, within the round (split
    learning answers every batch with the gradients): an upload of one of
    ``answered_types`` goes to :meth:`answer` instead of ``on_upload``, and the
    coordinator sends the answer to the agent."""

    answered_types: ClassVar[tuple[type[Message], ...]] = ()

    def answer(self, agent: str, msg: Message) -> Message | None:
        """Take one upload and return the message to send back (None: nothing to send);
        raise a ProtocolError subclass to reject it."""
        raise NotImplementedError
