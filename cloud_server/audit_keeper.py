"""What the leakage audit needs, kept as the server received it (``[server] audit``).

The coordinator hands the keeper every message it sends (:meth:`AuditKeeper.on_sent`) and
every message from a known agent it decoded (:meth:`AuditKeeper.on_received`), before the
method sees it, so that no method keeps anything itself. What is kept, under ``RUN_DIR/audit/`` as ``.npz``
files (``np.savez``; read back with ``allow_pickle=False``):

- ``maps-<agent>.npz``: activation uploads (FedGKT's feature maps, split learning's
  activations): the first ``samples_per_agent`` training rows the agent uploaded, decoded,
  with their labels, sample ids (FedGKT) and round, and every label of that round's uploads
  (FedGKT also the edge logits' argmax), which the label attacks read; FedGKT also the
  ResNet-8 the agent sent with its evaluation report of that round (the model that extracted
  the round's maps: an agent extracts after training). Split learning's
  rows are the first batch of the agent's first turn, whole (whatever ``samples_per_agent``
  says: the batch's normalisation used all of it), with the extractor the server sent it at
  that turn's start (within a turn the extractor moves every batch).
- ``evalmaps-<agent>.npz``: evaluation's uploads of the agent's local test images (as many
  rows, one round) with their labels: FedGKT's maps with their sample ids and that round's
  ResNet-8; split learning's activations with the round's final extractor the server sent the
  agent to evaluate with (in eval mode, so each row stands alone).
- ``extractor.npz``: FedGKT's initial edge model, when the server sends one
  (``edge_init = "shared"``): the model every agent's stem starts from.
- ``update-<agent>.npz``: weight-sharing uploads (the FedAvg family's models, FedKD's
  factored mentee update): the agent's first upload whose starting global model the keeper
  saw go out, that global model, and the round config that set its local schedule.
- with ``[server] secure_aggregation``, ``update-<agent>.npz`` holds instead the agent's first
  masked input (kind ``secagg.masked_input``) whose starting global model the keeper saw,
  decoded as the server would read a plain update from it: each ring element as the fixed-point
  encoding's signed value scaled back to a float, cut into the model's float arrays in the
  order the agent flattened them (sorted by name), with the (masked) weight entry apart; and
  ``aggregate.npz`` the first round's unmasked aggregate (the new global model minus the one
  the round started from: the survivors' mean update, what the server legitimately learns)
  with the survivors and their sample counts.
- ``kept.json``: the method, the bound, what each file holds, the uploads the keeper
  does not know how to keep (named, so that the audit can say so instead of reporting
  safety), and per agent the models its evaluation reports carried (FedKD's mentor, FedGKT's
  ResNet-8: models trained on private data, in the server's hands).

Everything is bounded: per agent at most ``samples_per_agent`` activation rows (and the
labels of one round), one update and one global model.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared_protocol.errors import ShapeMismatchError
from shared_protocol.messages import ErrorReply, EvalReport, Hello, Message, RoundEnd, RoundStart, Status
from shared_protocol.methods.fedavg import FedAvgGlobalModel, FedAvgUpdate, join_state
from shared_protocol.methods.fedgkt import GktFeatures, GktReusedMaps
from shared_protocol.methods.fedkd import FedKdAggregate, FedKdUpdate
from shared_protocol.methods.splitnn import SplitActivations, SplitExtractor, SplitExtractorWeights
from shared_protocol.secagg_messages import SecAggAdvertise, SecAggMaskedInput, SecAggUnmask
from shared_protocol.secagg_params import SecAggParams

log = logging.getLogger("cloud_server")

__all__ = ["AGGREGATE_FILE", "AGGREGATE_KIND", "AUDIT_DIR", "KEPT_MANIFEST", "MASKED_KIND", "AuditKeeper", "decode_masked", "save_arrays"]

#: The run directory's folder of what the audit reads.
AUDIT_DIR = "audit"
#: The keeper's manifest in :data:`AUDIT_DIR`.
KEPT_MANIFEST = "kept.json"
#: Uploads that carry nothing of the private data the audit attacks (requests, checksums of work done;
#: secure aggregation's keys and seed shares, whose use, the unmasked sum, is kept as the aggregate).
_NOT_ATTACKED = ("fedgkt.ort_artifacts_request", "splitnn.extractor", "eval_set_request", "secagg.share_keys",
                 "secagg.unmask_shares")
#: The kind of a kept masked input and of a kept secure aggregate (``kind`` in their files).
MASKED_KIND = "secagg.masked_input"
AGGREGATE_KIND = "secagg.aggregate"
#: The file of the kept secure aggregate.
AGGREGATE_FILE = "aggregate.npz"


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` to exactly ``path``, atomically (a reader never sees half a file). Strings
    go as numpy unicode arrays: nothing here needs pickle to load."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def decode_masked(masked: np.ndarray, params: SecAggParams, start: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
    """A masked input read as the server would read a plain update from it: (the update by name,
    the weight entry). ``start`` is the global model the input started from, whose float arrays
    the agent flattened in name order (edge_agent/methods/fedavg.py) before appending its weight.

    Raises:
        ShapeMismatchError: ``masked`` does not hold one entry per float of ``start`` and the weight.
    """
    from shared_protocol.secagg import dequantise  # needs cryptography and pycryptodome, as secure aggregation does

    names = sorted(n for n, a in start.items() if np.asarray(a).dtype.kind == "f")
    length = sum(np.asarray(start[n]).size for n in names)
    if masked.size != length + 1:
        raise ShapeMismatchError(f"a masked input of {masked.size} entries does not fit the {length} floats of the "
                                 "global model it started from and a weight")
    values = dequantise(np.ascontiguousarray(masked).view(params.dtype), params)
    update, offset = {}, 0
    for name in names:
        shape = np.shape(start[name])
        size = int(np.prod(shape))
        update[name] = values[offset:offset + size].reshape(shape).astype(np.float32)
        offset += size
    return update, float(values[-1])


@dataclass
class _Maps:
    """One agent's kept activation rows."""

    round: int
    features: list[np.ndarray] = field(default_factory=list)  # (n, C, H, W) each
    labels: list[np.ndarray] = field(default_factory=list)
    sample_ids: list[np.ndarray] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    round_labels: list[np.ndarray] = field(default_factory=list)  # every label of the round's uploads
    round_predicted: list[np.ndarray] = field(default_factory=list)  # FedGKT: the edge logits' argmax
    whole_batch: bool = True  # split learning: the kept rows are one whole training batch
    eval_model: dict[str, np.ndarray] = field(default_factory=dict)  # FedGKT: the round's evaluation ResNet-8

    @property
    def rows(self) -> int:
        return sum(len(f) for f in self.features)


