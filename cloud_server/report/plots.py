"""The report's PNG plots: accuracy per round, accuracy against cumulative bytes on
the wire, and the edge cost per round.

matplotlib is imported inside the functions, so importing the report package
stays cheap on the coordinator's start-up path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .formatting import EDGE_PHASES, GFLOP, cumulative_wire_mb, series

if TYPE_CHECKING:  # only for annotations; matplotlib is imported inside the plotting code
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PLOTS"]


def _new_figure(rows: int = 1, height: float = 4.2) -> tuple[Figure, list[Axes]]:
    # A bare Figure on an Agg canvas, not pyplot: no global figure registry to leak
    # from a long-running coordinator, and the host process's backend is untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    # Fixed margins rather than constrained layout: the figures have a known shape,
    # and layout solving doubles the time of a report written after every round.
    fig.subplots_adjust(left=0.13, right=0.97, bottom=0.6 / height, top=1 - 0.4 / height, hspace=0.12)
    return fig, list(axes)


def _note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4", fontsize=11)


def _integer_x(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _accuracy_axes(ax: Axes, x: np.ndarray, rounds: Sequence[Mapping[str, Any]]) -> None:
    """Global accuracy (the headline), local accuracy and the edge models' global accuracy
    (percent) against ``x``; a note if nothing was measured."""
    server, local, edge = (series(rounds, k) for k in ("accuracy", "local_accuracy", "edge_accuracy"))
    ax.set_ylabel("test accuracy (%)")
    ax.grid(True, alpha=0.3)
    measured = np.concatenate([v[~np.isnan(v)] for v in (server, local, edge)])
    if measured.size == 0:
        _note(ax, "no rounds yet" if x.size == 0 else "no accuracy measured yet")
        ax.set_ylim(0, 100)  # matplotlib's default 0..1 would read as fractions of a percent
        return
    for values, label, marker in ((server, "global: deployed model(s), global test set", "o"),
                                  (local, "local: same, agents' own test shards", "^"),
                                  (edge, "edge models on the devices, global test set", "s")):
        keep = ~np.isnan(values)
        if keep.any():
            # Only measured points: a round without evaluation is not a zero.
            ax.plot(x[keep], 100 * values[keep], marker=marker, markersize=4, label=label)
    low, high = 100 * measured.min(), 100 * measured.max()
    ax.set_ylim(max(0.0, low - 5), min(101.0, high + 5))
    ax.legend(loc="lower right")


def _plot_accuracy_vs_round(report: Mapping[str, Any]) -> Figure:
    rounds = report["rounds"]
    fig, (ax,) = _new_figure()
    x = np.array([r["round"] for r in rounds], dtype=np.float64)
    failed = [r["round"] for r in rounds if r["status"] != "ok"]
    for i, number in enumerate(failed):
        ax.axvspan(number - 0.5, number + 0.5, color="tab:red", alpha=0.12, label="failed quorum" if i == 0 else None)
    _accuracy_axes(ax, x, rounds)
    if failed and ax.get_legend() is None:
        ax.legend(loc="lower right")
    ax.set_xlabel("round")
    _integer_x(ax)
    ax.set_title(f"{report['run_id']} ({report['method']}): accuracy per round")
    return fig


def _plot_accuracy_vs_wire(report: Mapping[str, Any]) -> Figure:
    rounds = report["rounds"]
    fig, (ax,) = _new_figure()
    _accuracy_axes(ax, cumulative_wire_mb(rounds), rounds)
    ax.set_xlabel("cumulative MB on the wire (up + down)")
    ax.set_title(f"{report['run_id']} ({report['method']}): accuracy vs communication")
    return fig


def _plot_edge_cost(report: Mapping[str, Any]) -> Figure:
    rounds = report["rounds"]
    fig, (ax_flops, ax_time) = _new_figure(rows=2, height=6.0)
    ax_flops.set_title(f"{report['run_id']} ({report['method']}): edge cost per round")
    ax_flops.set_ylabel("edge train GFLOPs\n(sum over agents)")
    ax_time.set_ylabel("seconds per agent\n(mean over completed)")
    ax_time.set_xlabel("round")
    for ax in (ax_flops, ax_time):
        ax.grid(True, axis="y", alpha=0.3)
    if not rounds:
        for ax in (ax_flops, ax_time):
            _note(ax, "no rounds yet")
        return fig
    x = np.array([r["round"] for r in rounds], dtype=np.float64)
    ax_flops.bar(x, [r["edge_train_flops"] / GFLOP for r in rounds], width=0.7, color="tab:purple")
    bottom = np.zeros(len(rounds))
    for phase, color in zip(EDGE_PHASES, ("tab:blue", "tab:orange", "tab:green", "0.75")):
        seconds = np.array([r["time_s"][f"edge_{phase}"] for r in rounds], dtype=np.float64)
        ax_time.bar(x, seconds, width=0.7, bottom=bottom, label=phase, color=color)
        bottom += seconds
    if bottom.max() > 0:
        ax_time.set_ylim(0, 1.3 * bottom.max())  # headroom so the legend never covers a bar
    ax_time.legend(loc="upper left", ncols=4, fontsize=8)
    _integer_x(ax_time)
    return fig



# Name in REPORT_FILES -> the function that draws it.
PLOTS: dict[str, Callable[[Mapping[str, Any]], "Figure"]] = {
    "accuracy_vs_round": _plot_accuracy_vs_round,
    "accuracy_vs_wire_mb": _plot_accuracy_vs_wire,
    "edge_cost": _plot_edge_cost,
}
