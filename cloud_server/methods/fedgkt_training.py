"""FedGKT's server training (Algorithm 1, lines 11-15; Eq. 6): the batches over the agents'
staged maps in ``server_order``, the shared server step with its guard, and the server's
logits z_s keyed by sample id; async replay of the other agents' latest maps.

A mixin of :class:`cloud_server.methods.fedgkt.FedGktServer`: it reads the server's
model, optimiser, staging and config, which the server makes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from models.batchnorm import BnStatistics, measure_bn_statistics
from models.train_step import DeviceSum
from models.training import Batch, StepSkipped, Trainer

from ..feature_store import AgentRows, RowSource
from ..row_bank import banks_for_staged_rows
from ..server_step import TrainStep

log = logging.getLogger("cloud_server.fedgkt")

__all__ = ["FedGktTraining"]


class FedGktTraining:
    """The server training of :class:`~cloud_server.methods.fedgkt.FedGktServer`."""

    ctx: Any  # ServerContext
    config: Any  # FedGktConfig
    model: torch.nn.Module
    device: torch.device
    replay: dict[str, AgentRows]

    @property
    def _replaying(self) -> bool:
        return self.config.mode == "async" and self.config.async_replay

    def _replayed(self, fresh: dict[str, AgentRows]) -> dict[str, AgentRows]:
        """The other agents' latest maps to train with beside ``fresh`` (async replay; {} otherwise)."""
        if not self._replaying:
            return {}
        return {a: rows for a, rows in sorted(self.replay.items()) if a not in fresh}

    def _batches(self, data: dict[str, tuple], generator: torch.Generator) -> list[list[tuple[int, torch.Tensor]]]:
        """One epoch's batches, each a list of (agent position, sample indices into that
        agent's data) pieces.

        Eq. 8 sums the loss over all agents' samples; Algorithm 1 walks it agent by
        agent. ``server_order = "per_agent"`` keeps that walk; ``"shuffled"`` shuffles
        the order of the per-agent batches (each batch still one agent's maps), which keeps
        the server from forgetting earlier agents' feature maps within an epoch; the
        default ``"mixed"`` draws every batch from the union of all agents' maps, so no
        batch, and no BatchNorm batch statistic, belongs to one agent: with label-skewed
        agents, one-agent batches let the server tell the agents apart by their batch
        statistics and learn each one's label mix, and the running statistics it is evaluated
        with fit none of them (docs/methods/fedgkt.md).
        """
        c = self.config
        sizes = [len(d[3]) for d in data.values()]
        if c.server_order == "mixed":
            agent_of = torch.cat([torch.full((n,), k, dtype=torch.long) for k, n in enumerate(sizes)])  # (N,)
            row_of = torch.cat([torch.arange(n) for n in sizes])  # (N,)
            plans = []
            for chunk in torch.randperm(len(agent_of), generator=generator).split(c.server_batch_size):
                pieces = [(k, row_of[chunk[agent_of[chunk] == k]]) for k in range(len(sizes))]
                plans.append([(k, rows) for k, rows in pieces if len(rows)])
            return plans
        per_agent = [
            [[(k, chunk)] for chunk in torch.randperm(n, generator=generator).split(c.server_batch_size)]
            for k, n in enumerate(sizes)
        ]
        flat = [b for batches in per_agent for b in batches]
        if c.server_order == "per_agent":
            return flat
        order = torch.randperm(len(flat), generator=generator).tolist()
        return [flat[i] for i in order]

    def _train(self, data: dict[str, tuple], round_: int,
               fresh: list[str] | None = None) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float]:
        """Algorithm 1 lines 6-12: E_s epochs over the agents' uploads; z_s from the last epoch.

        ``fresh`` (async replay): the agents whose maps just arrived; the others in ``data`` are
        replayed. Each epoch then takes as many samples as the fresh agents sent, drawn from all
        of ``data`` (so over a round every map is drawn about as often as in a sync round), and
        z_s, for the fresh agents only, comes from the trained model with its running BatchNorm
        averages (not every fresh map is drawn in the last epoch).

        Through the shared server step: each agent's maps on the device when they fit (staged
        there as they arrived, or copied now), batches gathered by index there; z_s, the loss
        and the training accuracy stay on the device until the end and are read once."""
        c = self.config
        generator = torch.Generator().manual_seed(self.ctx.seed * 100_003 + round_)
        self.model.train()
        agents = list(data)
        device = self.device
        banks = banks_for_staged_rows([data[a][0] for a in agents], device)  # over each agent's (n, 16, H, W) float16 maps
        for a, bank in zip(agents, banks):
            if bank.placement == "host":
                log.info("round %d: %s's maps stay on the host: %s", round_, a, bank.why_host)
        edge_logits = [data[a][1].to(device) for a in agents]  # (n, K) each
        labels = [data[a][2].to(device) for a in agents]  # (n,) each
        z_s = [torch.zeros((len(data[a][3]), self.ctx.num_classes), dtype=torch.float32, device=device) for a in agents]
        train_correct = DeviceSum(device)

        per_epoch = None if fresh is None else math.ceil(sum(len(data[a][3]) for a in fresh) / c.server_batch_size)

        def batches(epoch: int):  # -> Iterator[Batch of maps (B, 16, H, W), labels (B,), edge logits (B, K)]
            for plan in self._batches(data, generator)[:per_epoch]:
                # (agent position, rows on the device); the host's copy of the rows gathers maps
                # left on the host without waiting for the device.
                pieces = [(k, idx, idx.to(device, non_blocking=True)) for k, idx in plan]
                if len(pieces) == 1:
                    (k, idx, index), = pieces
                    yield Batch(banks[k].gather(idx, torch.float32), (labels[k][index], edge_logits[k][index]),
                                meta=[(k, index)])
                    continue
                yield Batch(torch.cat([banks[k].gather(idx, torch.float32) for k, idx, _ in pieces]),
                            (torch.cat([labels[k][index] for k, _, index in pieces]),
                             torch.cat([edge_logits[k][index] for k, _, index in pieces])),
                            meta=[(k, index) for k, _, index in pieces])

        def keep_last_epoch_logits(trainer: Trainer) -> None:
            if trainer.last_epoch:
                logits = trainer.out.logits  # (B, K)
                start = 0
                for k, index in trainer.batch.meta:  # the batch's rows are its pieces', in order
                    if fresh is None:
                        z_s[k].index_copy_(0, index, logits[start : start + len(index)].float())  # keyed by row: by sample id
                    start += len(index)
                train_correct.add((logits.argmax(1) == trainer.batch.targets[0]).sum())

        if per_epoch is None:
            steps = sum(math.ceil(len(d[3]) / c.server_batch_size) for d in data.values()) * c.server_epochs
        else:
            steps = per_epoch * c.server_epochs
        step = self._trainer()
        guard = self._guard(round_, agents, step)
        trainer = Trainer(step, desc=f"server round {round_}", progress=tqdm if self.ctx.progress else None,
                          guard=guard[0] if guard else None)
        trainer.add_callback("on_batch_end", keep_last_epoch_logits)
        if guard:
            trainer.add_callback("on_batch_start", guard[1])
            trainer.add_callback("on_batch_skipped", guard[2])
        try:
            result = trainer.run(c.server_epochs, batches, planned_steps=steps)
            if fresh is not None:
                self.model.eval()
                with torch.no_grad():
                    for k, a in enumerate(agents):
                        if a in fresh:
                            for rows in torch.arange(len(data[a][3])).split(512):
                                z_s[k][rows.to(device)] = self.model(banks[k].gather(rows, torch.float32)).float()  # (b, K)
                self.model.train()
            # The call's other reads from the device: logits and accuracy to the host.
            logits_by_agent = {a: (data[a][3], z_s[k].cpu().numpy()) for k, a in enumerate(agents) if fresh is None or a in fresh}
            correct = train_correct.item()
        finally:
            for bank in banks:
                bank.release()
        if guard:
            step.max_grad_norm = 0.0
            if step.clipped:
                self.figures.setdefault(round_, {})["server_steps_clipped"] = step.clipped
            if trainer.skipped:
                self.figures.setdefault(round_, {})["server_steps_skipped"] = trainer.skipped
        if self.config.eval_diagnostics:
            self.figures.setdefault(round_, {})["server_train_accuracy"] = correct / max(result.last_epoch_samples, 1)
        return logits_by_agent, result.last_epoch_loss

    def _guard(self, round_: int, agents: list[str], step: TrainStep):
        """The server step's guard (``[server] server_grad_clip_norm``, ``server_loss_skip_factor``;
        None when both are off): (guard(loss), on_batch_start, on_batch_skipped). Gradients are
        clipped to the norm; a step whose loss is not finite, or above the factor x the median of
        the last 50 steps' losses (after 10), is skipped, the BatchNorm statistics its forward
        pass moved are put back, and the skip is attributed to the agent whose maps in the batch
        were the largest. Every guarded step runs eagerly (the loss is read before backward)."""
        cfg = self.ctx.robustness
        if not (cfg.server_grad_clip_norm or cfg.server_loss_skip_factor):
            return None
        step.max_grad_norm, step.clipped = float(cfg.server_grad_clip_norm), 0
        recent = self.recent_losses
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        buffers = [b for m in self.norms for b in (m.running_mean, m.running_var) if b is not None]
        why: list[str] = [""]

        def guard(loss: torch.Tensor) -> None:
            value = float(loss.detach())
            if not math.isfinite(value):
                why[0] = f"loss {value}"
                raise StepSkipped(why[0])
            if cfg.server_loss_skip_factor and len(recent) >= 10:
                limit = cfg.server_loss_skip_factor * float(np.median(recent))
                if value > limit:
                    why[0] = f"loss {value:.4g} > {cfg.server_loss_skip_factor:g} x the running median ({limit:.4g})"
                    raise StepSkipped(why[0])
            recent.append(value)
            del recent[:-50]

        def snapshot(trainer: Trainer) -> None:
            saved[:] = [(b, b.detach().clone()) for b in buffers]

        def skipped(trainer: Trainer) -> None:
            with torch.no_grad():
                for b, copy in saved:
                    b.copy_(copy)
            batch, start, worst, culprit = trainer.batch, 0, -1.0, agents[0]
            for k, index in batch.meta:
                peak = float(batch.inputs[start : start + len(index)].abs().max())
                start += len(index)
                if peak > worst:
                    worst, culprit = peak, agents[k]
            self.ctx.ledger.skip_step(round_, culprit, why[0])

        return guard, snapshot, skipped

    def _calibrate(self, features: RowSource) -> BnStatistics:
        """BatchNorm statistics of the server model on one agent's maps (at most
        ``bn_calibration_samples``, an even spread), leaving the model as it was."""
        n = len(features)
        rows = torch.linspace(0, n - 1, min(n, self.config.bn_calibration_samples)).round().long().unique()
        return measure_bn_statistics(self.model, (features[chunk].to(self.device, torch.float32) for chunk in rows.split(256)))
