"""FedDistill's loss weights searched over its paper's printed ranges, one at a time.

The paper (Song et al., Sec. IV-A) prints search ranges, not the weights it kept: "We first search
an optimal alpha_t, alpha_r and alpha_f from {0.0, 0.1, 0.2, ..., 1.0}. We will freeze the alpha_t,
alpha_r and alpha_f and search the beta_L from {0.5, 0.8, 1.0, 1.1, 1.2, 1.4}, and beta_E beta_FC
from {0.1, 0.2, 0.3, 0.4, 0.5}, respectively." Its Fig. 9 (CIFAR-10, Dir(0.3)) shows trends only:
accuracy falls as alpha_t grows from 0 to 1; alpha_r at 0.0 and at 1.0 both worse than between;
alpha_f better up to 0.8 and still, less, up to 1.0; "the average top-1 accuracy of last 10 epochs
is increased with higher beta_L" while the last round's is "relatively robust". The defaults
(``cloud_server/methods/feddistill.py``: alpha_t 0.0, alpha_r 0.5, alpha_f 1.0, beta_l 1.4,
beta_e 0.3, beta_fc 0.3) were read off those trends; this bench runs the search instead.

The search: one factor at a time around the defaults, in the paper's order (the alphas, then the
betas), 12 arms, each setting exactly one weight to another value of the paper's range: alpha_t
0.5 / 1.0, alpha_r 0.0 / 1.0, alpha_f 0.0 / 0.5, beta_l 0.5 / 1.0, beta_e 0.1 / 0.5, beta_fc
0.1 / 0.5 (``SEARCH``). Every arm is measured against the defaults, not against the best arm of
the previous weight (the paper freezes the alphas it found before searching the betas; every beta
arm here keeps the default alphas, and as recorded no alpha arm beat them, so freezing the best
alphas found gives the defaults too).

The regime: bench/kd_methods.py's grid (``kd_methods.SCALES["full"]``: 20 agents, 4 a round,
10,000 Fashion-MNIST images, SimpleCNN, 10 local epochs of SGD lr 0.01, evaluated every second
round) at Dirichlet(0.1), the grid's strongest skew and the one where FedDistill beat FedAvg, with
the grid's seeds 0, 1, 2, but **10 rounds** instead of 20 (a 2-core budget: 36 runs).

The default arm and FedAvg are not run again: they are the grid's recorded runs of the same seeds
cut at round 10 (``kd_methods.grid_baseline``). That is the run a 10-round run would have made:
the agents drawn in a round depend on (seed, round) only (``cloud_server/agents.py``, ``sample``),
and neither FedAvg nor FedDistill has a schedule over the run's total rounds: FedDistill's server
sends the same six weights and gamma every round (``FedDistillServer.extra_round_config``), its
agents' loss has no round-dependent term, and the local training (lr 0.01, no decay) is FedAvg's.
``grid_baseline`` also checks that the grid's recorded run was made with this regime and with the
default weights (the grid's resolved [feddistill] table holds them). The arm ``default-rerun``
(run only when named with ``--only``) makes the default's run afresh, to check that it reproduces:
recorded for seeds 0, 1, 2, its 10-round runs scored exactly what the grid's 20-round runs scored at
every evaluated round up to 10.

The scores, each run's global accuracy on the balanced 1,000-image set:

* ``final``: at round 10;
* ``late_mean``: the mean over the evaluated rounds 6, 8 and 10 (``LATE_ROUNDS``): the paper's
  Fig. 9d reads "the average top-1 accuracy of last 10 epochs" beside the last one, and at
  Dir(0.1) a run moves by several points from one evaluated round to the next (the runs of
  bench/results/kd_search_feddistill.json), so one round's figure is noisier than three.

Each arm is paired seed by seed (``bench/_stats.py``'s ``paired``; |mean d| > sd d) against the
default and against FedAvg, on both scores. An arm is *better than the default* only when it is
above it by that rule on both scores, *worse* when below on both (``judge``).

Writes ``bench/results/kd_search_feddistill.json`` after every run: the arms, every run (per round),
per arm both scores (mean ± sd and per seed), the paired differences, the verdicts, each run's wall
and CPU time and load, and the budget.

    python bench/kd_search_feddistill.py                                # every arm, seeds 0,1,2 (36 runs)
    python bench/kd_search_feddistill.py --resume                       # keep the runs already recorded
    python bench/kd_search_feddistill.py --only beta_l-0.5 --seeds 0 --resume
    python bench/kd_search_feddistill.py --only default-rerun --seeds 0 --resume   # the reproduction check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import kd_methods as kd
from _federation import RESULTS, DataSpec, RunSpec, machine, quiet_logs, run_federation, write_json
from _stats import PAIRED_RULE, mean_sd, paired
from _federation import budget, elapsed_s, parse_seeds, run_key

from cloud_server.methods.feddistill import FedDistillConfig

PARTITION = "dir0.1"
#: The grid's regime at Dir(0.1), its seeds, 10 rounds (evaluated at 2, 4, ..., 10).
SCALE = dataclasses.replace(kd.SCALES["full"], name="search-feddistill", rounds=10, partitions=(PARTITION,),
                            budget_minutes=90, fedbe_server={})
#: The evaluated rounds whose mean is the second score: the last three (rounds 6, 8, 10).
LATE_ROUNDS = (6, 8, 10)

WEIGHTS = ("alpha_t", "alpha_r", "alpha_f", "beta_l", "beta_e", "beta_fc")
#: The paper's printed search ranges (Sec. IV-A).
PAPER_RANGES: dict[str, tuple[float, ...]] = {
    **{w: tuple(round(i / 10, 1) for i in range(11)) for w in ("alpha_t", "alpha_r", "alpha_f")},
    "beta_l": (0.5, 0.8, 1.0, 1.1, 1.2, 1.4),
    **{w: (0.1, 0.2, 0.3, 0.4, 0.5) for w in ("beta_e", "beta_fc")},
}
#: The method's defaults, as FedDistillConfig sets them (the grid ran them).
DEFAULTS: dict[str, float] = {f.name: f.default for f in dataclasses.fields(FedDistillConfig) if f.name in WEIGHTS}
#: The searched values, in the paper's order: the alphas, then the betas.
SEARCH: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("alpha_t", (0.5, 1.0)), ("alpha_r", (0.0, 1.0)), ("alpha_f", (0.0, 0.5)),
    ("beta_l", (0.5, 1.0)), ("beta_e", (0.1, 0.5)), ("beta_fc", (0.1, 0.5)),
)

DEFAULT = kd.Arm("default", "feddistill", {}, "none: the grid's FedDistill (the defaults), read from the grid cut at round 10",
                 from_grid=True)
FEDAVG = kd.Arm("fedavg", "fedavg", {}, "the baseline: the grid's FedAvg, cut at round 10", from_grid=True)
RERUN = kd.Arm("default-rerun", "feddistill", {}, "none: the default's run made again (does the grid's run reproduce?)")
SEARCH_ARMS: tuple[kd.Arm, ...] = tuple(
    kd.Arm(f"{w}-{v}", "feddistill", {w: v}, f"{w} {DEFAULTS[w]} -> {v}") for w, values in SEARCH for v in values)
ARMS: tuple[kd.Arm, ...] = (DEFAULT, FEDAVG, *SEARCH_ARMS, RERUN)
ARMS_BY_NAME = {a.name: a for a in ARMS}
#: What a plain invocation runs or reads: everything but the reproduction check.
PLANNED = tuple(a.name for a in ARMS if a is not RERUN)


def run_spec(arm: kd.Arm) -> RunSpec:
    """The arm's run: the grid's [method] table, FedDistill's six weights stated (the defaults
    but for the arm's one change) so that each run's report records them."""
    config = kd.method_config(arm.base, SCALE)
    if arm.base == "feddistill":
        config = {**config, **DEFAULTS, **arm.changes}
    return RunSpec(f"{arm.name}-{PARTITION}", kd.METHODS[arm.base][0], config, SCALE.rounds, eval_every=SCALE.eval_every,
                   server={"client_fraction": SCALE.client_fraction})


# -- the scores and the verdicts ------------------------------------------------------------------- #


def scores(run: Mapping[str, Any]) -> dict[str, float | None]:
    """A run's two scores: the global accuracy at the last round and the mean over ``LATE_ROUNDS``
    (None when a round of them was not evaluated)."""
    by_round = {r["round"]: r["accuracy"] for r in run["rounds"]}
    late = [by_round.get(r) for r in LATE_ROUNDS]
    return {"final": by_round.get(SCALE.rounds),
            "late_mean": None if any(a is None for a in late) else sum(late) / len(late)}  # type: ignore[arg-type]


SCORES = {"final": f"global accuracy at round {SCALE.rounds}",
          "late_mean": "mean global accuracy over the evaluated rounds " + ", ".join(map(str, LATE_ROUNDS))}


def direction(pair: Mapping[str, Any]) -> str:
    """One paired comparison in words: above, below, within noise, too few seeds."""
    if pair["differ"] is None:
        return "too few seeds"
    if not pair["differ"]:
        return "within noise"
    return "above" if pair["mean_difference"] > 0 else "below"


def judge(final: Mapping[str, Any], late: Mapping[str, Any]) -> str:
    """An arm against the default on both scores: better / worse only when both say so."""
    a, b = direction(final), direction(late)
    if "too few seeds" in (a, b):
        return "too few seeds"
    if a == b == "above":
        return "better than the default"
    if a == b == "below":
        return "worse than the default"
    if a == b == "within noise":
        return "within noise"
    return f"mixed (final {a}, rounds {'-'.join(map(str, (LATE_ROUNDS[0], LATE_ROUNDS[-1])))} {b})"


def arm_runs(runs: Mapping[str, Any], arm: str) -> dict[str, dict[str, Any]]:
    """The arm's runs by seed (as a string)."""
    return {str(r["seed"]): r for r in runs.values() if r.get("arm") == arm}


