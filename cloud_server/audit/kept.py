"""What a run kept for the audit (``RUN_DIR/audit``, written by
:mod:`cloud_server.audit_keeper`), read back without pickle, and the private images it is
scored against, looked up by sample id from the run's own data config.

The private images: a local simulation's agents (``edgesplit local``) each take their share
of one dataset by a seeded spec (``RUN_DIR/configs/agent-*.toml``, ``[data]``), so the audit
derives every agent's shard exactly as the agent did. A real deployment's images never leave
the devices: its auditor has to supply them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fldata import AgentDataSpec, ArrayDataset, load_agent_subsets

from ..audit_keeper import AGGREGATE_FILE, AUDIT_DIR, KEPT_MANIFEST
from .errors import AuditError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["AgentImages", "KeptMaps", "KeptRun", "KeptUpdate", "load_kept_run"]


@dataclass(frozen=True)
class KeptMaps:
    """One agent's kept activation rows (``maps-<agent>.npz``)."""

    agent: str
    round: int
    features: torch.Tensor  # (N, C_f, H_f, W_f) float32, as decoded
    labels: np.ndarray  # (N,)
    sample_ids: np.ndarray  # (N,); -1 where the upload carried none (split learning)
    round_labels: np.ndarray  # every label of the round's uploads
    round_predicted: np.ndarray | None  # FedGKT: the edge logits' argmax of the round's uploads
    whole_batch: bool
    extractor: dict[str, np.ndarray]  # split learning: the extractor of the agent's turn (else empty)
    eval_model: dict[str, np.ndarray]  # FedGKT: the edge model of the agent's evaluation report of the round (else empty)
    split: str = "train"  # "test": evaluation's upload of the agent's local test images (``evalmaps-<agent>.npz``)


@dataclass(frozen=True)
class KeptUpdate:
    """One agent's kept weight update (``update-<agent>.npz``)."""

    agent: str
    round: int
    kind: str  # "fedavg.update", "fedkd.update", "secagg.masked_input" or "secagg.aggregate"
    num_samples: int
    round_config: dict[str, Any]
    global_weights: dict[str, np.ndarray]
    arrays: dict[str, np.ndarray]  # the rest, as kept (uploaded/..., update/..., factors, layout, ...)

    @property
    def agents(self) -> tuple[str, ...]:
        """Whose data the update comes from: the agent, or a secure aggregate's survivors."""
        return tuple(str(a) for a in self.arrays["agents"]) if "agents" in self.arrays else (self.agent,)


