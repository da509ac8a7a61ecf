"""Distillation losses shared by the edge and the server."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(p_teacher || p_student) with p = softmax(z / T), mean over the batch.

    This is FedGKT's l_KD (Eqs. 6-7): the KL term pulls the student's softened
    prediction toward the teacher's. The T^2 factor keeps gradient magnitudes
    comparable across temperatures (Hinton et al.). The teacher is detached.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} vs teacher {tuple(teacher_logits.shape)}")
    if student_logits.shape[0] == 0:
        return student_logits.sum() * 0.0
    log_p_student = F.log_softmax(student_logits / temperature, dim=1)  # (B, K)
    log_p_teacher = F.log_softmax(teacher_logits.detach() / temperature, dim=1)  # (B, K)
    kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(dim=1)  # (B,)
    return kl.mean() * temperature**2


def ensemble_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """The ensemble's prediction (FedBE Eq. 4): ``p_hat = 1/M' sum_m softmax(logits_m)``; ``(M', B, K)`` logits -> ``(B, K)`` probabilities."""
    if logits.dim() != 3 or logits.shape[0] < 1:
        raise ValueError(f"expected (models, batch, classes) logits, got shape {tuple(logits.shape)}")
    return F.softmax(logits.float(), dim=-1).mean(dim=0)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """``-1/B sum_j p_hat_j^T log softmax(logits_j)`` (FedBE Sec. 4's distillation loss: cross-entropy to soft targets); ``(B, K)`` each."""
    return -(target_probs * F.log_softmax(logits, dim=-1)).sum(dim=-1).mean()
