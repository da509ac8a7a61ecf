"""A console line while the server works long on a round: what it is doing and for how long.

A round's work on the server (training on the uploads, aggregating, distilling, scoring) can
take minutes on a CPU, while the agents wait and nothing else is printed. :class:`PhaseTicker`
watches :meth:`cloud_server.rounds.HookClock.current` from a thread of its own and prints a line
every ``interval_s`` while one piece of work lasts longer than that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .rounds import HookClock

__all__ = ["PHASE_WORDS", "PhaseTicker", "describe_phase"]

#: What each piece of the server's work is, in words (the method's hooks and the scoring).
PHASE_WORDS = {
    "round_config": "preparing the round",
    "on_upload": "taking the uploads",
    "answer": "answering the uploads",
    "complete": "working on the round's uploads (training, aggregating or distilling)",
    "evaluation": "preparing the evaluation",
    "scoring": "scoring the models on the global test set",
    "end_round": "closing the round",
}


def describe_phase(what: str) -> str:
    return PHASE_WORDS.get(what, what)


class PhaseTicker:
    """Prints ``round R/N: server <work>, <s> s so far`` every ``interval_s`` while one piece
    of work lasts (0 or less: never starts)."""

    def __init__(self, clock: HookClock, total_rounds: int, interval_s: float,
                 emit: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        self.clock, self.total_rounds, self.interval_s, self.emit = clock, total_rounds, interval_s, emit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PhaseTicker":
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="phase-ticker", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _watch(self) -> None:
        seen: tuple[int, str, float] | None = None
        next_at = self.interval_s
        while not self._stop.wait(min(1.0, self.interval_s)):
            current = self.clock.current()
            if current != seen:
                seen, next_at = current, self.interval_s
            if current is None:
                continue
            round_, what, started = current
            elapsed = time.monotonic() - started
            if elapsed >= next_at:
                self.emit(f"round {round_}/{self.total_rounds}: server {describe_phase(what)}, {elapsed:.0f} s so far")
                next_at += self.interval_s
