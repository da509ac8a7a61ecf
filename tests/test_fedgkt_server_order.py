"""FedGKT's server batch order (``fedgkt.server_order``): which agents' maps a server batch holds."""

from __future__ import annotations

import pytest
import torch

from cloud_server.methods import ServerContext
from cloud_server.methods.fedgkt import FedGktConfig, FedGktServer

CTX = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=3)
SIZES = {"a": 37, "b": 5, "c": 20}  # agent -> staged samples


def _data() -> dict[str, tuple]:
    # _batches reads only the sample count (the ids, row 3) of each agent's rows.
    return {agent: (None, None, None, torch.arange(n)) for agent, n in SIZES.items()}


def _plans(order: str, batch: int = 8) -> list[list[tuple[int, torch.Tensor]]]:
    server = FedGktServer(CTX, {"server_order": order, "server_batch_size": batch})
    return server._batches(_data(), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("order", ["shuffled", "per_agent", "mixed"])
def test_every_row_of_every_agent_is_in_one_batch_per_epoch(order: str) -> None:
    seen = {k: [] for k in range(len(SIZES))}
    for plan in _plans(order):
        assert 1 <= sum(len(idx) for _, idx in plan) <= 8
        assert len({k for k, _ in plan}) == len(plan)  # one piece per agent
        for k, idx in plan:
            seen[k].extend(idx.tolist())
    for k, n in enumerate(SIZES.values()):
        assert sorted(seen[k]) == list(range(n))


def test_one_agent_per_batch_unless_mixed() -> None:
    for order in ("shuffled", "per_agent"):
        assert all(len(plan) == 1 for plan in _plans(order))
    walk = [plan[0][0] for plan in _plans("per_agent")]
    assert walk == sorted(walk)  # Algorithm 1: agent by agent
    mixed = _plans("mixed")
    # Batches of the union: full batches but the last, and most hold several agents' maps.
    assert [sum(len(i) for _, i in p) for p in mixed] == [8] * 7 + [6]
    assert sum(len(plan) > 1 for plan in mixed) >= len(mixed) // 2


def test_server_order_is_checked() -> None:
    assert FedGktConfig(server_order="mixed").server_order == "mixed"
    with pytest.raises(ValueError, match="server_order"):
        FedGktConfig(server_order="random")
