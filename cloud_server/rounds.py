"""An open round's record and what a round scheduler may ask of the coordinator.

:class:`OpenRound` is what the coordinator and the scheduler know of a round while it
is open (participants, who finished or missed it, its deadline, the evaluation
awaited); :class:`RoundHost` is the whole of the coordinator a scheduler
(:mod:`cloud_server.schedulers`) sees: open and close a round, start an agent's round,
send, and hand the method what arrived. :class:`HookClock` is how the coordinator
times the method's hooks, round by round.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from shared_protocol.messages import EvalReport, Message, RoundEnd

from .methods import RoundOutcome

if TYPE_CHECKING:
    from .records import RoundRecord

__all__ = ["HookClock", "OpenRound", "RoundHost"]


@dataclass
class OpenRound:
    round: int
    evaluate: bool
    started_at: float
    deadline_at: float = math.inf  # monotonic time at which the round closes whoever is missing
    participants: set[str] = field(default_factory=set)
    done: dict[str, RoundEnd] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    outcomes: list[RoundOutcome] = field(default_factory=list)
    resend_requests: dict[str, int] = field(default_factory=dict)  # per agent: incomplete uploads asked again
    # Evaluation (cloud_server/evaluation.py): agents asked to evaluate the round, each with the
    # monotonic time its report is awaited until, and the reports that came.
    eval_requested: dict[str, float] = field(default_factory=dict)
    eval_reports: dict[str, EvalReport] = field(default_factory=dict)

    def eval_waiting(self) -> list[str]:
        """Agents asked to evaluate the round whose report has not come and is still awaited."""
        now = time.monotonic()
        return sorted(a for a, until in self.eval_requested.items() if a not in self.eval_reports and now < until)

    def waiting_for(self) -> list[str]:
        return sorted(a for a in self.participants if a not in self.done and a not in self.missing)

    def time_left_s(self) -> float:
        return self.deadline_at - time.monotonic()


class HookClock:
    """The seconds the server spends in a method's hooks, by round and hook. The coordinator
    times every call it makes (``round_config``, ``on_upload`` / ``answer``, ``complete``,
    ``evaluation``, ``end_round``), so a round's record says what the method cost the server
    (``server_hooks_s``) whether or not the method times anything itself."""

    def __init__(self) -> None:
        self._seconds: dict[int, dict[str, float]] = {}
        # (round, what, monotonic start) of the work the server is in now, for a progress line
        # from another thread (a tuple, swapped whole: no lock needed to read it)
        self._current: tuple[int, str, float] | None = None

    @contextmanager
    def timing(self, round_: int, hook: str) -> Iterator[None]:
        """Count the enclosed call to ``hook`` as ``round_``'s, whether it returns or raises."""
        started = time.perf_counter()
        try:
            with self.phase(round_, hook):
                yield
        finally:
            spent = self._seconds.setdefault(round_, {})
            spent[hook] = spent.get(hook, 0.0) + time.perf_counter() - started

    @contextmanager
    def phase(self, round_: int, what: str) -> Iterator[None]:
        """Say that the server is in ``what`` (a hook's name, or other work such as scoring) for
        ``round_`` while the block runs; not timed."""
        outer, self._current = self._current, (round_, what, time.monotonic())
        try:
            yield
        finally:
            self._current = outer

    def current(self) -> tuple[int, str, float] | None:
        """(round, what, monotonic start) of the server's work now, or None between works."""
        return self._current

    def take(self, round_: int) -> dict[str, float]:
        """``round_``'s seconds by hook (empty when none ran); forgets them."""
        return self._seconds.pop(round_, {})


class RoundHost(Protocol):
    """What a scheduler may ask of the coordinator: the whole of it."""

    @property
    def open_rounds(self) -> Mapping[int, OpenRound]:
        """The rounds open now, by number (read-only: opened and closed through the host)."""

    @property
    def completed_round(self) -> int:
        """The last round closed (0: none yet)."""

    def open_round(self, round_: int) -> OpenRound:
        """Round ``round_``, opened now with this scheduler's deadline if it is not open yet."""

    def start_agent_round(self, agent: str, round_: int) -> None:
        """Make ``agent`` a participant of ``round_`` (opened if need be) and send its RoundStart."""

    def close_round(self, rnd: OpenRound, status: str) -> RoundRecord:
        """Evaluate (an evaluated round that is ok), record and checkpoint ``rnd``; it is no longer open."""

    def send(self, agent: str | None, msg: Message) -> None:
        """Send ``msg`` to ``agent`` (None: every agent), its bytes counted to its round."""

    def discover(self, agent: str | None, round_: int) -> None:
        """Ask ``agent`` (None: every agent) to announce itself."""

    def request_evaluation(self, rnd: OpenRound, agents: list[str], wait_s: float | None = None) -> None:
        """Ask ``agents`` to evaluate ``rnd``; their reports are awaited until its deadline or ``wait_s``."""

    def complete(self, rnd: OpenRound, ends: dict[str, RoundEnd]) -> RoundOutcome:
        """Hand the method what ``ends``' agents sent in ``rnd``: its server step."""

    def discard(self, agent: str) -> None:
        """Have the method forget what ``agent`` staged in its current round."""

    def pump(self, timeout_s: float) -> None:
        """Receive and handle at most one inbound message."""

    def backlog(self) -> int:
        """Messages received but not handled yet."""
