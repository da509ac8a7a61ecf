"""models.seeding: initial weights drawn from a caller's generator, never from torch's global
RNG, and bit for bit the weights the global RNG seeded alike gives (for every registered model)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

from models import build_model, list_models, state_dict_to_arrays
from models.seeding import build_seeded


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list_models())
def test_a_generator_gives_the_weights_the_global_rng_seeded_alike_gives(name: str) -> None:
    # Prepare: the weights as every run before models.seeding drew them.
    torch.manual_seed(11)
    reference = state_dict_to_arrays(build_model(name, 10, 1))
    global_state = torch.get_rng_state()
    # Execute
    seeded = state_dict_to_arrays(build_model(name, 10, 1, generator=torch.Generator().manual_seed(11)))
    # Assert: the same values, and the global RNG neither read nor advanced.
    assert _same(seeded, reference)
    assert torch.equal(torch.get_rng_state(), global_state)


def test_the_weights_depend_on_the_generator_alone_while_other_threads_draw() -> None:
    expected = state_dict_to_arrays(build_model("convnet", 10, 1, generator=torch.Generator().manual_seed(3)))
    stop = threading.Event()

    def draw_from_the_global_rng() -> None:  # another agent, or anything else in the process
        while not stop.is_set():
            torch.rand(64)
            torch.manual_seed(int(torch.randint(0, 1000, ())))

    other = threading.Thread(target=draw_from_the_global_rng, daemon=True)
    other.start()
    try:
        built = [state_dict_to_arrays(build_model("convnet", 10, 1, generator=torch.Generator().manual_seed(3))) for _ in range(5)]
    finally:
        stop.set()
        other.join(5)
    assert all(_same(b, expected) for b in built)
    other_seed = state_dict_to_arrays(build_model("convnet", 10, 1, generator=torch.Generator().manual_seed(4)))
    assert not _same(other_seed, expected)


def test_one_generator_gives_consecutive_draws_like_the_global_stream() -> None:
    # A method's models share its agent's one stream (FedKD: mentor, mentee, then W_h).
    torch.manual_seed(5)
    reference = [state_dict_to_arrays(build_model("simplecnn", 10, 1)), state_dict_to_arrays(nn.Linear(4, 8))]
    generator = torch.Generator().manual_seed(5)
    drawn = [state_dict_to_arrays(build_model("simplecnn", 10, 1, generator=generator)),
             state_dict_to_arrays(build_seeded(lambda: nn.Linear(4, 8), generator))]
    assert all(_same(a, b) for a, b in zip(drawn, reference))


def test_a_layer_it_cannot_initialise_is_refused() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(3))  # drawn from the global RNG: cannot be replayed

    with pytest.raises(TypeError, match="Scaled has its own parameters"):
        build_seeded(lambda: nn.Sequential(nn.Linear(3, 3), Scaled()), torch.Generator().manual_seed(0))
