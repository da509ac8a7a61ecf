"""docs/protocol.md specifies every message type, field and error code the code registers: a
type, field or code added to shared_protocol without its specification fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from shared_protocol import errors
from shared_protocol.message_base import Message, message_types
from shared_protocol.registry import registered_methods

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "protocol.md"
BASE_FIELDS = {f.name for f in dataclasses.fields(Message)}


def _registered_types() -> dict[str, type[Message]]:
    import shared_protocol.secagg_messages  # noqa: F401  (registers the secure-aggregation types)

    registered_methods()  # imports every method's messages
    return message_types()


def _defined_types(spec: str) -> set[str]:
    """Message types the spec defines: a bold, backticked type name."""
    return set(re.findall(r"\*\*`([a-z_]+(?:\.[a-z_]+)?)`\*\*", spec))


def _undocumented_fields(spec: str, types: dict[str, type[Message]]) -> list[str]:
    return [f"{name}.{f.name}" for name, cls in sorted(types.items()) for f in dataclasses.fields(cls)
            if f.name not in BASE_FIELDS and f"`{f.name}`" not in spec]


def _error_table_codes(spec: str) -> set[str]:
    section = spec[spec.index("## 8. Validation and error codes"):spec.index("## 9. Versioning")]
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M))


def _exception_codes() -> set[str]:
    """The codes of the protocol's own errors (a test elsewhere in the process may define more)."""
    found, todo = set(), [errors.ProtocolError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("shared_protocol."):
            found.add(cls.code)
    return found - {errors.ProtocolError.code}


def test_every_registered_message_type_is_specified_and_nothing_else() -> None:
    spec = SPEC.read_text()
    assert set(_registered_types()) == _defined_types(spec)


def test_every_field_of_every_message_type_is_named_in_the_spec() -> None:
    assert _undocumented_fields(SPEC.read_text(), _registered_types()) == []


def test_the_error_table_lists_exactly_the_exception_codes() -> None:
    assert _error_table_codes(SPEC.read_text()) == _exception_codes()


def test_the_checks_find_what_is_missing() -> None:
    # Positive controls: a spec without hello's definition, its `fault` field or the
    # bad_magic row fails each check.
    spec = SPEC.read_text()
    assert "hello" not in _defined_types(spec.replace("**`hello`**", "hello"))
    types = _registered_types()
    assert _undocumented_fields(spec.replace("`fault`", "fault"), {"hello": types["hello"]}) == ["hello.fault"]
    assert "bad_magic" not in _error_table_codes(spec.replace("| `bad_magic` |", "| bad_magic |"))
    assert {"bad_magic", "secagg_replay", "over_budget"} <= _exception_codes()
