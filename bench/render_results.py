"""Render ``docs/results.md`` from the benchmark JSON files in ``bench/results/``.

The tables are generated, never typed: rerun a benchmark, then this script.

* ``edge_cost.json``, ``codecs.json``, ``transport.json``, ``server_loop.json``, ``footprint.json``,
  ``scale.json``, ``metrics_overhead.json``: the micro-benchmarks' pytest-benchmark JSONs (``bench/micro/``,
  ``make bench-micro``; ``bench/micro_docs.py``);
* every experiment with a template (``bench/experiments/NAME.md``): its results
  (``bench/results/NAME.json``) through the runner's generic tables, or the one
  line naming the command that measures it;

It also rewrites the README's table of methods (from the method registry) and
docs/configuration.md's tables of the methods' keys (from each method's config,
``cloud_server/config_docs.py``).

    python bench/render_results.py [--results bench/results] [--out docs/results.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT / "bench") not in sys.path:
    sys.path.append(str(REPO_ROOT / "bench"))  # appended: the repository's packages come first

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from cloud_server.config_docs import update_config_doc  # noqa: E402
from defence_docs import (decision_section, defence_rows, load_defences, readme_defence_cell, secagg_section,  # noqa: E402
                          update_privacy_page)
from micro_docs import (codecs_section, edge_cost_section, footprint_section, load_micro,  # noqa: E402
                        metrics_overhead_section, scale_section, server_loop_section, transport_section)
from leakage_docs import (copy_pictures, cost_cells, leakage_cell, method_figures, present_pictures,  # noqa: E402
                          setting_line, update_inversion_section, update_method_notes)

DASH = "—"
#: The sections rendered from the micro-benchmarks' pytest-benchmark JSONs (bench/micro/, bench/micro_docs.py).
MICRO_SECTIONS = ("edge_cost", "codecs", "transport", "server_loop", "scale", "metrics_overhead")


class ResultsError(ValueError):
    """A results file is missing a field this page needs."""


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return lines


def _pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.2f}%"


def _load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "benchmark" not in data:
        raise ResultsError(f"{path}: not a benchmark result (no 'benchmark' key)")
    return data


def gpu_section(server: dict[str, Any] | None, fullscale: dict[str, Any] | None, methods: dict[str, Any] | None) -> list[str]:
    """The server on a GPU (measured by bench/gpu_checklist.sh and collected by
    bench/gpu_collect.py): the server step's speed, FedGKT at full scale, every method on CUDA."""
    lines = ["## The server on a GPU", ""]
    if server is None or not server.get("gpu_figures_measured"):
        return lines + ["*No GPU figure recorded: on a GPU machine run `bash bench/gpu_checklist.sh`, then "
                        "`python3 bench/gpu_collect.py` on what it brings back (bench/gpu_checklist.sh says how).*", ""]
    machine = server["machine"]
    lines += [f"From `bench/results/server_gpu.json` (`bench/server_gpu.py`): one {server['device_name']}, torch {machine['torch']}, "
              f"{machine['date'][:10]}. One ResNet-55 server step (CE + KD) on 16x32x32 maps, {server['setup']['steps']} timed steps x "
              f"{server['setup']['repeats']} repeats; `bare`: a plain PyTorch loop, `eager` / `graph`: the server's step (`graph`: one "
              "CUDA graph per step). Seconds per epoch of 60,000 maps:", ""]
    rows = []
    for key, row in server["results"].items():
        model, batch, precision = key.split("/")
        cells = []
        for mode in ("bare", "eager", "graph", "compiled"):
            figure = row.get(mode, {})
            cells.append(f"{figure['epoch_60k_s']:.1f}" if figure.get("measured") else "—")
        graph = row.get("graph", {})
        rows.append([model.replace("_server", ""), batch.removeprefix("bs"), precision, *cells,
                     f"{graph['peak_memory_bytes'] / 2**20:,.0f}" if graph.get("measured") else "—"])
    lines += _table(["Model", "Batch", "Precision", "bare s", "eager s", "graph s", "compiled s", "graph peak MiB"], rows, right_from=1)
    lines.append("")
    for batch, verdict in server["targets"]["verdicts"].items():
        lines.append(f"- Batch {batch.removeprefix('bs')}: best {verdict['best_epoch_s']:.1f} s per epoch ({verdict['best_mode']}), "
                     f"target <= {verdict['target_epoch_s']:g} s: {'met' if verdict['met'] else '**missed**'}.")
    compiled = next((row["compiled"] for row in server["results"].values() if "compiled" in row), None)
    if compiled is not None and not compiled.get("measured"):
        lines.append(f"- Compiled: {compiled['why']}.")
    util = server.get("gpu_utilization") or {}
    if util.get("samples"):
        lines.append(f"- GPU utilisation (nvidia-smi every {util['every_s']:g} s while the bench ran, set-up and model builds "
                     f"included): mean {util['mean_percent']:.0f} %, max {util['max_percent']:.0f} %.")
    lines += [""]
    if fullscale is not None:
        setup = fullscale["setup"]
        method = setup["method_config"]
        rows = [[str(r["round"]), _pct(r["accuracy"]), _pct(r["local_accuracy"]), _pct(r["edge_accuracy"]), f"{r['round_s']:.1f}",
                 f"{r['server_train_s']:.1f}", f"{r['edge_compute_s_mean']:.1f}", f"{100 * r['agents_idle_share_mean']:.0f} %",
                 f"{r['gpu_peak_memory_bytes'] / 2**20:,.0f}",
                 "—" if r["gpu_utilization_percent"] is None else f"{r['gpu_utilization_percent']:.0f} %"]
                for r in fullscale["rounds"]]
        target = fullscale["target"]
        lines += ["### FedGKT at full scale", "",
                  f"From `bench/results/fedgkt_fullscale.json`: `{setup['command']}`, {setup['agents']} agent processes, "
                  f"the server on {fullscale['device_name']}; the server trained {method['server_epochs']} epoch(s) a round at batch "
                  f"{method['server_batch_size']} ({method['server_order']} order), the agents {method['edge_epochs']} epoch(s) at batch "
                  f"{method['edge_batch_size']}. Edge: the agents' ResNet-8 alone.", "",
                  *_table(["Round", "Global", "Local", "Edge", "Round s", "Server train s", "Agent compute s", "Agents idle",
                           "GPU peak MiB", "GPU util."], rows),
                  "", f"{fullscale['status']}. Target ({target['what']}): best {_pct(target['best_so_far'])} so far, "
                  f"{'reached' if target['reached'] else 'not reached in the rounds run'}.", ""]
    if methods is not None:
        runs = methods["runs"]
        # Shown only where a run did not finish or its server left CUDA: the heading says the rest.
        full = not all(run["finished"] and run.get("device") == "cuda" for run in runs.values())
        rows = [[name, *(["yes" if run["finished"] else "**no**", run.get("device") or "—"] if full else []),
                 " / ".join(_pct(a) for a in run.get("accuracy", []))] for name, run in runs.items()]
        tests = methods.get("cuda_tests") or {}
        lines += ["### Every method on CUDA", "", f"From `bench/results/gpu_methods.json`: {methods['setup']}.", "",
                  *_table(["Method", *(["Finished", "Server device"] if full else []), "Global accuracy per round"], rows), ""]
        if tests:
            lines += [f"CUDA tests (`{tests['file']}`): {tests['summary']}.", ""]
    return lines


