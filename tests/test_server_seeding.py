"""A server method's initial models depend on the run's seed alone, whatever other threads of
the process do with torch's global RNG meanwhile.

The cause of the FedKD two-run difference (tests/test_fedkd_determinism.py): ``FedKdServer``
seeded torch's global RNG with the run's seed and drew the initial global mentee from it. In
an in-memory federation the server is built while other threads of the process (agents of
a federation still shutting down, a benchmark's loop, the test's own global-RNG user) draw
from and reseed that one generator; a reseed between the server's ``torch.manual_seed`` and
its last draw gave another initial mentee, so every upload and aggregate after it differed
(found by dumping both runs per round: the first difference was the server's initial
mentee; every agent's initial mentor and W_h were equal). FedAvg, split learning and FedGKT
built their initial server-side models the same way. They now draw from a generator of
their own, seeded with the run's seed: bit for bit the weights ``torch.manual_seed(seed)``
gave (models.seeding), so recorded runs keep their initial models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from cloud_server.methods.base import ServerContext
from cloud_server.methods.fedavg import FedAvgServer
from cloud_server.methods.fedgkt import FedGktServer
from cloud_server.methods.fedkd import FedKdServer
from cloud_server.methods.splitnn import SplitNNServer
from models import build_model, state_dict_to_arrays

Arrays = dict[str, np.ndarray]


def _ctx(seed: int) -> ServerContext:
    return ServerContext(run_id="seeding", num_classes=10, in_channels=1, device="cpu", seed=seed, rounds=2)


def _prefixed(prefix: str, arrays: Arrays) -> Arrays:
    return {f"{prefix}/{k}": v for k, v in arrays.items()}


def _fedkd(seed: int) -> Arrays:
    return FedKdServer(_ctx(seed), {"mentor_model": "convnet", "mentee_model": "simplecnn"}).global_state


def _fedavg(seed: int) -> Arrays:
    return FedAvgServer(_ctx(seed), {"model": "simplecnn"}).global_state


def _splitnn(seed: int) -> Arrays:
    server = SplitNNServer(_ctx(seed), {"edge_model": "resnet8", "server_model": "resnet55_server"})
    return _prefixed("extractor", server.extractor_state) | _prefixed("server", state_dict_to_arrays(server.model))


def _fedgkt(seed: int) -> Arrays:
    server = FedGktServer(_ctx(seed), {"edge_model": "resnet8", "server_model": "resnet55_server", "edge_init": "shared"})
    return _prefixed("edge", server.edge_init_weights) | _prefixed("server", state_dict_to_arrays(server.model))


SERVERS: dict[str, Callable[[int], Arrays]] = {"fedkd": _fedkd, "fedavg": _fedavg, "splitnn": _splitnn, "fedgkt": _fedgkt}


def _same(a: Arrays, b: Arrays) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method", sorted(SERVERS))
def test_building_a_server_leaves_torchs_global_rng_alone(method: str) -> None:
    """The cause, pinned without a race: the server neither reseeds torch's global RNG nor
    draws from it (what it drew depended on what other threads had done to it). A race test
    (another thread reseeding while servers are built) caught the old servers only now and
    then; tests/test_fedkd_determinism.py runs the whole federation that way."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    SERVERS[method](7)
    assert torch.equal(torch.get_rng_state(), before), f"{method}'s server reseeded or drew from torch's global RNG"


def _seeded_globally(seed: int, *builds: tuple[str, dict[str, Any]]) -> list[Arrays]:
    """What the servers drew before: ``torch.manual_seed(seed)``, then the models in order."""
    torch.manual_seed(seed)
    return [state_dict_to_arrays(build_model(name, **kw)) for name, kw in builds]


def test_the_initial_models_are_the_ones_the_global_seed_gave() -> None:
    """Recorded runs keep their starting point: the same weights as the old global-RNG draws."""
    mentee, = _seeded_globally(3, ("simplecnn", {"num_classes": 10, "in_channels": 1}))
    assert _same(_fedkd(3), {k: v for k, v in mentee.items() if v.dtype.kind == "f"})
    model, = _seeded_globally(3, ("simplecnn", {"num_classes": 10, "in_channels": 1}))
    assert _same(_fedavg(3), model)
    # Split learning drew the edge model (the extractor is its stem), then the server model, from one stream.
    torch.manual_seed(3)
    extractor = state_dict_to_arrays(build_model("resnet8", 10, 1).extractor)
    server = state_dict_to_arrays(build_model("resnet55_server", 10))
    assert _same(_splitnn(3), _prefixed("extractor", extractor) | _prefixed("server", server))
    # FedGKT: the server model from the seed; the shared edge model from the seed afresh.
    server, = _seeded_globally(3, ("resnet55_server", {"num_classes": 10}))
    edge, = _seeded_globally(3, ("resnet8", {"num_classes": 10, "in_channels": 1}))
    assert _same(_fedgkt(3), _prefixed("edge", edge) | _prefixed("server", server))
