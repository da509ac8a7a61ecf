"""The server's own judgement of the agents' data: the figures behind the defaults of
``[server] validation_loss_margin`` / ``validation_samples`` and ``plausible_min_label_agreement``
(cloud_server/robust_validation.py).

The robustness bench's federation (bench/robustness.py: 5 agents, ResNet-8, 3,000 Fashion-MNIST
images, 500 test images), IID, Dirichlet(0.5) and Dirichlet(0.1), with every check recording and
refusing nothing, so that honest and bad agents' figures are measured side by side:

* ``validation`` (FedAvg): a server validation set of ``VALIDATION_SAMPLES`` labelled images (the
  training samples the agents do not take), every update scored by the rise of the validation loss
  from the global model to the global model plus that update, and plus its share (1 / 5) of a mean
  (``validation_step`` update / share; ``validation_loss_margin`` 1e9: nothing refused). ``none``: five honest agents under the ``mean``; ``sign_flip``: agent-4 sends
  ``global - 4 (w - global)``, under the ``median`` (f = 1), so that the model trains as it would
  with the attacker kept out and every round judges the flip against a healthy model
  (bench/update_directions.py's protocol); it flips BatchNorm's running statistics too, whose
  negative variances make the loss NaN (refused as not finite at any margin);
  ``sign_flip_weights``: the same flip of the trainable parameters only, the statistics as the
  agent trained them: a finite rise, which is what the margin must catch;
* ``labels`` (FedGKT, bench/robustness.py's table): the server model's agreement with each
  agent's labels from round 2 on (``plausible_min_label_agreement`` 1e-9: recorded, nothing below
  it); ``none``: five honest agents; ``random_labels``: agent-4 trains on its shard with the
  labels shuffled (seeded) and sends its maps with those labels.

The summary replays the rules (:func:`implausible_validation`, :func:`implausible_labels`) on
the recorded figures for a range of thresholds: per partition, how many honest uploads each
would refuse and in how many rounds it refuses the bad agent. The defaults are read off it.

    python bench/defence_scores.py                       # the whole grid, seeds 0 and 1
    python bench/defence_scores.py --resume              # go on after an interruption
    python bench/defence_scores.py --seeds 0,1,2 --resume  # one more seed, the recorded ones kept
    python bench/defence_scores.py --only validation-none-dir0.1-s0

Each run's seed is the data split's and the server's (bench/robustness.py's
``run_case``); the shuffled-labels permutation stays ``LABEL_SEED``. The seed is not part of the
JSON's scale: resuming with more seeds keeps the runs recorded with fewer.

Writes ``bench/results/defence_scores.json`` after every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._federation import RESULTS, quiet_logs  # noqa: E402
from bench._runs import add_grid_arguments, run_grid  # noqa: E402
from bench.robustness import AGENTS, BAD, LABEL_SEED, SIGN_FLIP_SCALE, TABLES, Case, run_case  # noqa: E402
from cloud_server.robust_validation import implausible_labels, implausible_validation  # noqa: E402

PARTITIONS = {"iid": "iid", "dir0.5": "dirichlet:0.5", "dir0.1": "dirichlet:0.1"}
TRAIN, TEST = 3000, 500  # bench/robustness.py's scale
ROUNDS = {"validation": 5, "labels": 3}  # labels: judged from round 2 on, FedGKT runs cost 3x FedAvg's
VALIDATION_SAMPLES = 500
MAD = 6.0  # [server] plausible_mad's default, which both rules use
MARGINS = (0.1, 0.25, 0.5, 1.0, 2.0)  # validation_loss_margin candidates (nats)
FLOORS = (0.15, 0.2, 0.3, 0.4, 0.5)  # plausible_min_label_agreement candidates


@dataclasses.dataclass(frozen=True)
class Run:
    check: str  # validation | labels
    attack: str  # none | sign_flip | sign_flip_weights | random_labels
    partition: str  # a key of PARTITIONS
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.check}-{self.attack}-{self.partition}-s{self.seed}"

    @property
    def method(self) -> str:
        return "fedavg" if self.check == "validation" else "fedgkt"

    @property
    def aggregation(self) -> str:
        return "median" if self.attack in ("sign_flip", "sign_flip_weights") else "mean"

    def server(self) -> dict[str, Any]:
        if self.check == "validation":
            return {"validation_samples": VALIDATION_SAMPLES, "validation_agent_train_samples": TRAIN,
                    "validation_loss_margin": 1e9}
        return {"plausible_min_label_agreement": 1e-9}


SEEDS = (0, 1)  # one seed per cell is noise: every threshold is read off both


def grid(seeds: tuple[int, ...] = SEEDS) -> list[Run]:
    """Seed by seed (a seed's whole grid before the next, so that an interrupted bench leaves whole
    seeds); within a seed the strongest skew first; the attacked runs first (four honest agents'
    figures beside the bad one's), then the clean ones (five honest agents, no attacker among the peers)."""
    parts = ("dir0.1", "dir0.5", "iid")
    out: list[Run] = []
    for s in seeds:
        out += [Run(c, a, p, s) for p in parts for c, a in (("validation", "sign_flip"),
                                                            ("validation", "sign_flip_weights"), ("labels", "random_labels"))]
        out += [Run("validation", "none", p, s) for p in parts]
        out += [Run("labels", "none", p, s) for p in parts]
    return out


def parse_seeds(text: str) -> tuple[int, ...]:
    """``--seeds 0,1``: distinct non-negative integers, in the order given."""
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds: expected comma-separated integers such as 0,1, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds: expected distinct non-negative integers, got {text!r}")
    return seeds


STEP_KEYS = {"update": "agents", "share": "agents_share"}  # validation_step -> its figures in update_validation


def _rises(r: dict[str, Any], step: str) -> dict[str, float]:
    section = r.get("update_validation") or {}
    return {a: (float("inf") if v is None else float(v)) for a, v in (section.get(STEP_KEYS[step]) or {}).items()}


def _finite(value: float | None) -> float | None:
    """``value``, or None where it is missing or not finite (JSON holds no infinity)."""
    return value if value is not None and math.isfinite(value) else None


def _agreement(r: dict[str, Any]) -> dict[str, float]:
    section = r.get("label_agreement") or {}
    return {a: float(f["server"]) for a, f in (section.get("agents") or {}).items() if f.get("server") is not None}


def replay(run: dict[str, Any]) -> dict[str, Any]:
    """The rule at every candidate threshold on a run's recorded figures: honest uploads refused
    and rounds the bad agent is refused in; and the figures themselves, per round."""
    bad_present = run["attack"] != "none"
    honest = lambda a: a != BAD or not bad_present  # noqa: E731
    out: dict[str, Any] = {"per_threshold": {}}
    if run["check"] == "validation":
        for step in STEP_KEYS:
            per_round = [_rises(r, step) for r in run["rounds"]]
            # Recorded as JSON: a rise that is not finite (the rule refuses it at any margin) is null.
            out[f"rises_{step}"] = [{a: _finite(v) for a, v in rs.items()} for rs in per_round]
            out[f"honest_max_rise_{step}"] = max((v for rs in per_round for a, v in rs.items() if honest(a)), default=None)
            out[f"honest_nonfinite_{step}"] = sum(1 for rs in per_round for a, v in rs.items() if honest(a) and not math.isfinite(v))
            out[f"bad_rises_{step}"] = [_finite(rs.get(BAD)) for rs in per_round] if bad_present else None
            out[f"honest_max_rise_{step}"] = _finite(out[f"honest_max_rise_{step}"])
            for margin in MARGINS:
                refused = [implausible_validation(rs, margin, MAD, 0.0) for rs in per_round]
                out["per_threshold"][f"{step}-{margin}"] = {
                    "honest_refused": sum(1 for rf in refused for a in rf if honest(a)),
                    "honest_judged": sum(1 for rs in per_round for a in rs if honest(a)),
                    "bad_refused_rounds": [k + 1 for k, rf in enumerate(refused) if BAD in rf] if bad_present else None}
    else:
        per_round = [_agreement(r) for r in run["rounds"]]
        out["agreement"] = per_round
        out["honest_min_agreement"] = min((v for ag in per_round for a, v in ag.items() if honest(a)), default=None)
        out["bad_agreement"] = [ag.get(BAD) for ag in per_round] if bad_present else None
        out["edge_agreement"] = [{a: f["edge"] for a, f in ((r.get("label_agreement") or {}).get("agents") or {}).items()}
                                 for r in run["rounds"]]
        for floor in FLOORS:
            refused = [implausible_labels(ag, floor, MAD) for ag in per_round]
            out["per_threshold"][str(floor)] = {
                "honest_refused": sum(1 for rf in refused for a in rf if honest(a)),
                "honest_judged": sum(1 for ag in per_round for a in ag if honest(a)),
                "bad_refused_rounds": [k + 1 for k, rf in enumerate(refused) if BAD in rf] if bad_present else None}
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per check and partition, per threshold: honest uploads refused (of judged) over the clean
    and attacked runs of every seed held, and seed by seed (``by_seed``: one seed's zero is not
    another's), and per attacked run (its name ends in its seed) the rounds the bad agent was
    refused in. ``seeds``: the seeds the runs hold."""
    out: dict[str, Any] = {"seeds": sorted({int(r["seed"]) for r in runs})}
    validation = [f"{step}-{m}" for step in STEP_KEYS for m in MARGINS]
    for check, thresholds in (("validation", validation), ("labels", [str(f) for f in FLOORS])):
        for part in PARTITIONS:
            mine = [r for r in runs if r["check"] == check and r["partition"] == part]
            if not mine:
                continue
            entry: dict[str, Any] = {}
            for t in thresholds:
                rows = [r["replay"]["per_threshold"][t] for r in mine]
                by_seed: dict[str, dict[str, int]] = {}
                for r, x in zip(mine, rows):
                    cell = by_seed.setdefault(str(r["seed"]), {"honest_refused": 0, "honest_judged": 0})
                    cell["honest_refused"] += x["honest_refused"]
                    cell["honest_judged"] += x["honest_judged"]
                # Per attacked run (two attacks of the validation check: the flip with and without BatchNorm's statistics).
                entry[t] = {"honest_refused": sum(x["honest_refused"] for x in rows),
                            "honest_judged": sum(x["honest_judged"] for x in rows), "by_seed": by_seed,
                            "bad_refused_rounds": {r["name"]: x["bad_refused_rounds"] for r, x in zip(mine, rows)
                                                   if x["bad_refused_rounds"] is not None}}
            keys = ([f"honest_max_rise_{s}" for s in STEP_KEYS] + [f"bad_rises_{s}" for s in STEP_KEYS]
                    if check == "validation" else ["honest_min_agreement", "bad_agreement"])
            for key in keys:
                entry[key] = {r["name"]: r["replay"][key] for r in mine if r["replay"][key] is not None}
            entry["final_accuracy"] = {r["name"]: r["final_accuracy"] for r in mine}
            out.setdefault(check, {})[part] = entry
    return out


def _run_one(run: Run, work: Path) -> dict[str, Any]:
    case = Case(run.method, run.attack, True, run.aggregation)
    result = run_case(case, ROUNDS[run.check], TRAIN, TEST, work, partition=PARTITIONS[run.partition], seed=run.seed,
                      server=run.server(), name=run.name, threads=1)  # no timings here: one thread
    result.update({"name": run.name, "check": run.check, "partition": run.partition, "seed": run.seed})
    result["replay"] = replay(result)
    print(f"  final accuracy {result['final_accuracy']}, refusals {result['refusals']}, {result['wall_s']} s\n"
          f"  {json.dumps({k: v for k, v in result['replay'].items() if not k.startswith(('rises', 'agreement', 'edge'))})}",
          flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_arguments(parser)
    parser.add_argument("--out", type=Path, default=RESULTS / "defence_scores.json")
    parser.add_argument("--seeds", type=parse_seeds, default=SEEDS,
                        help="comma-separated seeds of the grid (default %(default)s); with --resume the seeds "
                             "recorded in --out are kept and only the missing runs are run")
    args = parser.parse_args(argv)
    quiet_logs()
    scale = {"agents": AGENTS, "bad_agent": BAD, "rounds": ROUNDS, "train_samples": TRAIN, "test_samples": TEST,
             "validation_samples": VALIDATION_SAMPLES, "dataset": "fashion-mnist"}
    runs = grid(args.seeds)

    def head(started: dict[str, Any], kept: list[dict[str, Any]]) -> dict[str, Any]:
        # The grid's seeds: those asked for and those already recorded (--seeds 1 --resume keeps seed
        # 0's runs); the summary's ``seeds`` are those with a run recorded.
        held = sorted({*args.seeds, *(int(r["seed"]) for r in kept)})
        return {"benchmark": "defence_scores", "generated_by": "bench/defence_scores.py", "machine": started, **scale,
                "partitions": PARTITIONS, "method_config": {m: TABLES[m] for m in ("fedavg", "fedgkt")},
                "sign_flip_scale": SIGN_FLIP_SCALE, "label_seed": LABEL_SEED, "plausible_mad": MAD,
                "grid_seeds": held, "servers": {r.name: r.server() for r in grid(tuple(held))}}

    run_grid(runs, _run_one, args.out, scale, head, resume=args.resume, only=args.only, summary=summary,
             work_prefix="defence-scores-")


if __name__ == "__main__":
    main()
