"""``edgesplit bench``: run, check and tabulate experiment files.

    edgesplit bench run EXPERIMENT.toml [--only KEY-GLOB] [--dry-run] [--runs-dir DIR] [--results PATH]
    edgesplit bench check FILE...
    edgesplit bench table EXPERIMENT.toml [--results PATH] [--render OUT.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .spec import Experiment

__all__ = ["add_parser", "cmd_bench"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="run an experiment file (bench/experiments/NAME.toml) resumably, check one, "
                           "or print its collected table; see docs/experiments.md")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    run = commands.add_parser("run", help="run the cells not yet done; results after every cell")
    run.add_argument("experiment", metavar="EXPERIMENT.toml")
    run.add_argument("--only", default=None, metavar="KEY-GLOB", help="only the cells whose key matches, e.g. 'fedgkt-*-s0'")
    run.add_argument("--dry-run", action="store_true", help="print the cells that would run and their commands")
    run.add_argument("--reaudit", action="store_true",
                     help="audit the done cells again on what their runs kept (their run directories must still be "
                     "there), as after a change to the audit; nothing is trained again")
    run.add_argument("--recollect", action="store_true",
                     help="read the done cells' run figures again from their runs' report.json (their run directories "
                     "must still be there), as after a change to the figures collected; nothing runs")
    run.add_argument("--runs-dir", default=None, help="where each cell's run directory goes (default bench/runs/NAME)")
    run.add_argument("--results", default=None, help="the results file (default bench/results/NAME.json)")
    run.add_argument("--broker", default=None, help="every run uses this broker instead of starting its own")
    check = commands.add_parser("check", help="parse experiment files, expand their grids, resolve every name; print the cells")
    check.add_argument("files", nargs="+", metavar="FILE")
    table = commands.add_parser("table", help="print the collected table: the summary, the claims, every cell")
    table.add_argument("experiment", metavar="EXPERIMENT.toml")
    table.add_argument("--results", default=None, help="the results file (default bench/results/NAME.json)")
    table.add_argument("--json", action="store_true", help="print the long table and the summary as JSON")
    table.add_argument("--render", default=None, metavar="OUT.md",
                       help="fill the template beside the experiment (NAME.md: {{table}}, {{claims}}, {{cells}}, {{plot}}) "
                       "into OUT.md, the plot beside it")


def cmd_bench(args: argparse.Namespace) -> int:
    from .results import ResultsError, load_results
    from .runner import SubprocessExecutor, default_paths, run_experiment
    from .experiment_file import load_experiment
    from .spec import ExperimentError

    try:
        if args.bench_command == "check":
            for path in args.files:
                experiment = load_experiment(path)
                cells = experiment.cells()
                print(f"{path}: {experiment.name}: {len(cells)} cells ({', '.join(experiment.method_names())}); "
                      f"{experiment.question}")
                for cell in cells:
                    print(f"  {cell.key}")
            return 0
        experiment = load_experiment(args.experiment)
        runs_dir, results_path = default_paths(Path(args.experiment), experiment.name)
        results_path = Path(args.results) if args.results else results_path
        if args.bench_command == "run":
            try:
                run_experiment(experiment, results_path=results_path, runs_dir=Path(args.runs_dir) if args.runs_dir else runs_dir,
                               only=args.only, dry_run=args.dry_run, executor=SubprocessExecutor(broker=args.broker), reaudit=args.reaudit, recollect=args.recollect,
                               progress=lambda line: print(line, flush=True))
            except KeyboardInterrupt:
                print(f"edgesplit bench: interrupted; the cell that was running was stopped, the cells done are in "
                      f"{results_path} (rerun to go on)", flush=True)
                return 130
            return 0
        results = load_results(results_path)
        if results is None:
            print(f"edgesplit bench: error: no results at {results_path}; run `edgesplit bench run {args.experiment}` first",
                  file=sys.stderr)
            return 2
        return _table(args, experiment, results)
    except (ExperimentError, ResultsError) as exc:
        print(f"edgesplit bench: error: {exc}", file=sys.stderr)
        return 2


def _table(args: argparse.Namespace, experiment: Experiment, results: dict) -> int:
    from .tables import DEFAULT_TEMPLATE, claims_md, evaluate_claims, long_md, long_table, render, summary, summary_md

    rows = long_table(results)
    groups = summary(rows)
    claims = evaluate_claims(experiment.claims, groups)
    if args.render:
        template_path = Path(args.experiment).with_suffix(".md")
        template = template_path.read_text() if template_path.exists() else DEFAULT_TEMPLATE
        out = Path(args.render)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render(template, results, experiment.claims, out))
        print(f"edgesplit bench: wrote {out}")
        return 0
    if args.json:
        print(json.dumps({"cells": rows, "summary": groups, "claims": claims}, indent=1))
        return 0
    print(f"# {experiment.name}\n\n{experiment.question}\n\n{summary_md(groups)}\n")
    if claims:
        print(claims_md(claims) + "\n")
    print(long_md(rows))
    return 0
