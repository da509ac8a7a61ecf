"""FedGKT's evaluation (cloud_server/evaluation.py): agent k's deployed model is its
extractor followed by the server model, with the server's running BatchNorm averages
(the headline) and, labelled ``personalised_bn``, with agent k's own statistics.

With a server-made frozen extractor (no secret) the agents send their ResNet-8 and
their test maps, and the server scores. With a private extractor
(``FedGktConfig.private_extractor``) the ResNet-8 never leaves the device: the server
sends each agent its model (and, when due, the agent's BatchNorm statistics) with the
evaluation request (:class:`GktEvalModel`, evaluation bytes), and the agent scores
every label on the public global set and on its shard itself.

A mixin of :class:`cloud_server.methods.fedgkt.FedGktServer`: it reads the server's
model, its staged test maps and the agents' BatchNorm statistics, which the server keeps.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Any

import torch

from models import build_model, load_arrays_into, state_dict_to_arrays
from models.batchnorm import BnStatistics, load_bn_statistics, restoring_bn_statistics
from models.weights import WeightsMismatchError
from shared_protocol.errors import MapsNotHeldError
from shared_protocol.messages import EvalReport, Message
from shared_protocol.methods.fedgkt import GktEvalModel

from ..evaluation import HEADLINE, EvalModel, Evaluation, global_results, local_results, models_from_report, module_digest
from ..feature_store import AgentRows, StagedUploads, gather_batches
from ..feature_store import HeldMaps

log = logging.getLogger("cloud_server.fedgkt")

__all__ = ["FedGktEvaluation"]


class FedGktEvaluation:
    """The evaluation hook of :class:`~cloud_server.methods.fedgkt.FedGktServer`."""

    ctx: Any  # ServerContext
    config: Any  # FedGktConfig

    @property
    def scores_on_device(self) -> bool:  # type: ignore[override]
        """A private extractor never leaves the device: the agents score it."""
        return bool(self.config.private_extractor)
    model: torch.nn.Module
    device: torch.device
    agent_bn: dict[str, BnStatistics]
    eval_staged: dict[str, StagedUploads]
    held: dict[tuple[str, str], HeldMaps]
    staging: Any  # ArrayStaging
    _holds_maps: bool

    # -- evaluation ------------------------------------------------------------ #

    def _personalised(self, round_: int) -> bool:
        mode = self.config.personalised_eval
        return mode == "every" or (mode == "final" and round_ == self.ctx.rounds)

    def evaluation_downloads(self, round_: int, agent: str) -> list[Message]:
        """A private extractor is scored on the device: the agent gets the server model it
        needs (and its own BatchNorm statistics when the personalised figure is due)."""
        if not self.config.private_extractor:
            return []
        bn = {}
        if self._personalised(round_) and agent in self.agent_bn:
            bn = {f"{i}/{part}": t.detach().cpu().numpy() for i, pair in enumerate(self.agent_bn[agent])
                  for part, t in zip(("mean", "var"), pair)}
        return [GktEvalModel(run=self.ctx.run_id, round=round_, sender="server", weights=state_dict_to_arrays(self.model), bn=bn)]

    def evaluation(self, round_: int, reports: dict[str, EvalReport]) -> Evaluation:
        """Agent k's deployed model is its extractor followed by the server model: on the global
        set through the ResNet-8 it reported, on its own shard through the test maps it streamed.
        The headline uses the server's running BatchNorm averages; ``personalised_bn`` agent k's
        own statistics; ``edge`` is the ResNet-8 left on the device."""
        ev = Evaluation(edge="edge", labels={
            HEADLINE: "agent k's extractor + the server model, the server's running BatchNorm statistics (mean over agents)",
            "personalised_bn": "agent k's extractor + the server model with agent k's own BatchNorm statistics "
                               "(personalised; mean over agents)",
            "edge": "agent k's ResNet-8 on its device (mean over agents)",
        })
        if self.config.private_extractor:  # every figure scored on the devices, checked on arrival
            ev.global_reported = global_results(reports)
            ev.local = local_results(reports)
            return ev
        personalised = self._personalised(round_)
        self.model.eval()
        for agent, report in sorted(reports.items()):
            arrays = models_from_report(report, "edge")
            if arrays:
                edge = build_model(self.config.edge_model, self.ctx.num_classes, self.ctx.in_channels)
                try:
                    load_arrays_into(edge, arrays)
                except WeightsMismatchError as exc:
                    log.warning("round %d: %s's edge model cannot be evaluated: %s", round_, agent, exc)
                else:
                    edge = edge.to(self.device).eval()
                    # Agents whose extractors are equal (the shared, frozen stem) have one pipeline: scored once.
                    ev.global_models.setdefault(HEADLINE, {})[agent] = replace(
                        self._pipeline(edge, None), identity=module_digest(edge.extractor, extra="extractor+server"))
                    ev.global_models.setdefault("edge", {})[agent] = EvalModel(lambda x, e=edge: e(x)[0],
                                                                               identity=module_digest(edge, extra="edge"))
                    if personalised and agent in self.agent_bn:
                        ev.global_models.setdefault("personalised_bn", {})[agent] = self._pipeline(edge, self.agent_bn[agent])
        ev.local = local_results(reports)  # "edge": the ResNet-8 on the agent's shard
        for agent, report in sorted(reports.items()):
            wanted = self._wanted(agent, report.instance, round_, "test")
            if wanted:
                # Claims to reuse test maps the server did not hold: a figure would be on a part of
                # the shard. Left out; the next evaluation uploads them in full (none held then).
                log.warning("round %d: %s's local figure left out: %d test batches reused maps the server does not "
                            "hold (%s)", round_, agent, len(wanted), next(iter(wanted.values())))
                self.drop_held_test_maps(agent)
                self._release(self.eval_staged, agent)
        for agent, held in sorted(self.eval_staged.items()):
            if held.round != round_ or agent not in reports or not held.test:
                continue
            sent = reports[agent].uploads.get("test", {}).get("batches") if isinstance(reports[agent].uploads.get("test"), dict) else None
            if isinstance(sent, int) and sent != len(held.test):
                log.warning("round %d: %s's local figure left out: %d of the %d test batches it sent are staged",
                            round_, agent, len(held.test), sent)
                self._release(self.eval_staged, agent)
                continue
            staged = self.eval_staged.pop(agent)
            try:
                maps = self._agent_rows(agent, "test", [staged.test[k] for k in sorted(staged.test)])
            except MapsNotHeldError as exc:
                log.warning("round %d: %s's local figure left out: %s", round_, agent, exc)
                continue
            finally:
                self.staging.release_all(staged.staged_arrays())
            try:
                ev.local.setdefault(HEADLINE, {})[agent] = self._score_maps(maps, None)
                if personalised and agent in self.agent_bn:
                    ev.local.setdefault("personalised_bn", {})[agent] = self._score_maps(maps, self.agent_bn[agent])
            finally:
                digest = staged.digest("test")
                if self._holds_maps and digest:
                    self._hold(agent, "test", digest, maps)  # the next evaluations' claims
                else:
                    self._release_rows(maps[0].staged)
        return ev

    def drop_held_test_maps(self, agent: str) -> None:
        held = self.held.pop((agent, "test"), None)
        if held is not None:
            self._release_rows(held.rows.staged)

    def _pipeline(self, edge: torch.nn.Module, bn: BnStatistics | None) -> EvalModel:
        """Extractor + server model as one model; with ``bn``, the server's BatchNorm layers use
        those statistics for the pass (the server's own are restored after it)."""
        def forward(x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) images
            return self.model(edge.extract(x))  # (B, 16, H, W) maps -> (B, K)

        if bn is None:
            return EvalModel(forward)

        @contextlib.contextmanager
        def with_agent_bn():
            with restoring_bn_statistics(self.model):
                load_bn_statistics(self.model, bn)
                yield
        return EvalModel(forward, with_agent_bn)

    @torch.no_grad()
    def _score_maps(self, maps: AgentRows, bn: BnStatistics | None) -> tuple[int, int]:
        """(correct, total) of the server model on one agent's test maps."""
        features, _edge_logits, labels, _ids = maps
        correct = total = 0
        with restoring_bn_statistics(self.model):
            if bn is not None:
                load_bn_statistics(self.model, bn)
            for start in range(0, len(labels), 512):
                logits = self.model(features[start : start + 512].to(self.device, torch.float32))  # (b, K)
                correct += int((logits.argmax(1).cpu() == labels[start : start + 512]).sum())
                total += int(len(labels[start : start + 512]))
        return correct, total
