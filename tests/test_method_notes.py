"""docs/methods/*.md set each method's defaults beside its paper's values in a table headed
:data:`HEADER`; its "default here" cells are the method config's defaults as
docs/configuration.md renders them (cloud_server/config_docs.py), so a changed default fails here
until the note says why it now differs from the paper (or no longer does)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

import cloud_server.config_docs as config_docs
from fedhelpers import ROOT

#: The header of a method note's table of its settings against its paper's.
HEADER = "| key | the paper | default here | why |"


def _defaults(cls: type) -> dict[str, str]:
    """Key -> its default as docs/configuration.md writes it (`0.95`, `"adam"`, unset)."""
    out: dict[str, str] = {}
    for keys, _types, defaults, _meaning in config_docs.key_rows(cls):
        names = re.findall(r"`([^`]+)`", keys)
        values = re.findall(r"`[^`]*`|unset", defaults)
        assert len(names) == len(values), (keys, defaults)
        out.update(zip(names, values))
    return out


def settings_mismatches(page: str, cls: type) -> list[str]:
    """Every row of ``page``'s settings tables whose keys are not ``cls``'s or whose "default
    here" cell is not their defaults (keys and defaults comma-separated, in the same order)."""
    defaults = _defaults(cls)
    lines = page.splitlines()
    wrong: list[str] = []
    for start in (i for i, line in enumerate(lines) if line.strip() == HEADER):
        for line in lines[start + 2:]:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]  # `\|` stays in its cell
            keys = re.findall(r"`([^`]+)`", cells[0])
            if not keys or any(k not in defaults for k in keys):
                wrong.append(f"{line}: not keys of {cls.__name__}")
            elif cells[2] != ", ".join(defaults[k] for k in keys):
                wrong.append(f"{line}: {cls.__name__}'s defaults are {', '.join(defaults[k] for k in keys)}")
    return wrong


def _notes() -> list[tuple[str, Any]]:
    from shared_protocol.registry import registered_methods

    return [(name, spec) for name, spec in sorted(registered_methods().items())
            if spec.config and spec.docs and HEADER in (ROOT / spec.docs).read_text()]


def test_every_paper_method_sets_its_defaults_beside_its_paper() -> None:
    # The five methods with a paper of their own; the baselines' shared note has none.
    assert {name for name, _ in _notes()} == {"fedbe", "feddistill", "fedgkd", "fedgkt", "fedkd"}


@pytest.mark.parametrize("name", ["fedbe", "feddistill", "fedgkd", "fedgkt", "fedkd"])
def test_the_defaults_in_a_method_note_are_its_configs(name: str) -> None:
    from shared_protocol.registry import get_method, import_part

    spec = get_method(name)
    assert settings_mismatches((ROOT / spec.docs).read_text(), import_part(spec.config)) == []


@dataclass(frozen=True)
class _Toy:
    KEY_MEANINGS: ClassVar[dict[str, str]] = {"lr, optimizer": "local training", "gamma": "a weight"}
    lr: float = 0.01
    optimizer: str = "sgd"
    gamma: float | None = None


def test_a_drifted_default_or_an_unknown_key_is_found() -> None:
    def page(*rows: str) -> str:
        return "\n".join(("intro", "", HEADER, "|---|---|---|---|", *rows, "", "after"))

    good = ("| `lr`, `optimizer` | 0.01, SGD | `0.01`, `\"sgd\"` | |", "| `gamma` | 1/\\|C\\| | unset | |")
    assert settings_mismatches(page(*good), _Toy) == []
    assert len(settings_mismatches(page("| `lr` | 0.1 | `0.1` | why |", *good), _Toy)) == 1
    assert len(settings_mismatches(page("| `lr`, `optimizer` | | `\"sgd\"`, `0.01` | |"), _Toy)) == 1  # order counts
    assert len(settings_mismatches(page("| `lrr` | | `0.01` | |"), _Toy)) == 1
    assert len(settings_mismatches(page("| the optimiser | | `0.01` | |"), _Toy)) == 1  # a row that names no key
