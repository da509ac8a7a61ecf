"""One evaluation for every method: the run's global test set, and the agents' own shards.

Every method is judged the same way, or the comparison is worthless. Two kinds of
accuracy, as Flower separates ``evaluate`` (centralized) from
``configure_evaluate`` / ``aggregate_evaluate`` (federated):

* **global** (the headline): the method's deployed model(s) on one balanced
  held-out test set that the server holds (:class:`EvalSet`: a seeded, stratified
  subset of the dataset's test split, the same images for every method of a run).
  One global model (FedAvg and its family, FedBE, centralized training): that
  model. A model per agent (FedGKT: agent k's extractor followed by the server
  model; FedKD: each agent's mentor): the mean over agents of each agent's model
  on the same images.
* **local**: each agent's deployed model on its own test shard, sample-weighted.

How a round is evaluated (the coordinator, for every method): after the method's
``complete`` and its downloads, every agent that finished the round gets an
:class:`~shared_protocol.messages.EvalRequest`. It evaluates what it holds on its
own shard and answers with an :class:`~shared_protocol.messages.EvalReport`: the
figures, and the agent-side model(s) the server needs to score the deployed model
on the global set (FedGKT's 10,586-parameter ResNet-8, about 42 KB, instead of
thousands of test feature maps). A split method also streams its test
activations before the report (the server holds the other half of the model).
When the round closes, the method's one evaluation hook,
:meth:`~cloud_server.methods.base.ServerMethod.evaluation`, says which models
to score and which local figures came in (:class:`Evaluation`), and
:class:`Evaluator` scores every model on the global set and writes the round's
:class:`~cloud_server.records.RoundEvaluation`. Evaluation traffic (requests,
reports, test activations) and evaluation FLOPs are metered apart from training.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ContextManager

import numpy as np
import torch

from fldata import ArrayDataset
from fldata.datasets import load_dataset, take
from fldata.torch_data import TorchArrayDataset
from shared_protocol.messages import EvalReport

from .records import RoundEvaluation

log = logging.getLogger("cloud_server.evaluation")

__all__ = [
    "EVAL_BATCH_SAMPLES", "EvalModel", "EvalSet", "EvalSetSpec", "Evaluation", "Evaluator", "HEADLINE",
    "local_results", "models_from_report",
]

#: Images per forward pass when scoring a model on the global set.
EVAL_BATCH_SAMPLES = 256
#: The label of a method's deployed model: its figures are the round's ``accuracy`` and ``local_accuracy``.
HEADLINE = "model"
#: No global test set (a deployment whose server holds none): only local figures.
NO_EVAL_SET = "none"


@dataclass(frozen=True)
class EvalSetSpec:
    """Where the server's global test set comes from: a seeded, stratified subset of a
    dataset's test split (``samples`` 0: the whole split); dataset ``"none"``: no global set."""

    dataset: str
    samples: int = 0
    seed: int = 0
    root: str | None = None
    download: bool = False

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise ValueError(f"eval_samples must be >= 0, got {self.samples}")


class EvalSet:
    """The global test set: images, labels and their stable sample ids, balanced by class
    (``fldata.datasets.take`` keeps class proportions, and test splits are balanced)."""

    def __init__(self, data: ArrayDataset, spec: EvalSetSpec) -> None:
        if len(data) == 0:
            raise ValueError(f"the global test set of {spec.dataset!r} is empty")
        self.data = data
        self.spec = spec
        self._normalised = TorchArrayDataset(data)

    @classmethod
    def load(cls, spec: EvalSetSpec) -> "EvalSet | None":
        if spec.dataset == NO_EVAL_SET:
            return None
        # As fldata.subsets.seeded_subset cuts the test split the agents' test shares come from.
        test = load_dataset(spec.dataset, "test", spec.root, spec.download)
        if spec.samples:
            test = take(test, min(spec.samples, len(test)), spec.seed)
        return cls(test, spec)

    def __len__(self) -> int:
        return len(self.data)

    @property
    def num_classes(self) -> int:
        return self.data.num_classes

    def describe(self) -> dict[str, Any]:
        """What report.json says about the set: enough to tell two runs used the same images."""
        ids = np.ascontiguousarray(self.data.sample_ids, dtype="<i8")
        return {
            "dataset": self.spec.dataset, "split": "test", "samples": len(self.data), "seed": self.spec.seed,
            "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
            "images_sha256": hashlib.sha256(np.ascontiguousarray(self.data.images).tobytes()).hexdigest(),
            "class_counts": [int(c) for c in self.data.class_counts()],
        }

    def batches(self, batch_samples: int = EVAL_BATCH_SAMPLES) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(normalised images (B, C, H, W) float32, labels (B,) int64), in a fixed order."""
        n = len(self.data)
        for start in range(0, n, batch_samples):
            rows = range(start, min(n, start + batch_samples))
            items = [self._normalised[i] for i in rows]
            yield torch.stack([x for x, _, _ in items]), torch.stack([y for _, y, _ in items])


@dataclass
class EvalModel:
    """A model to score on the global set: ``forward(images (B, C, H, W)) -> logits (B, K)``
    on the server's device, inside ``setup()`` when given (entered once around the whole
    pass: e.g. load an agent's BatchNorm statistics, then restore the server's)."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    setup: Callable[[], ContextManager[Any]] | None = None
    device: str | torch.device | None = None  # where the model lives (None: the evaluator's device)


