"""What ``edgesplit local`` checks before it starts anything (no broker, no process, no
line announcing the run): every flag and every ``--set``, each mistake named by its flag
or key with the closest valid value and the list of valid ones.

Three stages, cheapest first: argparse's own (the ``type=`` functions here: numbers out of
range, an unknown method, dataset or partition spec exit at parse time), the flags that
depend on each other (:func:`check_local_args`: the ``--set`` tables and keys, the models
the method's flags name), then the configs as the run would write them, read by the
server's config class and method here and by ``edge-agent check`` for the agents (the server
never imports the agent's package), and the partition for that many agents
(:func:`check_generated_configs`). A mistake
is a :class:`LaunchConfigError`; the launcher exits with :data:`EXIT_CONFIG`, as argparse,
``cloud-server run`` and ``edge-agent run`` do for a configuration error.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared_protocol.configs import did_you_mean
from shared_protocol.faults import FaultSpec, fault_kinds_text
from shared_protocol.registry import registered_methods
from shared_protocol.tomlio import read_toml

from .local_run import AGENT_TABLES, SERVER_TABLE, launcher_flags, parse_setting, write_configs

__all__ = ["EXIT_CONFIG", "PARTITION_FORMS", "LaunchConfigError", "check_generated_configs", "check_local_args",
           "dataset_name", "faulty_agent", "float_in", "int_at_least", "method_name", "model_flags", "partition_spec"]

#: The exit code of a configuration error, in ``edgesplit``, ``cloud-server`` and ``edge-agent``
#: (argparse's own for a bad flag).
EXIT_CONFIG = 2
#: What ``--partition`` takes.
PARTITION_FORMS = "iid | dirichlet:A | step:K | table:FILE"


class LaunchConfigError(ValueError):
    """A flag or ``--set`` of ``edgesplit local`` the run cannot start with; the message
    names it and what to give instead."""


# -- argparse types: a bad value exits at parse time, naming the flag ------------------------ #


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def float_in(low: float, high: float | None = None, low_open: bool = True) -> Callable[[str], float]:
    """An argparse type: a number above ``low`` (or at it, ``low_open=False``), at most ``high``."""
    shown = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {shown}, got {text!r}") from None
        if value != value or (value <= low if low_open else value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be a number in {shown}, got {text}")
        return value

    parse.__name__ = f"number in {shown}"
    return parse


def _choice(kind: str, value: str, known: list[str]) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"unknown {kind} {value!r};{did_you_mean(value, known)} {kind}s: {', '.join(known)}")


def method_name(text: str) -> str:
    """An argparse type: a registered method (built in or a plugin)."""
    known = list(registered_methods())
    if text not in known:
        raise _choice("method", text, known)
    return text


def dataset_name(text: str) -> str:
    """An argparse type: a dataset of :mod:`fldata`'s registry (torch-free)."""
    from fldata.registry import list_datasets

    import fldata  # noqa: F401  (its import registers the built-in datasets)

    known = list(list_datasets())
    if text not in known:
        raise _choice("dataset", text, known)
    return text


def partition_spec(text: str) -> str:
    """An argparse type: a partition spec :class:`fldata.PartitionSpec` parses, whose table
    file (``table:FILE``) exists; kept as written (the agents parse it again)."""
    from fldata import PartitionSpec

    try:
        spec = PartitionSpec.parse(text, num_agents=1)
    except ValueError as exc:
        reason = str(exc).split("; expected")[0]  # fldata's own list of the forms, said below as the flag takes them
        raise argparse.ArgumentTypeError(f"{reason}; give {PARTITION_FORMS} (e.g. dirichlet:0.5)") from None
    if spec.table_path is not None and not Path(spec.table_path).is_file():
        raise argparse.ArgumentTypeError(f"table:{spec.table_path}: no such file (a CSV of class counts per agent)")
    return text


