"""The knowledge-distillation methods against their papers' claims: FedGKD,
FedGKD-Vote, FedDistill, FedBE and FedKD vs FedAvg in the papers' regime -- many agents,
a fraction of them per round, Dirichlet skew, tens of rounds, a model one of the papers
trains -- at a size 2 CPU cores can run, every cell with seeds.

The regime and its budget were measured with ``bench/kd_pilots.py``: every figure that chose them
is a row of ``bench/results/kd_pilots.json`` (named below), not repeated here.

* The model: FedDistill's SimpleCNN (``simplecnn``: its Table I model for CIFAR-10 and MNIST)
  for every method, FedBE's ConvNet (``convnet``: its Table 1 model) as FedKD's mentors; plain
  CNNs without a normalisation layer. Not FedGKD's GroupNorm ResNet-8 (its Sec. 5.1): it learns
  too slowly for 2 cores, centralized as well as federated (FedAvg with it stayed at chance at
  Dir(0.1)), and trains with far more FLOPs per image than SimpleCNN (the ``MODEL`` rows).
* The local training: FedDistill's (Table I / Sec. IV-A: SGD lr 0.01, momentum 0.9, weight
  decay 1e-5, batch 64, 10 local epochs; ``LOCAL``); FedGKD's search set {0.1, 0.05, 0.01}
  (Sec. 5.1), run for FedAvg at Dir(0.1), keeps 0.01: the larger rates diverged or left FedAvg
  at chance, and so did fewer local epochs.
* The federation: FedGKD's Table 3 clients and participation (20 agents, ``client_fraction``
  0.2: 4 a round) with FedDistill's data per client (Table I: 50,000 CIFAR-10 images over 100
  clients, 500 each): 10,000 Fashion-MNIST images, 500 an agent on average; 20 rounds,
  evaluated every second one. With half the images FedAvg at Dir(0.1) swings far more from
  round to round; at this scale every method learns at every partition, though one seed is no
  verdict.

The seeds: FedAvg at Dir(0.1) at the full scale ends far apart from one seed to the next (the
``seeds-fedavg`` rows). The seed draws the partition too, so each seed is a different Dirichlet
split, shared by every method of that seed; with a spread like that the difference rule (the two
sds combined) calls "within noise" gaps as large as the papers' Dir(0.1) gains (FedGKD Table 3,
FedDistill Table II). So the claims are judged *paired*: each method minus FedAvg within a seed
(the same split for both), then the mean and sd of those differences, by ``bench/_stats.py``'s
``PAIRED_RULE`` (|mean d| > sd d); the unpaired comparison is kept beside it in the JSON.

The budget: 7 runs x 3 partitions x 3 seeds = 63 runs in at most 150 minutes on 2 cores. One
seed of each run at Dir(0.1) was timed on the machine with no other job running (the ``grid-*``
rows; ``PILOT_S``) and projected to the grid; a round costs about the same at every partition
(the same images, epochs and agents per round on average). On a machine shared with other jobs
the same runs take several times their CPU seconds in wall time (the ``time-*`` rows): the grid
keeps its budget on a quiet machine only. The grid records each run's wall and CPU time,
``budget.projected`` re-projects from the recorded runs as they come, and ``budget`` in
``bench/results/kd_methods.json`` holds what the recorded grid took (wall and CPU minutes, the
highest load average). FedKD and its ConvNet baseline are the largest share of it: FedKD with a
SimpleCNN mentor and a smaller mentee (FedAvg of the mentor then being the FedAvg run) would
leave room for more rounds.

The claims (each row of the claim table; ``CLAIMS``) and where they are printed:

* FedGKD (Yao et al., Sec. 5.2, Table 3: CIFAR-10, ResNet-8 with GroupNorm, 20 clients,
  C = 0.2, 100 rounds, 3 trials): above FedAvg at Dir(0.5) 77.15 vs 75.15 and Dir(0.1) 72.27 vs
  69.22, the gain largest at the strongest skew ("FedGKD shows the superiority when the data
  heterogeneity increases"); Table 5 (ResNet-8, Dir(0.5), C = 0.1-0.4) the same at every C.
* FedGKD-Vote (the same Table 3, buffer M = 5): 77.44 vs 75.15 and 72.99 vs 69.22.
* FedDistill (Song et al., Sec. IV-B, Table II: CIFAR-10, SimpleCNN, 100 clients, 10 % per
  round, 100 rounds, 3 seeds): above FedAvg at Dir(0.1) 47.78 vs 35.37, Dir(0.3) 56.72 vs 49.68,
  Dir(0.5) 58.88 vs 55.6; Table III: FedAvg's final accuracy in 18 / 25 / 43 rounds instead of 100
  (the JSON's ``rounds_to_fedavg_final``).
* FedBE (Chen & Chao, Sec. 5.2, Table 1: CIFAR-10, 10 clients all in every round, Dir(0.1),
  40 rounds, ResNet-20 74.4 -> 78.2; Sec. 5.3, Table 5: 100 clients, 10 per round, Tiny-ImageNet,
  ResNet-20, i.i.d. 32.4 -> 35.4, non-i.i.d. (Step) 27.5 -> 32.4): above FedAvg, i.i.d. and not.
* FedKD (Wu et al., Results, Table 1: MIND and ADR split into 4 random folds, one client each,
  pretrained UniLM mentors with their first 4 or 2 layers as the mentee, every client every
  round, 5 runs): the mentors as accurate as FedAvg of the large model ("UniLM (Fed)": AUC 71.0
  vs 70.9, F-score 60.7 vs 60.6) at 10.8-11.4x less communication; scored as "the average
  performance of local mentor models on the local data" (the passages are quoted in
  docs/methods/fedkd.md, with the paper's "Complexity analysis": communication O(R |Theta_s| / rho)
  vs O(R |Theta_t|)). Two rows:
  the mentors on their agents' own test shards against FedAvg(ConvNet)'s global model on the same
  shards (``measure`` "local", the paper's evaluation), and both on the balanced set (``measure``
  "global", the project's headline); each with FedKD's wire bytes against that run's.

A verdict (``verdict``) is computed from the numbers with ``bench/_stats.py``'s rules, paired
over the seeds both cells ran (unpaired, the two sds combined, only where fewer than two seeds
pair): for an "above FedAvg" claim, *holds* when the mean per-seed difference is above zero by
more than the sd of the differences, *fails* when below by more than that, *within noise*
otherwise; for a "not below" claim (FedKD) *holds* unless it is below by more than that (and,
with ``fewer_bytes``, only if its mean wire bytes are below the baseline's).

    python bench/kd_methods.py --quick                     # synthetic data, every method, 2 seeds (< 1 minute; the test suite runs it)
    python bench/kd_methods.py                             # the full grid: 7 runs x 3 partitions x 3 seeds
    python bench/kd_methods.py --only fedavg-dir0.1 fedgkd-dir0.1 --seeds 0 --merge
    python bench/kd_methods.py --collect                   # write the JSON from the runs recorded so far
    python bench/kd_methods.py --ablation fedkd --resume   # FedKD one factor at a time (its "ablations" section)
    python bench/kd_methods.py --ablation fedkd --quick    # the same on synthetic data (the test suite runs it)

Writes ``bench/results/kd_methods.json`` (``--quick``: ``runs/bench/kd_methods/kd_methods-quick.json``):
the scale, the budget (stated, projected and kept), the runs (per seed, per round), the cells
(mean ± sd over seeds), the claims with their verdicts, FedKD's mentors next to its mentee and
its bytes-to-accuracy curve against FedAvg(ConvNet). Every finished run leaves a
``summary.json`` next to its report; ``--merge`` / ``--collect`` take the runs of the same scale
recorded before (invocations may run side by side, an interrupted grid resumes).
``bench/render_results.py`` puts the claim table and the cells into ``docs/results.md``.

``--ablation fedkd`` (the section "FedKD's ablation" below; docs/methods/fedkd.md reads it) runs
FedKD one factor at a time at Dirichlet(0.1) and writes ``ablations.fedkd`` into the same JSON,
keeping the rest of it (and the grid keeps that section when it rewrites the file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _federation import REPO_ROOT, RESULTS, DataSpec, RunSpec, machine, quiet_logs, round_series, run_federation, write_json
from _stats import DIFFERENCE_RULE, PAIRED_RULE, comparison, mean_sd, paired
from _federation import budget, elapsed_s, eval_set_of, parse_seeds, run_key

# In the order the grid runs them: the strongest skew (every claim's headline) first.
PARTITIONS = {"dir0.1": "dirichlet:0.1", "dir0.5": "dirichlet:0.5", "iid": "iid"}
PARTITION_LABELS = {"iid": "IID", "dir0.5": "Dirichlet(0.5)", "dir0.1": "Dirichlet(0.1)"}
SEEDS = (0, 1, 2)
BATCH = 64  # FedGKD Sec. 5.1 ("B=64"), FedDistill Table I


@dataclass(frozen=True)
class Scale:
    name: str
    dataset: str
    agents: int
    client_fraction: float  # [server] client_fraction: the agents drawn per round (FedGKD's C)
    train_samples: int  # all agents together (a seeded subset of the training split)
    test_samples: int  # the balanced evaluation set (and the union of the agents' test shards)
    rounds: int
    eval_every: int
    local_epochs: int
    partitions: tuple[str, ...]
    seeds: tuple[int, ...]
    budget_minutes: float  # all runs of all seeds, on 2 CPU cores
    fedbe_server: dict[str, int] = field(default_factory=dict)  # FedBE's server work per round, sized for the scale

    def key(self) -> dict[str, Any]:
        """The regime every run of the scale shares: runs recorded under another key are never
        merged with these. A method's own settings (FedBE's server work) are not part of it: they
        are in each run's [method] table, which :func:`recorded_for` checks run by run, so that a
        changed method setting orphans that method's runs only."""
        return {**{k: v for k, v in asdict(self).items() if k not in ("seeds", "budget_minutes", "partitions", "fedbe_server")},
                "model": MODEL, "mentor": MENTOR}


