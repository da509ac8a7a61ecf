"""An experiment (``bench/experiments/NAME.toml``, read by :mod:`.experiment_file`) as frozen
dataclasses, and its grid.

The file says which methods (registry names, or ``"*"`` for every registered one), which
partitions and seeds, at what scale (exactly ``edgesplit local``'s flags), with which
``--set`` overrides and method flags (for every run, per method, per variant), under what
budget, whether every run is audited, the paper's claims it checks, and which models to
train centrally on the union of the same data as reference cells (``edgesplit centralized``). Nothing here
names a method: ``"*"`` is read from the registry when the grid is expanded, so a new
method appears in every ``"*"`` experiment without an edit.

Every problem is an :class:`ExperimentError` naming the file, the key and the fix.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import operator
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fldata.partition_spec import PartitionSpec
from shared_protocol.registry import LauncherFlag, registered_methods

from ..local_run import AGENT_TABLES, SERVER_TABLE
from .results import LEAKAGE_FIGURES, OPTIONAL_RUN_FIGURES, RUN_FIGURES

__all__ = ["AuditSpec", "Cell", "Centralized", "Claim", "Experiment", "ExperimentError", "Overrides", "Scale", "Variant",
           "CENTRALIZED", "CLAIM_OPERATORS", "DEFAULT_VARIANT", "RUN_TABLES", "UNION"]

#: The variant of an experiment that declares none.
DEFAULT_VARIANT = "default"
#: The tables a ``--set`` may name besides a method's own (the configs ``edgesplit local`` writes).
RUN_TABLES = (SERVER_TABLE, *AGENT_TABLES)
#: A reference cell's method: one model trained on the union of the data (``edgesplit centralized``).
CENTRALIZED = "centralized"
#: A reference cell's partition: it trains on the union of the agents' data, whatever their partition.
UNION = "union"
CLAIM_OPERATORS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class ExperimentError(ValueError):
    """An experiment file that cannot be run as written; the message names the key and the fix."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(key: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ExperimentError(f"{key} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Scale:
    """The ``edgesplit local`` flags every run of the experiment shares (defaults: the launcher's)."""

    agents: int = 4
    rounds: int = 8
    dataset: str = "fashion-mnist"
    data_root: str | None = None
    train_samples: int = 4000
    test_samples: int = 1000
    eval_every: int = 1
    deadline: float = 900.0
    client_fraction: float = 1.0
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        _int("scale.agents", self.agents, 1)
        _int("scale.rounds", self.rounds, 1)
        _int("scale.train_samples", self.train_samples, 0)
        _int("scale.test_samples", self.test_samples, 0)
        _int("scale.eval_every", self.eval_every, 1)
        if self.chunk_size is not None:
            _int("scale.chunk_size", self.chunk_size, 1)
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ExperimentError(f"scale.dataset names a dataset (e.g. \"fashion-mnist\"), got {self.dataset!r}")
        if self.data_root is not None and not isinstance(self.data_root, str):
            raise ExperimentError(f"scale.data_root is a path (a string), got {self.data_root!r}")
        if not _number(self.deadline) or self.deadline <= 0:
            raise ExperimentError(f"scale.deadline is the round deadline in seconds (> 0), got {self.deadline!r}")
        if not _number(self.client_fraction) or not 0 < self.client_fraction <= 1:
            raise ExperimentError(f"scale.client_fraction must be in (0, 1], got {self.client_fraction!r}")

    def local_args(self) -> list[str]:
        args = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                args += [f"--{f.name.replace('_', '-')}", str(value)]
        return args

    def centralized_args(self) -> list[str]:
        """The flags ``edgesplit centralized`` shares with ``edgesplit local`` (the data and rounds;
        no agents, deadline or broker)."""
        args = self.local_args()
        shared = {f"--{name.replace('_', '-')}" for name in ("rounds", "dataset", "data_root", "train_samples", "test_samples",
                                                               "eval_every")}
        return [x for flag, value in zip(args[::2], args[1::2]) if flag in shared for x in (flag, value)]