EXPERIMENTS = REPO_ROOT / "bench" / "experiments"


def load_experiment_results(path: Path) -> dict[str, Any] | None:
    """An experiment's results (the runner's schema, validated), or None when not run yet."""
    from cloud_server.experiments.results import load_results

    return load_results(path)


#: The order of the experiments on the page: what a user chooses by (accuracy, leakage, defences, cost), then
#: the papers' claims and ablations, then how the defaults were chosen; the rest after, by name.
EXPERIMENT_ORDER = ("table1", "leakage", "defences_activations_small", "defences_activations", "defences_table1", "defences_dp",
                    "robustness_defaults", "bad_device", "demo", "comm_cost", "fedgkt_async", "kd_methods", "fedkd_bytes",
                    "fedgkt_ablation", "gkt_server_epochs", "fedkd_ablation", "feddistill_weights", "fedbe_unlabeled",
                    "kd_regime", "low_memory", "direction_cosines", "validation_scores", "label_scores")


def experiment_sections(results: Path, image_dir: Path | None, runs_dir: Path) -> list[str]:
    """Each experiment with a template (``bench/experiments/NAME.md``) and results, rendered by
    the experiment runner's generic tables and plots; its pictures copied beside the page's. An
    experiment with no results yet is left off the page (the page shows what was measured;
    ``edgesplit bench run`` and docs/experiments.md say how to measure the rest)."""
    from cloud_server.experiments.experiment_file import load_experiment
    from cloud_server.experiments.tables import render as render_experiment

    lines: list[str] = []
    for template in sorted(EXPERIMENTS.glob("*.md"), key=lambda t: (EXPERIMENT_ORDER.index(t.stem) if t.stem in EXPERIMENT_ORDER
                                                                     else len(EXPERIMENT_ORDER), t.stem)):
        data = load_experiment_results(results / f"{template.stem}.json")
        experiment = load_experiment(template.with_suffix(".toml"))
        if data is None:
            continue
        with tempfile.TemporaryDirectory() as scratch:
            # Without image_dir (a check that the page is current) nothing is written beside the page.
            images = image_dir if image_dir is not None else Path(scratch)
            images.mkdir(parents=True, exist_ok=True)
            text = render_experiment(template.read_text(), data, experiment.claims, images / f"{template.stem}.md", "img/")
        pictures = {}
        if template.stem == "leakage":
            pictures = (copy_pictures(data, runs_dir / template.stem, image_dir) if image_dir is not None
                        else present_pictures(data, REPO_ROOT / "docs" / "img"))
        grid = "\n\n".join(f"`{method}`, seed {_first_seed(data, method)}: private images, each attack's reconstructions "
                            f"beneath.\n\n![{method}](img/{name})" for method, name in sorted(pictures.items()))
        lines += [text.replace("{{pictures}}", grid).rstrip(), ""] + unrun_lines(template, experiment, data)
        if template.stem == "leakage":
            lines += update_inversion_section(_load(results / "update_inversion.json"))
        if template.stem == "demo":
            lines += fresh_clone_lines(_load(results / "demo_fresh_clone.json"))
    lines += secagg_section(_load(results / "secagg.json"))
    return lines


