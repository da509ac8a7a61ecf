"""The audit's exceptions: each says what was expected and what came."""

from __future__ import annotations

__all__ = ["AttackInputError", "AuditError", "UnknownAuditMethodError", "UnsupportedScheduleError"]


class AuditError(Exception):
    """Base of every error the leakage audit raises on purpose."""


class AttackInputError(AuditError, ValueError):
    """An attack or a score was given inputs it cannot use: shapes that do not match, images
    outside ``[0, 1]``, an empty batch, a config value out of range."""


class UnsupportedScheduleError(AuditError, ValueError):
    """A local training schedule the update attacks cannot unroll or read (an optimiser they
    do not implement, a schedule whose update does not carry what the attack reads)."""


class UnknownAuditMethodError(AuditError, LookupError):
    """``attacks_for`` was asked about a method the audit has no entry for."""