#: FedBE's server work a round in the full grid: 1,000 unlabeled images (FedBE's own default,
#: ``unlabeled_samples``; the paper's Fig. 5(a): "FedBE outperforms FedAvg even with 1K unlabeled"
#: of its 10K) and 16 distillation steps of batch 32 with SWA after 8, every 4 (a 2-core budget; the
#: paper distils 20 epochs a round). The grid first ran 64 images, which put FedBE within noise of
#: FedAvg everywhere; bench/kd_ablation_fedbe.py measured the set's size as the factor (its
#: ``u64-steps16`` variant is that first setting) and the paper's schedule as adding nothing
#: measurable at 3x the server FLOPs (docs/methods/fedbe.md).
FEDBE_SERVER = {"unlabeled_samples": 1000, "validation_samples": 0, "distill_steps": 16, "distill_batch_size": 32,
                "swa_warmup_steps": 8, "swa_cycle_steps": 4}

SCALES = {
    # The regime and budget of the module docstring: FedDistill's data per client and local
    # training, FedGKD's clients and participation, 20 rounds for 2 cores.
    "full": Scale("full", "fashion-mnist", agents=20, client_fraction=0.2, train_samples=10000, test_samples=1000, rounds=20,
                  eval_every=2, local_epochs=10, partitions=tuple(PARTITIONS), seeds=SEEDS, budget_minutes=150,
                  fedbe_server=FEDBE_SERVER),
    # The pipeline check the test suite runs: synthetic data, every method, two seeds (so that
    # every cell has an sd and every verdict is computed), one partition.
    "quick": Scale("quick", "synthetic", agents=4, client_fraction=0.5, train_samples=96, test_samples=40, rounds=2,
                   eval_every=1, local_epochs=1, partitions=("dir0.1",), seeds=(0, 1), budget_minutes=1,
                   fedbe_server={"unlabeled_samples": 24, "validation_samples": 0, "distill_steps": 4, "distill_batch_size": 8,
                                 "swa_warmup_steps": 2, "swa_cycle_steps": 1}),
}

# The local training every method shares, so that the methods differ in what each adds to
# FedAvg and nothing else: FedDistill's (Sec. IV-A / Table I, its SimpleCNN: "the number of
# local epochs is 10 and the batch size is 64. We take 0.01 as the learning rate for SimpleCNN
# and we adopt SGD as optimizer with momentum as 0.9 and weight-decay as 1e-5"); the local
# epochs are the scale's. FedGKD's (Sec. 5.1) is the same but "we tune the learning rate in
# {0.1, 0.05, 0.01} for FedAvg and set the learning rate as 0.05" and 20 local epochs; FedBE's
# (Sec. 5.1, B.1-B.2) lr 0.01 decayed by 10 at 30 % and 60 % of the rounds, 20 local epochs,
# batch 40, weight decay searched in [1e-3, 1e-4]. FedGKD's search, run here for FedAvg with
# SimpleCNN at Dir(0.1) (bench/results/kd_pilots.json, the ``cnn-*`` rows): lr 0.1 diverged,
# 0.05 and 0.01 at 2 local epochs both stayed low, and at 10 local epochs only 0.01 left chance
# (the regime above).
LOCAL = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5, "batch_size": BATCH}
# The model every method trains: FedDistill's SimpleCNN (Table I: its CIFAR-10 and MNIST model;
# MOON's layers, models/convnet.py), no normalisation layer; FedKD's mentors are FedBE's ConvNet
# (its Table 1 model), with more parameters and FLOPs. Not FedGKD's ResNet-8 with GroupNorm
# (Sec. 5.1): measured here, it learns too slowly for 2 cores -- centralized it trails both
# CNNs epoch for epoch (the ``central-*`` rows of bench/results/kd_pilots.json), and FedAvg at
# Dir(0.1) stayed at chance with it at the bench's first scale whatever the learning rate,
# local epochs or images (the ``base``, ``lr*``, ``e10`` and ``n20k-e5`` rows). Before that, the
# FedML BatchNorm ResNet-8's averaged model stayed at chance on the balanced set, and so did the
# GroupNorm ResNets (FedML's ResNet-8, He et al.'s ResNet-8, ResNet-20).
MODEL = "simplecnn"
MENTOR = "convnet"  # FedKD's mentor here (FedKD's text has no CNN); FedAvg of it is FedKD's baseline
#: How tables name the registry's models.
MODEL_LABELS = {"simplecnn": "SimpleCNN", "convnet": "ConvNet", "cifar_resnet8_gn": "ResNet-8", "cifar_resnet20_gn": "ResNet-20"}
MODEL_LABEL, MENTOR_LABEL = MODEL_LABELS[MODEL], MODEL_LABELS[MENTOR]


#: The runs of one partition and seed, by name: (method, label, what the run is).
METHODS: dict[str, tuple[str, str]] = {
    "fedavg": ("fedavg", f"FedAvg ({MODEL_LABEL})"),
    "fedgkd": ("fedgkd", f"FedGKD ({MODEL_LABEL}, M = 5)"),
    "fedgkd-vote": ("fedgkd", f"FedGKD-Vote ({MODEL_LABEL}, M = 5)"),
    "feddistill": ("feddistill", f"FedDistill ({MODEL_LABEL})"),
    "fedbe": ("fedbe", f"FedBE ({MODEL_LABEL})"),
    "fedkd": ("fedkd", f"FedKD ({MENTOR_LABEL} mentors, {MODEL_LABEL} mentee)"),
    "fedavg-mentor": ("fedavg", f"FedAvg ({MENTOR_LABEL}, FedKD's mentor)"),
}


def method_config(name: str, scale: Scale) -> dict[str, Any]:
    """A run's [method] table: the shared local training plus what the method sets. The
    methods' own keys are left at their defaults (cloud_server/methods/*.py), which the run
    report records resolved (``config.method_config``)."""
    local = {**LOCAL, "local_epochs": scale.local_epochs}
    if name == "fedkd":
        return {"mentor_model": MENTOR, "mentee_model": MODEL, "local_epochs": scale.local_epochs, "batch_size": BATCH,
                "optimizer": LOCAL["optimizer"], "mentor_lr": LOCAL["lr"], "mentee_lr": LOCAL["lr"],
                "momentum": LOCAL["momentum"], "weight_decay": LOCAL["weight_decay"]}
    config: dict[str, Any] = {"model": MENTOR if name == "fedavg-mentor" else MODEL, **local}
    if name == "fedgkd-vote":
        config["variant"] = "vote"
    if name == "fedbe":
        # The server's unlabeled set is the training split minus the subset the agents take.
        config.update(scale.fedbe_server, unlabeled_dataset=scale.dataset, agent_train_samples=scale.train_samples)
    return config


def plan(scale: Scale) -> list[tuple[str, str, RunSpec]]:
    """(partition key, method name, run) for one seed: every method on every partition."""
    return [(key, name, RunSpec(f"{name}-{key}", METHODS[name][0], method_config(name, scale), scale.rounds,
                                eval_every=scale.eval_every, server={"client_fraction": scale.client_fraction}))
            for key in scale.partitions for name in METHODS]


# -- the claims ------------------------------------------------------------------------------------ #


@dataclass(frozen=True)
class Claim:
    method: str  # a name of METHODS
    baseline: str  # the name of the run it is compared with
    partitions: tuple[str, ...]  # where the paper claims it
    kind: str  # "above": the method's mean above the baseline's | "not_below": not below it
    claim: str
    source: str  # the paper's table / section
    regime: str  # the paper's setting of that table
    fewer_bytes: bool = False  # the claim also says: fewer wire bytes than the baseline
    # Which final accuracy decides: "global", the deployed model(s) on the balanced set (the
    # headline every method shares), or "local", each agent's deployed model on its own test
    # shard (FedKD's paper scores its mentors so).
    measure: str = "global"

    def __post_init__(self) -> None:
        if self.kind not in ("above", "not_below"):
            raise ValueError(f"Claim.kind must be 'above' or 'not_below', got {self.kind!r}")
        if self.measure not in MEASURES:
            raise ValueError(f"Claim.measure must be one of {sorted(MEASURES)}, got {self.measure!r}")