@dataclass(frozen=True)
class Overrides:
    """Method flags (by their ``LauncherFlag.dest``: ``model``, ``codec``), ``--set`` settings
    (``"TABLE.KEY"`` -> value) and agents made faulty on purpose (``--faulty-agent``'s
    ``AGENT_INDEX:KIND[:SCALE]``, one per agent)."""

    flags: Mapping[str, Any] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)
    faulty_agents: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for text in self.faulty_agents:
            self.faulty_index(text)
        for name, value in self.settings.items():
            table, _, key = name.partition(".")
            if not table or not key or "." in key:
                raise ExperimentError(f"set: {name!r} is not TABLE.KEY (e.g. \"server.round_deadline_s\" = 60)")
            if isinstance(value, dict):
                raise ExperimentError(f"set: {name} takes a scalar or a list, not a table")

    @staticmethod
    def faulty_index(text: str) -> int:
        """The agent index of a ``faulty_agents`` entry, checked as ``--faulty-agent`` checks it."""
        from ..local_checks import faulty_agent

        if not isinstance(text, str):
            raise ExperimentError(f"faulty_agents: each entry is a string AGENT_INDEX:KIND[:SCALE], got {text!r}")
        try:
            return faulty_agent(text)[0]
        except argparse.ArgumentTypeError as exc:
            raise ExperimentError(f"faulty_agents: {exc}") from None

    def then(self, other: Overrides) -> Overrides:
        """These overrides with ``other``'s on top (a faulty agent of ``other`` replaces this one's fault for that agent)."""
        faulty = {self.faulty_index(t): t for t in self.faulty_agents} | {self.faulty_index(t): t for t in other.faulty_agents}
        return Overrides({**self.flags, **other.flags}, {**self.settings, **other.settings}, tuple(faulty[i] for i in sorted(faulty)))


@dataclass(frozen=True)
class Variant:
    """A named set of overrides every method of the grid runs with (``methods``: only these;
    ``partitions``: only these; ``seeds``: only these, e.g. a costly reference run once)."""

    name: str
    overrides: Overrides = Overrides()
    methods: tuple[str, ...] = ()
    seeds: tuple[int, ...] = ()
    partitions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for seed in self.seeds:
            _int(f"variants.{self.name}.seeds", seed, 0)


@dataclass(frozen=True)
class AuditSpec:
    """``edgesplit audit``'s options for every run (``None``: each option's default)."""

    steps: int | None = None
    public_samples: int | None = None
    max_update_images: int | None = None
    max_wall_s: float | None = None  # the audit's own budget (None: the run's)

    def __post_init__(self) -> None:
        for name in ("steps", "max_update_images"):
            if getattr(self, name) is not None:
                _int(f"audit.{name}", getattr(self, name), 1)
        if self.public_samples is not None:
            _int("audit.public_samples", self.public_samples, 0)
        if self.max_wall_s is not None and (not _number(self.max_wall_s) or self.max_wall_s <= 0):
            raise ExperimentError(f"audit.max_wall_s is seconds (> 0), got {self.max_wall_s!r}")

    def audit_args(self) -> list[str]:
        args = []
        for name in ("steps", "public_samples", "max_update_images"):
            if getattr(self, name) is not None:
                args += [f"--{name.replace('_', '-')}", str(getattr(self, name))]
        return args


