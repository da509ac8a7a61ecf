"""The defences' price beside their leakage, in the docs: docs/privacy.md's generated table and
README's column, from every defence experiment's results (``bench/results/defences_*.json``,
the experiment runner's schema).

Each defence is a variant of its experiment; its price is read against the same experiment's
``default`` variant of the same method (same data, seeds, rounds and evaluation): global
accuracy, edge FLOPs and bytes up beside the strongest attack's PSNR over the mean image's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cloud_server.experiments.results import load_results
from cloud_server.experiments.tables import long_table, summary

__all__ = ["PRIVACY_BEGIN", "PRIVACY_END", "decision_section", "defence_rows", "load_defences", "privacy_block", "readme_defence_cell",
           "secagg_section", "update_privacy_page"]

PRIVACY_BEGIN = "<!-- defences: rendered from bench/results/defences_*.json by bench/render_results.py. Do not edit by hand. -->"
PRIVACY_END = "<!-- end of the defences -->"

Row = dict[str, Any]


def load_defences(results_dir: Path) -> dict[str, Mapping[str, Any]]:
    """Experiment name -> its results, for every ``defences_*.json`` of the runner's schema.
    When an experiment and its ``_small`` version both exist, the fuller one is kept."""
    found = {}
    for path in sorted(results_dir.glob("defences_*.json")):
        data = load_results(path)
        if data is not None and "cells" in data:
            found[path.stem] = data
    for name in list(found):
        if name.endswith("_small") and name[: -len("_small")] in found:
            del found[name]
    return found


def _mean(stat: Mapping[str, Any] | None) -> float | None:
    return None if stat is None else stat.get("mean")


def defence_rows(experiments: Mapping[str, Mapping[str, Any]]) -> list[Row]:
    """One row per experiment x method x variant with done cells: the figures (mean, sd, n over
    the seeds) and, beside the method's ``default`` variant of the same experiment on the same
    seeds, the differences (accuracy points, dB, bytes and FLOPs ratios)."""
    rows: list[Row] = []
    for name, results in experiments.items():
        cells = [r for r in long_table(results) if r["status"] == "done"]
        defaults = {(r["method"], r["partition"], r["seed"]): r for r in cells if r["variant"] == "default"}
        for g in summary(long_table(results)):
            seeds = {r["seed"] for r in cells if (r["method"], r["partition"], r["variant"]) == (g["method"], g["partition"], g["variant"])}
            base = [defaults[(g["method"], g["partition"], s)] for s in sorted(seeds) if (g["method"], g["partition"], s) in defaults]

            def base_mean(figure: str) -> float | None:
                values = [r[figure] for r in base if r.get(figure) is not None]
                return sum(values) / len(values) if values else None

            def paired_mean(figure: str) -> float | None:
                values = [r[figure] for r in cells if r["seed"] in {b["seed"] for b in base} and r.get(figure) is not None
                          and (r["method"], r["partition"], r["variant"]) == (g["method"], g["partition"], g["variant"])]
                return sum(values) / len(values) if values else None

            def difference(figure: str) -> float | None:
                mine, theirs = paired_mean(figure), base_mean(figure)
                return None if mine is None or theirs is None else mine - theirs

            def ratio(figure: str) -> float | None:
                mine, theirs = paired_mean(figure), base_mean(figure)
                return None if mine is None or not theirs else mine / theirs

            points = difference("final_accuracy")
            rows.append({
                "experiment": name, "method": g["method"], "partition": g["partition"], "variant": g["variant"], "n": g["n"],
                "accuracy": g["final_accuracy"], "psnr": g["leakage_psnr_db"], "baseline_psnr": g["leakage_baseline_psnr_db"],
                "gain_db": g["leakage_gain_db"], "up_bytes": _mean(g["train_up_wire_bytes"]),
                "gflops": _mean(g["edge_train_gflops_per_agent"]),
                "epsilon": next((_mean(g[k]) for k in ("activation_epsilon_per_image", "dp_fedavg_epsilon", "dpsgd_epsilon")
                                 if _mean(g.get(k)) is not None), None),
                "paired_seeds": len(base),
                "accuracy_points": None if points is None else 100 * points,
                "gain_change_db": difference("leakage_gain_db"),
                "up_ratio": ratio("train_up_wire_bytes"), "flops_ratio": ratio("edge_train_gflops_per_agent"),
            })
    return rows


def _pm(stat: Mapping[str, Any] | None, scale: float = 1.0, digits: int = 1) -> str:
    if stat is None or stat.get("mean") is None:
        return "—"
    text = f"{stat['mean'] * scale:.{digits}f}"
    return text + (f" ± {stat['sd'] * scale:.{digits}f}" if stat.get("sd") is not None else "")


def _signed(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "—" if value is None else f"{value:+.{digits}f}{suffix}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def privacy_block(rows: Sequence[Row]) -> list[str]:
    """docs/privacy.md's generated table between :data:`PRIVACY_BEGIN` and :data:`PRIVACY_END`."""
    lines = [PRIVACY_BEGIN, ""]
    if not rows:
        lines += ["No defence is measured yet: `edgesplit bench run bench/experiments/defences_activations_small.toml` "
                  "(and `defences_dp.toml`), then `python bench/render_results.py`.", "", PRIVACY_END]
        return lines
    lines += ["| Method | Variant | Experiment | Seeds | Accuracy (points) | Over mean image (dB) | ε | Bytes up |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["variant"] == "default":
            continue  # the undefended runs: the rows' reference, in the experiment's own section of results.md
        eps = "—" if r["epsilon"] is None else f"{r['epsilon']:.3g}"
        lines.append(f"| `{r['method']}` | {r['variant']} | {r['experiment']} | {r['paired_seeds']} | "
                     f"{_signed(r['accuracy_points'])} | {_signed(r['gain_change_db'])} | {eps} | {_ratio(r['up_ratio'])} |")
    lines += ["", "Each defence against its experiment's undefended runs of the same method on the seeds both have (Seeds), mean "
              "over them: the change in global accuracy, in what the strongest attack rebuilds over guessing the mean image, "
              "and the bytes up as a multiple; ε per image for noised maps, per run for DP. The runs themselves: "
              "[results.md](results.md#what-each-activation-defence-leaves-the-server-and-what-it-costs) and the "
              "sections after it.", "", PRIVACY_END]
    return lines


#: The README names the least-leaking defence among those that cost at most this many points of accuracy.
ACCURACY_BUDGET_POINTS = 20.0


def readme_defence_cell(rows: Sequence[Row], method: str) -> str:
    """README's cell: of the measured defences that cost at most :data:`ACCURACY_BUDGET_POINTS` of
    accuracy, the one that leaves the least over the mean image, with its accuracy beside the
    undefended one's, and the one that leaves the least at any cost where that is another (none
    within the budget: said); for a method without an image attack, the one that costs the least
    accuracy."""
    mine = [r for r in rows if r["method"] == method and r["variant"] != "default"]
    if not mine:
        return "not measured yet"
    several = len({r["experiment"] for r in mine}) > 1
    if several:
        # A defence measured in several experiments: the one with the most seeds paired with its
        # undefended runs; between equals, a full experiment over its `_small` version.
        best: dict[str, Row] = {}
        for r in mine:
            rank = (r["paired_seeds"], not r["experiment"].endswith("_small"))
            kept = best.get(r["variant"])
            if kept is None or rank > (kept["paired_seeds"], not kept["experiment"].endswith("_small")):
                best[r["variant"]] = r
        mine = list(best.values())

    def named(r: Row) -> str:
        seeds = r["paired_seeds"]
        return f"{r['variant']} ({r['experiment']}, {seeds} seed{'' if seeds == 1 else 's'})" if several else r["variant"]

    attacked = [r for r in mine if r["gain_db"] is not None and r["gain_db"].get("mean") is not None]
    if attacked:
        def said(r: Row) -> str:
            return f"{named(r)}: {r['gain_db']['mean']:.1f} dB over the mean image, accuracy {_signed(r['accuracy_points'])} points"

        affordable = [r for r in attacked if r["accuracy_points"] is not None
                      and r["accuracy_points"] >= -ACCURACY_BUDGET_POINTS]
        least = min(attacked, key=lambda r: r["gain_db"]["mean"])
        if not affordable:
            return f"none within {ACCURACY_BUDGET_POINTS:.0f} points of accuracy; the least left: {said(least)}"
        best = min(affordable, key=lambda r: r["gain_db"]["mean"])
        return said(best) if best is least else f"{said(best)}; the least left: {said(least)}"
    cheapest = max(mine, key=lambda r: -math.inf if r["accuracy_points"] is None else r["accuracy_points"])
    return f"{named(cheapest)}: accuracy {_signed(cheapest['accuracy_points'])} points"


def update_privacy_page(path: Path, rows: Sequence[Row]) -> bool:
    """Rewrite the generated table in ``path`` (docs/privacy.md); True if it changed."""
    text = path.read_text()
    if PRIVACY_BEGIN not in text or PRIVACY_END not in text:
        raise ValueError(f"{path} has no table of defences between {PRIVACY_BEGIN!r} and {PRIVACY_END!r}")
    start, end = text.index(PRIVACY_BEGIN), text.index(PRIVACY_END) + len(PRIVACY_END)
    updated = text[:start] + "\n".join(privacy_block(rows)) + text[end:]
    if updated != text:
        path.write_text(updated)
    return updated != text


def secagg_section(data: Mapping[str, Any] | None) -> list[str]:
    """``bench/results/secagg.json`` on the results page: secure aggregation's cost per round
    (the protocol alone) at each number of agents, with and without an agent dropping after it
    shared its keys; mean over the repeats."""
    if data is None:
        return ["*`bench/results/secagg.json` not found: run `bench/secagg.py`.*", ""]
    groups: dict[tuple[int, int], list[Mapping[str, Any]]] = {}
    for cell in data["cells"]:
        if cell["status"] == "done":
            groups.setdefault((cell["agents"], cell["dropped"]), []).append(cell)

    def mean(rows: Sequence[Mapping[str, Any]], key: str) -> float:
        return sum(float(r[key]) for r in rows) / len(rows)

    params = data["params"]
    lines = ["### Secure aggregation's cost", "",
             f"Pairwise masking with dropout recovery (`[server] secure_aggregation`, [privacy.md](privacy.md#secure-aggregation)) "
             f"on an update of {data['model']}'s {data['update_entries']:,} entries (a plain zstd FedAvg upload of it: "
             f"{data['plain_update_bytes'] / 1e3:.1f} kB), ring of {params['ring_bits']} bits; {data['note']}. "
             "From `bench/secagg.py`, `bench/results/secagg.json`; mean over the repeats.", "",
             "| Agents | Dropped after sharing keys | Round s | Server unmask s | kB up per agent | MB up (wire) | MB down (wire) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (agents, dropped), rows in sorted(groups.items()):
        lines.append(f"| {agents} | {dropped} | {mean(rows, 'round_s'):.2f} | {mean(rows, 'server_unmask_s'):.3f} | "
                     f"{mean(rows, 'frame_bytes_per_agent_up') / 1e3:.1f} | {mean(rows, 'wire_bytes_up') / 1e6:.2f} | "
                     f"{mean(rows, 'wire_bytes_down') / 1e6:.2f} |")
    return lines + [""]


def decision_section(leakage: Mapping[str, Any] | None, defences: Sequence[Row]) -> list[str]:
    """The results page's opening table: every method on one setting (the leakage experiment's:
    the same data, agents, seeds, rounds and evaluation for all), with what a device pays
    (edge FLOPs, bytes up per round, peak memory), what the server can rebuild, and the measured
    defence that leaves the least."""
    lines = ["## Which method: the decision table", ""]
    if leakage is None:
        return lines + ["*`bench/results/leakage.json` not found: run `edgesplit bench run bench/experiments/leakage.toml`.*", ""]
    scale = leakage["experiment"].get("scale", {})
    agents, rounds = scale.get("agents") or 1, scale.get("rounds") or 1
    groups = summary(long_table(leakage))

    def cell(stat: Mapping[str, Any] | None, factor: float, digits: int) -> str:
        return _pm(stat, factor, digits)

    lines += [f"Every registered method at its defaults, {agents} agents, {rounds} rounds, "
              f"{scale.get('train_samples', 0):,} {scale.get('dataset', '')} training images (Dirichlet {leakage['experiment'].get('partitions', ['?'])[0].split(':')[-1]}), "
              "the same seeds and evaluation for every row (`bench/experiments/leakage.toml`). A few rounds: accuracy ranks how "
              "fast each method learns; the studies below say where each ends. \"Over mean image\": what the server's strongest "
              "attack rebuilds beyond guessing the mean image (0: nothing; —: no image attack ran). Defences: "
              "[privacy.md](privacy.md).", "",
              "| Method | n | Global acc. % | Edge GFLOPs / agent (run) | MB up / agent / round | Peak agent RSS MB | "
              "Over mean image dB | Its best measured defence |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for g in groups:
        up = g["train_up_wire_bytes"]
        per_round = None if up["mean"] is None else {"mean": up["mean"] / agents / rounds,
                                                      "sd": None if up["sd"] is None else up["sd"] / agents / rounds}
        lines.append(f"| `{g['method']}` | {g['n']} | {cell(g['final_accuracy'], 100, 1)} | "
                     f"{cell(g['edge_train_gflops_per_agent'], 1, 0)} | {cell(per_round, 1e-6, 2)} | "
                     f"{cell(g['peak_agent_rss_bytes'], 1e-6, 0)} | {cell(g['leakage_gain_db'], 1, 1)} | "
                     f"{readme_defence_cell(defences, g['method'])} |")
    return lines + [""]
