"""The leakage experiment's figures in the docs: README's column, each method's "What the
server sees" figure, and the reconstructions beside the private images.

Everything here reads ``bench/results/leakage.json`` (the experiment runner's schema, written
by ``edgesplit bench run bench/experiments/leakage.toml``); a method without a done cell reads
"not measured yet".
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloud_server.experiments.tables import long_table, summary

__all__ = ["METHOD_NOTE_BEGIN", "copy_pictures", "cost_cells", "leakage_cell", "setting_line", "method_figures", "present_pictures", "update_inversion_section",
           "update_method_notes"]

#: Each method's notes carry its figure between these lines (``{method}`` filled in).
METHOD_NOTE_BEGIN = "<!-- leakage: {method} (rendered from bench/results/leakage.json by bench/render_results.py) -->"
METHOD_NOTE_END = "<!-- end of leakage: {method} -->"

Figures = dict[str, dict[str, Any]]


def _label_error(results: Mapping[str, Any], method: str) -> tuple[str, float, float | None] | None:
    """The label attack with the lowest histogram error over the method's done cells (the most
    the server learns about a label distribution), that error and a uniform guess's there."""
    best: tuple[str, float, float | None] | None = None
    for cell in results["cells"]:
        if cell["method"] != method or cell["status"] != "done" or not cell.get("leakage"):
            continue
        for name, scores in cell["leakage"]["attacks"].items():
            if "histogram_error" in scores and (best is None or scores["histogram_error"] < best[1]):
                baseline = scores.get("baseline_histogram_error")
                best = (name, float(scores["histogram_error"]), None if baseline is None else float(baseline))
    return best


def _image_attacks(results: Mapping[str, Any], method: str) -> dict[str, float]:
    """Each image attack's PSNR (its best agent), mean over the method's done cells, highest first."""
    scores: dict[str, list[float]] = {}
    for cell in results["cells"]:
        if cell["method"] == method and cell["status"] == "done" and cell.get("leakage"):
            for name, attack in cell["leakage"]["attacks"].items():
                if "psnr_db" in attack:
                    scores.setdefault(name, []).append(float(attack["psnr_db"]))
    means = {name: sum(values) / len(values) for name, values in scores.items()}
    return dict(sorted(means.items(), key=lambda item: -item[1]))


def method_figures(results: Mapping[str, Any] | None) -> Figures:
    """Per method: seeds, the strongest image attack's PSNR / SSIM (mean, sd) beside the mean
    image's, the attack's name, and the most revealing label attack."""
    if results is None:
        return {}
    rows = long_table(results)
    scale = results["experiment"].get("scale", {})
    setting = (f"{scale.get('agents', '?')} agents, {scale.get('rounds', '?')} rounds, {scale.get('train_samples', 0):,} "
               f"{scale.get('dataset', '')} training images")
    out: Figures = {}
    for group in summary(rows):
        method = group["method"]
        attacks = sorted({r["leakage_attack"] for r in rows if r["method"] == method and r["leakage_attack"]})
        out[method] = {"n": group["n"], "attacks": attacks, "psnr": group["leakage_psnr_db"], "ssim": group["leakage_ssim"],
                       "baseline_psnr": group["leakage_baseline_psnr_db"], "accuracy": group["final_accuracy"],
                       "gflops": group["edge_train_gflops_per_agent"], "up_bytes": group["train_up_wire_bytes"],
                       "labels": _label_error(results, method), "setting": setting,
                       "image_attacks": _image_attacks(results, method)}
    return out


def _db(stat: Mapping[str, Any]) -> str:
    return f"{stat['mean']:.1f}" + (f" ± {stat['sd']:.1f}" if stat.get("sd") is not None else "")


