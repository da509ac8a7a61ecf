"""Reading an experiment file (``bench/experiments/NAME.toml``) into an :class:`~.spec.Experiment`.

The file's layout (docs/experiments.md)::

    name = "NAME"                  # the file's stem
    question = "the one line it answers"
    methods = ["*"]                # registry names, "*": every registered method
    partitions = ["iid", "dirichlet:0.5"]
    seeds = [0, 1]
    audit = true                   # or a table: { steps, public_samples, max_update_images, max_wall_s }
    [scale]                        # edgesplit local's flags: agents, rounds, dataset, train_samples, ...
    [budget]                       # max_wall_s: the most one run may take
    [flags] / [set]                # every run: method flags by name, --set TABLE.KEY = VALUE
    [method.NAME]                  # one method's: flags = {...}, set = {...}
    [variants.NAME]                # a variant of the grid: flags, set, faulty_agents, methods, partitions and seeds (only these)
    faulty_agents = ["4:sign_flip:4"]  # (top level, per method or per variant) --faulty-agent AGENT_INDEX:KIND[:SCALE]
    [[claims]]                     # text, method, figure, op, value, partition, variant, baseline, baseline_variant, unless
    [centralized]                  # reference cells: models = ["resnet56"], set = {"centralized.batch_size" = 32}
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from .spec import DEFAULT_VARIANT, AuditSpec, Centralized, Claim, Experiment, ExperimentError, Overrides, Scale, Variant

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["load_experiment", "parse_experiment"]

_TOP_KEYS = ("name", "question", "methods", "partitions", "seeds", "scale", "budget", "set", "flags", "method", "variants",
             "audit", "claims", "faulty_agents", "centralized")


def _flatten(prefix: str, table: Mapping[str, Any]) -> dict[str, Any]:
    """``{"server": {"round_deadline_s": 60}}`` and ``{"server.round_deadline_s": 60}`` alike -> ``TABLE.KEY``."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            flat.update(_flatten(name, value))
        else:
            flat[name] = value
    return flat


