"""fldata.mapped: a shard kept on disk gives the same batches and leaves no pages resident."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fldata import make_synthetic
from fldata.mapped import drop_mapped_pages, gather_rows, is_mapped, keep_on_disk
from fldata.numpy_data import iterate_batches
from fldata.torch_data import make_loader


def _resident_bytes(images: np.ndarray) -> int:
    """The resident bytes (``Rss`` in /proc/self/smaps) of the mapping that holds ``images``."""
    start = images.ctypes.data
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif inside and head == "Rss:":
            rss += int(line.split()[1]) * 1024
    return rss


@pytest.fixture
def shard():
    return make_synthetic(4096, num_classes=10, in_channels=1, size=32, seed=3)


def test_a_shard_kept_on_disk_holds_the_same_images_in_a_mapping(shard, tmp_path):
    mapped = keep_on_disk(shard, tmp_path)
    assert is_mapped(mapped.images) and not is_mapped(shard.images)
    assert np.array_equal(mapped.images, shard.images)
    assert np.array_equal(mapped.labels, shard.labels) and np.array_equal(mapped.sample_ids, shard.sample_ids)
    assert keep_on_disk(mapped, tmp_path) is mapped
    assert list(tmp_path.iterdir()) == []  # an unnamed file: nothing left behind
    idx = np.array([4000, 3, 3, 1024, 17])
    assert np.array_equal(gather_rows(mapped.images, idx), shard.images[idx])


def test_the_loaders_give_the_same_batches_from_disk_as_from_memory(shard, tmp_path):
    mapped = keep_on_disk(shard, tmp_path)
    for a, b in zip(make_loader(shard, 64, shuffle=True, augment=True, seed=5), make_loader(mapped, 64, shuffle=True, augment=True, seed=5)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # the batched fetch is the item-by-item one: same values, same augmentation draws
    per_item = make_loader(shard, 64, shuffle=True, augment=True, seed=5)
    per_item.dataset.__getitems__ = None  # the DataLoader then fetches item by item
    for a, b in zip(per_item, make_loader(mapped, 64, shuffle=True, augment=True, seed=5)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for a, b in zip(iterate_batches(shard, 64, shuffle=True, augment=True, seed=5), iterate_batches(mapped, 64, shuffle=True, augment=True, seed=5)):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_an_epoch_from_disk_leaves_the_shard_out_of_resident_memory(shard, tmp_path):
    mapped = keep_on_disk(shard, tmp_path)
    size = mapped.images.nbytes  # 4 MiB
    for _ in make_loader(mapped, 64, shuffle=True, augment=True):
        pass
    for _ in iterate_batches(mapped, 64, shuffle=True):
        pass
    assert _resident_bytes(mapped.images) < size / 8
    # the control: the same epoch's reads without giving the pages back leave the shard resident
    for start in range(0, len(mapped), 64):
        np.asarray(mapped.images[start : start + 64]).sum()
    assert _resident_bytes(mapped.images) > size / 2
    drop_mapped_pages(mapped.images)
    assert _resident_bytes(mapped.images) < size / 8


def test_a_directory_that_cannot_hold_the_shard_is_named_with_the_fix(shard, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError, match="EDGESPLIT_DATA_DIR.*shard_on_disk = false"):
        keep_on_disk(shard, blocker / "shards")


def test_a_low_memory_agent_holds_its_shards_on_disk(shard, tmp_path, monkeypatch):
    from edge_agent.agent import EdgeAgent
    from edge_agent.config import EdgeConfig, MemoryConfig
    from shared_protocol.transport import InMemoryBroker, InMemoryTransport

    monkeypatch.setenv("EDGESPLIT_DATA_DIR", str(tmp_path))
    broker = InMemoryBroker()
    test = make_synthetic(64, num_classes=10, in_channels=1, size=32, seed=4, split="test")
    low = EdgeAgent(EdgeConfig(agent_id="a", memory=MemoryConfig.low()), transport=InMemoryTransport(broker, "a"), data=(shard, test))
    assert is_mapped(low.train.images) and is_mapped(low.test.images)
    assert np.array_equal(low.train.images, shard.images)
    plain = EdgeAgent(EdgeConfig(agent_id="b"), transport=InMemoryTransport(broker, "b"), data=(shard, test))
    assert plain.train is shard and plain.test is test
