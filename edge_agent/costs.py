"""What a round costs on this device: time by phase, FLOPs, memory, bytes.

Time is split into compute (training and feature extraction), encode (frame
encoding and compression), network (publishing until the broker acknowledged)
and idle (waiting for the server between rounds). Phases nest: time spent in an
inner phase (an upload sent from inside training) is the inner phase's only.

Samples and FLOPs are counted by the training loops, not by methods: the torch
loop (:func:`edge_agent.trainer.train_epochs`) calls :meth:`RoundMeter.trained` for
every step from what the method declares it trains, and forward passes outside
training (evaluation, feature extraction, a starting loss) go through
:meth:`RoundMeter.forward` with the model's per-sample figures from the shared
count (:func:`models.cost.cached_flops_per_sample`). No method multiplies FLOPs.
"""

from __future__ import annotations

import platform
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Protocol

from shared_protocol.records import AgentRoundCosts

from .deadline import RoundDeadline

PHASES = ("compute", "encode", "network", "idle")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if platform.system() == "Darwin" else peak * 1024)


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` memory figure (``VmHWM``, ``VmRSS``) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_rss() -> bool:
    """Set this process's peak RSS (``VmHWM``) back to its current RSS (Linux >= 4.0); True if it was."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RoundPeakRss:
    """Each round's own peak RSS: the most this process held since the previous :meth:`take`.

    ``ru_maxrss`` is the process's lifetime maximum: once the first rounds set it, a later
    round that holds more shows only as a new record and one that holds less not at all, so
    growth over a run hides behind it. Linux keeps the same high-water mark as ``VmHWM`` and
    lets a process reset it (``/proc/self/clear_refs``, value 5): :meth:`take` reads it and
    resets it, so each reading covers one round's cycle (its training and uploads, and the
    downloads and evaluation since the previous round ended). Where that is not possible (not
    Linux, or ``per_round`` False: several simulated agents share the process), the readings
    are the lifetime peak (:attr:`per_round` is False).
    """

    def __init__(self, per_round: bool = True) -> None:
        self.per_round = per_round and _status_bytes("VmHWM") is not None and reset_peak_rss()

    def take(self) -> int:
        """The peak since the previous call (or since construction), in bytes; starts the next window."""
        if not self.per_round:
            return peak_rss_bytes()
        peak = _status_bytes("VmHWM")
        if peak is None:  # /proc went away under us: keep reporting, as the lifetime figure
            self.per_round = False
            return peak_rss_bytes()
        reset_peak_rss()
        return peak


class SampleFlops(Protocol):
    """One model's FLOPs per sample (``models.FlopsPerSample`` is one; so is :class:`DeclaredFlops`)."""

    @property
    def training(self) -> int: ...  # forward + loss + backward

    @property
    def forward(self) -> int: ...  # one inference pass


@dataclass(frozen=True)
class DeclaredFlops:
    """Per-sample FLOPs counted elsewhere: the ort agent has no torch, so the server counts
    its model and says (``GktOrtArtifacts``)."""

    training: int = 0
    forward: int = 0


@dataclass
class RoundMeter:
    """Accumulates one round's costs."""

    seconds: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    train_flops: int = 0
    samples_trained: int = 0
    raw_bytes: int = 0  # tensor bytes before encoding
    encoded_bytes: int = 0  # after the codec
    deadline: RoundDeadline = field(default_factory=RoundDeadline)  # unbounded unless the round sets one
    _open: list[list] = field(default_factory=list, repr=False)  # [phase, since] of the phases entered, innermost last

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the enclosed time as ``name``'s, less what inner phases count (the same phase
        nested counts once)."""
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; known: {PHASES}")
        now = time.perf_counter()
        if self._open:  # the outer phase's time so far; it resumes when this one ends
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        entry = [name, now]
        self._open.append(entry)
        try:
            yield
        finally:
            now = time.perf_counter()
            self._open = [e for e in self._open if e is not entry]
            self.seconds[name] += now - entry[1]
            if self._open:
                self._open[-1][1] = now

    def trained(self, samples: int, flops_per_sample: int) -> None:
        """``samples`` went through a training step costing ``flops_per_sample`` each: called by
        the training loops (``edge_agent/trainer.py``, the ort backend's), not by methods."""
        self.samples_trained += samples
        self.train_flops += flops_per_sample * samples

    def forward(self, flops: SampleFlops, samples: int) -> None:
        """``samples`` forward passes, outside training, of the model whose per-sample figures
        ``flops`` are (evaluation, feature extraction): FLOPs, not trained samples."""
        self.train_flops += flops.forward * samples

    @property
    def codec_ratio(self) -> float:
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else 1.0

    def costs(
        self, *, round_s: float, peak_rss_bytes: int, before: Mapping[str, int], after: Mapping[str, int], codec: str,
        peak_rss_per_round: bool = True,
    ) -> AgentRoundCosts:
        """The round's costs for RoundEnd; ``before`` / ``after`` are the transport's
        byte counters (``TransportStats.snapshot()``) around the round."""
        return AgentRoundCosts(
            samples=self.samples_trained,
            train_flops=self.train_flops,
            compute_s=self.seconds["compute"],
            encode_s=self.seconds["encode"],
            network_s=self.seconds["network"],
            idle_s=self.seconds["idle"],
            round_s=round_s,
            peak_rss_bytes=peak_rss_bytes,
            peak_rss_per_round=peak_rss_per_round,
            payload_bytes_up=after["payload_bytes_out"] - before["payload_bytes_out"],
            wire_bytes_up=after["wire_bytes_out"] - before["wire_bytes_out"],
            payload_bytes_down=after["payload_bytes_in"] - before["payload_bytes_in"],
            wire_bytes_down=after["wire_bytes_in"] - before["wire_bytes_in"],
            codec=codec,
            codec_ratio=self.codec_ratio,
            skipped_batches=self.deadline.skipped_batches,
        )
