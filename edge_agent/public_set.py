"""The run's public global test set on the agent, for a method whose private model is
scored where it lives (cloud_server/evaluation.py): FedKD's mentor, FedGKT's extractor
when it is private.

The server's :class:`~shared_protocol.messages.EvalRequest` names the set
(:class:`~shared_protocol.messages.PublicEvalSet`: dataset, subset size and seed, and the
sha256 of its sample ids and images). The agent gets it once per run and keeps it:

* **loaded locally** when its own ``[data] dataset`` is the set's dataset (a local
  simulation's agents read the same public dataset; a device may keep a copy of a public
  test split): nothing crosses the wire, and the digests must match the server's, or the
  evaluation is refused with :class:`PublicSetMismatchError` (the two copies differ);
* **downloaded** otherwise, or when no local copy can be read: an
  :class:`~shared_protocol.messages.EvalSetRequest` up and the server's
  :class:`~shared_protocol.messages.EvalSetData` (images, labels, ids) down, metered as
  the evaluation's bytes, checked against the same digests.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from fldata import ArrayDataset
from fldata.downloads import DownloadError
from fldata.public_set import load_public_test_set, public_set_digests
from shared_protocol.errors import UnknownEvalSetError
from shared_protocol.messages import EvalSetData, EvalSetRequest, Message, PublicEvalSet

from .config import DataConfig
from .costs import RoundMeter

log = logging.getLogger("edge_agent")

__all__ = ["EVAL_SET_TIMEOUT_S", "PublicSetMismatchError", "PublicTestSet"]

#: How long the agent waits for the server's EvalSetData, per attempt.
EVAL_SET_TIMEOUT_S = 60.0


class PublicSetMismatchError(ValueError):
    """The agent's own copy of the public dataset gives another global test set than the server's."""


class PublicTestSet:
    """The public global test set, loaded or downloaded once and kept (:meth:`get`)."""

    def __init__(self, data: DataConfig, request: Callable[..., Message], base: Callable[[int], dict]) -> None:
        self.data_config = data
        self._request = request  # EdgeAgent.request: send and wait for the server's answer
        self._base = base  # the message header fields of a round
        self._held: tuple[str, ArrayDataset] | None = None  # (images_sha256, the set)
        self.source = ""  # "local" | "download": how the held set came

    def get(self, ref: PublicEvalSet, meter: RoundMeter, round_: int) -> ArrayDataset:
        """The set ``ref`` names, checked against its digests."""
        if not ref.dataset:
            raise ValueError("the evaluation request names no public test set to score on")
        if self._held is not None and self._held[0] == ref.images_sha256:
            return self._held[1]
        data = self._load_local(ref) if self.data_config.dataset == ref.dataset else None
        if data is None:
            data = self._download(ref, meter, round_)
            self.source = "download"
        else:
            self.source = "local"
        self._held = (ref.images_sha256, data)
        log.info("public test set %s (%d images) %s", ref.dataset, len(data),
                 "loaded from this device's copy" if self.source == "local" else "downloaded from the server")
        return data

    def _load_local(self, ref: PublicEvalSet) -> ArrayDataset | None:
        try:
            data = load_public_test_set(ref.dataset, ref.subset_samples, ref.seed, self.data_config.root, self.data_config.download)
        except (OSError, DownloadError) as exc:  # no readable copy here: the server sends it
            log.info("public test set %s: no local copy (%s); asking the server for it", ref.dataset, exc)
            return None
        ids, images = public_set_digests(data)
        if (ids, images) != (ref.ids_sha256, ref.images_sha256) or len(data) != ref.samples:
            raise PublicSetMismatchError(
                f"this agent's copy of {ref.dataset!r} (data.root = {self.data_config.root!r}) gives another global test "
                f"set than the server's: {len(data)} images, ids_sha256 {ids[:16]}..., images_sha256 {images[:16]}... "
                f"against {ref.samples}, {ref.ids_sha256[:16]}..., {ref.images_sha256[:16]}...; give the agent the "
                "server's copy of the dataset (data.root / [server] eval_root), or another [data] dataset so that it "
                "downloads the set from the server")
        return data

    def _download(self, ref: PublicEvalSet, meter: RoundMeter, round_: int) -> ArrayDataset:
        reply = self._request(EvalSetRequest(**self._base(round_), images_sha256=ref.images_sha256), meter,
                              lambda m: isinstance(m, EvalSetData), EVAL_SET_TIMEOUT_S)
        assert isinstance(reply, EvalSetData)
        data = ArrayDataset(np.ascontiguousarray(reply.images), reply.labels, reply.sample_ids, reply.num_classes, reply.name)
        ids, images = public_set_digests(data)
        if (ids, images) != (ref.ids_sha256, ref.images_sha256):
            raise UnknownEvalSetError(f"eval_set_data: the server sent a set with ids_sha256 {ids[:16]}..., images_sha256 "
                                      f"{images[:16]}..., not the {ref.ids_sha256[:16]}..., {ref.images_sha256[:16]}... "
                                      "its evaluation request named")
        return data