@dataclass(frozen=True)
class Claim:
    """A paper's claim checked on the collected table: the mean over seeds of ``figure`` for
    the cells of ``method`` (and ``partition`` / ``variant`` when given) ``op`` ``value``. With a
    ``baseline`` (a method of the grid, in ``baseline_variant``, default the plain runs) the claim
    is relative: the mean over the seeds both ran of ``method``'s figure minus the baseline's on
    the same partition and seed (each seed is one split, shared by both) ``op`` ``value``. With
    ``unless`` (``{figure, op, value}``) the claim is judged seed by seed: each seed meets the check
    or, on the same cell, the alternative (e.g. "stays within 5 points of the clean run, or the
    report warns": ``unless = { figure = "report_warnings", op = ">=", value = 1 }``)."""

    text: str
    method: str
    figure: str
    op: str
    value: float
    partition: str | None = None
    variant: str | None = None
    baseline: str | None = None
    baseline_variant: str = DEFAULT_VARIANT
    unless: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.op not in CLAIM_OPERATORS:
            raise ExperimentError(f"claims: op must be one of {' | '.join(CLAIM_OPERATORS)}, got {self.op!r}")
        if not _number(self.value):
            raise ExperimentError(f"claims: value must be a number, got {self.value!r}")
        figures = (*RUN_FIGURES, *OPTIONAL_RUN_FIGURES, *LEAKAGE_FIGURES)
        if self.figure not in figures:
            raise ExperimentError(f"claims: no figure {self.figure!r}; figures: {', '.join(figures)}")
        if self.unless is not None:
            if not isinstance(self.unless, Mapping) or sorted(self.unless) != ["figure", "op", "value"]:
                raise ExperimentError(f"claims: unless is a table {{ figure, op, value }}, got {self.unless!r}")
            if self.unless["figure"] not in figures or self.unless["op"] not in CLAIM_OPERATORS or not _number(self.unless["value"]):
                raise ExperimentError(f"claims: unless = {dict(self.unless)!r} needs a figure of the table, an op of "
                                      f"{' | '.join(CLAIM_OPERATORS)} and a number")

    def describe(self) -> str:
        where = ", ".join(x for x in (self.partition, self.variant) if x)
        minus = ""
        if self.baseline:
            minus = f" - {self.baseline}{f' ({self.baseline_variant})' if self.baseline_variant != DEFAULT_VARIANT else ''}'s"
        alternative = (f", or {self.unless['figure']} {self.unless['op']} {self.unless['value']:g}, seed by seed"
                       if self.unless else "")
        return f"{self.method}{f' ({where})' if where else ''} {self.figure}{minus} {self.op} {self.value:g}{alternative}"


@dataclass(frozen=True)
class Centralized:
    """Reference cells beside the grid: each of ``models`` trained on the union of the experiment's
    data (``edgesplit centralized``, the same data subset, rounds and evaluation), once per seed;
    ``settings``: ``--set`` values of its ``[centralized]`` (or ``[server]``) table."""

    models: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for model in self.models:
            if not isinstance(model, str) or not re.fullmatch(r"[A-Za-z0-9_]+", model):
                raise ExperimentError(f"centralized.models: a model name (e.g. \"resnet56\"), got {model!r}")
        if len(set(self.models)) != len(self.models):
            raise ExperimentError("centralized.models: a model is named once")
        Overrides(settings=self.settings)  # TABLE.KEY and scalar values
        for name in self.settings:
            if name.partition(".")[0] not in (SERVER_TABLE, CENTRALIZED):
                raise ExperimentError(f"centralized.set: {name}: a centralized run's tables are {SERVER_TABLE} and {CENTRALIZED}")


@dataclass(frozen=True)
class Cell:
    """One run of the grid: a method on a partition with a seed, in a variant; or a reference cell
    (method ``centralized``, its model as the variant, partition ``union``)."""

    key: str
    method: str
    partition: str
    seed: int
    variant: str
    overrides: Overrides

    def local_args(self, scale: Scale) -> list[str]:
        """``edgesplit local``'s arguments for this cell (without ``--out`` and ``--run-id``)."""
        args = ["--method", self.method, "--partition", self.partition, "--seed", str(self.seed), *scale.local_args()]
        for dest, value in self.overrides.flags.items():
            args += [f"--{dest.replace('_', '-')}", str(value)]
        for name, value in self.overrides.settings.items():
            args += ["--set", f"{name}={_toml_value(value)}"]
        for text in self.overrides.faulty_agents:
            args += ["--faulty-agent", text]
        return args

    def command_args(self, scale: Scale) -> list[str]:
        """The launcher's subcommand and its arguments for this cell (without ``--out`` and ``--run-id``)."""
        if self.method != CENTRALIZED:
            return ["local", *self.local_args(scale)]
        args = ["centralized", "--model", self.variant, "--seed", str(self.seed), *scale.centralized_args()]
        for name, value in self.overrides.settings.items():
            args += ["--set", f"{name}={_toml_value(value)}"]
        return args


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


