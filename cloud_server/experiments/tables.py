"""Collected results as tables, claims and plots, the same for every experiment.

- :func:`long_table`: one row per cell, its figures flat (``leakage_*`` for the strongest attack);
- :func:`summary`: per method x partition x variant, mean, sd and n over the seeds of every figure;
- :func:`evaluate_claims`: each claim of the experiment met, not met, or without data;
- :func:`summary_md`, :func:`claims_md`, :func:`long_md`: markdown; :func:`compact_md` and
  :func:`claims_summary_md` the shorter forms the results page shows; :func:`setting_md` the
  experiment's setting, from its recorded spec;
- :func:`plot`: accuracy against bytes up and, where audited, against the strongest attack's PSNR;
- :func:`curves`, :func:`curves_md`, :func:`plot_curves`: per round, accuracy against what it has cost so far;
- :func:`render`: an experiment's template (``NAME.md``, ``{{table}}``, ``{{plot}}``...) filled in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .results import LEAKAGE_FIGURES, OPTIONAL_RUN_FIGURES, RUN_FIGURES, RUN_SERIES
from .spec import CLAIM_OPERATORS, Claim

__all__ = ["claims_md", "claims_summary_md", "compact_md", "curves", "curves_md", "evaluate_claims", "long_md", "long_table",
           "pivot_md", "plot", "render", "setting_md", "summary", "summary_md", "unattacked_md"]

Row = dict[str, Any]
GROUP = ("method", "partition", "variant")
#: The summary's markdown columns: (figure, header, scale, decimals).
SUMMARY_COLUMNS = (
    ("final_accuracy", "Global acc. %", 100, 1), ("best_accuracy", "Best global %", 100, 1),
    ("local_accuracy", "Local acc. %", 100, 1), ("personalised_accuracy", "Personalised %", 100, 1),
    ("edge_train_gflops_per_agent", "Edge GFLOPs / agent", 1, 1), ("train_up_wire_bytes", "Up MB (wire)", 1e-6, 2),
    ("train_down_wire_bytes", "Down MB (wire)", 1e-6, 2), ("peak_agent_rss_bytes", "Peak agent RSS MB", 1e-6, 0),
    ("leakage_psnr_db", "Strongest attack PSNR dB", 1, 1), ("leakage_baseline_psnr_db", "Baseline PSNR dB", 1, 1),
    ("leakage_gain_db", "Over baseline dB", 1, 1),
    ("leakage_label_error", "Label histogram error", 1, 2),
    ("leakage_label_baseline_error", "Uniform guess's error", 1, 2),
    ("dp_fedavg_epsilon", "DP-FedAvg ε", 1, 2), ("dpsgd_epsilon", "DP-SGD ε", 1, 2),
    ("activation_epsilon_per_image", "Maps ε / image", 1, 1),
    ("agents_warned_against_peers", "Agents warned against", 1, 1),
)
#: Columns shown only where some group's mean is not zero (a warning no run gave says nothing).
_NONZERO_COLUMNS = ("agents_warned_against_peers",)
#: The timing table's columns (``{{timing}}``): where a run's time and upload bytes go per round.
TIMING_COLUMNS = (
    ("run_wall_s", "Run s", 1, 0), ("round_s_per_round", "Round s", 1, 1),
    ("server_train_s_per_round", "Server training s / round", 1, 1),
    ("server_eval_s_per_round", "Server evaluation s / round", 1, 1),
    ("server_eval_over_train", "Evaluation ÷ training", 1, 2),
    ("up_wire_bytes_first_round", "Up MB, round 1", 1e-6, 2),
    ("up_wire_bytes_per_later_round", "Up MB, later rounds", 1e-6, 2),
    ("agent_idle_share", "Agents idle %", 100, 1),
    ("final_accuracy", "Global acc. %", 100, 1),
)
#: The screen's table (``{{robustness}}``): what the server refused and judged, the faulty agents apart.
ROBUSTNESS_COLUMNS = (
    ("final_accuracy", "Global acc. %", 100, 1), ("honest_accuracy", "Honest agents' acc. %", 100, 1),
    ("rounds", "Rounds done", 1, 0), ("honest_refused_uploads", "Honest uploads refused", 1, 0), ("faulty_refused_uploads", "Faulty uploads refused", 1, 0),
    ("faulty_unused_rounds", "Rounds faulty unused", 1, 0),
    ("honest_min_cosine", "Honest min cosine", 1, 3), ("faulty_max_cosine", "Faulty max cosine", 1, 3),
    ("honest_max_validation_rise", "Honest max rise (nats)", 1, 2),
    ("faulty_min_validation_rise", "Faulty min finite rise (nats)", 1, 2),
    ("honest_min_label_agreement", "Honest min label agreement", 1, 2),
    ("faulty_max_label_agreement", "Faulty max label agreement", 1, 2),
)

#: Every column a template may name in ``{{table:figure,...}}`` (:func:`compact_md`).
COLUMNS = {c[0]: c for c in (*SUMMARY_COLUMNS, *TIMING_COLUMNS, *ROBUSTNESS_COLUMNS)}


def long_table(results: Mapping[str, Any]) -> list[Row]:
    """One row per cell: its key, method, partition, variant, seed, status, wall time and figures."""
    rows = []
    for cell in results["cells"]:
        row: Row = {k: cell[k] for k in ("key", "method", "partition", "variant", "seed", "status", "wall_s")}
        row.update({k: (cell["run"] or {}).get(k) for k in (*RUN_FIGURES, *OPTIONAL_RUN_FIGURES, *RUN_SERIES)})
        strongest = (cell.get("leakage") or {}).get("strongest") or {}
        row["leakage_attack"] = strongest.get("attack")
        row.update({f"leakage_{k}": strongest.get(k) for k in ("psnr_db", "ssim", "baseline_psnr_db", "baseline_ssim")})
        row["leakage_gain_db"] = (strongest["psnr_db"] - strongest["baseline_psnr_db"]) if strongest else None
        labels = [a for a in ((cell.get("leakage") or {}).get("attacks") or {}).values() if "histogram_error" in a]
        best = min(labels, key=lambda a: a["histogram_error"], default={})
        row["leakage_label_error"] = best.get("histogram_error")
        row["leakage_label_baseline_error"] = best.get("baseline_histogram_error")
        rows.append(row)
    return rows


def _mean_sd(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return mean, sd


def summary(rows: Sequence[Row]) -> list[Row]:
    """Per method x partition x variant (in the rows' order): ``n`` done seeds and, per figure,
    ``{"mean", "sd", "n", "by_seed"}`` over the seeds that measured it (sd: sample sd, None for one seed)."""
    groups: dict[tuple[str, ...], list[Row]] = {}
    for row in rows:
        if row["status"] == "done":
            groups.setdefault(tuple(row[k] for k in GROUP), []).append(row)
    out = []
    for group, members in groups.items():
        entry: Row = {**dict(zip(GROUP, group)), "n": len(members), "seeds": [m["seed"] for m in members]}
        for figure in (*RUN_FIGURES, *OPTIONAL_RUN_FIGURES, *LEAKAGE_FIGURES):
            by_seed = {m["seed"]: m[figure] for m in members if m.get(figure) is not None}
            mean, sd = _mean_sd(list(by_seed.values()))
            entry[figure] = {"mean": mean, "sd": sd, "n": len(by_seed), "by_seed": by_seed}
        out.append(entry)
    return out


def _paired(group: Row, baseline: Row | None, figure: str) -> tuple[float | None, float | None]:
    """The mean and sd of ``group``'s figure minus ``baseline``'s, over the seeds both measured."""
    if baseline is None:
        return None, None
    mine, theirs = group.get(figure, {}).get("by_seed", {}), baseline.get(figure, {}).get("by_seed", {})
    return _mean_sd([mine[seed] - theirs[seed] for seed in mine if seed in theirs])


def evaluate_claims(claims: Sequence[Claim], summary_rows: Sequence[Row]) -> list[Row]:
    """Each claim against the mean over seeds of its cells: ``met`` True / False, or None when
    no done cell measured the figure (several matching groups: each must meet it). A claim with
    a baseline is judged on the mean per-seed difference from the baseline's cell of the same
    partition; ``spread`` holds the sd of those differences (the paired noise), None for one seed."""
    out = []
    for claim in claims:
        groups = [s for s in summary_rows if s["method"] == claim.method
                  and claim.partition in (None, s["partition"]) and claim.variant in (None, s["variant"])]
        if claim.baseline is None:
            measured = [s for s in groups if s.get(claim.figure, {}).get("mean") is not None]
            observed = [s[claim.figure]["mean"] for s in measured]
            spread: list[float | None] = [s[claim.figure]["sd"] for s in measured]
        else:
            pairs = [(s, _paired(s, next((b for b in summary_rows if b["method"] == claim.baseline and b["partition"] == s["partition"]
                                          and b["variant"] == claim.baseline_variant), None), claim.figure)) for s in groups]
            measured = [s for s, (mean, _) in pairs if mean is not None]
            observed = [mean for _, (mean, _) in pairs if mean is not None]
            spread = [sd for _, (mean, sd) in pairs if mean is not None]
        met = all(CLAIM_OPERATORS[claim.op](v, claim.value) for v in observed) if observed else None
        row = {"claim": claim.text, "check": claim.describe(), "observed": observed, "spread": spread, "met": met,
               "where": [f"{s['partition']}, {s['variant']}" for s in measured]}
        if claim.unless is not None:
            row.update(_seed_by_seed(claim, groups, summary_rows))
        out.append(row)
    return out


def _seed_by_seed(claim: Claim, groups: Sequence[Row], summary_rows: Sequence[Row]) -> Row:
    """A claim with ``unless``: met when every seed of every matching group meets the check (its
    figure, or its difference from the baseline's same seed) or, on the same cell, the alternative;
    None when no seed measured either. ``saved_by_unless``: the cells that met only the alternative."""
    check, alternative = CLAIM_OPERATORS[claim.op], CLAIM_OPERATORS[claim.unless["op"]]  # type: ignore[index]
    verdicts, saved = [], []
    for group in groups:
        values = dict(group.get(claim.figure, {}).get("by_seed", {}))
        if claim.baseline is not None:
            base = next((b for b in summary_rows if b["method"] == claim.baseline and b["partition"] == group["partition"]
                         and b["variant"] == claim.baseline_variant), None)
            theirs = (base or {}).get(claim.figure, {}).get("by_seed", {})
            values = {seed: v - theirs[seed] for seed, v in values.items() if seed in theirs}
        alternatives = group.get(claim.unless["figure"], {}).get("by_seed", {})  # type: ignore[index]
        for seed in sorted(set(values) | set(alternatives)):
            holds = seed in values and check(values[seed], claim.value)
            rescued = not holds and seed in alternatives and alternative(alternatives[seed], claim.unless["value"])  # type: ignore[index]
            verdicts.append(holds or rescued)
            if rescued:
                saved.append(f"{group['partition']}, {group['variant']}, seed {seed}")
    return {"met": all(verdicts) if verdicts else None, "saved_by_unless": saved}


def _cell(stat: Mapping[str, Any] | None, scale: float, decimals: int) -> str:
    if not stat or stat.get("mean") is None:
        return "—"
    text = f"{stat['mean'] * scale:,.{decimals}f}"
    return text + (f" ± {stat['sd'] * scale:,.{decimals}f}" if stat.get("sd") is not None else "")


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def summary_md(summary_rows: Sequence[Row], columns_wanted: Sequence[tuple[str, str, float, int]] = SUMMARY_COLUMNS) -> str:
    """The summary as markdown: mean ± sd over the seeds (n), only the columns some group measured."""
    if not summary_rows:
        return "No cell is done yet."
    columns = [c for c in columns_wanted if any(s[c[0]]["mean"] is not None and (s[c[0]]["mean"] or c[0] not in _NONZERO_COLUMNS)
                                                for s in summary_rows)]
    variants = any(s["variant"] != summary_rows[0]["variant"] for s in summary_rows)
    header = ["Method", "Partition", *(["Variant"] if variants else []), "n", *(h for _, h, _, _ in columns)]
    rows = [[f"`{s['method']}`", s["partition"], *([s["variant"]] if variants else []), str(s["n"]),
             *(_cell(s[f], scale, d) for f, _, scale, d in columns)] for s in summary_rows]
    return _md(header, rows) + "\n\nMean ± sd over the seeds (n); — where no run measured it."


def claims_md(claims: Sequence[Row]) -> str:
    if not claims:
        return ""
    word = {True: "met", False: "**not met**", None: "no data"}

    def seen(value: float, sd: float | None) -> str:
        return f"{value:.4g}" + (f" ± {sd:.2g}" if sd is not None else "")

    rows = [[c["claim"], f"`{c['check']}`", ", ".join(seen(v, sd) for v, sd in zip(c["observed"], c.get("spread") or
                                                                                   [None] * len(c["observed"]))) or "—",
             word[c["met"]] + (f" ({len(c['saved_by_unless'])} by the alternative)" if c.get("saved_by_unless") else "")]
            for c in claims]
    return _md(["Claim", "Check", "Observed (mean ± sd over seeds)", "Result"], rows)


def compact_md(summary_rows: Sequence[Row], figures: Sequence[str]) -> str:
    """The summary with the named figures' columns only (those some group measured); a column the
    same in every row (the partition, n, a figure no variant moves) is said once under the table."""
    unknown = [f for f in figures if f not in COLUMNS]
    if unknown:
        raise ValueError(f"{{{{table:...}}}} names {unknown}; a column is one of {sorted(COLUMNS)}")
    if not summary_rows:
        return "No cell is done yet."
    columns = [COLUMNS[f] for f in figures if any(s[f]["mean"] is not None for s in summary_rows)]
    header = ["Method", "Partition", "Variant", "n", *(h for _, h, _, _ in columns)]
    rows = [[f"`{s['method']}`", s["partition"], s["variant"], str(s["n"]), *(_cell(s[f], scale, d) for f, _, scale, d in columns)]
            for s in summary_rows]
    same = {i for i in range(len(header)) if len(rows) > 1 and len({r[i] for r in rows}) == 1}
    kept = [i for i in range(len(header)) if i not in same]
    table = _md([header[i] for i in kept], [[r[i] for i in kept] for r in rows])
    every = "; ".join(f"{header[i].lower() if i < 4 else header[i]} {rows[0][i]}" for i in sorted(same))
    return table + (f"\n\nEvery row: {every}." if every else "")


def pivot_md(summary_rows: Sequence[Row], figure: str, across: str = "partition") -> str:
    """One figure (mean ± sd over the seeds) with a column per value of ``across`` (``partition`` or
    ``method``) and a row per value of the other two (a variant column only where some variant is not
    the default, a partition column only where there are several), in the summary's order."""
    if figure not in COLUMNS:
        raise ValueError(f"{{{{pivot:...}}}} names {figure!r}; a column is one of {sorted(COLUMNS)}")
    if across not in ("partition", "method"):
        raise ValueError(f"{{{{pivot:{figure},...}}}} pivots across {across!r}; it takes partition or method")
    if not summary_rows:
        return "No cell is done yet."
    _, title, scale, decimals = COLUMNS[figure]
    labels = [d for d in GROUP if d != across]
    columns = list(dict.fromkeys(s[across] for s in summary_rows))
    cells: dict[tuple[str, ...], dict[str, str]] = {}
    for s in summary_rows:
        cells.setdefault(tuple(s[d] for d in labels), {})[s[across]] = _cell(s[figure], scale, decimals)
    shown = [i for i, d in enumerate(labels) if d == "method" or (d == "variant" and any(k[i] != "default" for k in cells))
             or (d == "partition" and len({k[i] for k in cells}) > 1)]

    def name(dimension: str, value: str) -> str:
        return f"`{value}`" if dimension == "method" else value

    rows = [[*(name(labels[i], key[i]) for i in shown), *(by.get(c, "—") for c in columns)] for key, by in cells.items()]
    return (_md([*(labels[i].capitalize() for i in shown), *(name(across, c) for c in columns)], rows)
            + f"\n\n{title}, by {across}.")


def _worse(op: str, a: float, b: float) -> bool:
    """Whether observation ``a`` is further from meeting a claim with operator ``op`` than ``b``."""
    return a < b if op in (">", ">=") else a > b


def claims_summary_md(claims: Sequence[Claim], summary_rows: Sequence[Row]) -> str:
    """One row per kind of claim, with how many held and the observation furthest from holding,
    with its check (``edgesplit bench report`` prints every claim). One kind: the claims whose
    texts agree after a ``"PREFIX: "`` (one statement made per method or partition), or that
    check each variant of a method against the method's own cells the same way."""
    if not claims:
        return ""
    kinds: dict[Any, list[tuple[Claim, Row]]] = {}
    for claim, judged in zip(claims, evaluate_claims(claims, summary_rows)):
        statement = claim.text.split(": ", 1)[-1]
        ablation = claim.baseline == claim.method and claim.variant not in (None, claim.baseline_variant)
        key = ((claim.method, claim.partition, claim.figure, claim.op, claim.value, claim.baseline_variant) if ablation
               else statement if ": " in claim.text else claim.text)
        kinds.setdefault(key, []).append((claim, judged))
    rows = []
    for key, members in kinds.items():
        first = members[0][0]
        if len(members) == 1:
            text = first.text
        elif isinstance(key, tuple):
            text = (f"Each of {len(members)} variants{f' at {first.partition}' if first.partition else ''}: "
                    f"`{first.method} (VARIANT) {first.figure} - {first.method}'s {first.op} {first.value:g}`")
        else:
            text = key[0].upper() + key[1:]
        held = sum(1 for _, j in members if j["met"])
        judged = [j for _, j in members if j["met"] is not None]
        worst: tuple[float, float | None, str, Claim] | None = None
        for claim, j in members:
            for value, sd, where in zip(j["observed"], j["spread"], j["where"]):
                if worst is None or _worse(claim.op, value, worst[0]):
                    worst = (value, sd, where, claim)
        if worst is None:
            seen = "no data"
        else:
            value, sd, where, claim = worst
            scope = f" at {where.split(', ')[0]}" if claim.partition is None else ""
            # Variants checked alike: the row's text is the check, so the furthest one is named by its variant alone.
            said = where.split(", ")[-1] if isinstance(key, tuple) and len(members) > 1 and claim.partition else f"`{claim.describe()}`"
            seen = f"{value:.3g}" + (f" ± {sd:.2g}" if sd is not None else "") + f"{scope}: {said}"
        count = f"{held} of {len(judged)}" + (f" ({len(members) - len(judged)} no data)" if len(judged) < len(members) else "")
        rows.append([text, count if judged else "no data", seen])
    return _md(["Claim", "Held", "Furthest from holding (mean ± sd over seeds)"], rows)


def _overrides(overrides: Mapping[str, Any]) -> str:
    return ", ".join(_override_items(overrides))


def _override_items(overrides: Mapping[str, Any]) -> list[str]:
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in (overrides.get("flags") or {}).items()]
    # The same key and value set for several methods (`fedgkt.x=1`, `splitnn.x=1`): said once, as `{fedgkt,splitnn}.x=1`.
    owners: dict[tuple[str, str], list[str]] = {}
    for key, value in (overrides.get("settings") or {}).items():
        table, _, name = key.rpartition(".")
        owners.setdefault((name if table else key, str(value)), []).append(table)
    settings = [f"{{{','.join(t)}}}.{name}={value}" if len(t) > 1 else f"{t[0] + '.' if t[0] else ''}{name}={value}"
                for (name, value), t in owners.items()]
    faults = [f"--faulty-agent {f}" for f in overrides.get("faulty_agents") or []]
    return [f"`{x}`" for x in (*flags, *settings, *faults)]


def _joins(name: str, variants: Mapping[str, Sequence[str]]) -> bool:
    """Whether ``name`` is two or more other variants' names joined by ``_`` and makes exactly their
    changes together (``flip_nochecks``: ``flip`` and ``nochecks``), so the setting need not list it."""
    tokens = name.split("_")

    def splits(start: int) -> list[list[str]]:
        if start == len(tokens):
            return [[]]
        return [[part, *rest] for end in range(start + 1, len(tokens) + 1)
                if (part := "_".join(tokens[start:end])) in variants and part != name for rest in splits(end)]

    return any(len(parts) > 1 and set(variants[name]) == {i for p in parts for i in variants[p]} for parts in splits(0))


def setting_md(results: Mapping[str, Any]) -> str:
    """The experiment's setting from its recorded spec: the methods, scale, partitions and seeds,
    what each variant changes, and the files that hold it."""
    spec = results["experiment"]
    scale = spec["scale"]
    name = spec["name"]
    seeds = spec["seeds"]
    seeds_text = (f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1))
                  else ", ".join(str(s) for s in seeds))
    fraction = scale.get("client_fraction")
    methods = spec.get("methods_resolved") or spec["methods"]
    line = (f"Setting: {', '.join(f'`{m}`' for m in methods)}; {scale['agents']} agents"
            f"{f' ({fraction:g} drawn a round)' if fraction not in (None, 1.0) else ''}, {scale['rounds']} rounds, "
            f"{scale['train_samples']:,} / {scale['test_samples']:,} {scale['dataset']} images; {', '.join(spec['partitions'])}; "
            f"seed{'s' if len(seeds) > 1 else ''} {seeds_text} (`bench/experiments/{name}.toml`, `bench/results/{name}.json`).")
    overrides = spec.get("overrides") or {}
    common = _overrides({"flags": overrides.get("flags"), "faulty_agents": overrides.get("faulty_agents")})
    settings = overrides.get("settings") or {}
    if len(settings) > 3:  # a long list of shared settings is the TOML's to hold
        common = ", ".join(x for x in (common, f"{len(settings)} `--set` values (the TOML)") if x)
    else:
        common = _overrides(overrides)
    lines = [line + (f" Every run: {common}." if common else "")]
    variants = {v["name"]: _override_items(v["overrides"]) for v in spec.get("variants") or []}
    if not any(variants.values()):
        return "\n".join(lines)
    joined = [name for name in variants if _joins(name, variants)]
    lines.append("")
    lines += [f"- `{name}`: {', '.join(items) or 'as above'}" for name, items in variants.items()
              if name not in joined and (items or name != "default")]
    if joined:
        lines.append(f"- a variant whose name joins others' (`{joined[0]}`): their changes together")
    return "\n".join(lines)