def _table(raw: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ExperimentError(f"{key} is a table ([{key}]), got {value!r}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ExperimentError(f"{key}: unknown key {unknown[0]!r}; keys: {', '.join(allowed)}")
    return value


def _keys(raw: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """Every key of the table ``key`` (a table of tables named by the user: any name goes)."""
    value = raw.get(key, {})
    return tuple(value) if isinstance(value, dict) else ()


def _overrides(raw: Mapping[str, Any], where: str) -> Overrides:
    flags = raw.get("flags", {})
    settings = raw.get("set", {})
    if not isinstance(flags, dict) or not isinstance(settings, dict):
        raise ExperimentError(f"{where}: flags and set are tables (flags = {{ model = \"resnet8\" }})")
    faulty = raw.get("faulty_agents", [])
    if not isinstance(faulty, list):
        raise ExperimentError(f"{where}: faulty_agents is a list of AGENT_INDEX:KIND[:SCALE], e.g. [\"4:sign_flip:4\"], got {faulty!r}")
    try:
        return Overrides(dict(flags), _flatten("", settings), tuple(faulty))
    except ExperimentError as exc:
        raise ExperimentError(f"{where}: {exc}") from None


def _strings(raw: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ExperimentError(f"{key} is a list of strings, e.g. {key} = [\"...\"], got {value!r}")
    return tuple(value)


def parse_experiment(raw: Mapping[str, Any], source: str = "") -> Experiment:
    """An :class:`Experiment` from a file's TOML document."""
    unknown = sorted(set(raw) - set(_TOP_KEYS))
    if unknown:
        raise ExperimentError(f"unknown key {unknown[0]!r}; keys: {', '.join(_TOP_KEYS)}")
    for key in ("name", "question", "methods", "partitions", "seeds"):
        if key not in raw:
            raise ExperimentError(f"missing key {key!r}: an experiment names its {key}")
    seeds = raw["seeds"]
    if not isinstance(seeds, list):
        raise ExperimentError(f"seeds is a list of integers, e.g. seeds = [0, 1], got {seeds!r}")
    scale = Scale(**_table(raw, "scale", tuple(f.name for f in fields(Scale))))
    budget = _table(raw, "budget", ("max_wall_s",))
    per_method = {}
    for name, table in _table(raw, "method", _keys(raw, "method")).items():
        unknown_keys = sorted(set(table) - {"flags", "set", "faulty_agents"}) if isinstance(table, dict) else ["(not a table)"]
        if unknown_keys:
            raise ExperimentError(f"method.{name}: unknown key {unknown_keys[0]!r}; keys: flags, set, faulty_agents")
        per_method[name] = _overrides(table, f"method.{name}")
    variants = []
    for name, table in _table(raw, "variants", _keys(raw, "variants")).items():
        if not isinstance(table, dict) or sorted(set(table) - {"flags", "set", "faulty_agents", "methods", "partitions", "seeds"}):
            raise ExperimentError(f"variants.{name}: a variant is a table with flags, set, faulty_agents, methods, partitions "
                                  "and seeds only")
        only_seeds = table.get("seeds", [])
        if not isinstance(only_seeds, list):
            raise ExperimentError(f"variants.{name}.seeds is a list of seeds, got {only_seeds!r}")
        only_partitions = _strings(table, "partitions") if "partitions" in table else ()
        variants.append(Variant(name, _overrides(table, f"variants.{name}"), tuple(table.get("methods", ())), tuple(only_seeds),
                                only_partitions))
    audit_raw = raw.get("audit", False)
    if isinstance(audit_raw, bool):
        audit = AuditSpec() if audit_raw else None
    else:
        audit = AuditSpec(**_table(raw, "audit", tuple(f.name for f in fields(AuditSpec))))
    claims = []
    for entry in raw.get("claims", []):
        if not isinstance(entry, dict):
            raise ExperimentError("claims is an array of tables ([[claims]])")
        allowed = tuple(f.name for f in fields(Claim))
        bad = sorted(set(entry) - set(allowed))
        missing = [k for k in ("text", "method", "figure", "op", "value") if k not in entry]
        if bad or missing:
            raise ExperimentError(f"claims: {'unknown key ' + repr(bad[0]) if bad else 'missing key ' + repr(missing[0])}; "
                                  f"keys: {', '.join(allowed)}")
        claims.append(Claim(**entry))
    central = _table(raw, "centralized", ("models", "set"))
    models, settings = central.get("models", []), central.get("set", {})
    if not isinstance(models, list) or not isinstance(settings, dict):
        raise ExperimentError("centralized: models is a list of model names and set a table, e.g. "
                              "models = [\"resnet56\"], set = { \"centralized.batch_size\" = 32 }")
    return Experiment(
        name=raw["name"], question=raw["question"], methods=_strings(raw, "methods"), partitions=_strings(raw, "partitions"),
        seeds=tuple(seeds), scale=scale, max_wall_s=budget.get("max_wall_s", Experiment.max_wall_s),
        overrides=_overrides(raw, "every run"), per_method=per_method,
        variants=tuple(variants) or (Variant(DEFAULT_VARIANT),), audit=audit, claims=tuple(claims),
        centralized=Centralized(tuple(models), _flatten("", settings)), source=source)


def load_experiment(path: str | Path) -> Experiment:
    """Read and check an experiment file; every problem is an ExperimentError naming the file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ExperimentError(f"{path}: no such experiment file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ExperimentError(f"{path}: not valid TOML: {exc}") from None
    try:
        experiment = parse_experiment(raw, source=str(path))
        experiment.cells()
    except (ExperimentError, TypeError) as exc:  # TypeError: a dataclass given a key it has no field for
        raise ExperimentError(f"{path}: {exc}") from None
    if experiment.name != path.stem:
        raise ExperimentError(f"{path}: name is {experiment.name!r} but the file is {path.name}: make them agree "
                              "(the results file and the template are named after it)")
    return experiment
