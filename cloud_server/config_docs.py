"""docs/configuration.md's tables of the methods' keys, rendered from each method's config.

A method's ``[<name>]`` table is read by the frozen dataclass its registry entry names
(``MethodSpec.config``, ``"module:Class"``). Its keys are the flat table the config reads
back from (``to_table()``: its own fields and those of the round config it embeds), its
defaults the dataclass's, and the meaning of every key is declared beside the fields, in
the class's ``KEY_MEANINGS`` (key, or comma-separated keys that share one row -> one line;
a subclass adds its own to its bases'). The tables of configs that are no method's
(``[centralized]``: :data:`OTHER_TABLES`) are rendered after them the same way. A key without a meaning, or a meaning for no key, is
a :class:`ConfigDocError`: the page cannot drift from the code, and nothing about a method
is written out by hand in the shared page.

``python bench/render_results.py`` rewrites the block between :data:`CONFIG_BEGIN` and
:data:`CONFIG_END` (as it rewrites the README's table of methods).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: docs/configuration.md's method tables lie between these lines.
CONFIG_BEGIN = ("<!-- The methods' tables: rendered from each method's config (MethodSpec.config, its KEY_MEANINGS) "
                "by bench/render_results.py. Do not edit by hand. -->")
CONFIG_END = "<!-- end of the methods' tables -->"


class ConfigDocError(ValueError):
    """A method's config whose keys and declared meanings do not match, or a page without the block."""


def default_table(cls: type) -> dict[str, Any]:
    """The flat ``[<method>]`` table of ``cls``'s declared defaults, in the order ``to_table()``
    writes it. Built without ``__post_init__``: a config with a required key (no usable default)
    still has a table of defaults."""
    config = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            raise ConfigDocError(f"{cls.__name__}.{f.name} has no default: a method's table needs one for every key")
        object.__setattr__(config, f.name, value)
    to_table = getattr(config, "to_table", None)
    return dict(to_table()) if to_table is not None else {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}


def declared_meanings(cls: type) -> dict[str, str]:
    """``KEY_MEANINGS`` of ``cls`` and its bases, the bases' first."""
    meanings: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        meanings.update(vars(klass).get("KEY_MEANINGS", {}))
    return meanings


def _type_name(cls: type, key: str, default: Any) -> str:
    """The key's type: its field's annotation where ``cls`` has the field, else its default's type."""
    own = {f.name: f.type for f in dataclasses.fields(cls)}
    if key in own:
        annotation = own[key]
        return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return type(default).__name__


def _toml(value: Any) -> str:
    """A default as it is written in the TOML table."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{'true' if value else 'false'}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(_toml(v).strip("`") for v in value) + "]`"
    return f"`{value!r}`"


def key_rows(cls: type) -> list[tuple[str, str, str, str]]:
    """(keys, types, defaults, meaning) per row of ``cls``'s table, in the order of its
    declared meanings; a ConfigDocError names the keys without a meaning and the meanings of no key."""
    defaults = default_table(cls)
    meanings = declared_meanings(cls)
    rows, described = [], set()
    for group, meaning in meanings.items():
        keys = [k.strip() for k in group.split(",")]
        described.update(keys)
        missing = [k for k in keys if k not in defaults]
        if missing:
            raise ConfigDocError(f"{cls.__name__}.KEY_MEANINGS describes {missing}, which its table does not have "
                                 f"(its keys: {sorted(defaults)})")
        rows.append((", ".join(f"`{k}`" for k in keys), ", ".join(_type_name(cls, k, defaults[k]) for k in keys),
                     ", ".join(_toml(defaults[k]) for k in keys), meaning))
    undescribed = [k for k in defaults if k not in described]
    if undescribed:
        raise ConfigDocError(f"{cls.__name__}: no meaning declared for {undescribed}: add them to its KEY_MEANINGS")
    return rows


#: The tables read by a config that is no registered method's: (table, "module:Class", a note for
#: its heading). Rendered after the methods', the same way.
OTHER_TABLES = (("centralized", "cloud_server.centralized:CentralizedConfig", "run with `edgesplit centralized --config FILE`"),)


def table_section(name: str, config: str, note: str = "") -> list[str]:
    """The ``[name]`` table's heading line and table, read by ``config`` (``"module:Class"``)."""
    from shared_protocol.registry import import_part

    cls = import_part(config)
    module, _, class_name = config.partition(":")
    lines = [f"`[{name}]` (`{module.replace('.', '/')}.py`, `{class_name}`{'; ' + note if note else ''})", "",
             "| key | type | default | meaning |", "|---|---|---|---|"]
    for row in key_rows(cls):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return lines


def config_tables(methods: Mapping[str, Any] | None = None) -> list[str]:
    """The block of docs/configuration.md: every registered method with a config, by name, then
    :data:`OTHER_TABLES`."""
    if methods is None:
        from shared_protocol.registry import registered_methods

        methods = registered_methods()
    lines = [CONFIG_BEGIN]
    for name, spec in methods.items():
        if spec.config:
            notes = spec.docs.removeprefix("docs/") if spec.docs else ""
            lines += ["", *table_section(name, spec.config, f"notes in [{notes}]({notes})" if notes else "")]
    for name, config, note in OTHER_TABLES:
        lines += ["", *table_section(name, config, note)]
    return [*lines, "", CONFIG_END]


def update_config_doc(path: Path) -> bool:
    """Rewrite the methods' tables in ``path`` (docs/configuration.md); True if they changed."""
    text = path.read_text()
    if CONFIG_BEGIN not in text or CONFIG_END not in text:
        raise ConfigDocError(f"{path} has no methods' tables between {CONFIG_BEGIN!r} and {CONFIG_END!r}")
    start, end = text.index(CONFIG_BEGIN), text.index(CONFIG_END) + len(CONFIG_END)
    updated = text[:start] + "\n".join(config_tables()) + text[end:]
    if updated != text:
        path.write_text(updated)
    return updated != text