def long_md(rows: Sequence[Row]) -> str:
    def fmt(value: Any) -> str:
        if value is None:
            return "—"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    keys = ("key", "status", "final_accuracy", "best_accuracy", "local_accuracy", "edge_train_gflops", "train_up_wire_bytes",
            "train_down_wire_bytes", "eval_up_wire_bytes", "peak_agent_rss_bytes", "leakage_attack", "leakage_psnr_db", "wall_s")
    return _md(list(keys), [[fmt(r.get(k)) for k in keys] for r in rows])


def plot(summary_rows: Sequence[Row], path: Path, title: str = "") -> bool:
    """Global accuracy against bytes up (wire, training) and, when any cell was audited, against
    what the strongest attack rebuilds over the mean image (each cell against its own baseline:
    uploads without ids are scored against the images they were matched to); one point per
    group, error bars the sd. False: nothing to plot."""
    points = [s for s in summary_rows if s["final_accuracy"]["mean"] is not None]
    if not points:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("train_up_wire_bytes", 1e-6, "bytes up, training (MB, wire)")]
    if any(s["leakage_gain_db"]["mean"] is not None for s in points):
        panels.append(("leakage_gain_db", 1, "strongest attack's PSNR over the mean image's (dB; higher leaks more)"))
    fig = Figure(figsize=(6.5 * len(panels), 4.5), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    # One colour and marker per group in every panel, so a point is the same group on both.
    colours = [f"C{i % 10}" for i in range(len(points))]
    markers = [("o", "s", "^", "D")[(i // 10) % 4] for i in range(len(points))]
    for ax, (figure, scale, label) in zip(axes, panels):
        unmeasured = []
        for s, colour, marker in zip(points, colours, markers):
            x, y = s[figure], s["final_accuracy"]
            name = " ".join(str(s[k]) for k in GROUP if s[k] != "default")
            if x["mean"] is None:
                unmeasured.append(name)
                continue
            ax.errorbar(x["mean"] * scale, y["mean"] * 100, xerr=(x["sd"] or 0) * scale, yerr=(y["sd"] or 0) * 100,
                        fmt=marker, color=colour, capsize=3, label=name)
        if figure == "leakage_gain_db":
            ax.axvline(0.0, color="grey", linestyle="--", linewidth=1, label="the mean image (nothing received)")
            ax.legend(fontsize=8)
            if unmeasured:
                ax.set_title("no image attack ran: " + ", ".join(unmeasured), fontsize=8, wrap=True)
        ax.set_xlabel(label)
        ax.set_ylabel("global accuracy (%)")
        ax.grid(True, alpha=0.3)
        if figure == "train_up_wire_bytes":
            ax.set_xscale("log")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.savefig(path)
    return True


def _cumulative(series: Sequence[float | None]) -> list[float | None]:
    """Running sums; None from the first round that measured none on."""
    out: list[float | None] = []
    total: float | None = 0.0
    for value in series:
        total = None if total is None or value is None else total + value
        out.append(total)
    return out


def curves(rows: Sequence[Row]) -> list[Row]:
    """Per method x partition x variant and round: the global accuracy (mean, sd over the seeds) and
    the edge training GFLOPs and bytes spent so far (means over the seeds; None where a seed has none),
    over the rounds every done seed recorded."""
    groups: dict[tuple[str, ...], list[Row]] = {}
    for row in rows:
        if row["status"] == "done" and row.get("accuracy_by_round"):
            groups.setdefault(tuple(row[k] for k in GROUP), []).append(row)
    out = []
    for group, members in groups.items():
        spent = {key: [_cumulative(m.get(key) or [None] * len(m["accuracy_by_round"])) for m in members]
                 for key in ("edge_train_gflops_by_round", "train_wire_bytes_by_round")}
        for i in range(min(len(m["accuracy_by_round"]) for m in members)):
            mean, sd = _mean_sd([m["accuracy_by_round"][i] for m in members if m["accuracy_by_round"][i] is not None])
            so_far = {key: [s[i] for s in series] for key, series in spent.items()}
            out.append({**dict(zip(GROUP, group)), "round": i + 1, "accuracy": {"mean": mean, "sd": sd},
                        **{key.replace("_by_round", "_so_far"): None if None in values else sum(values) / len(values)  # type: ignore[arg-type]
                           for key, values in so_far.items()}})
    return out


def curves_md(points: Sequence[Row]) -> str:
    if not points:
        return ""
    variants = len({p["variant"] for p in points}) > 1

    def num(value: float | None, scale: float, decimals: int) -> str:
        return "—" if value is None else f"{value * scale:,.{decimals}f}"

    rows = [[f"`{p['method']}`", p["partition"], *([p["variant"]] if variants else []), str(p["round"]),
             _cell(p["accuracy"], 100, 1), num(p["edge_train_gflops_so_far"], 1, 0), num(p["train_wire_bytes_so_far"], 1e-6, 1)]
            for p in points]
    header = ["Method", "Partition", *(["Variant"] if variants else []), "Round", "Global acc. %", "Edge GFLOPs so far",
              "MB so far (wire, both ways)"]
    return _md(header, rows)


def plot_curves(points: Sequence[Row], path: Path, title: str = "") -> bool:
    """Global accuracy by round against the edge GFLOPs and the bytes spent so far (log axes), one line per
    group, error bars the sd over the seeds. False: nothing to plot."""
    groups: dict[tuple[str, ...], list[Row]] = {}
    for p in points:
        if p["accuracy"]["mean"] is not None:
            groups.setdefault(tuple(p[k] for k in GROUP), []).append(p)
    if not groups:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = (("edge_train_gflops_so_far", 1, "edge training GFLOPs so far (all agents)"),
              ("train_wire_bytes_so_far", 1e-6, "MB so far through the server's connection"))
    fig = Figure(figsize=(13, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, (key, scale, label) in zip(axes, panels):
        for i, (group, line) in enumerate(groups.items()):
            kept = [p for p in line if p[key]]  # nothing spent (a reference cell's edge and wire) has no place on a log axis
            if kept:
                ax.errorbar([p[key] * scale for p in kept], [p["accuracy"]["mean"] * 100 for p in kept],
                            yerr=[(p["accuracy"]["sd"] or 0) * 100 for p in kept], marker="o", capsize=3, color=f"C{i % 10}",
                            linestyle=("-", "--", ":", "-.")[(i // 10) % 4], label=" ".join(g for g in group if g != "default"))
        ax.set_xlabel(label)
        ax.set_ylabel("global accuracy (%)")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.savefig(path)
    return True


def unattacked_md(results: Mapping[str, Any]) -> str:
    """Per method and variant, the image attacks that apply but did not run and why (the first
    seed's reason), so that a "—" in the table is explained."""
    reasons: dict[tuple[str, str], dict[str, str]] = {}
    for cell in results["cells"]:
        skipped = (cell.get("leakage") or {}).get("skipped") or {}
        group = reasons.setdefault((cell["method"], cell["variant"]), {})
        for attack, why in skipped.items():
            group.setdefault(attack, why)
    shared: dict[tuple[str, str], list[str]] = {}
    for (method, variant), group in reasons.items():
        for attack, why in group.items():
            shared.setdefault((attack, why), []).append(f"`{method}`{'' if variant == 'default' else f' ({variant})'}")
    return "\n".join(f"- {', '.join(who)}, {attack}: {why}" for (attack, why), who in shared.items())


DEFAULT_TEMPLATE = "# {{name}}\n\n{{question}}\n\n{{table}}\n\n{{claims}}\n\n{{plot}}\n"


def render(template: str, results: Mapping[str, Any], claims: Sequence[Claim], out: Path, link_prefix: str = "") -> str:
    """Fill ``template``'s placeholders (``{{name}}``, ``{{question}}``, ``{{table}}`` the summary,
    ``{{claims}}``, ``{{cells}}`` the long table, ``{{unattacked}}`` the attacks that did not run and why, ``{{timing}}`` where each run's time and upload bytes go per round, ``{{robustness}}`` what the server's
    screen refused and judged, ``{{curves}}`` per round the accuracy against the edge FLOPs and bytes spent so far
    (a table and a picture; ``{{curves_plot}}`` the picture alone), ``{{plot}}`` a picture written beside ``out``,
    linked as ``link_prefix`` + its file name; the shorter forms: ``{{setting}}`` the recorded setting and what each
    variant changes, ``{{table:figure,...}}`` the summary with those columns, ``{{pivot:figure}}`` one figure
    by partition (``{{pivot:figure,method}}``: by method), ``{{claims_summary}}`` one row per kind of claim)."""
    rows = long_table(results)
    groups = summary(rows)
    text = template
    if "{{plot}}" in text:
        picture = out.with_suffix(".png")
        text = text.replace("{{plot}}", f"![{results['experiment']['name']}]({link_prefix}{picture.name})"
                            if plot(groups, picture, results["experiment"]["name"]) else "")
    if "{{curves}}" in text:
        points = curves(rows)
        picture = out.with_name(f"{out.stem}-curves.png")
        image = (f"![{results['experiment']['name']} by round]({link_prefix}{picture.name})\n\n"
                 if plot_curves(points, picture, results["experiment"]["name"]) else "")
        text = text.replace("{{curves}}", image + curves_md(points))
    if "{{curves_plot}}" in text:
        picture = out.with_name(f"{out.stem}-curves.png")
        text = text.replace("{{curves_plot}}", f"![{results['experiment']['name']} by round]({link_prefix}{picture.name})"
                            if plot_curves(curves(rows), picture, results["experiment"]["name"]) else "")
    for spec in set(re.findall(r"\{\{pivot:([^}]*)\}\}", text)):
        figure, _, across = spec.partition(",")
        text = text.replace("{{pivot:" + spec + "}}", pivot_md(groups, figure.strip(), across.strip() or "partition"))
    for spec in set(re.findall(r"\{\{table:([^}]*)\}\}", text)):
        text = text.replace("{{table:" + spec + "}}", compact_md(groups, [f.strip() for f in spec.split(",") if f.strip()]))
    unattacked = unattacked_md(results)
    fills = {"name": results["experiment"]["name"], "question": results["experiment"]["question"],
             "setting": setting_md(results) if "{{setting}}" in text else "",
             "claims_summary": claims_summary_md(claims, groups) if "{{claims_summary}}" in text else "",
             "table": summary_md(groups), "claims": claims_md(evaluate_claims(claims, groups)), "cells": long_md(rows),
             "unattacked": f"Image attacks that apply but did not run, and why:\n\n{unattacked}" if unattacked else "",
             "timing": summary_md(groups, TIMING_COLUMNS),
             "robustness": summary_md(groups, ROBUSTNESS_COLUMNS)}
    for key, value in fills.items():
        text = text.replace("{{" + key + "}}", value)
    return text