class AuditKeeper:
    """Keeps a bounded sample of what the server received for ``edgesplit audit``.

    Args:
        run_dir: the run directory (files go to ``run_dir/audit``).
        method: the run's method name.
        samples_per_agent: activation rows kept per agent (>= 1).
        secagg: the run's secure-aggregation parameters (None: off), to decode masked inputs.
    """

    def __init__(self, run_dir: str | Path, method: str, samples_per_agent: int, secagg: SecAggParams | None = None) -> None:
        if samples_per_agent < 1:
            raise ValueError(f"audit samples_per_agent must be >= 1, got {samples_per_agent}")
        self.dir = Path(run_dir) / AUDIT_DIR
        self.method = method
        self.samples_per_agent = samples_per_agent
        self.secagg = secagg
        self._advertised: dict[str, int] = {}  # agent -> the sample count of its latest secure-aggregation advert
        # the first secure round whose masked inputs the keeper saw start from a model it holds, until its aggregate is kept
        self._pending: dict[str, Any] | None = None
        self._aggregate_kept = False
        self._maps: dict[str, _Maps] = {}
        self._eval_maps: dict[str, _Maps] = {}  # FedGKT: the maps of the agents' local test images, evaluation's upload
        # agent (None: sent to all) -> (global version, weights) of the last model the server sent
        self._global: dict[str | None, tuple[int, dict[str, np.ndarray]]] = {}
        self._round_config: dict[str, dict[str, Any]] = {}  # agent -> its latest RoundStart.config
        self._turn_extractor: dict[str, dict[str, np.ndarray]] = {}  # split learning: agent -> extractor of its turn
        self._eval_extractor: dict[str, dict[str, np.ndarray]] = {}  # split learning: agent -> the round's final extractor
        self._updates: set[str] = set()
        self._extractor_kept = False
        self._unsupported: dict[str, int] = {}
        # agent -> the models (by label) and bytes its first evaluation report carried: trained on
        # private data and handed to the server, which the audit names but does not invert
        self._eval_models: dict[str, dict[str, Any]] = {}
        self._files: dict[str, dict[str, Any]] = {}
        self.dir.mkdir(parents=True, exist_ok=True)
        self._resume()
        self._write_manifest()

    def _resume(self) -> None:
        """A resumed run keeps what the first process kept, and adds none for the agents it covers."""
        path = self.dir / KEPT_MANIFEST
        if not path.exists():
            return
        self._files = {name: about for name, about in json.loads(path.read_text()).get("files", {}).items()
                       if (self.dir / name).exists()}
        for name, about in self._files.items():
            if name.startswith("update-"):
                self._updates.add(about["agent"])
            elif name.startswith("maps-"):
                self._maps[about["agent"]] = _Maps(round=-1)  # nothing more for this agent
            elif name.startswith("evalmaps-"):
                self._eval_maps[about["agent"]] = _Maps(round=-1)
        self._extractor_kept = "extractor.npz" in self._files
        self._aggregate_kept = AGGREGATE_FILE in self._files

    # -- what the coordinator calls ----------------------------------------------------- #

    def on_sent(self, agent: str | None, msg: Message) -> None:
        """A message the server sent (``agent`` None: to every agent)."""
        if isinstance(msg, RoundStart):
            if agent is not None:
                self._round_config[agent] = dict(msg.config)
            if msg.weights:
                self._on_model_sent(agent, msg)
        elif isinstance(msg, FedAvgGlobalModel):
            self._global[agent] = (msg.model_version, dict(msg.weights))
            self._maybe_keep_aggregate(msg.model_version, msg.weights)
        elif isinstance(msg, SecAggUnmask) and not msg.reason:
            if self._pending is not None and self._pending["round"] == msg.round:
                self._pending["survivors"] = list(msg.survivors)
        elif isinstance(msg, SplitExtractor) and agent is not None:
            self._eval_extractor[agent] = dict(msg.weights)  # the extractor the agent evaluates its test shard with
        elif isinstance(msg, FedKdAggregate):
            # The agents rebuild the next mentee from it; the keeper keeps only dense models it saw.
            pass

    def on_received(self, agent: str, msg: Message) -> None:
        """An upload as the server decoded it, before the method takes it."""
        if isinstance(msg, GktFeatures):
            if msg.split == "train":
                self._keep_maps(agent, msg.round, msg.seq, msg.features, msg.labels, msg.sample_ids,
                                msg.logits.argmax(axis=1) if len(msg.logits) else np.zeros(0, np.int64))
            else:
                self._keep_eval_maps(agent, msg.round, msg.seq, msg.features, msg.labels, msg.sample_ids)
        elif isinstance(msg, GktReusedMaps):
            pass  # names maps uploaded before (kept, if at all, when they were uploaded)
        elif isinstance(msg, SplitActivations):
            if msg.split == "train":
                self._keep_maps(agent, msg.round, msg.seq, msg.activations, msg.labels, None, None)
            else:  # evaluation: the test shard through the round's final extractor, in eval mode
                self._keep_eval_maps(agent, msg.round, msg.seq, msg.activations, msg.labels,
                                     np.full(len(msg.labels), -1, np.int64))
        elif isinstance(msg, FedAvgUpdate):
            self._keep_fedavg_update(agent, msg)
        elif isinstance(msg, FedKdUpdate):
            self._keep_fedkd_update(agent, msg)
        elif isinstance(msg, SecAggAdvertise):
            self._advertised[agent] = msg.num_samples  # in clear, as a plain upload's
        elif isinstance(msg, SecAggMaskedInput) and self.secagg is not None:
            self._keep_masked_input(agent, msg)
        elif isinstance(msg, EvalReport):
            self._note_eval_models(agent, msg)
            self._keep_eval_model(agent, msg)
        elif isinstance(msg, (Hello, Status, RoundEnd, ErrorReply, SplitExtractorWeights)) or msg.TYPE in _NOT_ATTACKED:
            pass
        else:
            self._unsupported[msg.TYPE] = self._unsupported.get(msg.TYPE, 0) + 1
            if self._unsupported[msg.TYPE] == 1:
                log.warning("audit: %s uploads are not kept (the audit does not read them yet)", msg.TYPE)
                self._write_manifest()

    # -- activations ------------------------------------------------------------------- #

    def _on_model_sent(self, agent: str | None, msg: RoundStart) -> None:
        weights = dict(msg.weights)
        if self.method == "fedgkt":
            if not self._extractor_kept:
                # The shared initial edge model: every agent gets the same one (edge_init = "shared").
                self._save("extractor.npz", {f"weights/{k}": v for k, v in weights.items()},
                           {"what": "the initial edge model the server sent", "round": msg.round, "agent": agent})
                self._extractor_kept = True
            return
        if self.method == "splitnn":
            if agent is not None:
                self._turn_extractor[agent] = weights
            return
        version = msg.config.get("model_version", msg.config.get("global_version"))
        if isinstance(version, int):
            self._global[agent] = (version, weights)
            self._maybe_keep_aggregate(version, weights)

    def _keep_maps(self, agent: str, round_: int, seq: int, features: np.ndarray, labels: np.ndarray,
                   sample_ids: np.ndarray | None, predicted: np.ndarray | None) -> None:
        kept = self._maps.get(agent)
        if kept is None:
            kept = self._maps[agent] = _Maps(round=round_)
        if round_ != kept.round:
            return  # one round's uploads per agent (-1: kept before a resume)
        kept.round_labels.append(np.asarray(labels, np.int64))
        if predicted is not None:
            kept.round_predicted.append(np.asarray(predicted, np.int64))
        room = self.samples_per_agent - kept.rows
        split_learning = sample_ids is None
        if split_learning and not kept.seqs:
            # The turn's first batch, whole: its activations came from a training pass whose
            # normalisation used the whole batch, so no part of it can be inverted alone.
            room = len(features)
        if room > 0 and (not split_learning or not kept.seqs):  # split learning: the turn's first batch only
            take = min(room, len(features))
            kept.features.append(np.array(features[:take], dtype=np.float32))
            kept.labels.append(np.array(labels[:take], dtype=np.int64))
            kept.sample_ids.append(np.array(sample_ids[:take] if sample_ids is not None else np.full(take, -1), dtype=np.int64))
            kept.seqs.append(seq)
            if split_learning:
                kept.whole_batch = take == len(features)
        self._write_maps(agent, kept)

    def _keep_eval_maps(self, agent: str, round_: int, seq: int, features: np.ndarray, labels: np.ndarray,
                        sample_ids: np.ndarray) -> None:
        """Evaluation's upload of the agent's local test images (FedGKT's maps, split learning's
        activations): one round's, bounded as the training rows."""
        kept = self._eval_maps.get(agent)
        if kept is None:
            kept = self._eval_maps[agent] = _Maps(round=round_)
        room = self.samples_per_agent - kept.rows
        if round_ != kept.round or room <= 0:
            return
        take = min(room, len(features))
        kept.features.append(np.array(features[:take], dtype=np.float32))
        kept.labels.append(np.array(labels[:take], dtype=np.int64))
        kept.round_labels.append(np.array(labels[:take], dtype=np.int64))
        kept.sample_ids.append(np.array(sample_ids[:take], dtype=np.int64))
        kept.seqs.append(seq)
        self._write_maps(agent, kept, "evalmaps", "activation uploads of evaluation (the agent's local test images)")

    def _note_eval_models(self, agent: str, msg: EvalReport) -> None:
        if not msg.models or agent in self._eval_models:
            return
        labels = sorted({name.split("/", 1)[0] for name in msg.models})
        self._eval_models[agent] = {"models": labels, "bytes": int(sum(np.asarray(v).nbytes for v in msg.models.values())),
                                    "round": msg.round}
        self._write_manifest()

    def _keep_eval_model(self, agent: str, msg: EvalReport) -> None:
        edge = {name[len("edge/"):]: value for name, value in msg.models.items() if name.startswith("edge/")}
        for store, prefix, what in ((self._maps, "maps", "activation uploads"),
                                    (self._eval_maps, "evalmaps", "activation uploads of evaluation (the agent's local test images)")):
            kept = store.get(agent)
            if kept is None or msg.round != kept.round or not edge or kept.eval_model:
                continue
            kept.eval_model = edge
            self._write_maps(agent, kept, prefix, what)

    def _write_maps(self, agent: str, kept: _Maps, prefix: str = "maps", what: str = "activation uploads") -> None:
        if not kept.features:
            return
        arrays: dict[str, np.ndarray] = {
            "features": np.concatenate(kept.features),  # (N, C, H, W)
            "labels": np.concatenate(kept.labels),
            "sample_ids": np.concatenate(kept.sample_ids),
            "seqs": np.asarray(kept.seqs, np.int64),
            "round": np.asarray(kept.round, np.int64),
            "round_labels": np.concatenate(kept.round_labels),
            "whole_batch": np.asarray(kept.whole_batch),
        }
        if kept.round_predicted:
            arrays["round_predicted"] = np.concatenate(kept.round_predicted)
        arrays.update({f"eval_weights/{k}": v for k, v in kept.eval_model.items()})
        extractor = (self._eval_extractor if prefix == "evalmaps" else self._turn_extractor).get(agent)
        if self.method == "splitnn" and extractor is not None:
            arrays.update({f"weights/{k}": v for k, v in extractor.items()})
        self._save(f"{prefix}-{agent}.npz", arrays, {"what": what, "agent": agent, "round": kept.round, "rows": kept.rows})

    # -- weight updates ------------------------------------------------------------------ #

    def _start_model(self, agent: str, version: int) -> dict[str, np.ndarray] | None:
        for key in (agent, None):
            held = self._global.get(key)
            if held is not None and held[0] == version:
                return held[1]
        return None

    def _keep_fedavg_update(self, agent: str, msg: FedAvgUpdate) -> None:
        if agent in self._updates:
            return
        start = self._start_model(agent, msg.model_version)
        if start is None:
            return
        uploaded = join_state(msg.weights, msg.int_buffers)
        arrays = {f"uploaded/{k}": v for k, v in uploaded.items()}
        arrays.update({f"global/{k}": np.asarray(start[k]) for k in msg.weights if k in start})
        self._keep_update(agent, msg.round, "fedavg.update", msg.num_samples, arrays)

    def _keep_fedkd_update(self, agent: str, msg: FedKdUpdate) -> None:
        if agent in self._updates:
            return
        start = self._start_model(agent, msg.base_version)
        if start is None:
            return
        arrays = {f"global/{k}": np.asarray(v) for k, v in start.items()}
        arrays.update({"factors": msg.factors, "layout": np.asarray(json.dumps(msg.layout)),
                       "payload": np.asarray(msg.payload), "threshold": np.asarray(msg.threshold),
                       "base_version": np.asarray(msg.base_version, np.int64)})
        self._keep_update(agent, msg.round, "fedkd.update", msg.num_samples, arrays)

    def _keep_masked_input(self, agent: str, msg: SecAggMaskedInput) -> None:
        start = self._start_model(agent, msg.model_version)
        if start is None or self.secagg is None:
            return
        if not self._aggregate_kept and (self._pending is None or self._pending["round"] < msg.round):  # a failed round's gives way
            self._pending = {"round": msg.round, "start": start, "round_config": self._round_config.get(agent, {}),
                             "survivors": [], "num_samples": {}}
        if self._pending is not None and self._pending["round"] == msg.round:
            self._pending["num_samples"][agent] = self._advertised.get(agent, 0)
        if agent in self._updates:
            return
        try:
            update, weight = decode_masked(msg.masked, self.secagg, start)
        except ShapeMismatchError as exc:
            log.warning("audit: %s's masked input is not kept: %s", agent, exc)
            return
        arrays = {f"update/{k}": v for k, v in update.items()}
        arrays.update({f"int_buffers/{k}": np.asarray(v, np.int64) for k, v in msg.int_buffers.items()})
        arrays.update({f"global/{k}": np.asarray(v) for k, v in start.items()})
        arrays["masked_weight"] = np.asarray(weight)
        self._keep_update(agent, msg.round, MASKED_KIND, self._advertised.get(agent, 0), arrays)

    def _maybe_keep_aggregate(self, version: int, weights: dict[str, np.ndarray]) -> None:
        """FedAvg's global version is the round that made it: the model of version r, minus the one
        round r started from, is the survivors' mean update (with DP-FedAvg's noise, where on)."""
        pending = self._pending
        if pending is None or version != pending["round"] or not pending["survivors"] or not weights:
            return
        start = pending["start"]
        names = sorted(n for n in weights if n in start and np.asarray(weights[n]).dtype.kind == "f")
        arrays: dict[str, np.ndarray] = {f"update/{n}": (np.asarray(weights[n], np.float64) - np.asarray(start[n], np.float64)).astype(np.float32)
                                         for n in names}
        arrays.update({f"global/{k}": np.asarray(v) for k, v in start.items()})
        survivors = pending["survivors"]
        counts = [int(pending["num_samples"].get(a, 0)) for a in survivors]
        arrays.update({"kind": np.asarray(AGGREGATE_KIND), "round": np.asarray(pending["round"], np.int64),
                       "agents": np.asarray(survivors), "agent_samples": np.asarray(counts, np.int64),
                       "num_samples": np.asarray(sum(counts), np.int64),
                       "round_config": np.asarray(json.dumps(pending["round_config"], sort_keys=True))})
        self._pending, self._aggregate_kept = None, True
        self._save(AGGREGATE_FILE, arrays, {"what": f"the unmasked aggregate of {len(survivors)} agents (their mean update) "
                                            "and the global model it started from", "agents": survivors,
                                            "round": int(arrays["round"]), "num_samples": int(sum(counts))})

    def _keep_update(self, agent: str, round_: int, kind: str, num_samples: int, arrays: dict[str, np.ndarray]) -> None:
        arrays.update({"kind": np.asarray(kind), "round": np.asarray(round_, np.int64),
                       "num_samples": np.asarray(num_samples, np.int64),
                       "round_config": np.asarray(json.dumps(self._round_config.get(agent, {}), sort_keys=True))})
        self._updates.add(agent)
        what = ("one masked input (secure aggregation), decoded as a plain update" if kind == MASKED_KIND else f"one {kind}")
        self._save(f"update-{agent}.npz", arrays, {"what": f"{what} and the global model it started from", "kind": kind,
                                                   "agent": agent, "round": round_, "num_samples": num_samples})

    # -- files ------------------------------------------------------------------------- #

    def _save(self, name: str, arrays: dict[str, np.ndarray], about: dict[str, Any]) -> None:
        save_arrays(self.dir / name, arrays)
        self._files[name] = {**about, "bytes": (self.dir / name).stat().st_size}
        self._write_manifest()

    def _write_manifest(self) -> None:
        manifest = {"method": self.method, "samples_per_agent": self.samples_per_agent, "files": self._files,
                    "not_kept": dict(sorted(self._unsupported.items())),
                    "eval_models": dict(sorted(self._eval_models.items()))}
        tmp = self.dir / f".{KEPT_MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.dir / KEPT_MANIFEST)
