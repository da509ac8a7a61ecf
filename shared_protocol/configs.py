"""Config dataclasses from dicts: one place for the refusal of unknown keys.

Two kinds of config come from dicts. A TOML table a person wrote (``[fedavg]``)
is parsed at start-up, and a mistake is a ``ValueError`` naming the table. A
round config that came over the wire (``RoundStart.config``) is a peer's
message, and anything wrong with it is a :class:`~shared_protocol.errors.ValueRangeError`,
which the receiver rejects like any other bad message.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from .codecs import list_codecs
from .errors import ValueRangeError

T = TypeVar("T")

__all__ = ["OPTIMIZERS", "EmbeddedRoundConfig", "check_choice", "check_codec", "check_optimizer", "config_from_table",
           "did_you_mean", "round_config_from_wire", "unknown_keys_error"]

#: The optimisers a config may name (``models.optimizers.make_optimizer`` builds them, the ort
#: backend's numpy optimisers mirror them; a test keeps the lists equal). Kept here, torch-free,
#: so that every config -- a TOML table or a round config off the wire -- checks against one list.
OPTIMIZERS = ("sgd", "adam")


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``" did you mean X?"`` for the closest of ``known`` to a mistyped ``word``, or ``""``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" did you mean {close[0]}?" if close else ""


def unknown_keys_error(table: str, unknown: Iterable[str], known: Iterable[str]) -> ValueError:
    """The error for keys of the TOML table ``[table]`` that its config does not have: each
    one with the closest known key, then every key the table has."""
    unknown, known = sorted(unknown), sorted(known)
    if len(unknown) == 1:
        hints = did_you_mean(unknown[0], known)
    else:
        hints = "".join(f" {key}:{hint}" for key in unknown if (hint := did_you_mean(key, known)))
    return ValueError(f"unknown [{table}] keys: {unknown};{hints} keys of [{table}]: {', '.join(known)}")


def check_choice(value: T, allowed: tuple[T, ...], key: str) -> T:
    """``value`` if it is one of ``allowed``, else a ValueError naming the config ``key``."""
    if value not in allowed:
        raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
    return value


def check_optimizer(name: str, key: str = "optimizer") -> str:
    """``name`` if it is one of :data:`OPTIMIZERS`, else a ValueError naming the config ``key``."""
    return check_choice(name, OPTIMIZERS, key)


def check_codec(name: str, key: str = "upload_codec") -> str:
    """``name`` if the codec registry (:mod:`shared_protocol.codecs`) has it, else a ValueError
    naming the config ``key`` and the known codecs."""
    known = list_codecs()
    if name not in known:
        raise ValueError(f"{key}: unknown codec {name!r}; known codecs: {known}")
    return name


def _unknown_keys(cls: type, raw: Mapping[str, Any]) -> list[str]:
    return sorted(set(raw) - {f.name for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class EmbeddedRoundConfig:
    """A server config that holds the agents' round config (the one sent in ``RoundStart.config``)
    as a field instead of copying its fields, read from one flat TOML table.

    ``field``: the server config's attribute holding it; ``table_keys``: round-config field ->
    its key in the table, where the two differ (the table also has the server's own settings,
    so e.g. ``batch_size`` is ``edge_batch_size`` there); ``derived``: round-config fields the
    server config sets from its own settings, never written in the table.
    """

    round_config: type
    field: str
    table_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    derived: tuple[str, ...] = ()

    def _keys(self) -> dict[str, str]:
        """Table key -> round-config field, for every field the table may set."""
        names = [f.name for f in dataclasses.fields(self.round_config) if f.name not in self.derived]
        return {self.table_keys.get(name, name): name for name in names}

    def table_keys_known(self) -> tuple[str, ...]:
        """The keys of the table that set the round config's fields."""
        return tuple(self._keys())

    def split(self, raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the server's own keys, the round config's fields) of a table."""
        keys = self._keys()
        own = {k: v for k, v in raw.items() if k not in keys}
        return own, {keys[k]: v for k, v in raw.items() if k in keys}

    def table_of(self, config: Any) -> dict[str, Any]:
        """The flat table ``config`` reads back from (its resolved form in reports and checkpoints)."""
        own = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != self.field}
        embedded = getattr(config, self.field)
        return {**own, **{key: getattr(embedded, name) for key, name in self._keys().items()}}


def config_from_table(cls: type[T], raw: Mapping[str, Any], table: str, embedded: EmbeddedRoundConfig | None = None) -> T:
    """``cls(**raw)`` for the TOML table ``[table]``; unknown keys are a ValueError. With
    ``embedded``, the keys of the round config ``cls`` holds build that field."""
    if embedded is None:
        unknown = _unknown_keys(cls, raw)
        if unknown:
            raise unknown_keys_error(table, unknown, (f.name for f in dataclasses.fields(cls)))
        return cls(**raw)
    own, wire = embedded.split(raw)
    own_keys = {f.name for f in dataclasses.fields(cls) if f.name != embedded.field}
    unknown = sorted(set(own) - own_keys)
    if unknown:
        raise unknown_keys_error(table, unknown, own_keys | set(embedded.table_keys_known()))
    try:
        round_config = embedded.round_config(**wire)
    except ValueError as exc:
        raise ValueError(f"[{table}]: {exc}") from None
    return cls(**own, **{embedded.field: round_config})


def round_config_from_wire(cls: type[T], raw: Any, what: str) -> T:
    """``cls(**raw)`` for a config received in a message (``what``, e.g. "fedavg round config");
    a non-dict, unknown keys or values ``cls`` refuses are a ValueRangeError."""
    if not isinstance(raw, dict):
        raise ValueRangeError(f"{what} must be a table, got {type(raw).__name__}")
    unknown = _unknown_keys(cls, raw)
    if unknown:
        raise ValueRangeError(f"{what} has unknown keys {unknown}")
    try:
        return cls(**raw)
    except (TypeError, ValueError) as exc:
        raise ValueRangeError(f"{what} invalid: {exc}") from None
