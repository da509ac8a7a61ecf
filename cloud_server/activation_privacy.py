"""The run report's account of the activation defences (``report.json`` ``defences``,
``summary.md``): what was on, its parameters, and for clipped, noised maps their ε from
Opacus's RDP accountant.

A released map is a Gaussian mechanism: the map clipped to an L2 norm of at most C, plus
``N(0, (z C)^2)`` per coordinate, released once (sample rate 1, one step). Its neighbour is
the map of *another* image, at most ``2 C`` away (both have norm <= C), so the accountant is
given the noise multiplier relative to that sensitivity, ``z / 2``. A map released again
unchanged carries the same noise (edge_agent/activation_guard.py) and costs nothing more;
a map of an extractor that trained since is a new release, and ``releases`` of them
compose (the accountant's steps).
"""

from __future__ import annotations

from typing import Any

from shared_protocol.activation_guard import ActivationGuard

__all__ = ["SENSITIVITY_IN_CLIP_NORMS", "activation_defences", "map_epsilon"]

#: A map's L2 sensitivity to replacing its image, in units of the clipping norm.
SENSITIVITY_IN_CLIP_NORMS = 2.0


def map_epsilon(noise_multiplier: float, delta: float, releases: int = 1) -> float:
    """ε of ``releases`` Gaussian releases of one image's map at noise ``noise_multiplier * C``
    (Opacus's RDP accountant, sample rate 1, one step per release, at ``delta``)."""
    from opacus.accountants import RDPAccountant

    if noise_multiplier <= 0:
        return float("inf")
    if releases < 1:
        raise ValueError(f"releases must be >= 1, got {releases}")
    accountant = RDPAccountant()
    for _ in range(releases):
        accountant.step(noise_multiplier=noise_multiplier / SENSITIVITY_IN_CLIP_NORMS, sample_rate=1.0)
    return float(accountant.get_epsilon(delta))


def activation_defences(guard: ActivationGuard, delta: float, *, method: str, private_extractor: bool,
                        extractor_trains: bool, cut: str, rounds: int | None = None,
                        releases_per_round: int = 1) -> dict[str, Any]:
    """The ``defences`` section of a run report for a method that uploads activations.

    ``extractor_trains``: every round releases new maps of each training image (their ε
    composes over ``rounds * releases_per_round``); otherwise a map goes up as one release."""
    out: dict[str, Any] = {"method": method, "cut": cut, "private_extractor": private_extractor, **guard.describe()}
    if guard.noisy:
        releases = max(1, (rounds or 1) * releases_per_round) if extractor_trains else 1
        out["map_noise_delta"] = delta
        out["epsilon_per_map"] = map_epsilon(guard.map_noise_multiplier, delta)
        out["releases_per_image"] = releases
        out["epsilon_per_image"] = map_epsilon(guard.map_noise_multiplier, delta, releases)
        out["accountant"] = "opacus RDPAccountant, Gaussian mechanism, sample rate 1, sensitivity 2C"
    return out