def fresh_clone_lines(data: dict[str, Any] | None) -> list[str]:
    """`make demo` on a fresh clone, install included (bench/demo_fresh_clone.sh)."""
    if data is None:
        return ["`make demo` on a fresh clone, install included, is timed by `bench/demo_fresh_clone.sh` "
                "(`bench/results/demo_fresh_clone.json`): not recorded yet.", ""]
    load = ", ".join(f"{x:.1f}" for x in data["machine"]["load_average_at_start"])
    return [f"`make demo` on a fresh clone, install included: {data['seconds'] / 60:.1f} minutes, of which its run "
            f"{data['run_wall_s'] / 60:.1f} (global accuracy {100 * data['final_accuracy']:.1f}%), at commit "
            f"`{data['commit'][:10]}` on {data['machine']['cpu_model']}, {data['machine']['cores']} cores, load average "
            f"{load} at the start (`bench/demo_fresh_clone.sh`, `bench/results/demo_fresh_clone.json`).", ""]


def unrun_lines(template: Path, experiment: Any, data: dict[str, Any]) -> list[str]:
    """An experiment whose results lack some cells of its grid (or hold them as failed): how many, and the command
    that runs them."""
    done = {cell["key"] for cell in data["cells"] if cell["status"] == "done"}
    grid = experiment.cells()
    missing = [cell.key for cell in grid if cell.key not in done]
    if not missing:
        return []
    return [f"{len(missing)} of its {len(grid)} runs not recorded yet (`edgesplit bench run bench/experiments/{template.stem}.toml`).", ""]


def _first_seed(data: dict[str, Any], method: str) -> int:
    return next(cell["seed"] for cell in data["cells"] if cell["method"] == method and cell["status"] == "done")