def summary(runs: Mapping[str, Any]) -> dict[str, Any]:
    """Per arm: both scores (mean ± sd, per seed), the paired differences against the default and
    FedAvg, and the verdict against the default."""
    by_arm = {a.name: {s: scores(r) for s, r in arm_runs(runs, a.name).items()} for a in ARMS}
    out: dict[str, Any] = {}
    for arm in ARMS:
        seeds = by_arm[arm.name]
        if not seeds:
            continue
        entry: dict[str, Any] = {"changes": arm.changes, "seeds": sorted(seeds)}
        for score in SCORES:
            values = {s: v[score] for s, v in seeds.items()}
            entry[score] = {**mean_sd(values.values()), "by_seed": values}
        for other in (DEFAULT, FEDAVG):
            if other is arm:
                continue
            entry[f"vs_{other.name}"] = {score: paired({s: v[score] for s, v in seeds.items()},
                                                      {s: v[score] for s, v in by_arm[other.name].items()}) for score in SCORES}
        if arm.base == "feddistill" and arm is not DEFAULT:
            entry["verdict"] = judge(entry["vs_default"]["final"], entry["vs_default"]["late_mean"])
        walls = [r["run_wall_time_s"] / 60 for r in arm_runs(runs, arm.name).values() if r.get("run_wall_time_s") is not None]
        entry["wall_min"] = mean_sd(walls)
        out[arm.name] = entry
    return out