def leakage_cell(figures: Figures, method: str) -> str:
    """README's cell: what the server rebuilds at the method's defaults."""
    entry = figures.get(method)
    if entry is None:
        return "not measured yet"
    if entry["psnr"]["mean"] is None:
        labels = entry["labels"]
        guess = "" if not labels or labels[2] is None else f" (uniform guess {labels[2]:.2f})"
        return "no image attack ran" + (f"; label shares, error {labels[1]:.2f}{guess}" if labels else "")
    return (f"images at {_db(entry['psnr'])} dB PSNR, SSIM {entry['ssim']['mean']:.2f} "
            f"(mean image {entry['baseline_psnr']['mean']:.1f} dB)")


def cost_cells(figures: Figures, method: str) -> list[str]:
    """README's cells beside the leakage: global accuracy %, edge GFLOPs per agent and MB up
    (wire, training), mean ± sd over the leakage experiment's seeds."""
    entry = figures.get(method)
    if entry is None:
        return ["—", "—", "—"]
    return [_pm(entry["accuracy"], 100, 1), _pm(entry["gflops"], 1, 0), _pm(entry["up_bytes"], 1e-6, 1)]


def _pm(stat: Mapping[str, Any] | None, scale: float, digits: int) -> str:
    if stat is None or stat.get("mean") is None:
        return "—"
    return f"{stat['mean'] * scale:,.{digits}f}" + (f" ± {stat['sd'] * scale:,.{digits}f}" if stat.get("sd") is not None else "")


def setting_line(figures: Figures) -> str:
    """What README's figures were measured on."""
    entry = next(iter(figures.values()), None)
    if entry is None:
        return "Not measured yet: `edgesplit bench run bench/experiments/leakage.toml`, then `python bench/render_results.py`."
    return (f"Measured at each method's defaults ({entry['setting']}, {entry['n']} seeds, mean ± sd; "
            "`bench/experiments/leakage.toml`); the defences from `bench/experiments/defences_*.toml`, "
            "each against the undefended runs of the same experiment ([privacy](docs/privacy.md)).")


def _method_note(figures: Figures, method: str) -> str:
    entry = figures.get(method)
    if entry is None:
        return ("Not measured yet: `edgesplit bench run bench/experiments/leakage.toml`, then "
                "`python bench/render_results.py`.")
    text = f"At the defaults ({entry['setting']}, {entry['n']} seeds, `bench/experiments/leakage.toml`): "
    if entry["psnr"]["mean"] is not None:
        text += (f"{', '.join(entry['attacks'])} rebuilds the private images at {_db(entry['psnr'])} dB PSNR, SSIM "
                 f"{entry['ssim']['mean']:.3f} (the mean image: {entry['baseline_psnr']['mean']:.1f} dB)")
        others = [f"{name} {psnr:.1f} dB" for name, psnr in entry["image_attacks"].items() if name not in entry["attacks"]]
        if others:
            text += f"; the others: {', '.join(others)}"
    else:
        text += "no image attack ran (the run's summary.md says why)"
    if entry["labels"]:
        name, error, baseline = entry["labels"]
        guess = "" if baseline is None else f", a uniform guess {baseline:.3f}"
        text += f"; {name} reads the label histogram to an error of {error:.3f} (0 is exact{guess})"
    return text + "."


def update_method_notes(docs: Path, figures: Figures) -> list[Path]:
    """Rewrite the figure between each method's markers in ``docs`` (every ``*.md`` below it);
    the notes that changed."""
    changed = []
    for path in sorted(docs.rglob("*.md")):
        text = original = path.read_text()
        for method in {**figures, **{m: {} for m in _methods_marked(text)}}:
            begin, end = METHOD_NOTE_BEGIN.format(method=method), METHOD_NOTE_END.format(method=method)
            if begin in text and end in text:
                start, stop = text.index(begin) + len(begin), text.index(end)
                text = text[:start] + "\n" + _method_note(figures, method) + "\n" + text[stop:]
        if text != original:
            path.write_text(text)
            changed.append(path)
    return changed


