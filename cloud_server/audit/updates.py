"""Inverting a weight update (the FedAvg family's upload) in the style of Inverting Gradients
(Geiping et al.): dummy images are optimised so that the update the agent's local schedule
would have produced on them points the way the received update points (cosine distance),
with a total-variation prior. The schedule (optimiser, learning rate, steps, batch size) is
unrolled step by step, differentiably, from the global model the round started from, which
the server sent and holds.

Labels are either given (the attacker knows them) or, for one image, read from the update
of the last linear layer (iDLG, Zhao et al.): with a cross-entropy loss only the true
class's bias (or weight row, for non-negative inputs) moves up.

What the update is compared by, and the other evidence it carries, are in
:mod:`~cloud_server.audit.update_matching`: the cosine for SGD and multi-step Adam, the
gradient's signs for one Adam step (the agents' default first step), and BatchNorm's running
statistics where the upload carries them. Several restarts keep the one that explains the
update best (never the one closest to the private images, which the server does not have).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from .errors import AttackInputError
from .image_prior import ImageVariable, total_variation
from .linear_inputs import capture_input, recover_linear_input
from .schedule import LocalSchedule
from .scoring import PixelSpace
from .update_matching import (batchnorm_distance, cosine_distance, observed_running_stats, record_batchnorm,
                              sign_distance)

__all__ = [
    "UpdateInversionConfig",
    "UpdateInversionResult",
    "infer_single_label",
    "invert_update",
    "last_linear_layer",
    "unrolled_update",
]

#: How the distance between two updates weighs their parameter tensors (UpdateInversionConfig.weighting).
UPDATE_WEIGHTINGS = ("per_tensor", "whole")
#: What the dummy update is compared with the received one by (UpdateInversionConfig.match):
#: ``"auto"`` is ``"sign"`` for one Adam step and ``"cosine"`` otherwise.
UPDATE_MATCHES = ("auto", "cosine", "sign")
# Under the square root of Adam's second moment, so that its gradient stays finite where a
# parameter's gradient is exactly zero; far below any second moment a real gradient makes.
_SQRT_FLOOR = 1e-30


@dataclass(frozen=True)
class UpdateInversionConfig:
    """The optimisation of the dummy images.

    Attributes:
        steps: Adam steps on the images.
        lr: Adam's initial learning rate (pixel units), decayed to a hundredth.
        tv_weight: weight of the total-variation prior against the cosine distance.
        weighting: ``"per_tensor"``: the mean of ``1 - cos`` per parameter tensor, so that the
            first layers, which carry the image, weigh as much as the large last ones;
            ``"whole"``: ``1 - cos`` over the whole update at once (Inverting Gradients').
            Which recovers more depends on the model.
        linear_input_weight: for one image and one SGD step, the weight of matching the input
            of the first linear layer with a bias, read exactly off its update
            (:func:`~cloud_server.audit.linear_inputs.recover_linear_input`); 0 leaves it out.
        adam_softening: for an Adam schedule, :func:`unrolled_update`'s softening of the
            dummy update (the received one is used as it is).
        signed_gradients: step on the gradient's sign, as Inverting Gradients does.
        match: ``"cosine"`` through the unrolled schedule; ``"sign"``: the dummy images'
            gradient against the signs a one-step Adam update gives
            (:func:`~cloud_server.audit.update_matching.sign_distance`); ``"auto"``: sign for
            one Adam step, cosine otherwise.
        batchnorm_weight: the weight of matching the BatchNorm running statistics the upload
            carries (:func:`~cloud_server.audit.update_matching.batchnorm_distance`); 0, or
            an update without them, leaves it out.
        restarts: optimisations from different starting noise, restart ``r`` at learning rate
            ``lr * restart_lr_factor ** r`` (the rate that suits a small sigmoid network is too
            large for a deep one with BatchNorm); the one with the lowest final matching loss
            is kept.
        restart_lr_factor: see ``restarts``.
        seed: seeds the starting images (restart ``r`` uses ``seed + r``).
    """

    steps: int = 1000
    lr: float = 0.1
    tv_weight: float = 1e-3
    weighting: str = "per_tensor"
    linear_input_weight: float = 1.0
    adam_softening: float = 0.1
    signed_gradients: bool = False
    match: str = "auto"
    batchnorm_weight: float = 10.0
    restarts: int = 2
    restart_lr_factor: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or not self.lr > 0 or self.tv_weight < 0:
            raise AttackInputError(f"UpdateInversionConfig needs steps >= 1, lr > 0, tv_weight >= 0, "
                                   f"got {self.steps}, {self.lr}, {self.tv_weight}")
        if self.linear_input_weight < 0:
            raise AttackInputError(f"UpdateInversionConfig.linear_input_weight must be >= 0, got {self.linear_input_weight}")
        if self.adam_softening < 0:
            raise AttackInputError(f"UpdateInversionConfig.adam_softening must be >= 0, got {self.adam_softening}")
        if self.match not in UPDATE_MATCHES:
            raise AttackInputError(f"UpdateInversionConfig.match must be one of {UPDATE_MATCHES}, got {self.match!r}")
        if self.batchnorm_weight < 0 or self.restarts < 1 or not self.restart_lr_factor > 0:
            raise AttackInputError(f"UpdateInversionConfig needs batchnorm_weight >= 0, restarts >= 1 and restart_lr_factor > 0, "
                                   f"got {self.batchnorm_weight}, {self.restarts} and {self.restart_lr_factor}")
        if self.weighting not in UPDATE_WEIGHTINGS:
            raise AttackInputError(f"UpdateInversionConfig.weighting must be one of {UPDATE_WEIGHTINGS}, got {self.weighting!r}")


@dataclass(frozen=True)
class UpdateInversionResult:
    """Reconstructions from one update.

    Attributes:
        images: ``(N, C, H, W)`` in ``[0, 1]`` pixel units.
        labels: ``(N,)`` the labels the dummy images were optimised with.
        labels_inferred: whether ``labels`` were read from the update (else given).
        cosine_distance: the final distance between the dummy and the received update
            (``1 - cos``, or the sign distance where ``match`` was the sign).
        match: the comparison used, ``"cosine"`` or ``"sign"``.
        loss: the kept restart's final matching loss (the distance plus the weighted
            BatchNorm and linear-input terms, without the image prior).
    """

    images: torch.Tensor
    labels: torch.Tensor
    labels_inferred: bool
    cosine_distance: float
    match: str = "cosine"
    loss: float = 0.0


def last_linear_layer(model: nn.Module) -> tuple[str, nn.Linear]:
    """The model's last ``nn.Linear`` in registration order (its classifier head) and its name.

    Raises:
        AttackInputError: the model has no linear layer.
    """
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not found:
        raise AttackInputError(f"{type(model).__name__} has no nn.Linear layer to read labels from")
    return found[-1]


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def _check_update(model: nn.Module, update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params = _trainable(model)
    missing = sorted(set(params) - set(update))
    if missing:
        raise AttackInputError(f"the update lacks {len(missing)} of the model's parameters, e.g. {missing[:3]}")
    for name, p in params.items():
        if tuple(update[name].shape) != tuple(p.shape):
            raise AttackInputError(f"update[{name!r}] has shape {tuple(update[name].shape)}, the model's {tuple(p.shape)}")
    return {name: update[name].detach().float() for name in params}


def infer_single_label(model: nn.Module, update: Mapping[str, torch.Tensor]) -> int:
    """The label of a one-image update (iDLG): the class whose bias in the last linear layer
    rose, or without a bias the class whose weight row rose the most in sum (the layer's
    inputs are non-negative after a ReLU or a pool of one).

    ``update`` is ``trained - initial`` per parameter name.

    Raises:
        AttackInputError: no linear layer, or the update lacks it.
    """
    name, layer = last_linear_layer(model)
    key = f"{name}.bias" if layer.bias is not None else f"{name}.weight"
    if key not in update:
        raise AttackInputError(f"the update has no {key!r} to read the label from")
    delta = update[key].detach().float()
    rise = delta if delta.dim() == 1 else delta.sum(1)  # (K,)
    return int(rise.argmax())


def unrolled_update(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                    schedule: LocalSchedule, adam_softening: float = 0.0) -> dict[str, torch.Tensor]:
    """``trained - initial`` for every trainable parameter after ``schedule`` on
    ``(images, labels)`` from the model's current weights, differentiable in ``images``.

    ``images`` are what the model takes (normalised), ``(N, C, H, W)``. The model is run in
    train mode, as agents train; its own weights and buffers are left untouched.

    ``adam_softening`` > 0 adds that multiple of each tensor's mean second-moment root to
    Adam's denominator: an early Adam step is close to ``-lr * sign(gradient)``, whose
    derivative in the images vanishes almost everywhere, and the softened step keeps the
    direction while giving the images a gradient. 0 replays the agent's Adam exactly.
    """
    params = {name: p.clone().requires_grad_(True) for name, p in _trainable(model).items()}
    initial = {name: p.detach() for name, p in params.items()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in params}
    was_training = model.training
    model.train()
    try:
        n = images.shape[0]
        for step in range(schedule.local_steps):
            index = torch.arange(step * schedule.batch_size, (step + 1) * schedule.batch_size) % n
            logits = _logits(functional_call(model, {**params, **buffers}, (images[index],)))
            loss = F.cross_entropy(logits, labels[index])
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            params = {name: _step(p, g, state[name], schedule, step + 1, adam_softening) for (name, p), g in zip(params.items(), grads)}
    finally:
        model.train(was_training)
    return {name: params[name] - initial[name] for name in params}


def _logits(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    # Models that return more than logits (ResNet8Edge: logits and the extractor's maps) put them first.
    return output[0] if isinstance(output, tuple) else output


def _step(p: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], schedule: LocalSchedule, t: int,
          adam_softening: float) -> torch.Tensor:
    """One optimiser step as models.optimizers takes it, out of place."""
    if schedule.weight_decay:
        grad = grad + schedule.weight_decay * p
    if schedule.optimizer == "sgd":
        if schedule.momentum:
            grad = grad if "momentum" not in state else schedule.momentum * state["momentum"] + grad
            state["momentum"] = grad
        return p - schedule.lr * grad
    beta1, beta2 = schedule.betas
    exp_avg = (1 - beta1) * grad + beta1 * state.get("exp_avg", torch.zeros_like(grad))
    exp_avg_sq = (1 - beta2) * grad * grad + beta2 * state.get("exp_avg_sq", torch.zeros_like(grad))
    max_sq = exp_avg_sq if "max_sq" not in state else torch.maximum(state["max_sq"], exp_avg_sq)
    state.update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, max_sq=max_sq)
    root = (max_sq + _SQRT_FLOOR).sqrt() / (1 - beta2**t) ** 0.5
    denom = root + schedule.eps + (adam_softening * root.mean() if adam_softening else 0.0)
    return p - schedule.lr / (1 - beta1**t) * exp_avg / denom


def invert_update(model: nn.Module, update: Mapping[str, torch.Tensor], pixels: PixelSpace,
                  image_shape: tuple[int, int, int], num_images: int, schedule: LocalSchedule,
                  labels: torch.Tensor | None = None, start: torch.Tensor | None = None,
                  config: UpdateInversionConfig = UpdateInversionConfig()) -> UpdateInversionResult:
    """Reconstruct the images an agent trained on from the update it uploaded.

    Args:
        model: the global model the agent started from (its weights are not changed).
        update: ``uploaded - global`` per trainable parameter name, and per BatchNorm
            running statistic where the upload carries them (FedAvg's does).
        pixels: the normalisation the agent's loader applied.
        image_shape: ``(C, H, W)`` of one image.
        num_images: how many images the schedule went through (the agent's sample count, or
            ``schedule.samples_seen`` for one pass without repeats).
        schedule: the agent's local training, as the server configured it.
        labels: ``(N,)`` the images' labels; ``None`` reads one image's label from the update
            (:func:`infer_single_label`).
        start: the starting image ``(C, H, W)`` in ``[0, 1]`` for every dummy image, e.g. the
            public set's mean image; ``None`` starts from uniform noise.
        config: the optimisation.

    Raises:
        AttackInputError: an update that does not fit the model, labels of the wrong length,
            no labels for more than one image, or a start of another shape than the images.
    """
    observed = _check_update(model, update)
    if num_images < 1:
        raise AttackInputError(f"num_images must be >= 1, got {num_images}")
    inferred = labels is None
    if labels is None:
        if num_images != 1:
            raise AttackInputError(f"labels can be read from the update of one image only; pass the labels of {num_images}")
        labels = torch.tensor([infer_single_label(model, observed)])
    labels = labels.detach().long().reshape(-1)
    if labels.numel() != num_images:
        raise AttackInputError(f"expected {num_images} labels, got {labels.numel()}")
    if start is not None and tuple(start.shape) != tuple(image_shape):
        raise AttackInputError(f"start has shape {tuple(start.shape)}, the images {tuple(image_shape)}")
    match = config.match if config.match != "auto" else (
        "sign" if schedule.optimizer == "adam" and schedule.local_steps == 1 else "cosine")
    # One Adam step's signs are those of the first gradient (weight decay included): one SGD
    # step of rate 1 from the same weights is minus that gradient.
    unrolled = replace(schedule, optimizer="sgd", lr=1.0, momentum=0.0) if match == "sign" else schedule
    running_stats = observed_running_stats(model, update) if config.batchnorm_weight else {}
    linear_input = recover_linear_input(model, observed, schedule) if num_images == 1 and config.linear_input_weight else None
    best: tuple[float, torch.Tensor, float] | None = None
    for restart in range(config.restarts):
        generator = torch.Generator().manual_seed(config.seed + restart)
        init = torch.rand((num_images, *image_shape), generator=generator)  # (N, C, H, W)
        if start is not None:
            init = start.detach().float().expand_as(init) + 0.05 * (init - 0.5)
        image = ImageVariable(init, config.lr * config.restart_lr_factor**restart, config.steps, config.signed_gradients)
        distance, matching = torch.tensor(1.0), torch.tensor(1.0)
        with capture_input(model, linear_input.module_name if linear_input else "") as captured, \
                record_batchnorm(model, bool(running_stats)) as moments:
            for _ in range(config.steps):
                captured.clear()
                moments.clear()
                produced = unrolled_update(model, pixels.to_model(image.pixels), labels, unrolled, config.adam_softening)
                if match == "sign":
                    distance = sign_distance({k: -v for k, v in produced.items()}, observed, config.weighting)
                else:
                    distance = cosine_distance(produced, observed, config.weighting)
                matching = distance
                if running_stats:
                    matching = matching + config.batchnorm_weight * batchnorm_distance(model, moments, running_stats)
                if linear_input is not None:  # the first forward pass is at the start weights, where the reading holds
                    target = linear_input.values
                    matching = matching + config.linear_input_weight * (captured[0].flatten() - target).square().mean() / target.square().mean().clamp_min(1e-12)
                image.step(matching + config.tv_weight * total_variation(image.pixels))
        if best is None or float(matching.detach()) < best[0]:
            best = (float(matching.detach()), image.result(), float(distance.detach()))
    assert best is not None  # restarts >= 1
    return UpdateInversionResult(images=best[1], labels=labels, labels_inferred=inferred, cosine_distance=best[2],
                                 match=match, loss=best[0])