def faulty_agent(text: str) -> tuple[int, FaultSpec]:
    """An argparse type: ``AGENT_INDEX:KIND[:SCALE]`` (``--faulty-agent 4:sign_flip:4``), the agent
    and the fault it commits on purpose; an unknown kind lists the known ones."""
    index, sep, fault = text.partition(":")
    if not sep or not fault:
        raise argparse.ArgumentTypeError(f"takes AGENT_INDEX:KIND[:SCALE] (e.g. 4:sign_flip:4), got {text!r}; "
                                         f"kinds: {fault_kinds_text()}")
    try:
        agent = int(index)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the agent index must be an integer >= 0, got {index!r}") from None
    if agent < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the agent index must be an integer >= 0, got {agent}")
    try:
        return agent, FaultSpec.parse(fault, where=text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


faulty_agent.__name__ = "AGENT_INDEX:KIND[:SCALE]"


# -- after parsing: what depends on other flags ------------------------------------------- #


def model_flags() -> dict[str, tuple[str, list[str]]]:
    """The launcher flags that name a model -- those whose declared default is a registered
    model -- by flag name: (the kind of input, the registered models taking it). Imports
    the models registry, hence torch."""
    from models import get_model_spec, list_models

    names = list_models()
    flags = {}
    for launch in launcher_flags():
        default = launch.flag.default
        if isinstance(default, str) and default in names:
            kind = get_model_spec(default).input_kind
            flags[launch.flag.name] = (kind, [n for n in names if get_model_spec(n).input_kind == kind])
    return flags


def _settable_tables(method: str) -> dict[str, tuple[str, ...] | None]:
    """The tables ``--set`` reaches, with their keys (None: checked by the config that reads
    them: the method's by its config class, the agents' by ``edge-agent check``, as the
    server never imports the agent)."""
    from .config import ServerConfig

    return {SERVER_TABLE: ServerConfig.table_keys(), method: None, **{table: None for table in AGENT_TABLES}}


def check_local_args(args: argparse.Namespace) -> None:
    """The ``--set`` settings (table, key, value syntax) and the models the method's flags
    name; a LaunchConfigError naming the flag or key, the closest valid one and the list."""
    tables = _settable_tables(args.method)
    for text in args.set or ():
        try:
            setting = parse_setting(text)
        except ValueError as exc:
            raise LaunchConfigError(str(exc)) from None
        if setting.table in registered_methods() and setting.table not in tables:
            raise LaunchConfigError(f"--set {setting}: [{setting.table}] is method {setting.table}'s table, and this run's "
                                    f"method is {args.method} (--method); tables: {', '.join(tables)}")
        if setting.table not in tables:
            raise LaunchConfigError(
                f"--set {setting}: no table [{setting.table}] in this run's configs;{did_you_mean(setting.table, tables)} "
                f"tables: {', '.join(tables)}")
        keys = tables[setting.table]
        if keys is not None and setting.key not in keys:
            raise LaunchConfigError(
                f"--set {setting}: [{setting.table}] has no key {setting.key!r};{did_you_mean(setting.key, keys)} "
                f"keys of [{setting.table}]: {', '.join(sorted(keys))}")
    seen: set[int] = set()
    for index, spec in getattr(args, "faulty_agent", None) or ():
        if index >= args.agents:
            raise LaunchConfigError(f"--faulty-agent {index}:{spec.describe()}: no agent {index} in a run of --agents "
                                    f"{args.agents} (indices 0 to {args.agents - 1})")
        if index in seen:
            raise LaunchConfigError(f"--faulty-agent: agent {index} is given twice; one fault per agent")
        seen.add(index)
    backend = getattr(args, "backend", None)
    if backend not in (None, "torch") and backend not in registered_methods()[args.method].backends:
        offering = sorted(name for name, spec in registered_methods().items() if backend in spec.backends)
        raise LaunchConfigError(f"--backend {backend}: --method {args.method} has no {backend} edge step; methods with one: "
                                f"{', '.join(offering) or 'none'}")
    declared = {flag.name for flag in registered_methods()[args.method].flags}
    for launch in launcher_flags():
        if getattr(args, launch.flag.dest, None) is not None and launch.flag.name not in declared:
            users = ", ".join(method for method, _ in launch.helps)
            raise LaunchConfigError(f"{launch.flag.name} does not apply to --method {args.method} (it is {users}'s); "
                                    f"{args.method}'s own flags: {', '.join(sorted(declared)) or 'none'}")
    for name, (kind, known) in model_flags().items():
        value = getattr(args, name[2:].replace("-", "_"), None)
        if value is not None and value not in known:
            fed = "images" if kind == "image" else "the edge's feature maps"
            raise LaunchConfigError(f"{name}: unknown model {value!r} (one fed {fed});{did_you_mean(value, known)} "
                                    f"registered: {' | '.join(known)}")


def check_generated_configs(args: argparse.Namespace, run_id: str, out: Path, broker: str | None) -> None:
    """Write the run's configs to a scratch directory and read them as the server and every
    agent will: the server builds its method (its table's keys and values, the models), each
    agent its config and partition. A LaunchConfigError says which file's check failed."""
    from fldata.subsets import NO_PARTITION

    from fldata import PartitionSpec

    from .local_run import check_server_config

    with tempfile.TemporaryDirectory(prefix="edgesplit-check-") as scratch:
        try:
            server_path, agent_paths = write_configs(args, run_id, out, broker or "mqtt://127.0.0.1:1883",
                                                     configs_dir=Path(scratch))
            check_server_config(server_path)
        except ValueError as exc:
            raise LaunchConfigError(str(exc)) from None
        # The agents' configs differ only in their id, index and metrics port: the first stands for
        # all, and each faulty agent's for itself.
        faulty = sorted({index for index, _ in getattr(args, "faulty_agent", None) or ()} - {0})
        for path in [agent_paths[0], *(agent_paths[i] for i in faulty)]:
            checked = subprocess.run([sys.executable, "-m", "edge_agent.cli", "check", "--config", str(path)],
                                     capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            if checked.returncode != 0:
                said = checked.stderr.strip().removeprefix("edge-agent: error: ")
                raise LaunchConfigError(f"the agents' config ({path.name}): {said}")
        data = read_toml(agent_paths[0])["data"]
    given = "--set data.partition" if ("data", "partition") in _set_keys(args) else "--partition"
    partition, num_agents = data["partition"], data["num_agents"]
    if partition == NO_PARTITION and num_agents > 1:
        raise LaunchConfigError(f'{given}: "none" would give all {num_agents} agents the same samples; give {PARTITION_FORMS}')
    if partition != NO_PARTITION:
        try:
            PartitionSpec.parse(partition, num_agents, data.get("seed", 0))
        except ValueError as exc:
            raise LaunchConfigError(f"{given} {partition}: {exc}; give {PARTITION_FORMS}") from None


def _set_keys(args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    settings = [parse_setting(text) for text in args.set or ()]
    return {(s.table, s.key): s.value for s in settings}
