"""Which models DP-SGD (Opacus) can train: per-sample gradients need layers that treat every
sample on its own, and BatchNorm mixes a batch's samples (Opacus refuses it)."""

from __future__ import annotations

import torch.nn as nn

from models.registry import list_models

__all__ = ["DpSgdModelError", "dpsgd_model_problems", "require_dpsgd_model"]


class DpSgdModelError(ValueError):
    """A model DP-SGD cannot train (BatchNorm, or another layer Opacus refuses)."""


def dpsgd_model_problems(model: nn.Module) -> list[str]:
    """Opacus's own objections to ``model`` (empty: it can be made private)."""
    from opacus.validators import ModuleValidator

    return [str(e) for e in ModuleValidator.validate(model, strict=False)]


def require_dpsgd_model(model: nn.Module, name: str) -> None:
    """Raise :class:`DpSgdModelError` naming the GroupNorm models to pick when Opacus refuses ``model``."""
    problems = dpsgd_model_problems(model)
    if problems:
        groupnorm = [m for m in list_models() if m.endswith("_gn")]
        raise DpSgdModelError(
            f"DP-SGD (server.dpsgd = true) cannot train {name!r}: {problems[0]}"
            f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}. Pick a GroupNorm model for the method's "
            f"`model` key, e.g. {', '.join(groupnorm)}"
        )
