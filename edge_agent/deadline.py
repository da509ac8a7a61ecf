"""A round's time budget on the agent: the RoundStart's ``deadline_s`` says how long the
server still waits for this agent's part of the round (the rest of the round's one
deadline, counted from when the RoundStart was sent). Training that cannot finish by
then is skipped, a batch at a time, rather than done for a round the server has already
closed; the agent reports how many batches it skipped (RoundEnd ``costs.skipped_batches``)."""

from __future__ import annotations

import math
import time
from typing import Callable, Generic, Iterable, Iterator, Sized, TypeVar

Batch = TypeVar("Batch")


class RoundDeadline:
    """When this round's training has to stop, and what was skipped to meet it.

    Training may use the budget minus a reserve (``RESERVE_FRACTION`` of it) for what
    follows it in a round: uploading, evaluation, the round_end. A batch starts only if
    the mean time of the batches before it still fits; the first batch of a round always
    runs, so every round reports trained figures.
    """

    RESERVE_FRACTION = 0.2

    def __init__(self, deadline_s: float = math.inf, clock: Callable[[], float] = time.monotonic) -> None:
        if not deadline_s >= 0:  # also refuses NaN
            raise ValueError(f"deadline_s must be >= 0, got {deadline_s}")
        self.clock = clock
        self.deadline_s = deadline_s
        self.train_until = clock() + deadline_s * (1.0 - self.RESERVE_FRACTION)
        self.trained_batches = 0
        self.skipped_batches = 0
        self._trained_s = 0.0

    def time_left_s(self) -> float:
        """Seconds left for training (may be negative: past the training budget)."""
        return self.train_until - self.clock()

    def allows_next_batch(self) -> bool:
        if self.trained_batches == 0:
            return True
        left_s = self.time_left_s()
        return left_s > 0 and self._trained_s / self.trained_batches <= left_s

    def record_batch(self, seconds: float) -> None:
        self.trained_batches += 1
        self._trained_s += seconds

    def batches(self, loader: Iterable[Batch], length: int | None = None) -> "DeadlineBatches[Batch]":
        """``loader`` for the trainer, stopping at the first batch that would not fit; may be
        iterated once per epoch (every later epoch's batches are skipped too)."""
        return DeadlineBatches(loader, self, length)


class DeadlineBatches(Generic[Batch]):
    """A loader bounded by a :class:`RoundDeadline`; keeps ``len`` (progress bars)."""

    def __init__(self, loader: Iterable[Batch], deadline: RoundDeadline, length: int | None = None) -> None:
        self.loader = loader
        self.deadline = deadline
        self.length = length  # for a loader without len (a generator): how many batches it yields

    def __len__(self) -> int:
        if self.length is not None:
            return self.length
        return len(self.loader) if isinstance(self.loader, Sized) else 0

    def __iter__(self) -> Iterator[Batch]:
        deadline, seen = self.deadline, 0
        for batch in self.loader:
            if not deadline.allows_next_batch():
                break
            started = deadline.clock()
            seen += 1
            yield batch
            deadline.record_batch(deadline.clock() - started)  # the trainer's step on this batch
        else:
            return
        # Stopped early: this epoch's remaining batches are skipped.
        deadline.skipped_batches += max(0, len(self) - seen)
