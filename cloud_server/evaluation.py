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
on the global set when they are no secret (FedGKT's ResNet-8 on a server-made
frozen extractor, instead of thousands of test feature maps). A split method also
streams its test activations before the report (the server holds the other half
of the model).

A model the method keeps private (FedKD's mentor; FedGKT's extractor when it is
private) never leaves the device: as Flower's federated evaluation, the agent
scores it on the global set itself and reports (correct, total) in
``EvalReport.global_results``. The request names the set
(:class:`~shared_protocol.messages.PublicEvalSet`: dataset, subset, seed and the
sha256 of its ids and images); the agent loads it from its own copy of the public
dataset and checks the digests, or asks the server for it
(:class:`~shared_protocol.messages.EvalSetRequest` /
:class:`~shared_protocol.messages.EvalSetData`, evaluation bytes), once per run.
The server checks every such report against its set
(:func:`check_global_results`) and averages the figures exactly as it averages
its own scores (:attr:`Evaluation.global_reported`).
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
from fldata.public_set import load_public_test_set, public_set_digests
from fldata.torch_data import TorchArrayDataset
from models.training import INFERENCE_BATCH_SAMPLES
from shared_protocol.errors import UnknownEvalSetError, ValueRangeError
from shared_protocol.messages import EvalReport, PublicEvalSet

from .records import HEADLINE, RoundEvaluation

log = logging.getLogger("cloud_server.evaluation")

__all__ = [
    "EVAL_BATCH_SAMPLES", "EvalModel", "EvalSet", "EvalSetSpec", "Evaluation", "Evaluator", "HEADLINE",
    "check_global_results", "global_results", "local_results", "models_from_report",
]

#: Images per forward pass when scoring a model on the global set.
EVAL_BATCH_SAMPLES = INFERENCE_BATCH_SAMPLES
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
        self.ids_sha256, self.images_sha256 = public_set_digests(data)

    @classmethod
    def load(cls, spec: EvalSetSpec) -> "EvalSet | None":
        if spec.dataset == NO_EVAL_SET:
            return None
        return cls(load_public_test_set(spec.dataset, spec.samples, spec.seed, spec.root, spec.download), spec)

    def __len__(self) -> int:
        return len(self.data)

    @property
    def num_classes(self) -> int:
        return self.data.num_classes

    def describe(self) -> dict[str, Any]:
        """What report.json says about the set: enough to tell two runs used the same images."""
        return {
            "dataset": self.spec.dataset, "split": "test", "samples": len(self.data), "seed": self.spec.seed,
            "ids_sha256": self.ids_sha256, "images_sha256": self.images_sha256,
            "class_counts": [int(c) for c in self.data.class_counts()],
        }

    def public(self) -> PublicEvalSet:
        """The set as an :class:`~shared_protocol.messages.EvalRequest` names it to an agent that
        scores a private model on it (loaded with :func:`fldata.public_set.load_public_test_set`)."""
        return PublicEvalSet(dataset=self.spec.dataset, split="test", subset_samples=self.spec.samples, seed=self.spec.seed,
                             samples=len(self.data), ids_sha256=self.ids_sha256, images_sha256=self.images_sha256)

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
    # A digest of everything ``forward`` depends on (weights, buffers, statistics; see
    # :func:`module_digest`): models of one round with the same identity are scored once.
    # None: scored on its own.
    identity: str | None = None


def module_digest(*modules: torch.nn.Module, extra: str = "") -> str:
    """sha256 over the modules' whole state (parameters and buffers, by name) and ``extra``:
    equal digests, equal functions."""
    digest = hashlib.sha256(extra.encode())
    for module in modules:
        for name, value in module.state_dict().items():
            digest.update(name.encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


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
    global_reported: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
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


def global_results(reports: Mapping[str, EvalReport], rename: Mapping[str, str] | None = None) -> dict[str, dict[str, tuple[int, int]]]:
    """``Evaluation.global_reported`` from the agents' reports: label -> agent -> (correct, total)
    of the private models they scored on the global set themselves."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for agent, report in sorted(reports.items()):
        for label, figures in report.global_results.items():
            out.setdefault((rename or {}).get(label, label), {})[agent] = (int(figures["correct"]), int(figures["total"]))
    return out


def check_global_results(report: EvalReport, eval_set: "EvalSet | None") -> None:
    """Refuse a report whose ``global_results`` were not scored on the run's global set: the
    set it names must be the server's (its images' sha256) and every figure's total that set's
    size (``correct <= total`` is the message's own check)."""
    if not report.global_results:
        return
    if eval_set is None:
        raise UnknownEvalSetError("eval_report carries global_results, but this run has no global test set "
                                  "([server] eval_dataset = \"none\"): nothing was asked to be scored on one")
    if report.public_set_sha256 != eval_set.images_sha256:
        raise UnknownEvalSetError(f"eval_report's global_results were scored on public set images_sha256 "
                                  f"{report.public_set_sha256[:16]}..., this run's is {eval_set.images_sha256[:16]}... "
                                  "(the agent's copy of the dataset differs, or the report is from another run)")
    for label, figures in report.global_results.items():
        if figures["total"] != len(eval_set):
            raise ValueRangeError(f"eval_report: global_results.{label} total = {figures['total']}, the global test set "
                                  f"has {len(eval_set)} images: every image must be scored once")


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
        scored: dict[str, tuple[int, int]] = {}  # identity -> its (correct, total), this round
        counts = {"scored": 0, "reused": 0}

        def score_once(model: EvalModel) -> tuple[int, int]:
            if model.identity is not None and model.identity in scored:
                counts["reused"] += 1
                return scored[model.identity]
            counts["scored"] += 1
            result = self.score(model)
            if model.identity is not None:
                scored[model.identity] = result
            return result

        if self.eval_set is not None:
            reported_only = [label for label in evaluation.global_reported if label not in evaluation.global_models]
            for label in [*evaluation.global_models, *reported_only]:
                scores = {who: score_once(model) for who, model in sorted(evaluation.global_models.get(label, {}).items())}
                scores.update(evaluation.global_reported.get(label, {}))  # scored on the device, checked on arrival
                if not scores:
                    continue
                fractions = []
                for who, (correct, total) in sorted(scores.items()):
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
                               server_eval_s=time.perf_counter() - started, figures=dict(evaluation.figures),
                               models_scored=counts["scored"], models_reused=counts["reused"])