def better_than_default(table: Mapping[str, Any]) -> list[str]:
    return [name for name, entry in table.items() if entry.get("verdict") == "better than the default"]


def _pct(stat: Mapping[str, Any]) -> str:
    return "–" if stat["mean"] is None else f"{100 * stat['mean']:.1f} ± {100 * (stat['sd'] or 0):.1f}%"


def _d(pair: Mapping[str, Any] | None) -> str:
    if not pair or pair["mean_difference"] is None:
        return "–"
    sd = "–" if pair["sd_difference"] is None else f"{100 * pair['sd_difference']:.1f}"
    return f"{100 * pair['mean_difference']:+.1f} ({sd})".replace("-", "−")


def table_rows(table: Mapping[str, Any]) -> list[str]:
    """The rows of docs/methods/feddistill.md's table, one per arm of ``table`` (a ``summary``):
    arm, both scores (mean ± sd), paired d (sd d) against the default on both, the verdict, and
    paired d against FedAvg on both."""
    rows = []
    for arm in ARMS:
        entry = table.get(arm.name)
        if entry is None:
            continue
        label = {"default": "default (the grid's)", "fedavg": "FedAvg (the grid's)",
                 "default-rerun": "default, run again"}.get(arm.name) or (
            arm.name if not arm.changes else " ".join(f"{k} {DEFAULTS[k]} → {v}" for k, v in arm.changes.items()))
        versus = entry.get("vs_default") or {}
        verdict = entry.get("verdict") or ("–" if arm is DEFAULT else "")
        if arm is FEDAVG:
            verdict = "baseline"
        fedavg = entry.get("vs_fedavg") or {}
        rows.append(f"| {label} | {_pct(entry['final'])} | {_pct(entry['late_mean'])} | {_d(versus.get('final'))} | "
                    f"{_d(versus.get('late_mean'))} | {verdict} | {_d(fedavg.get('final'))} | {_d(fedavg.get('late_mean'))} |")
    return rows