def _methods_marked(text: str) -> list[str]:
    head = METHOD_NOTE_BEGIN.split("{method}")[0]
    return [chunk.split(" ", 1)[0] for chunk in text.split(head)[1:]]


def present_pictures(results: Mapping[str, Any] | None, image_dir: Path) -> dict[str, str]:
    """Method -> file name of each done method's picture grid already in ``image_dir``."""
    methods = {cell["method"] for cell in (results or {}).get("cells", []) if cell["status"] == "done"}
    return {m: f"leakage-{m}.png" for m in sorted(methods) if (image_dir / f"leakage-{m}.png").exists()}


def copy_pictures(results: Mapping[str, Any] | None, runs_dir: Path, image_dir: Path) -> dict[str, str]:
    """Each method's picture grid from its first done cell's run directory, copied to
    ``image_dir/leakage-METHOD.png`` when the run directory is still there; method -> file name
    of every picture present in ``image_dir`` (copied now or earlier)."""
    if results is None:
        return {}
    present: dict[str, str] = {}
    for cell in results["cells"]:
        name = f"leakage-{cell['method']}.png"
        source = runs_dir / cell["key"] / "leakage.png"
        if cell["method"] in present or cell["status"] != "done":
            continue
        if source.exists():
            image_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, image_dir / name)
        if (image_dir / name).exists():
            present[cell["method"]] = name
    return present


def update_inversion_section(data: Mapping[str, Any] | None) -> list[str]:
    """``bench/results/update_inversion.json`` on the results page: per model, optimiser, batch x
    local steps and attack variant, the reconstructions' PSNR / SSIM over the seeds beside the
    mean image's (the attack the audit runs on weight updates, at sizes the audit can try)."""
    if data is None:
        return ["*`bench/results/update_inversion.json` not found: run `bench/update_inversion.py`.*", ""]
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in data["rows"]:
        key = (row["model"], row["optimizer"], row["batch_size"], row["local_steps"], row["variant"])
        groups.setdefault(key, []).append(row)

    def pm(values: list[float], digits: int) -> str:
        mean = sum(values) / len(values)
        if len(values) < 2:
            return f"{mean:.{digits}f}"
        sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        return f"{mean:.{digits}f} ± {sd:.{digits}f}"

    lines = ["### Inverting a weight update", "",
             "The audit's update inversion on one agent update of the project's models, mean ± sd over the seeds; labels read "
             "from the update at batch 1, given above it. From `bench/update_inversion.py`, `bench/results/update_inversion.json`.", ""]
    weaker = sorted({k[4] for k in groups} - {"strong"})
    if weaker and "strong" in {k[4] for k in groups}:  # the weaker variants stay in the JSON; the table shows the strongest
        groups = {k: v for k, v in groups.items() if k[4] == "strong"}
        lines[2] = lines[2].replace("given above it.", f"given above it; the `strong` attack only (the JSON also holds {', '.join(weaker)}).")
    attacks = len({k[4] for k in groups}) > 1  # one attack: the sentence above names it, no column repeats it
    if not attacks and groups and f"`{next(iter(groups))[4]}`" not in lines[2]:
        lines[2] = lines[2].replace("given above it.", f"given above it; the `{next(iter(groups))[4]}` attack.")
    lines += ["| Model | Optimiser | Batch x steps |" + (" Attack |" if attacks else "") + " PSNR dB | Mean image PSNR dB | SSIM |",
              "| --- | --- | ---: |" + (" --- |" if attacks else "") + " ---: | ---: | ---: |"]
    for (model, optimizer, batch, steps, variant), rows in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2] * kv[0][3], kv[0][3], kv[0][4])):
        lines.append(f"| {model} | {optimizer} | {batch} x {steps} |{f' {variant} |' if attacks else ''} "
                     f"{pm([r['psnr_db'] for r in rows], 1)} | {pm([r['baseline_psnr_db'] for r in rows], 1)} | "
                     f"{pm([r['ssim'] for r in rows], 2)} |")
    return lines + [""]
