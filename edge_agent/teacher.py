"""Server logits by sample id (FedGKT's teacher), shared by the torch and ort edge steps."""

from __future__ import annotations

import numpy as np

from shared_protocol.errors import ShapeMismatchError

#: Images per forward pass when extracting feature maps or evaluating. An upload
#: message holds ``upload_batch_samples`` (default 256) samples, but running the
#: extractor and classifier on all of them at once would hold 256 samples' worth of
#: 64-channel activations (about 350 MB at 32x32); slices of this size keep the
#: extraction peak below the training step's at the default batch of 64. Eval-mode
#: outputs do not depend on how the batch is sliced.
EXTRACT_BATCH_SAMPLES = 64


class TeacherLogits:
    """Server logits by sample id. Lookups return rows in the order of the ids asked for."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.ids = np.empty(0, np.int64)  # sorted
        self.logits = np.empty((0, num_classes), np.float32)

    def __len__(self) -> int:
        return len(self.ids)

    def update(self, ids: np.ndarray, logits: np.ndarray) -> None:
        if logits.ndim != 2 or logits.shape[1] != self.num_classes or logits.shape[0] != ids.shape[0]:
            raise ShapeMismatchError(f"server logits {logits.shape} for {ids.shape[0]} ids, expected (n, {self.num_classes})")
        keep = ~np.isin(self.ids, ids)
        all_ids = np.concatenate([self.ids[keep], ids.astype(np.int64)])
        all_logits = np.concatenate([self.logits[keep], logits.astype(np.float32)])
        order = np.argsort(all_ids, kind="stable")
        self.ids, self.logits = all_ids[order], all_logits[order]

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logits (B, K), found mask (B,)) for the given sample ids."""
        ids = np.asarray(ids, np.int64)
        pos = np.searchsorted(self.ids, ids)
        pos_clipped = np.minimum(pos, max(len(self.ids) - 1, 0))
        found = (pos < len(self.ids)) & (self.ids[pos_clipped] == ids) if len(self.ids) else np.zeros(len(ids), bool)
        out = np.zeros((len(ids), self.num_classes), np.float32)
        if found.any():
            out[found] = self.logits[pos_clipped[found]]
        return out, found