@dataclass
class KeptRun:
    """Everything the audit of one run reads."""

    run_dir: Path
    method: str
    config: dict[str, Any]  # the run's resolved server config (report.json)
    manifest: dict[str, Any]
    maps: dict[str, KeptMaps] = field(default_factory=dict)
    eval_maps: dict[str, KeptMaps] = field(default_factory=dict)  # FedGKT: evaluation's maps of the local test images
    updates: dict[str, KeptUpdate] = field(default_factory=dict)
    extractor: dict[str, np.ndarray] = field(default_factory=dict)  # FedGKT's initial edge model
    aggregate: KeptUpdate | None = None  # secure aggregation: one round's unmasked aggregate

    @property
    def method_config(self) -> dict[str, Any]:
        return dict(self.config.get("method_config", {}))

    @property
    def dataset(self) -> str:
        return str(self.config.get("dataset", "fashion-mnist"))

    @property
    def in_channels(self) -> int:
        from ..config import IN_CHANNELS_BY_DATASET

        return int(self.config.get("in_channels") or IN_CHANNELS_BY_DATASET.get(self.dataset, 3))

    @property
    def num_classes(self) -> int:
        return int(self.config.get("num_classes", 10))


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def _prefixed(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {name[len(prefix):]: value for name, value in arrays.items() if name.startswith(prefix)}


def load_kept_run(run_dir: str | Path) -> KeptRun:
    """Read ``run_dir``'s report config and what its server kept.

    Raises:
        AuditError: no report, or nothing kept (the message names the setting to turn on).
    """
    run = Path(run_dir)
    report = run / "report.json"
    if not report.exists():
        raise AuditError(f"{run} holds no report.json: give the run directory of a finished or running run")
    config = json.loads(report.read_text()).get("config", {})
    manifest_path = run / AUDIT_DIR / KEPT_MANIFEST
    if not manifest_path.exists():
        raise AuditError(f"this run kept nothing to audit ({manifest_path} is missing): rerun with `edgesplit local --audit`, "
                         "or with [server] audit = true for `cloud-server run`")
    manifest = json.loads(manifest_path.read_text())
    kept = KeptRun(run, str(manifest.get("method", config.get("method", ""))), config, manifest)
    for name in sorted(manifest.get("files", {})):
        path = run / AUDIT_DIR / name
        if not path.exists():
            continue
        arrays = _load(path)
        if name == "extractor.npz":
            kept.extractor = _prefixed(arrays, "weights/")
        elif name.startswith(("maps-", "evalmaps-")):
            evaluation = name.startswith("evalmaps-")
            agent = name[len("evalmaps-" if evaluation else "maps-"):-len(".npz")]
            (kept.eval_maps if evaluation else kept.maps)[agent] = KeptMaps(
                agent=agent, round=int(arrays["round"]), features=torch.from_numpy(arrays["features"].astype(np.float32)),
                labels=arrays["labels"], sample_ids=arrays["sample_ids"], round_labels=arrays["round_labels"],
                round_predicted=arrays.get("round_predicted"), whole_batch=bool(arrays["whole_batch"]),
                extractor=_prefixed(arrays, "weights/"), eval_model=_prefixed(arrays, "eval_weights/"),
                split="test" if evaluation else "train")
        elif name.startswith("update-") or name == AGGREGATE_FILE:
            agent = name[len("update-"):-len(".npz")] if name != AGGREGATE_FILE else "aggregate"
            update = KeptUpdate(
                agent=agent, round=int(arrays["round"]), kind=str(arrays["kind"]), num_samples=int(arrays["num_samples"]),
                round_config=json.loads(str(arrays["round_config"])), global_weights=_prefixed(arrays, "global/"),
                arrays={k: v for k, v in arrays.items() if not k.startswith("global/")})
            if name == AGGREGATE_FILE:
                kept.aggregate = update
            else:
                kept.updates[agent] = update
    if not kept.maps and not kept.updates:
        not_kept = manifest.get("not_kept", {})
        why = (f"its uploads ({', '.join(sorted(not_kept))}) are of a kind the audit does not keep yet" if not_kept
               else "no upload reached the server while it kept")
        raise AuditError(f"this run kept nothing to audit: {why}; for a method the audit reads, rerun with `edgesplit local --audit`")
    return kept


@dataclass(frozen=True)
class AgentImages:
    """Each agent's private training images, as its data config derives them."""

    shards: dict[str, ArrayDataset]  # agent id -> its training shard
    source: str  # how they were found, in words
    test_shards: dict[str, ArrayDataset] = field(default_factory=dict)  # agent id -> its local test shard

    def by_sample_id(self, agent: str, sample_ids: np.ndarray, split: str = "train") -> tuple[torch.Tensor, np.ndarray]:
        """``(images (N, C, H, W) in [0, 1], labels (N,))`` of ``agent``'s samples ``sample_ids``
        (``split`` "test": of its local test shard).

        Raises:
            AuditError: an id the agent's shard does not hold (the data config is not the run's).
        """
        shard = self._shard(agent) if split == "train" else self.test_shards.get(agent)
        if shard is None:
            raise AuditError(f"no local test shard for {agent} among the run's data configs")
        position = {int(i): p for p, i in enumerate(shard.sample_ids)}
        missing = [int(i) for i in sample_ids if int(i) not in position]
        if missing:
            raise AuditError(f"{agent}'s shard, derived from its data config, lacks sample ids {missing[:5]}: the config "
                             "is not the one the run used")
        rows = np.asarray([position[int(i)] for i in sample_ids])
        return _pixels(shard.images[rows]), shard.labels[rows]

    def all_of(self, agent: str, split: str = "train") -> tuple[torch.Tensor, np.ndarray]:
        """Every training image of ``agent`` and its labels (``split`` "test": its local test shard's)."""
        shard = self._shard(agent) if split == "train" else self.test_shards.get(agent)
        if shard is None:
            raise AuditError(f"no local test shard for {agent} among the run's data configs")
        return _pixels(np.asarray(shard.images)), np.asarray(shard.labels)

    def _shard(self, agent: str) -> ArrayDataset:
        if agent not in self.shards:
            raise AuditError(f"no data config for {agent} among the run's ({', '.join(sorted(self.shards))})")
        return self.shards[agent]


def _pixels(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(images, dtype=np.float32) / 255.0)  # (N, C, H, W) in [0, 1]


def agent_images(run_dir: Path, agents: list[str]) -> AgentImages:
    """The private training shards of ``agents``, from ``run_dir/configs/agent-*.toml``.

    Raises:
        AuditError: no agent configs (not a local simulation), or an agent whose data is its own
            (``partition = "none"``): the auditor has to supply those images.
    """
    paths = sorted((run_dir / "configs").glob("agent-*.toml"))
    if not paths:
        raise AuditError(f"{run_dir / 'configs'} holds no agent-*.toml: the agents' private images are on their devices. "
                         "The audit scores against them only for a local simulation (`edgesplit local`), whose agents "
                         "take their shares of one dataset by a seeded spec")
    specs: dict[str, tuple[AgentDataSpec, int]] = {}
    for path in paths:
        doc = tomllib.loads(path.read_text())
        data, agent_id = doc.get("data", {}), doc.get("agent", {}).get("agent_id")
        if agent_id not in agents:
            continue
        if data.get("partition") == "none":
            raise AuditError(f"{agent_id} trains on its own images ({path}: partition = \"none\"): supply them to audit")
        specs[agent_id] = (AgentDataSpec(dataset=data["dataset"], partition=data.get("partition", "iid"),
                                         num_agents=int(data.get("num_agents", 1)), seed=int(data.get("seed", 0)),
                                         root=data.get("root"), download=bool(data.get("download", False)),
                                         train_samples=int(data.get("train_samples", 0)),
                                         test_samples=int(data.get("test_samples", 0))), int(data.get("agent_index", 0)))
    shards: dict[str, ArrayDataset] = {}
    test_shards: dict[str, ArrayDataset] = {}
    by_spec: dict[AgentDataSpec, list[tuple[ArrayDataset, ArrayDataset]]] = {}
    for agent_id, (spec, index) in specs.items():
        if spec not in by_spec:
            by_spec[spec] = load_agent_subsets(spec)  # the dataset loaded and partitioned once
        shards[agent_id], test_shards[agent_id] = by_spec[spec][index]
    source = ("this is a local simulation: each agent's private images were derived from its seeded data spec "
              "(RUN_DIR/configs/agent-*.toml) and looked up by sample id (uploads without ids: matched to the shard's "
              "images); a real deployment's auditor must supply them")
    return AgentImages(shards, source, test_shards)