def render(results: Path, image_dir: Path | None = None) -> str:
    sources = {name: load_micro(results / f"{name}.json") for name in MICRO_SECTIONS}
    lines = [
        "# EdgeSplit results",
        "",
        "<!-- Generated by bench/render_results.py from bench/results/*.json. Do not edit by hand: "
        "rerun the benchmark, then the renderer. -->",
        "",
        "Every number below was measured by this system on the machine named with it, by the files named with it; "
        "tables give the mean ± sd over n seeds, — where a run did not measure a figure; times on a shared machine are "
        "indicative. How to run an experiment: [experiments.md](experiments.md).",
        "",
    ]
    lines += decision_section(load_experiment_results(results / "leakage.json"), defence_rows(load_defences(results)))
    lines += experiment_sections(results, image_dir, REPO_ROOT / "bench" / "runs")
    sections = (("edge_cost", edge_cost_section), ("codecs", codecs_section),
                ("transport", transport_section), ("server_loop", server_loop_section), ("scale", scale_section),
                ("metrics_overhead", metrics_overhead_section))
    footprint = load_micro(results / "footprint.json")
    try:
        memory = (footprint_section(footprint, image_dir) if footprint is not None
                  else ["*`bench/results/footprint.json` not found: run `make bench-micro MICRO=footprint`.*", ""])
    except KeyError as exc:
        raise ResultsError(f"bench/results/footprint.json has no field {exc}; rerun make bench-micro MICRO=footprint") from None
    for name, section in sections:
        if name == "transport":
            lines += memory
        data = sources[name]
        if data is None:
            lines += [f"*`bench/results/{name}.json` not found: run `make bench-micro MICRO={name}`.*", ""]
            continue
        try:
            lines += section(data)
        except KeyError as exc:
            raise ResultsError(f"bench/results/{name}.json has no field {exc}; rerun make bench-micro MICRO={name}") from None
    try:
        lines += gpu_section(*(_load(results / f"{name}.json") for name in ("server_gpu", "fedgkt_fullscale", "gpu_methods")))
    except KeyError as exc:
        raise ResultsError(f"bench/results/server_gpu.json, fedgkt_fullscale.json or gpu_methods.json has no field {exc}; "
                           "rerun bench/gpu_collect.py") from None
    return "\n".join(lines)


#: The README's table of methods lies between these lines, rendered from the method registry.
README_BEGIN = "<!-- The methods: rendered from their registry entries by bench/render_results.py. Do not edit by hand. -->"
README_END = "<!-- end of the methods -->"


def readme_methods(leakage: dict[str, Any] | None = None, defences: Sequence[dict[str, Any]] = ()) -> list[str]:
    """The README's table of methods: one row per registered method, from its registry entry
    (``MethodSpec.summary`` and ``docs``); its accuracy, edge FLOPs, bytes and what the server
    rebuilds at its defaults (from ``leakage``, the leakage experiment's results); its measured
    defence that leaves the least (``defences``: :func:`defence_docs.defence_rows`); between
    :data:`README_BEGIN` and :data:`README_END`."""
    from shared_protocol.registry import registered_methods

    figures = method_figures(leakage)
    rows = [[f"`{name}`", spec.summary, *cost_cells(figures, name), leakage_cell(figures, name),
             readme_defence_cell(defences, name), f"[notes]({spec.docs})" if spec.docs else DASH]
            for name, spec in registered_methods().items()]
    header = ["`--method`", "what", "global acc. %", "edge GFLOPs / agent", "MB up (wire)",
              "the server rebuilds, at the defaults", "its best measured defence", "notes"]
    return [README_BEGIN, *_table(header, rows, right_from=8), "", setting_line(figures), README_END]


def update_readme(path: Path, leakage: dict[str, Any] | None = None, defences: Sequence[dict[str, Any]] = ()) -> bool:
    """Rewrite the table of methods in the README at ``path``; True if it changed."""
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise ResultsError(f"{path} has no table of methods between {README_BEGIN!r} and {README_END!r}")
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    updated = text[:start] + "\n".join(readme_methods(leakage, defences)) + text[end:]
    if updated != text:
        path.write_text(updated)
    return updated != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "results.md")
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md", help="whose table of methods to rewrite")
    parser.add_argument("--config-doc", type=Path, default=REPO_ROOT / "docs" / "configuration.md",
                        help="whose tables of the methods' keys to rewrite")
    args = parser.parse_args(argv)
    text = render(args.results, args.out.parent / "img")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    leakage = load_experiment_results(args.results / "leakage.json")
    defences = defence_rows(load_defences(args.results))
    if update_privacy_page(args.out.parent / "privacy.md", defences):
        print(f"rewrote the table of defences in {args.out.parent / 'privacy.md'}")
    if update_readme(args.readme, leakage, defences):
        print(f"rewrote the table of methods in {args.readme}")
    for path in update_method_notes(args.out.parent / "methods", method_figures(leakage)):
        print(f"rewrote the leakage figure in {path}")
    if update_config_doc(args.config_doc):
        print(f"rewrote the tables of the methods' keys in {args.config_doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