#: A claim's measure -> (the cell's final figure, its per-seed figures, what it is in words).
MEASURES = {"global": ("final_accuracy", "final_accuracy_by_seed", "final global accuracy (the balanced set)"),
            "local": ("final_local_accuracy", "final_local_accuracy_by_seed",
                      "final local accuracy (each agent's deployed model on its own test shard, the paper's evaluation)")}


CLAIMS = (
    Claim("fedgkd", "fedavg", ("dir0.5", "dir0.1"), "above",
          "above FedAvg under non-IID data, the largest gain at the strongest skew",
          "FedGKD Table 3 (Dir 0.5: 77.15 vs 75.15; Dir 0.1: 72.27 vs 69.22), Table 5",
          "CIFAR-10, ResNet-8 (GroupNorm), 20 clients, C = 0.2, 100 rounds, 20 local epochs"),
    Claim("fedgkd-vote", "fedavg", ("dir0.5", "dir0.1"), "above",
          "above FedAvg under non-IID data (buffer M = 5)",
          "FedGKD Table 3 (Dir 0.5: 77.44 vs 75.15; Dir 0.1: 72.99 vs 69.22)",
          "CIFAR-10, ResNet-8 (GroupNorm), 20 clients, C = 0.2, 100 rounds, 20 local epochs"),
    Claim("feddistill", "fedavg", ("dir0.5", "dir0.1"), "above",
          "above FedAvg under Dir(α), α ∈ {0.1, 0.3, 0.5}; FedAvg's final accuracy in fewer rounds",
          "FedDistill Table II (Dir 0.1: 47.78 vs 35.37; Dir 0.5: 58.88 vs 55.6), Table III",
          "CIFAR-10, SimpleCNN, 100 clients, 10 % per round, 100 rounds, 10 local epochs"),
    Claim("fedbe", "fedavg", ("iid", "dir0.5", "dir0.1"), "above",
          "above FedAvg, i.i.d. and non-i.i.d., with partial participation",
          "FedBE Table 1 (Dir 0.1, ResNet-20: 78.2 vs 74.4), Table 5 (i.i.d. 35.4 vs 32.4)",
          "CIFAR-10, 10 clients, 40 rounds (Table 1); Tiny-ImageNet, 100 clients, 10 per round (Table 5); 20 local epochs"),
    *(Claim("fedkd", "fedavg-mentor", ("iid", "dir0.5", "dir0.1"), "not_below",
            "accuracy of the mentors comparable to FedAvg of the large model, at a fraction of its bytes",
            "FedKD Table 1 (MIND AUC 71.0 vs UniLM (Fed) 70.9; ADR F-score 60.7 vs 60.6; 10.8-11.4x less communication), "
            "scored on each client's local data",
            "4 clients, random folds (IID) of MIND / ADR; pretrained UniLM mentor, its first 4 layers as the mentee; every "
            "client every round", fewer_bytes=True, measure=measure)
      for measure in ("local", "global")),
)

VERDICTS = ("holds", "within noise", "fails", "at chance", "too few seeds")
NUM_CLASSES = 10  # Fashion-MNIST's and the synthetic set's
#: Both means below chance + this: no verdict ("at chance"), whatever the sds (three seeds all at
#: exactly 10 % have sd 0, and any difference would otherwise "differ").
CHANCE_MARGIN = 0.05


