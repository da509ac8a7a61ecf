"""docs/configuration.md's tables of the methods' keys are rendered from each method's config
(cloud_server/config_docs.py): the page holds exactly what the code renders, every key of every
registered method's table has a declared meaning, and a key without one stops the render."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from fedhelpers import ROOT
import cloud_server.config_docs as config_docs




def test_the_page_holds_the_rendered_tables() -> None:
    render = config_docs
    page = (ROOT / "docs" / "configuration.md").read_text()
    block = page[page.index(render.CONFIG_BEGIN):page.index(render.CONFIG_END) + len(render.CONFIG_END)]
    assert block.splitlines() == render.config_tables(), "rerun `python bench/render_results.py` (it rewrites the tables)"


def test_every_registered_method_with_a_config_has_its_table_with_every_key() -> None:
    from shared_protocol.registry import import_part, registered_methods

    render = config_docs
    lines = render.config_tables()
    for name, spec in registered_methods().items():
        if not spec.config:
            continue
        heading = next((i for i, line in enumerate(lines) if line.startswith(f"`[{name}]`")), None)
        assert heading is not None, f"no table for [{name}]"
        start = heading + 2  # the heading, a blank line, the table
        end = next((i for i in range(start, len(lines)) if lines[i] == ""), len(lines))
        table = "\n".join(lines[start:end])
        for key in render.default_table(import_part(spec.config)):
            assert f"`{key}`" in table, f"[{name}].{key} is not in its table"


def test_the_centralized_table_is_rendered_in_the_block_with_every_key() -> None:
    """[centralized] is no registered method's table, and is rendered all the same: the page's
    block (test_the_page_holds_the_rendered_tables) holds it, with every field of its config."""
    from cloud_server.centralized import CentralizedConfig

    render = config_docs
    assert ("centralized", "cloud_server.centralized:CentralizedConfig",
            "run with `edgesplit centralized --config FILE`") in render.OTHER_TABLES
    lines = render.config_tables()
    heading = next(i for i, line in enumerate(lines) if line.startswith("`[centralized]`"))
    assert lines[heading] == ("`[centralized]` (`cloud_server/centralized.py`, `CentralizedConfig`; "
                              "run with `edgesplit centralized --config FILE`)")
    start = heading + 2
    end = next(i for i in range(start, len(lines)) if lines[i] == "")
    table = "\n".join(lines[start:end])
    fields = [f.name for f in dataclasses.fields(CentralizedConfig)]
    assert fields and list(render.default_table(CentralizedConfig)) == fields
    for key in fields:
        assert f"`{key}`" in table, f"[centralized].{key} is not in its table"
    assert "| `augment` | bool \\| None | unset |" in table
    # Outside the block nothing is left of the hand-written table.
    page = (ROOT / "docs" / "configuration.md").read_text()
    headings = [i for i, line in enumerate(page.splitlines()) if line.startswith("`[centralized]`")]
    assert len(headings) == 1 and headings[0] < page.splitlines().index(render.CONFIG_END)


def test_a_row_shows_the_keys_types_defaults_and_meaning() -> None:
    render = config_docs

    @dataclass(frozen=True)
    class Inner:
        rate: float = 0.5
        codec: str = "zstd"

    @dataclass(frozen=True)
    class Outer:
        KEY_MEANINGS: ClassVar[dict[str, str]] = {"name, limit": "who and how far", "rate": "a | rate",
                                                  "codec, optional": "how, and maybe"}
        name: str = "x"
        limit: int = 3
        optional: float | None = None
        inner: Inner = field(default_factory=Inner)

        def to_table(self) -> dict[str, Any]:
            own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "inner"}
            return {**own, **dataclasses.asdict(self.inner)}

    assert render.key_rows(Outer) == [
        ("`name`, `limit`", "str, int", '`"x"`, `3`', "who and how far"),
        ("`rate`", "float", "`0.5`", "a | rate"),
        ("`codec`, `optional`", "str, float | None", '`"zstd"`, unset', "how, and maybe"),
    ]

    @dataclass(frozen=True)
    class Child(Outer):
        KEY_MEANINGS: ClassVar[dict[str, str]] = {"extra": "the child's own"}
        extra: bool = True

    assert render.key_rows(Child)[-1] == ("`extra`", "bool", "`true`", "the child's own")  # after its base's rows


def test_a_key_without_a_meaning_or_a_meaning_without_a_key_stops_the_render() -> None:
    render = config_docs

    @dataclass(frozen=True)
    class Undescribed:
        KEY_MEANINGS: ClassVar[dict[str, str]] = {"lr": "the learning rate"}
        lr: float = 0.1
        epochs: int = 1

    with pytest.raises(render.ConfigDocError, match=r"no meaning declared for \['epochs'\]"):
        render.key_rows(Undescribed)

    @dataclass(frozen=True)
    class Stale:
        KEY_MEANINGS: ClassVar[dict[str, str]] = {"lr": "the learning rate", "gone": "a key that was removed"}
        lr: float = 0.1

    with pytest.raises(render.ConfigDocError, match=r"describes \['gone'\]"):
        render.key_rows(Stale)


def test_a_page_without_the_block_is_an_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    render = config_docs
    page = tmp_path / "configuration.md"
    page.write_text("# Configuration\n")
    with pytest.raises(render.ConfigDocError, match="no methods' tables"):
        render.update_config_doc(page)
    page.write_text(f"before\n{render.CONFIG_BEGIN}\nstale\n{render.CONFIG_END}\nafter\n")
    assert render.update_config_doc(page) is True
    assert page.read_text() == "before\n" + "\n".join(render.config_tables()) + "\nafter\n"
    assert render.update_config_doc(page) is False


#: Fields set from flags or other files, never read from a TOML table.
NOT_TOML_KEYS = {"password", "log_json", "progress", "method_config", "exit_on_shutdown", "data", "memory"}


def test_every_key_of_the_server_and_agent_tables_is_on_the_page() -> None:
    """The hand-written tables ([server], [agent], [data], [memory]) name every key their dataclass
    reads; a key added to a config without a line on the page fails here."""
    from cloud_server.config import ServerConfig
    from edge_agent.config import DataConfig, EdgeConfig, MemoryConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    for config in (ServerConfig, EdgeConfig, DataConfig, MemoryConfig):
        keys = [f.name for f in dataclasses.fields(config) if f.name not in NOT_TOML_KEYS]
        assert keys, config
        missing = [key for key in keys if f"`{key}`" not in page]
        assert missing == [], f"{config.__name__}: {missing} not in docs/configuration.md"