@dataclass(frozen=True)
class Experiment:
    """A parsed experiment file. ``methods`` as written (``("*",)`` stays a wildcard until
    :meth:`cells` reads the registry)."""

    name: str
    question: str
    methods: tuple[str, ...]
    partitions: tuple[str, ...]
    seeds: tuple[int, ...]
    scale: Scale = Scale()
    max_wall_s: float = 3600.0
    overrides: Overrides = Overrides()
    per_method: Mapping[str, Overrides] = field(default_factory=dict)
    variants: tuple[Variant, ...] = (Variant(DEFAULT_VARIANT),)
    audit: AuditSpec | None = None
    claims: tuple[Claim, ...] = ()
    centralized: Centralized = Centralized()
    source: str = ""  # the file it was read from

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", self.name or ""):
            raise ExperimentError(f"name is letters, digits, '-' and '_' (the results are bench/results/NAME.json), got {self.name!r}")
        if not isinstance(self.question, str) or not self.question.strip() or "\n" in self.question.strip():
            raise ExperimentError("question is the one line the experiment answers, e.g. \"Which method leaks least?\"")
        for key, values in (("methods", self.methods), ("partitions", self.partitions), ("seeds", self.seeds)):
            if not values:
                raise ExperimentError(f"{key} is empty: the grid has no cell; list at least one")
        for seed in self.seeds:
            _int("seeds[]", seed, 0)
        for partition in self.partitions:
            try:
                PartitionSpec.parse(partition, self.scale.agents)
            except ValueError as exc:
                raise ExperimentError(f"partitions: {exc}") from None
        if not _number(self.max_wall_s) or self.max_wall_s <= 0:
            raise ExperimentError(f"budget.max_wall_s is the most seconds one run may take (> 0), got {self.max_wall_s!r}")
        if len({v.name for v in self.variants}) != len(self.variants):
            raise ExperimentError("variants: a variant is named once")
        self._check_names()

    def method_names(self) -> tuple[str, ...]:
        """The grid's methods: ``"*"`` is every registered method; an unknown name is an error."""
        known = registered_methods()
        names: list[str] = []
        for name in self.methods:
            for found in (list(known) if name == "*" else [name]):
                if found not in known:
                    raise ExperimentError(f"methods: unknown method {found!r}; registered: {', '.join(known)} (or \"*\" for all)")
                if found not in names:
                    names.append(found)
        return tuple(names)

    def _check_names(self) -> None:
        methods = self.method_names()
        known = registered_methods()
        for name in self.per_method:
            if name not in methods:
                raise ExperimentError(f"method.{name}: {name!r} is not a method of this grid ({', '.join(methods)}); "
                                      "add it to methods or remove the table")
        every_flag = {f.dest for m in methods for f in known[m].flags}
        tables = (*RUN_TABLES, *known)
        for where, overrides, own in [("flags", self.overrides, None),
                                      *((f"method.{m}", o, m) for m, o in self.per_method.items()),
                                      *((f"variants.{v.name}", v.overrides, None) for v in self.variants)]:
            allowed = {f.dest for f in known[own].flags} if own else every_flag
            for dest, value in overrides.flags.items():
                if dest not in allowed:
                    raise ExperimentError(f"{where}: no method flag {dest!r} here; flags: {', '.join(sorted(allowed)) or 'none'} "
                                          "(an `edgesplit local` scale flag goes in [scale])")
                for flag in _declarations(dest, [own] if own else methods):
                    expected = {"str": (str,), "int": (int,), "float": (int, float)}[flag.type]
                    if isinstance(value, bool) or not isinstance(value, expected):
                        raise ExperimentError(f"{where}: flags.{dest} is of type {flag.type} ({flag.name}), got {value!r}")
                    try:
                        flag.check(value)
                    except ValueError as exc:
                        raise ExperimentError(f"{where}: {exc}") from None
            for text in overrides.faulty_agents:
                if overrides.faulty_index(text) >= self.scale.agents:
                    raise ExperimentError(f"{where}: faulty_agents {text!r}: no agent {overrides.faulty_index(text)} in a run "
                                          f"of scale.agents = {self.scale.agents}")
            for name in overrides.settings:
                if name.partition(".")[0] not in tables:
                    raise ExperimentError(f"{where}: set {name}: no table {name.partition('.')[0]!r}; tables: "
                                          f"{', '.join(tables)}")
        for variant in self.variants:
            for method in variant.methods:
                if method not in methods:
                    raise ExperimentError(f"variants.{variant.name}.methods: {method!r} is not a method of this grid")
            for partition in variant.partitions:
                if partition not in self.partitions:
                    raise ExperimentError(f"variants.{variant.name}.partitions: {partition!r} is not a partition of this grid "
                                          f"({', '.join(self.partitions)})")
        if CENTRALIZED in methods and self.centralized.models:
            raise ExperimentError(f"centralized: the registry has a method named {CENTRALIZED!r}: its cells and the reference "
                                  "cells would share keys")
        for claim in self.claims:
            for role, name in (("method", claim.method), ("baseline", claim.baseline)):
                if name is not None and name not in methods and not (name == CENTRALIZED and self.centralized.models):
                    raise ExperimentError(f"claims: {role} {name!r} is not in the grid ({', '.join(methods)})")
            if claim.baseline is not None and claim.baseline_variant not in {v.name for v in self.variants}:
                raise ExperimentError(f"claims: baseline_variant {claim.baseline_variant!r} is not a variant of this grid")

    def cells(self) -> list[Cell]:
        """The grid: method x variant x partition x seed, each with its overrides (every run's,
        then the method's, then the variant's; a ``--set`` of a method's table and a method flag
        go only to the methods that have them)."""
        known = registered_methods()
        cells = []
        for method in self.method_names():
            flags = {f.dest for f in known[method].flags}
            for variant in self.variants:
                if variant.methods and method not in variant.methods:
                    continue
                merged = self.overrides.then(self.per_method.get(method, Overrides())).then(variant.overrides)
                mine = Overrides({d: v for d, v in merged.flags.items() if d in flags},
                                 {n: v for n, v in merged.settings.items()
                                  if n.partition(".")[0] in (*RUN_TABLES, method)}, merged.faulty_agents)
                for partition in self.partitions:
                    if variant.partitions and partition not in variant.partitions:
                        continue
                    for seed in variant.seeds or self.seeds:
                        parts = [method, *([variant.name] if variant.name != DEFAULT_VARIANT else []),
                                 re.sub(r"[^A-Za-z0-9_.-]+", "", partition), f"s{seed}"]
                        cells.append(Cell("-".join(parts), method, partition, seed, variant.name, mine))
        for model in self.centralized.models:
            for seed in self.seeds:
                cells.append(Cell(f"{CENTRALIZED}-{model}-{UNION}-s{seed}", CENTRALIZED, UNION, seed, model,
                                  Overrides(settings=self.centralized.settings)))
        if not cells:
            raise ExperimentError("the grid is empty: no variant applies to any method; check variants.*.methods")
        keys = [c.key for c in cells]
        if len(set(keys)) != len(keys):
            raise ExperimentError(f"two cells share a key: {sorted({k for k in keys if keys.count(k) > 1})}; rename a variant")
        for key in keys:
            if not _RUN_ID.match(key):
                raise ExperimentError(f"cell {key!r} is not a run id (64 characters at most): shorten the variant's name")
        return cells

    def select(self, only: str | None) -> list[Cell]:
        """The cells whose key matches the glob ``only`` (all when None); none is an error listing the keys."""
        cells = self.cells()
        if only is None:
            return cells
        chosen = [c for c in cells if fnmatch.fnmatchcase(c.key, only)]
        if not chosen:
            raise ExperimentError(f"--only {only!r} matches no cell; cells: {', '.join(c.key for c in cells)}")
        return chosen

    def as_data(self) -> dict[str, Any]:
        """The experiment as JSON data (what a results file records)."""
        data: dict[str, Any] = json.loads(json.dumps(asdict(self)))
        data["methods_resolved"] = list(self.method_names())
        return data


def _declarations(dest: str, methods: list[str] | tuple[str, ...]) -> list[LauncherFlag]:
    known = registered_methods()
    return [f for m in methods for f in known[m].flags if f.dest == dest][:1]
