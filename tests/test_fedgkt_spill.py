"""FedGKT's bound on staged feature maps: beyond ``staged_memory_bytes`` uploads are
staged in memory-mapped files, trained on from there with the same result, and
deleted when the round's training is done."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cloud_server.feature_store import ArrayStaging
from cloud_server.methods import ServerContext
from cloud_server.methods.fedgkt import FedGktConfig, FedGktServer
from shared_protocol.messages import EvalReport, RoundEnd
from shared_protocol.methods.fedgkt import GktFeatures

CTX = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)
BATCH_BYTES = 6 * 16 * 8 * 8 * 2  # one upload batch of float16 feature maps below


def _batch(agent: int, split: str, seq: int, ids: np.ndarray, salt: int = 0) -> GktFeatures:
    rng = np.random.default_rng(1000 * agent + 10 * seq + salt + (500 if split == "test" else 0))
    n = len(ids)
    return GktFeatures(
        run="u", round=1, sender=f"a{agent}", split=split, seq=seq, instance=f"i{agent}",
        features=np.maximum(rng.normal(size=(n, 16, 8, 8)), 0).astype(np.float32),
        logits=rng.normal(size=(n, 10)).astype(np.float32),
        labels=rng.integers(0, 10, n).astype(np.int64),
        sample_ids=ids.astype(np.int64),
    )


def _uploads() -> dict[str, list[GktFeatures]]:
    """Two agents, three train batches each (one sent twice, as a resend; one overlapping
    the others' sample ids), one test batch (evaluation's, sent after the round's step)."""
    out = {}
    for a in range(2):
        base = 100 * a
        out[f"a{a}"] = [
            _batch(a, "train", 0, np.arange(base, base + 6)),
            _batch(a, "train", 1, np.arange(base + 6, base + 12), salt=1),
            _batch(a, "train", 1, np.arange(base + 6, base + 12), salt=2),  # replaces seq 1
            _batch(a, "train", 2, np.arange(base + 3, base + 9)),  # re-sends ids of seqs 0 and 1: last wins
            _batch(a, "test", 0, np.arange(base + 50, base + 56)),
        ]
    return out


def _end(agent: str) -> RoundEnd:
    return RoundEnd(run="u", round=1, sender=agent, num_samples=18, instance=f"i{agent[1:]}",
                    uploads={"train": {"batches": 3, "samples": 18}})


def _run(config: dict, spill_dir: Path, rounds: int = 2) -> tuple[FedGktServer, list, list[list[Path]]]:
    torch.manual_seed(0)
    server = FedGktServer(CTX, {"server_batch_size": 6, "spill_dir": str(spill_dir), **config})
    outcomes, files_while_staged = [], []
    for _ in range(rounds):
        uploads = _uploads()
        for agent, batches in uploads.items():
            for msg in batches:
                if msg.split == "train":
                    server.on_upload(agent, msg)
        files_while_staged.append(sorted(spill_dir.glob("*.npy")) if spill_dir.exists() else [])
        outcome = server.complete(1, {a: _end(a) for a in ("a0", "a1")}, evaluate=True)
        for agent, batches in uploads.items():  # the evaluation's test maps, staged the same way
            for msg in batches:
                if msg.split == "test":
                    server.on_upload(agent, msg)
        ev = server.evaluation(1, {a: EvalReport(run="u", round=1, sender=a, instance=f"i{a[1:]}") for a in ("a0", "a1")})
        outcome.local = ev.local["model"]  # type: ignore[attr-defined]
        outcomes.append(outcome)
    return server, outcomes, files_while_staged


@pytest.fixture(scope="module")
def in_memory_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[FedGktServer, list, list[list[Path]]]:
    return _run({}, tmp_path_factory.mktemp("memory"))  # the default bound holds everything in memory


@pytest.mark.parametrize("bound", [0, 3 * BATCH_BYTES])  # everything spilled; some batches in memory, some on disk
def test_spilled_features_train_to_the_same_result_and_are_deleted(tmp_path: Path, bound: int, in_memory_run: tuple) -> None:
    in_memory, expected, none_spilled = in_memory_run
    spilled, got, files = _run({"staged_memory_bytes": bound}, tmp_path / "spill")
    assert none_spilled == [[], []] and in_memory.staging.files_written == 0
    # While staged (before the round's training) the uploads were in mapped .npy files ...
    assert all(len(f) >= 1 for f in files) and spilled.staging.files_written >= 4
    if bound:
        assert spilled.staging.peak_in_memory_bytes <= bound
    # ... and once the round is trained and evaluated, none is left.
    assert list((tmp_path / "spill").glob("*")) == [] and spilled.staging.files == []
    assert spilled.staging.in_memory_bytes == 0 and spilled.staging.spilled_bytes == 0
    for want, have in zip(expected, got):
        assert have.used_agents == want.used_agents == ["a0", "a1"]
        assert (have.local, have.samples) == (want.local, want.samples)
        assert sum(t for _, t in want.local.values()) == 12 and want.samples == 2 * 12  # 18 uploaded per agent, 6 of them twice
        assert have.server_loss == want.server_loss
        for (agent_w, msg_w), (agent_h, msg_h) in zip(want.downloads, have.downloads):
            assert agent_w == agent_h
            np.testing.assert_array_equal(msg_h.sample_ids, msg_w.sample_ids)
            np.testing.assert_array_equal(msg_h.logits, msg_w.logits)
    for p_w, p_h in zip(in_memory.model.parameters(), spilled.model.parameters()):
        assert torch.equal(p_w, p_h)


def test_discarded_uploads_free_memory_and_files(tmp_path: Path) -> None:
    server = FedGktServer(CTX, {"staged_memory_bytes": BATCH_BYTES, "spill_dir": str(tmp_path)})
    for msg in _uploads()["a0"]:
        server.on_upload("a0", msg)
    assert server.staging.in_memory_bytes == BATCH_BYTES and len(server.staging.files) == 3
    # A restarted agent process voids what its predecessor staged, files included.
    restarted = _batch(0, "train", 0, np.arange(6))
    restarted.instance = "new"
    server.on_upload("a0", restarted)
    assert len(server.staging.files) == 0 and server.staging.in_memory_bytes == BATCH_BYTES
    server.discard("a0")
    assert server.staging.in_memory_bytes == 0 and list(tmp_path.glob("*")) == []


def test_array_staging_bound_and_format(tmp_path: Path) -> None:
    staging = ArrayStaging(memory_bytes=100, spill_dir=tmp_path)
    small = staging.stage(np.ones((10, 5), np.float32))  # 100 bytes as float16: fits exactly
    big = staging.stage(np.full((3, 4), 2.5, np.float32))
    assert not small.spilled and big.spilled and small.array.dtype == np.float16
    # A plain .npy file, readable without pickle; the staged view is a read-only map.
    np.testing.assert_array_equal(np.load(big.path, allow_pickle=False), np.full((3, 4), 2.5, np.float16))
    assert isinstance(big.array, np.memmap) and not big.array.flags.writeable
    staging.release(big)
    staging.release(big)  # idempotent
    staging.release(small)
    assert staging.in_memory_bytes == 0 and list(tmp_path.glob("*")) == []
    with pytest.raises(ValueError):
        ArrayStaging(-1)
    with pytest.raises(ValueError, match="staged_memory_bytes"):
        FedGktConfig(staged_memory_bytes=-5)


def test_private_spill_directory_is_removed_when_empty() -> None:
    staging = ArrayStaging(memory_bytes=0)
    item = staging.stage(np.zeros((2, 2), np.float32))
    assert item.path is not None and item.path.exists()
    directory = item.path.parent
    staging.release(item)
    assert not directory.exists()


def test_spill_files_go_to_the_run_directory_by_default(tmp_path: Path) -> None:
    from dataclasses import replace

    server = FedGktServer(replace(CTX, out_dir=str(tmp_path / "run")), {"staged_memory_bytes": 0})
    assert server.staging._spill_dir == tmp_path / "run" / "staged"
    assert FedGktServer(CTX, {"staged_memory_bytes": 0}).staging._spill_dir is None  # no run directory: a private temp dir