def verdict(method: Mapping[str, Any] | None, baseline: Mapping[str, Any] | None, kind: str,
            method_bytes: Mapping[str, Any] | None = None, baseline_bytes: Mapping[str, Any] | None = None,
            chance: float | None = None, pairs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The verdict on a claim from two ``mean_sd`` summaries (the method's, its baseline's), by
    the difference rule of ``bench/_stats.py``. ``kind`` "above": holds when the method is above
    by more than the sds combined, fails when below by more than that, within noise otherwise.
    "not_below": holds unless below by more than the sds combined. With ``pairs`` (``_stats.paired``
    of the two cells' per-seed figures, two seeds or more) the paired rule decides instead: the
    mean per-seed difference against the sd of the differences; the unpaired figures stay beside
    it. With bytes given, a claim of fewer bytes fails when the method's mean wire bytes are not
    below the baseline's. With ``chance`` given, two means both below ``chance + CHANCE_MARGIN``
    get no verdict ("at chance")."""
    if kind not in ("above", "not_below"):
        raise ValueError(f"kind must be 'above' or 'not_below', got {kind!r}")
    unpaired = comparison(method, baseline)
    if pairs is not None and pairs.get("differ") is not None:
        c = {"mean_difference": pairs["mean_difference"], "combined_sd": unpaired["combined_sd"], "differ": pairs["differ"],
             "rule": "paired", "sd_difference": pairs["sd_difference"], "paired": dict(pairs), "unpaired": unpaired}
    else:
        c = {**unpaired, "rule": "unpaired", "sd_difference": None, "paired": None if pairs is None else dict(pairs),
             "unpaired": unpaired}
    means = [(x or {}).get("mean") for x in (method, baseline)]
    if chance is not None and all(m is not None and m < chance + CHANCE_MARGIN for m in means):
        said = "at chance"
    elif c["differ"] is None:
        said = "too few seeds"
    elif c["differ"] and c["mean_difference"] < 0:
        said = "fails"
    elif c["differ"] or kind == "not_below":
        said = "holds"
    else:
        said = "within noise"
    out: dict[str, Any] = {**c, "verdict": said}
    if method_bytes is not None or baseline_bytes is not None:
        mine, theirs = (method_bytes or {}).get("mean"), (baseline_bytes or {}).get("mean")
        fraction = mine / theirs if mine is not None and theirs else None
        out["bytes_fraction"] = fraction
        if said == "holds" and (fraction is None or fraction >= 1.0):
            out["verdict"] = "fails"
    return out


# -- one run --------------------------------------------------------------------------------------- #


def _last(series: Sequence[dict[str, Any]], read: Any) -> Any:
    values = [read(r) for r in series]
    values = [v for v in values if v is not None]
    return values[-1] if values else None


def honest_screening(report: Mapping[str, Any]) -> dict[str, Any]:
    """What the default plausibility checks (cloud_server/robust.py) did to these honest agents:
    uploads refused (by reason) and the largest ratio of an agent's update norm to the median of
    the round's other agents' (``robustness.update_norms``; rounds with three or more agents)."""
    refused: dict[str, int] = {}
    ratios: list[float] = []
    for record in report["rounds"]:
        section = record.get("robustness") or {}
        for reasons in section.get("refused", {}).values():
            for reason, entry in reasons.items():
                refused[reason] = refused.get(reason, 0) + int(entry["count"])
        norms = (section.get("update_norms") or {}).get("agents") or {}
        for agent, norm in norms.items():
            others = sorted(v for a, v in norms.items() if a != agent)
            if len(others) >= 2 and others[len(others) // 2] > 0:
                median = others[len(others) // 2] if len(others) % 2 else (others[len(others) // 2 - 1] + others[len(others) // 2]) / 2
                ratios.append(norm / median)
    return {"refused": refused, "refused_total": sum(refused.values()), "update_norm_peer_ratio_max": max(ratios) if ratios else None,
            "update_norms_judged": len(ratios)}


def screening_total(results: Mapping[str, Any]) -> dict[str, Any]:
    """Over every run (all agents honest): uploads the default plausibility checks refused, and
    the largest update-norm ratio to the other agents' median, per partition."""
    out: dict[str, Any] = {"refused_total": 0, "by_partition": {}}
    for r in results.values():
        screened = r.get("screening")
        if not screened:
            continue
        out["refused_total"] += screened["refused_total"]
        part = out["by_partition"].setdefault(r["partition"], {"refused": 0, "update_norms_judged": 0, "update_norm_peer_ratio_max": None})
        part["refused"] += screened["refused_total"]
        part["update_norms_judged"] += screened["update_norms_judged"]
        if screened["update_norm_peer_ratio_max"] is not None:
            part["update_norm_peer_ratio_max"] = max(part["update_norm_peer_ratio_max"] or 0.0, screened["update_norm_peer_ratio_max"])
    return out


#: FedBE's per-round figures on its accuracy set (cloud_server/methods/fedbe.py): the weight
#: average w_bar, the ensemble's pseudo-labels (the teacher), and the distilled global model.
SERVER_ACCURACY = ("weight_average_accuracy", "pseudo_label_accuracy", "distilled_accuracy")


def summarize(partition: str, name: str, run: RunSpec, seed: int, report: dict[str, Any]) -> dict[str, Any]:
    """One seed of one cell: final accuracies (every label the evaluation scored), costs, and
    the round series (global and local accuracy by label, wire bytes, FLOPs)."""
    totals = report["totals"]
    series = round_series(report)
    rounds = []
    for r, record in zip(series, report["rounds"]):
        figures = record.get("method") or {}
        rounds.append({
            "round": r["round"], "status": r["status"], "accuracy": r["accuracy"], "local_accuracy": r["local_accuracy"],
            "by_label": r["evaluation"], "wire": r["wire"], "cumulative_wire": r["cumulative_wire"],
            "edge_train_flops": r["edge_train_flops"], "round_s": r["round_s"], "participants": len(record.get("participants", [])),
            "server_flops": figures.get("server_flops"),
            # FedBE: its teacher against the plain mean, on the server's unlabeled set (what its
            # distillation can add: bench/kd_ablation_fedbe.py reads them); absent for the others.
            **({"server_accuracy": {k: figures.get(k) for k in SERVER_ACCURACY}}
               if any(figures.get(k) is not None for k in SERVER_ACCURACY) else {}),
        })
    labels = _last(report["rounds"], lambda r: (r.get("evaluation") or {}).get("labels"))
    server_flops = [r["server_flops"] for r in rounds if r["server_flops"] is not None]
    return {
        "partition": partition, "name": run.name, "method_name": name, "method": run.method, "seed": seed, "status": report["status"],
        "method_config": report["config"]["method_config"], "client_fraction": report["config"].get("client_fraction"),
        "final_accuracy": totals["final_accuracy"], "final_local_accuracy": totals.get("final_local_accuracy"),
        "best_accuracy": totals.get("best_accuracy"),
        "final_by_label": {"global": _last(rounds, lambda r: r["by_label"].get("global")) or {},
                           "local": _last(rounds, lambda r: r["by_label"].get("local")) or {}, "labels": labels or {}},
        "models": report["models"],
        "edge_train_flops_total": totals["edge_train_flops"], "wire_total_bytes": totals["wire_total"],
        "server_flops_total": sum(server_flops) if server_flops else None,
        "wall_time_s": totals["wall_time_s"], "eval_set": report.get("eval_set"),
        "screening": honest_screening(report),
        "rounds": rounds,
    }


# -- cells, claims, FedKD ---------------------------------------------------------------------------- #

CELL_FIGURES: tuple[tuple[str, Any], ...] = (
    ("final_accuracy", lambda r: r["final_accuracy"]),
    ("final_local_accuracy", lambda r: r.get("final_local_accuracy")),
    ("best_accuracy", lambda r: r.get("best_accuracy")),
    ("edge_tflops", lambda r: r["edge_train_flops_total"] / 1e12),
    ("wire_mb", lambda r: r["wire_total_bytes"] / 1e6),
    ("server_tflops", lambda r: None if r.get("server_flops_total") is None else r["server_flops_total"] / 1e12),
    ("wall_min", lambda r: r["run_wall_time_s"] / 60 if r.get("run_wall_time_s") is not None else None),
    ("cpu_min", lambda r: r["run_cpu_s"] / 60 if r.get("run_cpu_s") is not None else None),
)


def _by_round(seeds: Sequence[dict[str, Any]], read: Any) -> list[dict[str, Any]]:
    """Per round, ``mean_sd`` over the seeds of ``read(round)`` (None where not evaluated)."""
    length = max(len(r["rounds"]) for r in seeds)
    return [{"round": i + 1, **mean_sd(read(r["rounds"][i]) if i < len(r["rounds"]) else None for r in seeds)} for i in range(length)]


def cells(results: Mapping[str, Any]) -> dict[str, Any]:
    """Mean ± sd over seeds of every figure of every cell (run name), of every evaluation label's
    final accuracy, and of the accuracy (global, local, every label) and wire bytes by round."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in results.values():
        by_name.setdefault(r["name"], []).append(r)
    out: dict[str, Any] = {}
    for run_name, seeds in sorted(by_name.items()):
        seeds = sorted(seeds, key=lambda r: r["seed"])
        cell: dict[str, Any] = {"partition": seeds[0]["partition"], "method_name": seeds[0]["method_name"], "method": seeds[0]["method"],
                                "seeds": [r["seed"] for r in seeds], "n": len(seeds)}
        for figure, read in CELL_FIGURES:
            cell[figure] = mean_sd(read(r) for r in seeds)
        # Per seed (keys are the seeds as text, as JSON keeps them): what a paired comparison reads.
        cell["final_accuracy_by_seed"] = {str(r["seed"]): r["final_accuracy"] for r in seeds}
        cell["final_local_accuracy_by_seed"] = {str(r["seed"]): r.get("final_local_accuracy") for r in seeds}
        labels = sorted({label for r in seeds for where in ("global", "local") for label in r["final_by_label"][where]})
        cell["final_by_label"] = {where: {label: mean_sd(r["final_by_label"][where].get(label) for r in seeds) for label in labels}
                                  for where in ("global", "local")}
        cell["labels"] = {k: v for r in seeds for k, v in (r["final_by_label"].get("labels") or {}).items()}
        cell["accuracy_by_round"] = _by_round(seeds, lambda x: x["accuracy"])
        cell["local_accuracy_by_round"] = _by_round(seeds, lambda x: x["local_accuracy"])
        cell["label_accuracy_by_round"] = {
            where: {label: _by_round(seeds, lambda x, w=where, lb=label: (x["by_label"].get(w) or {}).get(lb)) for label in labels}
            for where in ("global", "local")}
        cell["cumulative_wire_mb_by_round"] = [
            None if s["mean"] is None else s["mean"] / 1e6 for s in _by_round(seeds, lambda x: x["cumulative_wire"])]
        out[run_name] = cell
    return out


def first_round_reaching(curve: Sequence[Mapping[str, Any]], target: float | None) -> int | None:
    """The first round whose mean (over seeds) reaches ``target``; None if none does."""
    if target is None:
        return None
    return next((int(p["round"]) for p in curve if p.get("mean") is not None and p["mean"] >= target), None)


def versus_fedavg(cell_table: Mapping[str, Any], partitions: Sequence[str]) -> dict[str, Any]:
    """Every method minus FedAvg of the bench's model, per partition, global and local (the difference rule),
    and the first round at which its mean curve reaches FedAvg's final mean (FedDistill Table III)."""
    out: dict[str, Any] = {}
    for name in METHODS:
        if name == "fedavg":
            continue
        for key in partitions:
            mine, avg = cell_table.get(f"{name}-{key}"), cell_table.get(f"fedavg-{key}")
            if mine is None or avg is None:
                continue
            out.setdefault(name, {})[key] = {
                "global": comparison(mine["final_accuracy"], avg["final_accuracy"]),
                "local": comparison(mine["final_local_accuracy"], avg["final_local_accuracy"]),
                "global_paired": paired(mine.get("final_accuracy_by_seed") or {}, avg.get("final_accuracy_by_seed") or {}),
                "local_paired": paired(mine.get("final_local_accuracy_by_seed") or {}, avg.get("final_local_accuracy_by_seed") or {}),
                "fedavg_final_mean": avg["final_accuracy"]["mean"],
                "rounds_to_fedavg_final": first_round_reaching(mine["accuracy_by_round"], avg["final_accuracy"]["mean"]),
                "fedavg_rounds": len(avg["accuracy_by_round"]),
            }
    return out


def claims(cell_table: Mapping[str, Any], partitions: Sequence[str]) -> list[dict[str, Any]]:
    """One row per claim and partition where both cells exist: the figures and the verdict."""
    rows = []
    for c in CLAIMS:
        for key in c.partitions:
            if key not in partitions:
                continue
            mine, base = cell_table.get(f"{c.method}-{key}"), cell_table.get(f"{c.baseline}-{key}")
            if mine is None or base is None:
                continue
            figure, by_seed, said = MEASURES[c.measure]
            pairs = paired(mine.get(by_seed) or {}, base.get(by_seed) or {})
            judged = verdict(mine[figure], base[figure], c.kind,
                             *((mine["wire_mb"], base["wire_mb"]) if c.fewer_bytes else (None, None)), chance=1 / NUM_CLASSES,
                             pairs=pairs)
            rows.append({"method": c.method, "label": METHODS[c.method][1], "baseline": c.baseline,
                         "baseline_label": METHODS[c.baseline][1], "partition": key, "kind": c.kind, "claim": c.claim,
                         "source": c.source, "paper_regime": c.regime, "measure": c.measure, "figure": said,
                         "method_accuracy": mine[figure], "baseline_accuracy": base[figure], **judged})
    return rows


def fedkd_view(cell_table: Mapping[str, Any], partitions: Sequence[str]) -> dict[str, Any]:
    """FedKD as its paper evaluates it: the mentors (each agent's, the model it infers with) on
    the global set and on their own shards next to the global mentee; and accuracy against
    cumulative wire bytes, with FedAvg of the mentor-sized model and of the mentee-sized one."""
    out: dict[str, Any] = {}
    for key in partitions:
        kd = cell_table.get(f"fedkd-{key}")
        if kd is None:
            continue
        big, small = cell_table.get(f"fedavg-mentor-{key}"), cell_table.get(f"fedavg-{key}")
        entry: dict[str, Any] = {
            "mentors_global": kd["final_accuracy"], "mentors_local": kd["final_local_accuracy"],
            "mentee_global": kd["final_by_label"]["global"].get("mentee"), "mentee_local": kd["final_by_label"]["local"].get("mentee"),
            "fedkd_wire_mb": kd["wire_mb"],
            "fedavg_mentor_global": None if big is None else big["final_accuracy"],
            "fedavg_mentor_wire_mb": None if big is None else big["wire_mb"],
            "fedavg_mentee_global": None if small is None else small["final_accuracy"],
            "fedavg_mentee_wire_mb": None if small is None else small["wire_mb"],
        }
        target = None if big is None else big["final_accuracy"]["mean"]
        curves = {"fedkd mentors": (kd, kd["accuracy_by_round"]),
                  "fedkd mentee": (kd, kd["label_accuracy_by_round"]["global"].get("mentee") or [])}
        if big is not None:
            curves["fedavg mentor"] = (big, big["accuracy_by_round"])
        if small is not None:
            curves["fedavg mentee"] = (small, small["accuracy_by_round"])
        entry["curves"] = {}
        entry["wire_mb_to_fedavg_mentor_final"] = {}
        for label, (cell, curve) in curves.items():
            points = [{"round": p["round"], "cumulative_wire_mb": w, "accuracy": p["mean"], "sd": p["sd"]}
                      for p, w in zip(curve, cell["cumulative_wire_mb_by_round"]) if p["mean"] is not None]
            entry["curves"][label] = points
            reached = first_round_reaching(curve, target)
            entry["wire_mb_to_fedavg_mentor_final"][label] = (
                None if reached is None else {"round": reached, "wire_mb": cell["cumulative_wire_mb_by_round"][reached - 1]})
        out[key] = entry
    return out


def gains(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per method, its mean gain over the baseline by partition (FedGKD: largest at the strongest
    skew?), on the balanced set (the rows of ``measure`` "global")."""
    out: dict[str, dict[str, float | None]] = {}
    for r in rows:
        if r.get("measure", "global") != "global":
            continue
        out.setdefault(r["method"], {})[r["partition"]] = r["mean_difference"]
    return out


# -- the budget ------------------------------------------------------------------------------------ #

#: Wall seconds one run took in the pilots (PILOT_NOTE), at PILOT_ROUNDS rounds; a projection
#: scales them to the scale's rounds (a round costs about the same throughout: the same
#: agents, images and epochs).
PILOT_S: dict[str, float] = {"fedavg": 41.0, "fedgkd": 49.4, "fedgkd-vote": 91.2, "feddistill": 80.0, "fedbe": 43.5,
                             "fedkd": 149.8, "fedavg-mentor": 91.4}
PILOT_ROUNDS = 16
PILOT_NOTE = ("bench/results/kd_pilots.json, the grid-* rows: seed 0, Dirichlet(0.1), the full scale at 16 rounds, on the "
              "2-core machine with no other job running (load average 0.8-1.9)")


def projection(results: Mapping[str, Any], scale: Scale) -> dict[str, Any]:
    """Minutes the whole grid takes: per cell, the mean wall time of its recorded seeds (else the
    pilot's seconds of its method, scaled to the scale's rounds) times the scale's seeds, summed."""
    walls: dict[str, list[float]] = {}
    for r in results.values():
        if r.get("run_wall_time_s") is not None:
            walls.setdefault(r["name"], []).append(float(r["run_wall_time_s"]))
    total_s, from_pilot, missing = 0.0, [], []
    for key, name, run in plan(scale):
        if run.name in walls:
            total_s += sum(walls[run.name]) / len(walls[run.name]) * len(scale.seeds)
        elif name in PILOT_S:
            total_s += PILOT_S[name] * scale.rounds / PILOT_ROUNDS * len(scale.seeds)
            from_pilot.append(run.name)
        else:
            missing.append(run.name)
    return {"minutes": total_s / 60, "cells_from_pilot": from_pilot, "cells_unknown": missing,
            "pilot_s_per_run": dict(PILOT_S), "pilot_rounds": PILOT_ROUNDS, "pilot": PILOT_NOTE}


# -- recording, merging ---------------------------------------------------------------------------- #


def scale_folder(run_dir: Path, scale: Scale) -> Path:
    k = scale.key()
    return run_dir / "{name}-{agents}x-C{client_fraction}-{train_samples}-{test_samples}-r{rounds}-e{local_epochs}".format(**k)


def recorded_for(recorded_key: Mapping[str, Any] | None, recorded_run: Mapping[str, Any], scale: Scale,
                 spec: RunSpec | None) -> bool:
    """Whether a run recorded under ``recorded_key`` (its scale's key) counts as ``spec``'s run of
    ``scale``: the shared regime is ``scale``'s (keys recorded before :meth:`Scale.key` dropped FedBE's
    server work still hold it: ignored) and the run's resolved [method] table has every value the
    plan sets now (``spec.method_config``; a run with no spec is judged by the regime alone)."""
    shared = {k: v for k, v in (recorded_key or {}).items() if k != "fedbe_server"}
    if shared != scale.key():
        return False
    if spec is None:
        return True
    config = recorded_run.get("method_config") or {}
    return all(config.get(k) == v for k, v in spec.method_config.items())


def summary_matches(path: Path, scale: Scale, spec: RunSpec) -> bool:
    """A ``summary.json`` at ``path`` records ``spec``'s run of ``scale`` (``--resume`` skips it)."""
    if not path.exists():
        return False
    summary = json.loads(path.read_text())
    return recorded_for(summary.get("scale"), summary.get("run") or {}, scale, spec)


def runs_on_disk(run_root: Path, scale: Scale, specs: Mapping[str, tuple[str, str, RunSpec]]) -> dict[str, Any]:
    """The runs of ``scale`` whose summary.json lies under ``run_root``, by folder; a run whose
    report is there too (and is one of ``specs``: name -> (partition, method name, run)) is
    summarised afresh from it. A run of a planned name made with other [method] settings than
    the plan's now is left out (:func:`recorded_for`)."""
    found: dict[str, Any] = {}
    for path in sorted(run_root.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        planned = specs.get((summary.get("run") or {}).get("name"))
        if not recorded_for(summary.get("scale"), summary.get("run") or {}, scale, None if planned is None else planned[2]):
            continue
        run = dict(summary["run"])
        report_path = path.parent / "report.json"
        if report_path.exists() and run.get("name") in specs:
            key, name, spec = specs[run["name"]]
            run.update(summarize(key, name, spec, run["seed"], json.loads(report_path.read_text())))
        found[path.parent.name] = run
    return found


def previous_runs(out: Path, run_root: Path, scale: Scale) -> dict[str, Any]:
    """Runs of this scale recorded before, in ``out`` and in the runs' ``summary.json`` (the
    newer wins; each summarised again from its report, keeping what only the run measured)."""
    found: dict[str, Any] = {}
    specs = {run.name: run for _, _, run in plan(scale)}
    if out.exists():
        previous = json.loads(out.read_text())
        key = previous.get("scale", {}).get("key")
        found.update({k: r for k, r in previous["runs"].items() if recorded_for(key, r, scale, specs.get(r["name"]))})
    found.update(runs_on_disk(run_root, scale, {run.name: (key, name, run) for key, name, run in plan(scale)}))
    return found


def cpu_and_load(results: Mapping[str, Any]) -> dict[str, Any]:
    """Beside the wall time (which grows with other jobs' load on a shared machine): the CPU
    minutes the runs' processes used, and the highest load average seen before or after a run."""
    cpu = [r["run_cpu_s"] for r in results.values() if r.get("run_cpu_s") is not None]
    loads = [x[0] for r in results.values() for x in (r.get("load_average_before"), r.get("load_average_after")) if x]
    return {"cpu_time_min": sum(cpu) / 60 if cpu else None, "runs_with_cpu_time": len(cpu),
            "max_load_average": max(loads) if loads else None}


def document(results: dict[str, Any], scale: Scale, planned_seeds: Sequence[int] | None, generated_by: str) -> dict[str, Any]:
    seeds = sorted({r["seed"] for r in results.values()})
    names = {run.name for _, _, run in plan(scale)}
    wanted = planned_seeds if planned_seeds is not None else scale.seeds
    complete = {run_key(n, s) for n in names for s in wanted} <= set(results) and len(seeds) >= len(scale.seeds)
    elapsed, elapsed_is = elapsed_s(results)
    cell_table = cells(results)
    rows = claims(cell_table, scale.partitions)
    eval_set, same_set = eval_set_of(results)
    check = budget(elapsed, scale.budget_minutes, complete, True)
    return {
        "benchmark": "kd_methods",
        "description": "FedGKD, FedGKD-Vote, FedDistill, FedBE and FedKD against their papers' claims vs FedAvg, in the papers' "
                       "regime sized for 2 CPU cores (many agents, partial participation, Dirichlet 0.1 / 0.5 and IID, tens of "
                       f"rounds, {MODEL_LABEL} / {MENTOR_LABEL}), mean ± sd over seeds.",
        "scale": {
            "key": scale.key(), "name": scale.name, "dataset": scale.dataset, "agents": scale.agents,
            "client_fraction": scale.client_fraction, "agents_per_round": max(1, math.ceil(scale.client_fraction * scale.agents)),  # cloud_server/agents.py
            "train_samples": scale.train_samples, "train_samples_per_agent": scale.train_samples / scale.agents,
            "test_samples": scale.test_samples, "rounds": scale.rounds, "eval_every": scale.eval_every,
            "local_epochs": scale.local_epochs, "local_training": {**LOCAL, "local_epochs": scale.local_epochs},
            "model": MODEL, "mentor": MENTOR, "model_label": MODEL_LABEL, "mentor_label": MENTOR_LABEL, "partitions": {k: PARTITIONS[k] for k in scale.partitions},
            "methods": {name: {"method": m, "label": label, "method_config": method_config(name, scale)}
                        for name, (m, label) in METHODS.items()},
            "seeds": seeds, "planned_seeds": list(scale.seeds), "seed_drives": "the data subset, the partition, every model's initialisation, the client sampling "
                                          "and the shuffling",
            "complete": complete,
            "accuracy_is": {
                "global": "the deployed model(s) on the balanced evaluation set (eval_set), after the last round: the global "
                          "model (FedAvg, FedGKD, FedDistill, FedBE); FedKD: each agent's mentor, the mean over the round's "
                          "agents (the mentee beside it, labelled)",
                "local": "each of the round's agents' deployed model on its own test shard, sample-weighted (with partial "
                         "participation: the last evaluated round's agents only)",
            },
        },
        "eval_set": eval_set,
        "eval_set_same_for_every_run": same_set,
        "budget": {**check, "projected": projection(results, scale), "wall_time_is": elapsed_is, **cpu_and_load(results)},
        "difference_rule": DIFFERENCE_RULE,
        "paired_rule": PAIRED_RULE,
        "verdict_rule": {"paired": "every claim is judged paired over the seeds both cells ran (the seed draws the split, "
                                   "shared by every method of that seed), by paired_rule; unpaired (difference_rule) only "
                                   "where fewer than two seeds pair",
                         "above": "holds: above the baseline by more than the spread (paired: the sd of the per-seed "
                                  "differences; unpaired: the two sds combined); fails: below by more than that; "
                                  "within noise: otherwise",
                         "at_chance": f"no verdict when both means are below chance (1/{NUM_CLASSES}) + {CHANCE_MARGIN}",
                         "not_below": "holds unless below the baseline by more than the spread (and, for a claim of "
                                      "fewer bytes, only with fewer mean wire bytes)"},
        "claims": rows,
        "honest_screening": screening_total(results),
        "gains_over_baseline": gains(rows),
        "versus_fedavg": versus_fedavg(cell_table, scale.partitions),
        "fedkd": fedkd_view(cell_table, scale.partitions),
        "cells": cell_table,
        "machine": machine(),
        "runs": results,
        "generated_by": generated_by,
    }


# -- FedKD's ablation (--ablation fedkd) ------------------------------------------------------------ #
#
# The grid's FedKD fails its claim on the balanced global set at Dir(0.1) (its mentors far
# below FedAvg(ConvNet): bench/results/kd_methods.json's claims). Which factor makes the gap?
# One factor at a time against the grid's FedKD, at Dirichlet(0.1) (the largest gap), the same seeds (paired: each seed is one split that
# every arm shares), fewer rounds than the grid to fit its budget. Every arm is scored as the grid
# scores it: each agent's deployed model on the balanced set (global) and on its own test shard
# (local: the paper's "average performance of local mentor models on the local data"), the
# mentee beside the mentors; the two FedAvg arms are the baselines at the same rounds.


@dataclass(frozen=True)
class Arm:
    name: str  # the run's name before its partition key
    base: str  # the METHODS run whose [method] table it starts from
    changes: dict[str, Any]  # what it sets on top of that table: its one factor
    factor: str  # the factor, in words
    # A FedAvg baseline: read from the grid's recorded run of the same seed, up to the ablation's
    # rounds, where the JSON holds one (FedAvg has no schedule over the run's rounds and the agents
    # drawn in a round depend on (seed, round) alone: the grid's round R is a run of R rounds).
    from_grid: bool = False
    # The partitions it runs at (None: every partition of the ablation's scale). At IID only what
    # names the cause there: FedKD, its local-only mentor and the two baselines.
    where: tuple[str, ...] | None = None


FEDKD_ARMS: tuple[Arm, ...] = (
    Arm("fedkd", "fedkd", {}, "none: FedKD as the grid runs it (ConvNet mentors, SimpleCNN mentee, T 0.95 -> 0.98, "
                              "10 local epochs, adaptive mutual distillation and hidden losses)"),
    Arm("fedavg-mentor", "fedavg-mentor", {}, "the claim's baseline: FedAvg of the mentors' model (ConvNet)", from_grid=True),
    Arm("mentor-local", "fedkd", {"mentor_distillation": False},
        "the mentor learns from its own labels only (no distillation or hidden term from the mentee): a purely "
        "local model (the paper's Fig. 2, without mutual distillation)"),
    Arm("no-svd", "fedkd", {"threshold_start": 1.0, "threshold_end": 1.0},
        "SVD compression off: T = 1 keeps every singular value, updates travel lossless both ways", where=("dir0.1",)),
    Arm("mentee-ce", "fedkd", {"mentee_distillation": False},
        "the mentee learns from its labels only (its mentor does not teach it): FedAvg of the mentee with "
        "SVD-factored updates", where=("dir0.1",)),
    Arm("fixed-weight", "fedkd", {"adaptive_weight": False},
        "distillation and hidden terms weighted 1, not 1 / (L^t_t + L^t_s) (the paper's Fig. 3)", where=("dir0.1",)),
    Arm("epochs-2", "fedkd", {"local_epochs": 2}, "2 local epochs instead of 10", where=("dir0.1",)),
    Arm("mentee-convnet", "fedkd", {"mentee_model": MENTOR}, f"the mentee as large as the mentor ({MENTOR_LABEL})", where=("dir0.1",)),
    Arm("fedavg", "fedavg", {}, "the mentee's baseline: FedAvg of the mentee's model (SimpleCNN)", from_grid=True),
)
ARMS_BY_NAME = {a.name: a for a in FEDKD_ARMS}

ABLATION_SCALES = {
    # Dirichlet(0.1), the grid's seeds and regime, 6 rounds (evaluated in rounds 2, 4, 6): few
    # enough for every arm and seed to fit the budget on a machine shared with other jobs (each
    # run's wall and CPU time are recorded in ``ablations.fedkd`` of bench/results/kd_methods.json).
    # Dir(0.5) and IID (FedKD's mentors fail there too on the balanced set, and at IID on both
    # measures; the paper's MIND / ADR folds are IID): the four arms that run everywhere, 2 of them
    # FedKD runs a seed.
    "full": dataclasses.replace(SCALES["full"], name="ablation-fedkd", rounds=6, partitions=("dir0.1", "dir0.5", "iid"),
                                budget_minutes=90,
                                fedbe_server={}),
    # The pipeline check the test suite runs: synthetic data, every arm, two seeds, one round.
    "quick": dataclasses.replace(SCALES["quick"], name="ablation-fedkd-quick", rounds=1, fedbe_server={}),
}

#: What each figure of an arm is, read from a run's summary (None where the arm has no such model).
ABLATION_FIGURES: dict[str, tuple[str, Any]] = {
    "deployed_global": ("the deployed model(s) on the balanced set: FedKD's mentors (mean over the round's agents), "
                        "FedAvg's global model", lambda r: r["final_accuracy"]),
    "deployed_local": ("the same on each agent's own test shard, sample-weighted over the last evaluated round's agents",
                       lambda r: r.get("final_local_accuracy")),
    "mentee_global": ("FedKD's global mentee on the balanced set", lambda r: r["final_by_label"]["global"].get("mentee")),
    "mentee_local": ("FedKD's global mentee on the same agents' shards", lambda r: r["final_by_label"]["local"].get("mentee")),
    "local_majority": ("a constant predictor of each agent's most common test class, on the same agents' shards: what "
                       "local accuracy a model gets without telling classes apart", lambda r: r.get("local_majority_accuracy")),
}


def ablation_plan(scale: Scale, arms: Sequence[Arm] = FEDKD_ARMS) -> list[tuple[str, Arm, RunSpec]]:
    """(partition key, arm, run) for one seed: every arm on every partition of ``scale``."""
    return [(key, arm, RunSpec(f"{arm.name}-{key}", METHODS[arm.base][0], {**method_config(arm.base, scale), **arm.changes},
                               scale.rounds, eval_every=scale.eval_every, server={"client_fraction": scale.client_fraction}))
            for key in scale.partitions for arm in arms if arm.where is None or key in arm.where]


def local_majority_accuracy(report: Mapping[str, Any], data: DataSpec) -> float | None:
    """What predicting each agent's most common test class scores on its own test shard,
    sample-weighted over the agents of the last evaluated round (those the run's local accuracy
    is over): the floor that local accuracy is to be read against at strong skew."""
    agents = next((list((r.get("evaluation") or {}).get("per_agent") or {}) for r in reversed(report["rounds"])
                   if (r.get("evaluation") or {}).get("local_accuracy")), [])
    if not agents:
        return None
    import numpy as np

    from edge_agent.config import DataConfig
    from edge_agent.simulate import shards

    base = DataConfig(dataset=data.dataset, partition=data.partition, num_agents=data.agents, seed=data.seed,
                      train_samples=data.train_samples, test_samples=data.test_samples)
    tests = {f"agent-{i}": test for i, (_train, test) in enumerate(shards(base, data.agents))}  # as run_federation names them
    counts = [np.bincount(np.asarray(tests[a].labels, dtype=np.int64)) for a in agents if len(tests[a])]
    total = sum(int(c.sum()) for c in counts)
    return sum(int(c.max()) for c in counts) / total if total else None


def grid_baseline(grid_runs: Mapping[str, Any], grid_key: Mapping[str, Any] | None, scale: Scale, key: str, arm: Arm,
                  run: RunSpec, seed: int) -> dict[str, Any] | None:
    """``arm``'s run of ``seed`` read from the grid's recorded one (``grid_runs``, at ``grid_key``'s
    scale), cut at the ablation's rounds; None unless the grid ran exactly this run on the same data
    and regime for at least as many rounds, and evaluated the ablation's last round."""
    if not arm.from_grid or grid_key is None:
        return None
    regime = ("dataset", "agents", "client_fraction", "train_samples", "test_samples", "eval_every", "local_epochs", "model", "mentor")
    if any(grid_key.get(k) != scale.key()[k] for k in regime) or grid_key.get("rounds", 0) < scale.rounds:
        return None
    recorded = grid_runs.get(run_key(f"{arm.base}-{key}", seed))
    if recorded is None or recorded.get("status") != "finished" or len(recorded["rounds"]) < scale.rounds:
        return None
    if any(recorded["method_config"].get(k) != v for k, v in run.method_config.items()):
        return None
    kept = recorded["rounds"][: scale.rounds]
    last = kept[-1]
    if last["accuracy"] is None:
        return None
    labels = (recorded.get("final_by_label") or {}).get("labels") or {}
    return {**recorded, "name": run.name, "method_name": arm.name, "arm": arm.name, "rounds": kept,
            "final_accuracy": last["accuracy"], "final_local_accuracy": last["local_accuracy"],
            "best_accuracy": max(r["accuracy"] for r in kept if r["accuracy"] is not None),
            "final_by_label": {"global": dict(last["by_label"].get("global") or {}), "local": dict(last["by_label"].get("local") or {}),
                               "labels": labels},
            "wire_total_bytes": last["cumulative_wire"], "edge_train_flops_total": sum(r["edge_train_flops"] for r in kept),
            "server_flops_total": None, "local_majority_accuracy": None,
            "run_wall_time_s": None, "run_cpu_s": None, "finished_at": None,
            "from_grid": {"run": run_key(f"{arm.base}-{key}", seed), "grid_rounds": len(recorded["rounds"]), "cut_at_round": scale.rounds}}


def _by_seed(runs: Mapping[str, Any], name: str, read: Any) -> dict[str, float | None]:
    return {str(r["seed"]): read(r) for r in runs.values() if r["name"] == name}


def ablation_effects(runs: Mapping[str, Any], scale: Scale) -> dict[str, Any]:
    """Per partition, every arm's figures (mean ± sd over seeds, and per seed) and, paired over
    seeds: each FedKD arm minus the FedKD arm (the factor's effect), its mentors minus
    FedAvg(ConvNet) (global, and local: the paper's comparison), its mentee minus FedAvg(SimpleCNN)."""
    out: dict[str, Any] = {}
    for key in scale.partitions:
        part: dict[str, Any] = {"arms": {}, "effect_vs_fedkd": {}, "versus_fedavg": {}}
        base, big, small = f"fedkd-{key}", f"fedavg-mentor-{key}", f"fedavg-{key}"
        for arm in FEDKD_ARMS:
            name = f"{arm.name}-{key}"
            if not any(r["name"] == name for r in runs.values()):
                continue
            figures = {fig: _by_seed(runs, name, read) for fig, (_, read) in ABLATION_FIGURES.items()}
            part["arms"][arm.name] = {fig: {**mean_sd(v.values()), "by_seed": v} for fig, v in figures.items()}
            if METHODS[arm.base][0] != "fedkd":
                continue
            if arm.name != "fedkd":
                part["effect_vs_fedkd"][arm.name] = {
                    fig: paired(figures[fig], _by_seed(runs, base, read))
                    for fig, (_, read) in ABLATION_FIGURES.items() if fig != "local_majority"}
            deployed = {where: _by_seed(runs, big, ABLATION_FIGURES[f"deployed_{where}"][1]) for where in ("global", "local")}
            small_deployed = {where: _by_seed(runs, small, ABLATION_FIGURES[f"deployed_{where}"][1]) for where in ("global", "local")}
            part["versus_fedavg"][arm.name] = {
                **{f"mentors_vs_fedavg_mentor_{w}": paired(figures[f"deployed_{w}"], deployed[w]) for w in ("global", "local")},
                **{f"mentee_vs_fedavg_{w}": paired(figures[f"mentee_{w}"], small_deployed[w]) for w in ("global", "local")},
            }
        out[key] = part
    return out


def previous_ablation_runs(out: Path, run_root: Path, scale: Scale, name: str = "fedkd") -> dict[str, Any]:
    """The ablation's runs of this scale recorded before: in ``out``'s ``ablations`` section and
    in the runs' ``summary.json`` (the newer wins; each summarised again from its report)."""
    found: dict[str, Any] = {}
    if out.exists():
        section = (json.loads(out.read_text()).get("ablations") or {}).get(name) or {}
        key, specs = (section.get("scale") or {}).get("key"), {run.name: run for _, _, run in ablation_plan(scale)}
        found.update({k: r for k, r in (section.get("runs") or {}).items()
                      if recorded_for(key, r, scale, None if r.get("from_grid") else specs.get(r["name"]))})
    found.update(runs_on_disk(run_root, scale, {run.name: (key, arm.name, run) for key, arm, run in ablation_plan(scale)}))
    return found


def ablation_document(runs: dict[str, Any], scale: Scale, generated_by: str) -> dict[str, Any]:
    """The ``ablations.fedkd`` section of the JSON: the arms, every run, the cells and the effects."""
    names = {run.name for _, _, run in ablation_plan(scale)}
    complete = {run_key(n, s) for n in names for s in scale.seeds} <= set(runs)
    made = {k: r for k, r in runs.items() if not r.get("from_grid")}  # the baselines read from the grid took no time here
    elapsed, elapsed_is = elapsed_s(made) if made else (0.0, "no runs")
    walls: dict[str, list[float]] = {}
    for r in runs.values():
        if r.get("run_wall_time_s") is not None:
            walls.setdefault(r["name"], []).append(float(r["run_wall_time_s"]))
    projected = sum(sum(w) / len(w) * len(scale.seeds) for w in walls.values()) / 60
    eval_set, same_set = eval_set_of(runs)
    return {
        "description": "FedKD one factor at a time against the grid's FedKD at Dirichlet(0.1) (and at IID FedKD, its "
                       "local-only mentor and the baselines): which factor makes its mentors' gap to FedAvg(ConvNet) on the "
                       "balanced set, and how the arms compare on the agents' own shards (the paper's evaluation); paired "
                       "over seeds.",
        "scale": {"key": scale.key(), "name": scale.name, "dataset": scale.dataset, "agents": scale.agents,
                  "client_fraction": scale.client_fraction, "train_samples": scale.train_samples,
                  "test_samples": scale.test_samples, "rounds": scale.rounds, "eval_every": scale.eval_every,
                  "local_epochs": scale.local_epochs, "partitions": {k: PARTITIONS[k] for k in scale.partitions},
                  "seeds": sorted({r["seed"] for r in runs.values()}), "planned_seeds": list(scale.seeds), "complete": complete},
        "arms": {a.name: {"factor": a.factor, "base": a.base, "changes": a.changes, "method": METHODS[a.base][0],
                          "method_config": {**method_config(a.base, scale), **a.changes}, "from_grid_if_recorded": a.from_grid,
                          "partitions": list(a.where or scale.partitions)}
                 for a in FEDKD_ARMS},
        "figures": {fig: what for fig, (what, _) in ABLATION_FIGURES.items()},
        "paired_rule": PAIRED_RULE,
        "effects": ablation_effects(runs, scale),
        "cells": cells(runs) if runs else {},
        "eval_set": eval_set, "eval_set_same_for_every_run": same_set,
        "budget": {**budget(elapsed, scale.budget_minutes, complete, True), "wall_time_is": elapsed_is,
                   "projected_minutes": projected},
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS"),
        "machine": machine(),
        "runs": runs,
        "generated_by": generated_by,
    }


def write_ablation(out: Path, name: str, section: dict[str, Any]) -> None:
    """Put ``section`` at ``ablations[name]`` of the JSON at ``out``, keeping everything else in it."""
    doc = json.loads(out.read_text()) if out.exists() else {"benchmark": "kd_methods"}
    doc.setdefault("ablations", {})[name] = section
    write_json(out, doc)


def carry_ablations(out: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the ``ablations`` section of the JSON already at ``out`` (the grid rewrites the
    file from its runs; the ablations are not its runs and must not be lost)."""
    if out.exists():
        previous = json.loads(out.read_text()).get("ablations")
        if previous:
            doc = {**doc, "ablations": previous}
    return doc


def check_only(parser: argparse.ArgumentParser, only: Sequence[str] | None, names: set[str]) -> None:
    """``--only`` names runs of the plan (the grid's or the ablation's), or the command stops naming them."""
    unknown = sorted(set(only or ()) - names)
    if unknown:
        parser.error(f"--only: no runs named {unknown}; the runs are {sorted(names)}")


def run_ablation(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--ablation fedkd``: every arm (or ``--only``'s), every seed, into ``ablations.fedkd`` of the JSON."""
    scale = ABLATION_SCALES["quick" if args.quick else "full"]
    seeds = args.seeds if args.seeds is not None else list(scale.seeds)
    plan_ = ablation_plan(scale)
    check_only(parser, args.only, {run.name for _, _, run in plan_})
    run_root = scale_folder(args.run_dir, scale)
    recorded = json.loads(args.out.read_text()) if args.out.exists() else {}
    grid_key = (recorded.get("scale") or {}).get("key")
    runs: dict[str, Any] = {}
    for seed in seeds:  # seed by seed: every finished seed is a complete paired comparison of the arms
        for key, arm, run in plan_:
            if args.collect or (args.only and run.name not in args.only):
                continue
            derived = grid_baseline(recorded.get("runs") or {}, grid_key, scale, key, arm, run, seed)
            if derived is not None:
                runs[run_key(run.name, seed)] = derived
                print(f"== ablation {run.name} seed {seed}: the grid's {derived['from_grid']['run']} up to round {scale.rounds}")
                continue
            if args.resume and summary_matches(run_root / run_key(run.name, seed) / "summary.json", scale, run):
                continue
            data = DataSpec(scale.dataset, PARTITIONS[key], scale.agents, scale.train_samples, scale.test_samples, seed=seed)
            load_before = list(os.getloadavg())
            print(f"== ablation {run.name} seed {seed}: {arm.factor}", flush=True)
            started, cpu_started = time.monotonic(), _cpu_s()
            report = run_federation(run, data, run_root / run_key(run.name, seed))
            done = {**summarize(key, arm.name, run, seed, report), "arm": arm.name,
                    "local_majority_accuracy": local_majority_accuracy(report, data),
                    "run_wall_time_s": time.monotonic() - started, "run_cpu_s": _cpu_s() - cpu_started,
                    "finished_at": time.time(), "load_average_before": load_before, "load_average_after": list(os.getloadavg())}
            runs[run_key(run.name, seed)] = done
            write_json(run_root / run_key(run.name, seed) / "summary.json", {"scale": scale.key(), "run": done})
            mentee = done["final_by_label"]["global"].get("mentee")
            print(f"   global {done['final_accuracy']}, local {done['final_local_accuracy']}, mentee {mentee}, "
                  f"{done['run_wall_time_s']:.0f} s", flush=True)
    if args.merge or args.collect or args.resume:
        runs = {**previous_ablation_runs(args.out, run_root, scale), **runs}
    if not runs:
        parser.error("no ablation runs made or recorded for this scale")
    merged = args.merge or args.collect or args.resume
    section = ablation_document(runs, scale, "bench/kd_methods.py --ablation fedkd" + (" --quick" if args.quick else "")
                                + (" (runs merged with --merge / --collect / --resume)" if merged else ""))
    write_ablation(args.out, "fedkd", section)
    for key, part in section["effects"].items():
        for arm, figures in part["arms"].items():
            line = ", ".join(f"{fig} {100 * f['mean']:.1f}" for fig, f in figures.items() if f["mean"] is not None)
            print(f"{arm:15s} {key}: {line}")
    print(f"ablation: {section['budget']['wall_time_min']:.1f} min for {len(runs)} runs; projected "
          f"{section['budget']['projected_minutes']:.0f} min for every arm and seed", flush=True)
    return 0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="synthetic data, every method, 2 seeds: the pipeline check (< 1 min)")
    parser.add_argument("--seeds", type=parse_seeds, help="comma-separated seeds (default: the scale's, 0,1,2)")
    parser.add_argument("--only", nargs="*", help="run only these runs (e.g. fedgkd-dir0.1), every seed of --seeds")
    parser.add_argument("--collect", action="store_true", help="run nothing: write the JSON from the runs recorded before")
    parser.add_argument("--merge", action="store_true", help="also keep the runs of this scale recorded before")
    parser.add_argument("--resume", action="store_true",
                        help="skip the runs whose summary.json is already in --run-dir (implies --merge): an interrupted grid goes on")
    parser.add_argument("--out", type=Path, help="default: bench/results/kd_methods.json (--quick: in --run-dir)")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "kd_methods")
    parser.add_argument("--ablation", choices=("fedkd",),
                        help="run the ablation instead of the grid: FedKD one factor at a time at Dirichlet(0.1) "
                             "(into the JSON's ablations section; --only names its runs, e.g. no-svd-dir0.1)")
    args = parser.parse_args(argv)
    quiet_logs()
    scale = SCALES["quick" if args.quick else "full"]
    if args.out is None:
        args.out = args.run_dir / "kd_methods-quick.json" if args.quick else RESULTS / "kd_methods.json"
    if args.ablation == "fedkd":
        return run_ablation(args, parser)
    seeds = args.seeds if args.seeds is not None else list(scale.seeds)
    runs = plan(scale)
    check_only(parser, args.only, {run.name for _, _, run in runs})
    run_root = scale_folder(args.run_dir, scale)
    results: dict[str, Any] = {}
    for seed in seeds:
        for key, name, run in runs:
            if args.collect or (args.only and run.name not in args.only):
                continue
            if args.resume and summary_matches(run_root / run_key(run.name, seed) / "summary.json", scale, run):
                continue
            data = DataSpec(scale.dataset, PARTITIONS[key], scale.agents, scale.train_samples, scale.test_samples, seed=seed)
            load_before = list(os.getloadavg())
            print(f"== {run.name} seed {seed} ({data.partition}, {scale.agents} agents, C = {scale.client_fraction}, "
                  f"{scale.rounds} rounds)", flush=True)
            started, cpu_started = time.monotonic(), _cpu_s()
            report = run_federation(run, data, run_root / run_key(run.name, seed))
            # CPU seconds of this process (server, agents) beside the wall time: on a machine shared
            # with other jobs the wall time grows with their load, the CPU time much less.
            done = {**summarize(key, name, run, seed, report), "run_wall_time_s": time.monotonic() - started,
                    "run_cpu_s": _cpu_s() - cpu_started, "finished_at": time.time(),
                    "load_average_before": load_before, "load_average_after": list(os.getloadavg())}
            results[run_key(run.name, seed)] = done
            # Kept next to its report: an interrupted grid (or another invocation with --merge) keeps it.
            write_json(run_root / run_key(run.name, seed) / "summary.json", {"scale": scale.key(), "run": done})
            print(f"   global {done['final_accuracy']}, local {done['final_local_accuracy']}, "
                  f"{done['run_wall_time_s']:.0f} s", flush=True)
    if args.merge or args.collect or args.resume:
        results = {**previous_runs(args.out, run_root, scale), **results}
    if not results:
        parser.error("no runs made or recorded for this scale")
    merged = args.merge or args.collect or args.resume
    doc = document(results, scale, None if merged else seeds, "bench/kd_methods.py" + (" --quick" if args.quick else "")
                   + (" (runs merged with --merge / --collect / --resume)" if merged else ""))
    write_json(args.out, carry_ablations(args.out, doc))
    for row in doc["claims"]:
        m, b = row["method_accuracy"], row["baseline_accuracy"]
        print(f"{row['method']:12s} {row['partition']:7s} {100 * (m['mean'] or 0):5.1f} vs {row['baseline']} "
              f"{100 * (b['mean'] or 0):5.1f}: {row['verdict']}")
    check = doc["budget"]
    print(f"total {check['wall_time_min']:.1f} min for {len(results)} runs; projected {check['projected']['minutes']:.0f} min for "
          f"the grid: {check['verdict']} of {scale.budget_minutes:.0f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
