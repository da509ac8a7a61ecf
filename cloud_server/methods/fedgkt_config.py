"""FedGKT's ``[fedgkt]`` table: :class:`FedGktConfig`, the paper's presets and the keys of
the agents' half (``GktRoundConfig``) written in the table itself."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from models.registry import check_cut_pair, get_model_spec
from models.training import LR_SCHEDULES
from shared_protocol.activation_guard import ActivationGuard
from shared_protocol.configs import EmbeddedRoundConfig, check_choice, check_optimizer, config_from_table
from shared_protocol.methods.fedgkt import GktRoundConfig

from ..activation_privacy import activation_defences

__all__ = ["ALGORITHM_1", "EDGE_KEYS", "KD_MODES", "PAPER_PRESETS", "SERVER_ORDERS", "FedGktConfig"]

KD_MODES = ("bidirectional", "s2e", "none")
SERVER_ORDERS = ("shuffled", "per_agent", "mixed")

# The paper's hyper-parameters, Table 10 (CIFAR-10; Tables 11 and 12 give the same for
# CIFAR-100 and CINIC-10): one optimiser row for FedGKT, used on both sides; batch 256;
# 1 edge epoch; 20 server epochs for I.I.D., 40 for non-I.I.D.; 200 rounds (the server's
# [server] rounds, not a FedGKT setting). Non-I.I.D. gives no weight decay. Temperature 3
# and KD weight 1 are the reference code's defaults (the paper gives no value).
# ``preset = "paper-iid"`` or ``"paper-noniid"`` fills every key the table does not set.
# Algorithm 1 as the paper runs it, where the defaults here depart from it (docs/methods/fedgkt.md,
# "Non-IID agents and the balanced test set"): the server walks the agents' uploads agent by
# agent (one agent's maps per batch) and every agent trains its whole ResNet-8 (line 22, W^(k) =
# extractor + classifier). The evaluation is the same either way (the server model's running
# BatchNorm statistics, as the reference code evaluates).
ALGORITHM_1: dict[str, Any] = {"server_order": "per_agent", "train_extractor": True, "async_replay": False}

PAPER_PRESETS: dict[str, dict[str, Any]] = {
    "paper-iid": {
        "server_epochs": 20, "server_optimizer": "adam", "server_lr": 0.001, "server_weight_decay": 1e-4,
        "server_batch_size": 256, "edge_epochs": 1, "edge_optimizer": "adam", "edge_lr": 0.001,
        "edge_weight_decay": 1e-4, "edge_batch_size": 256, "temperature": 3.0, "alpha": 1.0, "kd": "bidirectional",
        "mode": "sync", "lr_schedule": "plateau", **ALGORITHM_1,
    },
    "paper-noniid": {
        "server_epochs": 40, "server_optimizer": "sgd", "server_lr": 0.005, "server_momentum": 0.9,
        "server_weight_decay": 0.0, "server_batch_size": 256, "edge_epochs": 1, "edge_optimizer": "sgd",
        "edge_lr": 0.005, "edge_momentum": 0.9, "edge_weight_decay": 0.0, "edge_batch_size": 256,
        "temperature": 3.0, "alpha": 1.0, "kd": "bidirectional", "mode": "sync", "lr_schedule": "plateau", **ALGORITHM_1,
    },
}


# How the [fedgkt] table names the fields of the GktRoundConfig that FedGktConfig holds.
EDGE_KEYS = EmbeddedRoundConfig(GktRoundConfig, "edge", {"batch_size": "edge_batch_size"}, derived=("edge_kd", "held_maps"))


@dataclass(frozen=True)
class FedGktConfig:
    # One line per key of the [fedgkt] table (docs/configuration.md is rendered from it by
    # bench/render_results.py; keys sharing a line are comma-separated).
    KEY_MEANINGS: ClassVar[dict[str, str]] = {
        "preset": "`\"paper-iid\"`, `\"paper-noniid\"`: the paper's Table 10 and Algorithm 1 fill every key this table "
                  "does not set; `\"\"`: the defaults below, sized for a CPU server",
        "mode": "`sync`: rounds with a barrier (Algorithm 1); `async`: the server trains on each upload as it arrives "
                "and answers at once",
        "kd": "`bidirectional` (Eqs. 6-7), `s2e` (only the edges distil), `none`",
        "server_model, edge_model": "the edge model sets the cut: `resnet8` (server `resnet55_server` / "
                                    "`resnet109_server`) or the deeper `resnet8_stage1` (server "
                                    "`resnet55_server_stage1` / `resnet109_server_stage1`)",
        "server_epochs, server_optimizer, server_lr, server_momentum, server_weight_decay, server_batch_size":
            "the server's training: E_s epochs a round",
        "server_order": "`mixed`: each batch drawn from all agents' maps; `shuffled`: one agent's maps per batch, the "
                        "agents in random order; `per_agent`: agent by agent (Algorithm 1)",
        "async_replay": "`async` only: an arrival also trains on the other agents' latest maps (kept by the server, not "
                        "checkpointed), as many samples as it sent; `false`: on its own maps alone (the reference code). "
                        "Refused with `server_order = \"per_agent\"`; the presets set `false`",
        "lr_schedule": "`plateau`: halve the server lr after 2 rounds without a lower training loss; `none`",
        "temperature, alpha": "KD: `CE + alpha * T^2 * KL(p_teacher || p_student)`; sent to agents",
        "edge_epochs, edge_optimizer, edge_lr, edge_momentum, edge_weight_decay, edge_batch_size":
            "the agents' local training, sent to agents",
        "train_extractor": "sent to agents: `false`, only the classifier trains and the extractors keep the shared "
                           "initial weights (one feature space); `true`: the whole ResNet-8 (Algorithm 1 line 22)",
        "upload_codec": "feature-map codec: `raw`, `zstd`, `fp16-zstd`, `u8-zstd`, `u8-affine-zstd` (signed: noised maps), `svd` (any registered one; an unknown "
                        "name is refused at start-up)",
        "upload_batch_samples": "samples per upload message (the agent holds one such batch of maps at a time)",
        "reuse_maps": "sent to agents: `true`, while an agent's extractor is unchanged the server keeps its maps (within "
                      "`staged_memory_bytes`, not checkpointed) and the agent sends logits and sample ids only; `false` "
                      "(or `train_extractor = true`): maps go up every round",
        "max_staged_samples_per_agent": "most samples one agent can make the server stage per round",
        "staged_memory_bytes, spill_dir": "staged float16 maps held in memory (all agents); beyond it, memory-mapped "
                                          "files in `spill_dir` (`\"\"`: `staged/` in the run directory), deleted after "
                                          "each round's training unless held for `reuse_maps`",
        "edge_init": "`shared`: every agent's ResNet-8 starts from the server's initial weights (from `[server] seed`); "
                     "`per_agent`: each agent draws its own from a key it keeps (`os.urandom`, or `[agent] private_seed`), "
                     "which the server cannot reproduce",
        "personalised_eval, bn_calibration_samples": "also score each agent's model with its own BatchNorm statistics "
                                                     "(`personalised_bn`, from at most `bn_calibration_samples` of its "
                                                     "training maps): in the last round (`final`), in `every` evaluated "
                                                     "round (twice the server's scoring work), or `off`",
        "edge_scoring": "where each agent's ResNet-8 is scored on the global set: `device` (the agent loads or downloads "
                        "the set once and reports counts, metered as its evaluation) or `server` (from the copy it "
                        "sends; for devices too slow to score it every evaluated round); a private extractor is "
                        "always scored on the device",
        "map_clip_norm, map_noise_multiplier, map_noise_delta":
            "sent to agents: each map clipped to L2 norm C, plus Gaussian noise of sd `map_noise_multiplier * C`; "
            "`0`: off; the report gives ε (δ: `map_noise_delta`) per map "
            "([protecting activations](privacy.md#protecting-activations))",
        "nopeek_alpha": "sent to agents: loss + `nopeek_alpha * dCor(images, maps)` (NoPeek); needs "
                        "`train_extractor = true`; `0`: off",
        "eval_diagnostics": "also record the server's training accuracy in its last epoch (`report.json` "
                            "`rounds[].method`)",
    }

    preset: str = ""  # "" (the defaults below) | "paper-iid" | "paper-noniid" (PAPER_PRESETS)
    server_model: str = "resnet55_server"
    edge_model: str = "resnet8"
    mode: str = "sync"  # sync | async
    kd: str = "bidirectional"  # bidirectional (S<->E) | s2e (S->E) | none
    server_epochs: int = 1
    server_optimizer: str = "adam"
    server_lr: float = 0.001
    server_momentum: float = 0.9
    server_weight_decay: float = 1e-4  # Table 10 (I.I.D.)
    server_batch_size: int = 64
    # mixed: every batch drawn from the union of all agents' maps; shuffled: one agent's maps per
    # batch, the agents' batches in random order; per_agent: Algorithm 1's walk, agent by agent.
    server_order: str = "mixed"
    # Async mode: each arrival's training draws its batches (server_order over the union) from
    # the arriving agent's new maps and the other agents' latest maps, which the server keeps,
    # as many samples an epoch as the arriving agent sent; the arriving agent's logits come from
    # the trained model (running BatchNorm averages) afterwards. Off: an arrival trains on that
    # one agent's label-skewed maps alone (docs/methods/fedgkt.md, "Asynchronous training").
    async_replay: bool = True
    lr_schedule: str = "plateau"  # plateau | none
    # The agents' half, sent as RoundStart.config: edge_epochs, edge_optimizer, edge_lr,
    # edge_momentum, edge_weight_decay, edge_batch_size (its batch_size), temperature and
    # alpha (the server's KD uses the same two), upload_codec, upload_batch_samples; all
    # written in the [fedgkt] table itself (EDGE_KEYS). Its edge_kd follows ``kd``.
    edge: GktRoundConfig = field(default_factory=GktRoundConfig)
    max_staged_samples_per_agent: int = 1_000_000
    # Float16 feature maps held in memory across all agents' staged uploads; beyond
    # this, uploads are staged in memory-mapped files in spill_dir ("": <run directory>/staged,
    # or a private temp dir when the server has no run directory).
    staged_memory_bytes: int = 2 * 1024**3
    spill_dir: str = ""
    # "shared": every agent's ResNet-8 starts from the server's initial weights (sent once,
    # with an agent's first RoundStart), so all extractors begin in one feature space;
    # "per_agent": each agent draws its own initialisation.
    edge_init: str = "shared"
    # Evaluation (cloud_server/evaluation.py) scores agent k's extractor + the server model
    # with the server's running BatchNorm averages (the reference code's evaluation: the
    # headline) and, labelled "personalised_bn", with agent k's own statistics, recomputed on
    # its training maps (at most bn_calibration_samples of them), the statistics its training
    # batches (one agent's maps each) were normalised with: in every evaluated round ("every"),
    # in the run's last round only ("final": it doubles the server's evaluation work), or never.
    personalised_eval: str = "final"
    # Where the agents' ResNet-8s are scored on the global set: "device" or "server".
    edge_scoring: str = "device"
    bn_calibration_samples: int = 256
    # An extra figure in report.json: the server's training accuracy in its last epoch.
    eval_diagnostics: bool = False
    # δ of the report's ε for noised maps (edge.map_noise_multiplier).
    map_noise_delta: float = 1e-5

    def __post_init__(self) -> None:
        if self.preset and self.preset not in PAPER_PRESETS:
            hint = " (Table 10 has two columns: say which)" if self.preset == "paper" else ""
            raise ValueError(f"fedgkt.preset must be '' or one of {sorted(PAPER_PRESETS)}, got {self.preset!r}{hint}")
        check_choice(self.mode, ("sync", "async"), "fedgkt.mode")
        check_choice(self.kd, KD_MODES, "fedgkt.kd")
        check_optimizer(self.server_optimizer, "fedgkt.server_optimizer")
        check_choice(self.server_order, SERVER_ORDERS, "fedgkt.server_order")
        check_choice(self.lr_schedule, LR_SCHEDULES, "fedgkt.lr_schedule")
        if self.mode == "async" and self.async_replay and self.server_order == "per_agent":
            raise ValueError("fedgkt.async_replay draws each arrival's batches from the union of the agents' maps; "
                             "server_order = 'per_agent' walks them agent by agent and would train on the first "
                             "agents' alone: set server_order = 'mixed' (or 'shuffled'), or async_replay = false")
        if min(self.server_epochs, self.server_batch_size, self.bn_calibration_samples) < 1 or self.server_lr <= 0:
            raise ValueError("fedgkt.server_epochs, server_batch_size, bn_calibration_samples must be >= 1 and server_lr > 0, "
                             f"got {self.server_epochs}, {self.server_batch_size}, {self.bn_calibration_samples}, {self.server_lr}")
        check_choice(self.personalised_eval, ("every", "final", "off"), "fedgkt.personalised_eval")
        check_choice(self.edge_init, ("shared", "per_agent"), "fedgkt.edge_init")
        check_choice(self.edge_scoring, ("device", "server"), "fedgkt.edge_scoring")
        check_cut_pair(self.edge_model, self.server_model, "fedgkt")
        if not 0 < self.map_noise_delta < 1:
            raise ValueError(f"fedgkt.map_noise_delta must be in (0, 1), got {self.map_noise_delta}")
        if self.staged_memory_bytes < 0:
            raise ValueError(f"fedgkt.staged_memory_bytes must be >= 0, got {self.staged_memory_bytes}")
        # The agents distil from the server's logits unless KD is off (S<->E and S->E both send them).
        object.__setattr__(self, "edge", replace(self.edge, edge_kd=self.kd in ("bidirectional", "s2e")))

    @property
    def private_extractor(self) -> bool:
        """Whether the agents' extractors are theirs alone: drawn by each agent (``edge_init =
        "per_agent"``) or trained on its data (``train_extractor = true``). A server-made frozen
        extractor (``"shared"`` and not trained) is no secret: the server holds it exactly. A
        private extractor never leaves the device: the agents score their extractor + the
        server model on the global set themselves (cloud_server/evaluation.py)."""
        return self.edge_init != "shared" or self.edge.train_extractor

    def defences_report(self, rounds: int | None = None) -> dict[str, Any] | None:
        """The run report's ``defences``: the activation defences on, with their parameters and ε."""
        guard = ActivationGuard.of(self.edge)
        if not (guard.active or self.private_extractor or get_model_spec(self.edge_model).cut != "stem"):
            return None
        return activation_defences(guard, self.map_noise_delta, method="fedgkt", private_extractor=self.private_extractor,
                                   extractor_trains=self.edge.train_extractor, cut=get_model_spec(self.edge_model).cut,
                                   rounds=rounds, releases_per_round=1) | {"edge_init": self.edge_init}

    def round_config(self) -> GktRoundConfig:
        return self.edge

    def to_table(self) -> dict[str, Any]:
        """The flat ``[fedgkt]`` table this config reads back from (reports, checkpoints)."""
        return EDGE_KEYS.table_of(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "FedGktConfig":
        """The [fedgkt] table; with a ``preset``, the preset's values fill the keys the table does not set."""
        preset = raw.get("preset", "")
        if preset in PAPER_PRESETS:
            raw = {**PAPER_PRESETS[preset], **raw}
        return config_from_table(cls, raw, "fedgkt", embedded=EDGE_KEYS)