# -- recording ---------------------------------------------------------------------------------- #


def grid_runs(grid: Mapping[str, Any], seeds: Sequence[int]) -> dict[str, Any]:
    """The default and FedAvg arms, read from the grid's recorded runs cut at ``SCALE.rounds``."""
    found: dict[str, Any] = {}
    key = (grid.get("scale") or {}).get("key")
    for arm in (DEFAULT, FEDAVG):
        run = run_spec(arm)
        for seed in seeds:
            derived = kd.grid_baseline(grid.get("runs") or {}, key, SCALE, PARTITION, arm, run, seed)
            if derived is not None:
                found[run_key(run.name, seed)] = derived
    return found


def previous_runs(out: Path, run_root: Path) -> dict[str, Any]:
    """The runs made before (not the grid's): those in ``out`` and those whose summary.json lies
    under ``run_root``, each kept only if made with this regime and its arm's [method] table now."""
    specs = {run_spec(a).name: run_spec(a) for a in ARMS if not a.from_grid}
    found: dict[str, Any] = {}
    candidates: list[tuple[Any, dict[str, Any]]] = []
    if out.exists():
        doc = json.loads(out.read_text())
        candidates += [(doc.get("scale", {}).get("key"), r) for r in (doc.get("runs") or {}).values()]
    for path in sorted(run_root.glob("*/summary.json")):
        summary_ = json.loads(path.read_text())
        candidates.append((summary_.get("scale"), summary_.get("run") or {}))
    for key, run in candidates:
        spec = specs.get(run.get("name"))
        if spec is not None and not run.get("from_grid") and kd.recorded_for(key, run, SCALE, spec):
            found[run_key(run["name"], run["seed"])] = run
    return found


