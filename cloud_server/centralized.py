"""Centralized training: the reference rows of the FedGKT paper's Table 1.

The server trains one architecture (ResNet-56/110, or ResNet-8) on the union of
the data the agents would hold -- the same seeded subset of the training set
(``train_samples``, ``seed``) that ``edgesplit local`` partitions -- and tests
it on the same seeded subset of the test set. No broker, no agents. A "round"
is ``epochs_per_round`` epochs, so runs compare round for round with the
federated methods, and the run report has the same format (``report.json``,
``rounds.csv``, plots, ``summary.md``) with zero bytes on the wire.

Run with ``edgesplit centralized --config server.toml`` (``[server]`` with
``method = "centralized"`` plus a ``[centralized]`` table) or ``edgesplit
centralized --model resnet56 --dataset ...`` (:mod:`cloud_server.centralized_cli`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fldata import ArrayDataset
from fldata.subsets import seeded_subset
from fldata.torch_data import make_loader
from models import build_model, count_parameters, get_model_spec, training_flops_per_sample
from models.training import INFERENCE_BATCH_SAMPLES, LR_SCHEDULES, Batch, Trainer, accuracy, logits_of, make_lr_schedule, make_optimizer

from .config import ServerConfig
from .device_meter import DeviceMeter
from .evaluation import HEADLINE, EvalModel, EvalSet, Evaluation, Evaluator
from .records import RoundEvaluation
from .methods.base import RoundOutcome
from .recorder import RunRecorder, server_info
from .records import RunReport
from .row_bank import RowBank, normalised_images, staging_budget_bytes
from .server_step import TrainStep
from shared_protocol.configs import check_choice, check_optimizer, config_from_table

log = logging.getLogger("cloud_server.centralized")

VERSION = "0.1.0"


@dataclass(frozen=True)
class CentralizedConfig:
    """``[centralized]``. Defaults are CPU-friendly; the paper's (Tables 10-12: Adam,
    lr 0.003, wd 1e-4, batch 256, 300 epochs) are in ``deploy/configs/paper``."""

    # One line per key of the [centralized] table (docs/configuration.md is rendered from it by
    # bench/render_results.py).
    KEY_MEANINGS: ClassVar[dict[str, str]] = {
        "model": "trained on the union of the agents' data: `resnet56`, `resnet110`, `resnet8`",
        "epochs_per_round, optimizer, lr, momentum, weight_decay, batch_size": "the training",
        "lr_schedule": "`none`, or `plateau`: halve the lr after 2 rounds without a lower training loss",
        "train_samples, test_samples": "the seeded subsets (with `[server] seed`) a federation with the same settings "
                                       "partitions; 0: all",
        "data_root, download": "as in an agent's `[data]`",
        "augment": "random crops and flips; unset: on for CIFAR-10/100 and CINIC-10, off otherwise",
    }

    model: str = "resnet56"  # resnet56 | resnet110 | resnet8
    epochs_per_round: int = 1
    optimizer: str = "adam"
    lr: float = 0.001
    momentum: float = 0.9
    weight_decay: float = 1e-4
    batch_size: int = 64
    lr_schedule: str = "none"  # none | plateau (halve after 2 rounds without a lower training loss)
    train_samples: int = 0  # 0: the whole training set; else the seeded subset the agents would share
    test_samples: int = 0
    data_root: str | None = None
    download: bool = False
    augment: bool | None = None  # None: on for CIFAR/CINIC as in the paper, off otherwise

    def __post_init__(self) -> None:
        if get_model_spec(self.model).input_kind != "image":
            raise ValueError(f"centralized.model must take images, {self.model!r} takes feature maps")
        if self.epochs_per_round < 1 or self.batch_size < 1:
            raise ValueError("centralized.epochs_per_round and batch_size must be >= 1")
        check_optimizer(self.optimizer, "centralized.optimizer")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError("centralized.lr must be > 0 and weight_decay >= 0")
        check_choice(self.lr_schedule, LR_SCHEDULES, "centralized.lr_schedule")
        if self.train_samples < 0 or self.test_samples < 0:
            raise ValueError("centralized.train_samples and test_samples must be >= 0")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "CentralizedConfig":
        return config_from_table(cls, raw, "centralized")




def load_union(server: ServerConfig, config: CentralizedConfig) -> tuple[ArrayDataset, ArrayDataset]:
    """The seeded train / test subsets a local federation with the same settings partitions."""
    return seeded_subset(server.dataset, root=config.data_root, download=config.download,
                         train_samples=config.train_samples, test_samples=config.test_samples, seed=server.seed)


class CentralizedTrainer:
    def __init__(self, server: ServerConfig, device: str = "cpu", data: tuple[ArrayDataset, ArrayDataset] | None = None) -> None:
        if server.method != "centralized":
            raise ValueError(f"server.method must be 'centralized' here, got {server.method!r}")
        self.server = server
        self.config = CentralizedConfig.from_dict(server.method_config)
        self.device = torch.device(device)
        self.train_data, self.test_data = data if data is not None else load_union(server, self.config)
        if len(self.train_data) == 0:
            raise ValueError("centralized training has no training samples")
        torch.manual_seed(server.seed)
        c = self.config
        self.model = build_model(c.model, server.num_classes, self.train_data.in_channels).to(self.device)
        self.optimizer = make_optimizer(c.optimizer, self.model.parameters(), c.lr, c.momentum, c.weight_decay, self.device)
        self.step = TrainStep(self.model, self.optimizer, lambda logits, labels: F.cross_entropy(logits, labels),
                              server.server_step, name="centralized")
        self.scheduler = make_lr_schedule(c.lr_schedule, self.optimizer)
        shape = tuple(self.train_data.images.shape[1:])  # (C, H, W)
        self.train_flops_per_sample = training_flops_per_sample(self.model, shape)
        self.augment = c.augment if c.augment is not None else server.dataset in ("cifar10", "cifar100", "cinic10")
        self.device_meter = DeviceMeter(self.device)
        self._bank: RowBank | None = None  # the normalised training images, staged once (no augmentation)
        self._labels: torch.Tensor | None = None
        self.out_dir = Path(server.out_dir)
        # Scored like every federated method: the run's global test set (cloud_server/evaluation.py).
        self.eval_set = EvalSet.load(server.eval_set_spec())
        self.evaluator = Evaluator(self.eval_set, self.device)

    # -- training ------------------------------------------------------------------ #

    def _batches(self, round_: int, epoch: int):  # -> Iterator[Batch of images (B, C, H, W), labels (B,) on the device]
        """One epoch's shuffled batches. Without augmentation the normalised images are staged
        once (on the device when they fit) and batches are gathered there by index; with it,
        the loader crops and flips on the host and each batch is copied."""
        c = self.config
        seed = self.server.seed * 100_003 + round_ * 1000 + epoch
        if self.augment:
            for images, labels, _ids in make_loader(self.train_data, c.batch_size, shuffle=True, augment=True, seed=seed):
                yield Batch(images.to(self.device, non_blocking=True), (labels.to(self.device, non_blocking=True),))
            return
        if self._bank is None:
            self._bank = RowBank(normalised_images(self.train_data), self.device, budget_bytes=staging_budget_bytes(self.device))
            if self._bank.placement == "host":
                log.info("centralized: training images stay on the host: %s", self._bank.why_host)
            self._labels = torch.from_numpy(self.train_data.labels).long().to(self.device)
        order = torch.randperm(len(self._bank), generator=torch.Generator().manual_seed(seed))
        for index in order.split(c.batch_size):  # the bank moves the index where its rows are
            yield Batch(self._bank.gather(index), (self._labels[index.to(self.device, non_blocking=True)],))  # type: ignore[index]

    def _train_round(self, round_: int) -> tuple[float, int]:
        """``epochs_per_round`` epochs through the shared loop; (mean loss, samples). Losses
        are summed on the device and read once, at the end of the round."""
        c = self.config
        self.model.train()
        planned = math.ceil(len(self.train_data) / c.batch_size) * c.epochs_per_round
        trainer = Trainer(self.step, desc=f"centralized round {round_}", progress=tqdm if self.server.progress else None)
        with self.device_meter.training():
            result = trainer.run(c.epochs_per_round, lambda epoch: self._batches(round_, epoch), planned_steps=planned)
        if not math.isfinite(result.mean_loss):
            raise RuntimeError(f"centralized training diverged in round {round_}: loss {result.mean_loss}")
        return result.mean_loss, result.samples

    @torch.no_grad()
    def _evaluation(self) -> RoundEvaluation:
        """The one evaluation: the model on the global set; "local" is the same model on the test
        subset a federation's agents would split into their shards (one model: the union's figure)."""
        self.model.eval()
        correct, total = accuracy(lambda images: logits_of(self.model(images)), make_loader(self.test_data, INFERENCE_BATCH_SAMPLES), self.device)
        evaluation = Evaluation(
            global_models={HEADLINE: {Evaluation.GLOBAL: EvalModel(lambda x: logits_of(self.model(x)))}},
            local={HEADLINE: {"union": (correct, total)}} if total else {},
            labels={HEADLINE: f"{self.config.model} trained on the union of the agents' data"},
        )
        return self.evaluator.run(evaluation)

    # -- report ---------------------------------------------------------------------- #

    def _new_report(self) -> RunReport:
        return RunReport(
            edgesplit_version=VERSION, run_id=self.server.run_id, method="centralized",
            config={**self.server.to_dict(), "method_config": asdict(self.config)},
            server=server_info(str(self.device)),
            models={
                "edge": None,  # no edge: the reference is trained in one place
                "server": {"name": self.config.model, "params": count_parameters(self.model),
                           "train_flops_per_sample": self.train_flops_per_sample},
            },
            data={"dataset": self.server.dataset, "train_samples": len(self.train_data), "test_samples": len(self.test_data)},
            eval_set=self.eval_set.describe() if self.eval_set is not None else None,
        )

    def _round(self, recorder: RunRecorder, round_: int) -> None:
        """Train, test when due, and hand the round to the recorder."""
        s = self.server
        started = time.monotonic()
        loss, samples = self._train_round(round_)
        train_s = time.monotonic() - started
        if self.scheduler is not None:
            self.scheduler.step(loss)
        evaluation = self._evaluation() if round_ % s.eval_every == 0 or round_ == s.rounds else None
        outcome = RoundOutcome(server_loss=loss, server_train_s=train_s, samples=samples)
        recorder.add_round(recorder.round_record(
            round_, "ok", participants=(), ends={}, outcomes=[outcome], started_at=started,
            server=self.device_meter.take(), server_train_flops=self.train_flops_per_sample * samples, evaluation=evaluation,
        ))

    def run(self) -> dict[str, Any]:
        s = self.server
        recorder = RunRecorder(self.out_dir, s.rounds)
        recorder.begin(self._new_report())
        log.info("centralized %s on %d %s samples (%d test), %d rounds of %d epochs, device %s",
                 self.config.model, len(self.train_data), s.dataset, len(self.test_data), s.rounds, self.config.epochs_per_round, self.device)
        report = recorder.report
        try:
            for round_ in range(1, s.rounds + 1):
                self._round(recorder, round_)
                accuracy = report.rounds[-1].accuracy
                if s.target_accuracy is not None and accuracy is not None and accuracy >= s.target_accuracy:
                    report.status = "stopped_target"
                    break
            if report.status == "running":
                report.status = "finished"
        except (RuntimeError, KeyboardInterrupt):
            report.status = "aborted"
            raise
        finally:
            recorder.finish()
        return report.to_json()
