"""When an agent's per-round peak memory counts as growing, for the agent's log and the server's report.

An agent reports each round's own peak RSS (``AgentRoundCosts.peak_rss_bytes``:
the most the process held since the previous round ended, see
``edge_agent.costs.RoundPeakRss``). A peak that rises round after round is what a
leak, a cache that fills or a fragmenting heap look like from outside, and what
a device with little headroom learns only hours into a run; one higher round is
not (the second round holds the server's logits the first did not, an
evaluation batch may be larger). So both sides say so when the peak rose by more
than :data:`PEAK_GROWTH_MIN_FRACTION` :data:`PEAK_GROWTH_ROUNDS` rounds in a
row, with the same rule (:func:`growing_since`).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PEAK_GROWTH_MIN_FRACTION", "PEAK_GROWTH_ROUNDS", "growing_since", "growth_message", "rising_run_start"]

#: A round's peak counts as growth when it exceeds the previous round's by more than this
#: fraction: well above the round-to-round noise of a steady agent once warm (the long runs
#: of bench/results/footprint.json, ``test_long_run``).
PEAK_GROWTH_MIN_FRACTION = 0.01
#: Growth this many rounds in a row is reported.
PEAK_GROWTH_ROUNDS = 3


def _grew(before: int, after: int) -> bool:
    return before > 0 and after > before * (1.0 + PEAK_GROWTH_MIN_FRACTION)


def rising_run_start(peaks: Sequence[int]) -> int:
    """The index in ``peaks`` where the run of growing rounds that ends at the last one begins
    (the last index when the last round did not grow)."""
    start = len(peaks) - 1
    while start > 0 and _grew(peaks[start - 1], peaks[start]):
        start -= 1
    return max(start, 0)


def growing_since(peaks: Sequence[int]) -> int | None:
    """The index in ``peaks`` (one per round, oldest first) where the growth that reaches the
    last round began, if the peak grew at least :data:`PEAK_GROWTH_ROUNDS` times in a row up
    to the last round; None otherwise.

    >>> growing_since([315, 328, 339, 352])
    0
    >>> growing_since([315, 328, 339, 339]) is None
    True
    """
    start = rising_run_start(peaks)
    return start if len(peaks) - 1 - start >= PEAK_GROWTH_ROUNDS else None


def growth_message(rounds: Sequence[int], peaks: Sequence[int]) -> str:
    """One line naming the rounds and peaks of a growth :func:`growing_since` found."""
    steps = len(peaks) - 1
    shown = " -> ".join(f"{p / 1e6:.0f}" for p in peaks)
    return (f"peak RSS grew {steps} rounds in a row (rounds {rounds[0]}-{rounds[-1]}: {shown} MB, "
            f"+{(peaks[-1] - peaks[0]) / 1e6:.0f} MB): memory is not flat over rounds (a leak, a filling cache "
            f"or a fragmenting heap); see docs/deploy.md#memory-on-the-device")