def document(runs: dict[str, Any], seeds: Sequence[int], generated_by: str) -> dict[str, Any]:
    made = {k: r for k, r in runs.items() if not r.get("from_grid")}
    elapsed, elapsed_is = elapsed_s(made) if made else (0.0, "no runs")
    planned = [run_key(run_spec(ARMS_BY_NAME[a]).name, s) for a in PLANNED for s in seeds]
    complete = set(planned) <= set(runs)
    walls = [r["run_wall_time_s"] for r in made.values() if r.get("arm") != RERUN.name]
    to_make = sum(1 for a in SEARCH_ARMS for s in seeds if run_key(run_spec(a).name, s) not in runs)
    table = summary(runs)
    return {
        "benchmark": "kd_search_feddistill", "generated_by": generated_by,
        "description": "FedDistill's six loss weights, one at a time around the defaults, over the paper's printed ranges "
                       "(Sec. IV-A), at Dirichlet(0.1) in bench/kd_methods.py's regime cut to 10 rounds; each arm paired "
                       "seed by seed with the default (the grid's FedDistill runs cut at round 10) and with FedAvg (likewise).",
        "scale": {"key": SCALE.key(), "rounds": SCALE.rounds, "partition": kd.PARTITIONS[PARTITION],
                  "seeds": sorted({r["seed"] for r in runs.values()}), "planned_seeds": list(seeds), "complete": complete},
        "paper_ranges": PAPER_RANGES, "defaults": DEFAULTS, "search": {w: list(v) for w, v in SEARCH},
        "arms": {a.name: {"factor": a.factor, "changes": a.changes, "method": kd.METHODS[a.base][0],
                          "method_config": run_spec(a).method_config, "from_grid": a.from_grid} for a in ARMS},
        "scores": SCORES, "late_rounds": list(LATE_ROUNDS), "paired_rule": PAIRED_RULE,
        "verdict_rule": "better (worse) than the default: above (below) it by the paired rule on both scores; "
                        "within noise: neither score differs; mixed: otherwise",
        "summary": table, "better_than_default": better_than_default(table),
        "budget": {**budget(elapsed, SCALE.budget_minutes, complete, True), "wall_time_is": elapsed_is, "runs_made": len(made),
                   "mean_run_min": (sum(walls) / len(walls) / 60) if walls else None,
                   "projected_minutes_left": (sum(walls) / len(walls) * to_make / 60) if walls else None},
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS"),
        "machine": machine(), "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=[a.name for a in ARMS if not a.from_grid],
                        help="run these arms only (default: every searched arm; default-rerun only when named)")
    parser.add_argument("--seeds", type=parse_seeds, default=list(SCALE.seeds))
    parser.add_argument("--resume", action="store_true", help="keep the runs already recorded (JSON or summary.json)")
    parser.add_argument("--grid", type=Path, default=RESULTS / "kd_methods.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "kd_search_feddistill.json")
    parser.add_argument("--run-dir", type=Path, default=kd.REPO_ROOT / "runs" / "bench" / "kd_search_feddistill")
    args = parser.parse_args(argv)
    quiet_logs()
    grid = json.loads(args.grid.read_text())
    run_root = kd.scale_folder(args.run_dir, SCALE)
    runs = {**(previous_runs(args.out, run_root) if args.resume else {}), **grid_runs(grid, SCALE.seeds)}
    for arm in (DEFAULT, FEDAVG):
        missing = [s for s in args.seeds if run_key(run_spec(arm).name, s) not in runs]
        if missing:  # the grid has no such run: the arm is run like any other
            print(f"!! the grid holds no {arm.name} run of seeds {missing} in this regime: not compared", flush=True)
    generated_by = "bench/kd_search_feddistill.py" + (" (runs merged with --resume)" if args.resume else "")
    write_json(args.out, document(runs, SCALE.seeds, generated_by))
    todo = [ARMS_BY_NAME[a] for a in args.only] if args.only else list(SEARCH_ARMS)
    total = sum(1 for a in todo for s in args.seeds if run_key(run_spec(a).name, s) not in runs)
    print(f"{total} runs to make ({len(todo)} arms x seeds {args.seeds}); {len(runs)} recorded", flush=True)
    made = 0
    for arm in todo:  # arm by arm, every seed: each finished arm is a complete paired comparison
        run = run_spec(arm)
        for seed in args.seeds:
            if run_key(run.name, seed) in runs:
                continue
            data = DataSpec(SCALE.dataset, kd.PARTITIONS[PARTITION], SCALE.agents, SCALE.train_samples, SCALE.test_samples,
                            seed=seed)
            load_before = list(os.getloadavg())
            made += 1
            print(f"== [{made}/{total}] {run.name} seed {seed}: {arm.factor} (load {load_before[0]:.1f})", flush=True)
            started, cpu_started = time.monotonic(), kd._cpu_s()
            report = run_federation(run, data, run_root / run_key(run.name, seed))
            done = {**kd.summarize(PARTITION, arm.name, run, seed, report), "arm": arm.name,
                    "run_wall_time_s": time.monotonic() - started, "run_cpu_s": kd._cpu_s() - cpu_started,
                    "finished_at": time.time(), "load_average_before": load_before, "load_average_after": list(os.getloadavg())}
            runs[run_key(run.name, seed)] = done
            write_json(run_root / run_key(run.name, seed) / "summary.json", {"scale": SCALE.key(), "run": done})
            doc = document(runs, SCALE.seeds, generated_by)
            write_json(args.out, doc)
            got = scores(done)
            versus = doc["summary"][arm.name]["vs_default"]
            print(f"   final {got['final']}, rounds 6-10 {got['late_mean']}; vs default so far "
                  f"{100 * (versus['final']['mean_difference'] or 0):+.1f} / {100 * (versus['late_mean']['mean_difference'] or 0):+.1f}"
                  f" points; {done['run_wall_time_s']:.0f} s; {doc['budget']['wall_time_min']:.1f} min in all, "
                  f"projected {doc['budget']['projected_minutes_left'] or 0:.0f} min left", flush=True)
    doc = document(runs, SCALE.seeds, generated_by)
    write_json(args.out, doc)
    for name, entry in doc["summary"].items():
        final, late = entry["final"], entry["late_mean"]
        line = f"{name:14s} final {100 * final['mean']:.1f} ± {100 * (final['sd'] or 0):.1f}, late {100 * late['mean']:.1f} ± {100 * (late['sd'] or 0):.1f}"
        if "vs_default" in entry:
            d = entry["vs_default"]
            line += (f"; vs default {100 * (d['final']['mean_difference'] or 0):+.1f} ({100 * (d['final']['sd_difference'] or 0):.1f})"
                     f" / {100 * (d['late_mean']['mean_difference'] or 0):+.1f} ({100 * (d['late_mean']['sd_difference'] or 0):.1f})"
                     f": {entry.get('verdict', '')}")
        print(line)
    print(f"better than the default on both scores: {doc['better_than_default'] or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