@dataclass
class Evaluation:
    """What a method's evaluation hook returns for a round (see the module docstring).

    ``global_models[label]``: ``{agent id: model}`` for a model per agent, or
    ``{GLOBAL: model}`` for one model; the label's global accuracy is the mean over its
    models. ``local[label][agent]``: (correct, total) of that agent's model on its shard.
    ``labels[label]``: what the label's models are, for the report. ``HEADLINE`` ("model")
    is the method's deployed model; ``edge`` names the label of the models left on the
    devices when they differ from the deployed one (FedGKT's ResNet-8s)."""

    GLOBAL = "global"

    global_models: dict[str, dict[str, EvalModel]] = field(default_factory=dict)
    local: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    edge: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)  # method-specific extras (small, JSON-able)


def local_results(reports: Mapping[str, EvalReport], rename: Mapping[str, str] | None = None) -> dict[str, dict[str, tuple[int, int]]]:
    """``Evaluation.local`` from the agents' reports: label -> agent -> (correct, total);
    ``rename`` maps an agent's label to the report's (e.g. FedKD's "mentor" -> "model")."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for agent, report in sorted(reports.items()):
        for label, figures in report.results.items():
            out.setdefault((rename or {}).get(label, label), {})[agent] = (int(figures["correct"]), int(figures["total"]))
    return out


def models_from_report(report: EvalReport, label: str) -> dict[str, np.ndarray]:
    """The arrays of ``label``'s model in an agent's report (``LABEL/PARAM`` names), by PARAM."""
    prefix = label + "/"
    return {name[len(prefix):]: array for name, array in report.models.items() if name.startswith(prefix)}


class Evaluator:
    """Scores an :class:`Evaluation` on the global set and makes the round's figures."""

    def __init__(self, eval_set: EvalSet | None, device: str | torch.device = "cpu") -> None:
        self.eval_set = eval_set
        self.device = torch.device(device)
        self._batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _global_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._batches is None:
            assert self.eval_set is not None
            self._batches = list(self.eval_set.batches())  # (B, C, H, W) float32, (B,) int64: kept for every round
        return self._batches

    @torch.no_grad()
    def score(self, model: EvalModel) -> tuple[int, int]:
        """(correct, total) of one model on the global set."""
        correct = total = 0
        device = torch.device(model.device) if model.device is not None else self.device
        with model.setup() if model.setup is not None else contextlib.nullcontext():
            for images, labels in self._global_batches():
                logits = model.forward(images.to(device))  # (B, K)
                correct += int((logits.argmax(1).cpu() == labels).sum())
                total += int(labels.shape[0])
        return correct, total

    def run(self, evaluation: Evaluation) -> RoundEvaluation:
        """The round's evaluation figures: accuracy / local_accuracy per label, per agent, the
        server's scoring seconds (the agents' costs and the bytes are added by the caller)."""
        started = time.perf_counter()
        per_agent: dict[str, dict[str, Any]] = {}
        accuracy: dict[str, float] = {}
        if self.eval_set is not None:
            for label, models in evaluation.global_models.items():
                if not models:
                    continue
                fractions = []
                for who, model in sorted(models.items()):
                    correct, total = self.score(model)
                    fractions.append(correct / total)
                    if who != Evaluation.GLOBAL:
                        per_agent.setdefault(who, {}).setdefault("accuracy", {})[label] = correct / total
                accuracy[label] = float(np.mean(fractions))  # the mean over agents of each agent's model
        local: dict[str, float] = {}
        for label, by_agent in evaluation.local.items():
            correct = sum(c for c, _ in by_agent.values())
            total = sum(t for _, t in by_agent.values())
            if total:
                local[label] = correct / total  # sample-weighted over the agents' shards
            for agent, (c, t) in by_agent.items():
                entry = per_agent.setdefault(agent, {})
                if t:
                    entry.setdefault("local_accuracy", {})[label] = c / t
                entry["local_samples"] = max(int(entry.get("local_samples", 0)), t)
        return RoundEvaluation(accuracy=accuracy, local_accuracy=local, labels=dict(evaluation.labels), per_agent=per_agent,
                               server_eval_s=time.perf_counter() - started, figures=dict(evaluation.figures))
