"""Every registered method is its own parts (registry entry, messages, edge step, server
step) plus a launcher table, and what ``edgesplit local --method X`` writes is a config
that method accepts; ``--set`` reaches any key and a wrong one is refused before anything
starts. The server interface stays small: at most six required hooks."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

import cloud_server.methods as server_methods
from cloud_server.assemble import build_server_method
from cloud_server.config import ServerConfig
from cloud_server.launcher import build_parser, check_server_config, write_configs
from cloud_server.local_run import LocalRunOptions, MissingLauncherTableError, Setting, get_launcher_table, parse_setting
from cloud_server.methods.base import ServerMethod, _SERVER_METHODS
from edge_agent.methods import KNOWN_METHODS as EDGE_METHODS
from edge_agent.methods import get_edge_method
from shared_protocol.messages import message_types
from shared_protocol.registry import load_method_messages
from shared_protocol.registry import LauncherFlag, MethodSpec, get_method, import_part, register_method
from cloud_server.schedulers import SCHEDULERS
from shared_protocol.tomlio import read_toml

from fedhelpers import ROOT

METHODS = server_methods.KNOWN_METHODS


def test_the_methods_are_found_on_disk() -> None:
    assert {"fedavg", "fedgkt", "fedkd", "splitnn"} <= set(METHODS)
    assert set(EDGE_METHODS) == set(METHODS), "every method has an edge step and a server step"


@pytest.mark.parametrize("method", METHODS)
def test_method_has_its_parts_and_a_launcher_table(method: str) -> None:
    spec = get_method(method)
    server = server_methods.get_server_method(method)
    assert issubclass(server, ServerMethod) and server.name == method and server.__module__ == spec.server
    edge = get_edge_method(method)
    assert edge.name == method and edge.__module__ == spec.edge
    modules = {m.__name__ for m in load_method_messages(method)}
    assert modules == set(spec.messages)
    registered = message_types()
    for cls in server.upload_types:
        assert registered.get(cls.TYPE) is cls, f"{method} uploads {cls.__name__}, which is not a registered message type"
        assert cls.__module__ in modules, f"{method} uploads {cls.__name__}, which its registry entry's messages do not hold"
    assert callable(get_launcher_table(method))
    for flag in spec.flags:  # what its table reads is what the launcher adds
        assert flag.dest.isidentifier()


def test_server_method_has_at_most_six_required_hooks() -> None:
    required = sorted(ServerMethod.__abstractmethods__)
    assert required == ["complete", "evaluation", "model_info", "on_upload", "round_config", "welcome_settings"]
    assert len(required) <= 6


def test_a_duplicate_method_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import shared_protocol.registry as registry

    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    held = get_method("fedavg")
    with pytest.raises(ValueError, match="'fedavg' is already registered"):
        register_method(MethodSpec(name="fedavg", summary="another", server=held.server, edge=held.edge))
    with pytest.raises(ValueError, match="--server-model"):
        LauncherFlag("server-model", "x", "no dashes")


@pytest.mark.parametrize("method", METHODS)
def test_edgesplit_local_writes_a_config_the_method_accepts(tmp_path: Path, method: str) -> None:
    args = build_parser().parse_args(["local", "--method", method, "--agents", "2", "--dataset", "synthetic",
                                      "--train-samples", "128", "--test-samples", "64"])
    server_path, agent_paths = write_configs(args, "walk", tmp_path, "mqtt://127.0.0.1:1883")
    config = ServerConfig.from_dict(read_toml(server_path))
    assert config.method == method and len(agent_paths) == 2
    built = build_server_method(config, device="cpu")
    assert built.name == method
    assert isinstance(built.resolved_config(), dict)
    # The registry names the config class its table is read with.
    assert type(built.config) is import_part(get_method(method).config)  # type: ignore[attr-defined]
    # What the coordinator reads of a method is declared by it, never set on the instance.
    assert not {"schedule", "download_codecs", "evaluate_every_round"} & set(vars(built))
    assert built.schedule in SCHEDULERS


def test_a_method_without_a_launcher_table_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("cloud_server.methods.tableless")
    module.__file__ = "cloud_server/methods/tableless.py"

    class Tableless(server_methods.get_server_method("fedavg")):  # type: ignore[misc,valid-type]
        name = "tableless"

    Tableless.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(_SERVER_METHODS, "tableless", Tableless)
    with pytest.raises(MissingLauncherTableError, match=r"define `def launcher_table.*tableless\.py.*adding-a-method"):
        get_launcher_table("tableless")
    with pytest.raises(ValueError, match="unknown method 'nosuch'"):
        get_launcher_table("nosuch")


def test_set_values_are_toml_with_bare_words_as_strings() -> None:
    assert parse_setting("fedgkt.server_epochs=3") == Setting("fedgkt", "server_epochs", 3)
    assert parse_setting("server.round_deadline_s = 2.5") == Setting("server", "round_deadline_s", 2.5)
    assert parse_setting("data.download=true") == Setting("data", "download", True)
    assert parse_setting('fedavg.upload_codec="raw"').value == "raw"
    assert parse_setting("fedavg.upload_codec=fp16-zstd").value == "fp16-zstd"
    assert parse_setting("server.allow_list=[\"a\", \"b\"]").value == ["a", "b"]
    for bad in ("server_epochs=3", "fedgkt.server_epochs", ".x=1", "a.b.c=1", "fedgkt.x={a = 1}"):
        with pytest.raises(ValueError, match="TABLE.KEY=VALUE|not a table"):
            parse_setting(bad)


def test_set_reaches_the_server_the_method_and_the_agents(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "local", "--method", "fedgkt", "--agents", "2", "--dataset", "synthetic",
        "--set", "fedgkt.server_epochs=3", "--set", "server.round_deadline_s=60", "--set", "data.download=true",
        "--set", "fedgkt.upload_codec=u8-zstd",
    ])
    server_path, agent_paths = write_configs(args, "set", tmp_path, "mqtt://127.0.0.1:1883")
    config = ServerConfig.from_dict(read_toml(server_path))
    assert config.round_deadline_s == 60.0
    assert config.method_config["server_epochs"] == 3 and config.method_config["upload_codec"] == "u8-zstd"
    assert all(read_toml(p)["data"]["download"] is True for p in agent_paths)
    check_server_config(server_path)


@pytest.mark.parametrize(("setting", "message"), [
    ("fedgkt.server_epochss=3", r"unknown \[fedgkt\] keys: \['server_epochss'\]"),
    ("server.roundz=3", r"unknown \[server\] keys: \['roundz'\]"),
    ("server.rounds=0", "rounds must be an integer >= 1"),
    ("fedavg.model=resnet8", r"no table \[fedavg\].*tables: server, fedgkt, agent, data"),
])
def test_a_wrong_set_is_refused_with_the_reason(tmp_path: Path, setting: str, message: str) -> None:
    args = build_parser().parse_args(["local", "--method", "fedgkt", "--agents", "1", "--dataset", "synthetic", "--set", setting])
    with pytest.raises(ValueError, match=message):
        check_server_config(write_configs(args, "bad", tmp_path, "mqtt://127.0.0.1:1883")[0])


def test_edgesplit_local_stops_at_a_wrong_set_before_starting_anything(tmp_path: Path) -> None:
    # --broker: no mosquitto is started; the config check fails before the server or an agent would.
    result = subprocess.run(
        [sys.executable, "-m", "cloud_server.launcher", "local", "--method", "fedavg", "--agents", "1", "--rounds", "1",
         "--dataset", "synthetic", "--broker", "mqtt://127.0.0.1:1", "--out", str(tmp_path / "run"),
         "--set", "fedavg.local_epochz=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "unknown [fedavg] keys: ['local_epochz']" in result.stderr
    assert not (tmp_path / "run" / "logs" / "server.log").exists()


def test_launcher_options_are_validated() -> None:
    with pytest.raises(ValueError, match="--train-samples"):
        LocalRunOptions(method="fedavg", train_samples=-1)
    with pytest.raises(ValueError, match="--server-epochs must be >= 1"):
        LocalRunOptions(method="fedgkt", flags={"server_epochs": 0})
    with pytest.raises(ValueError, match=r"--mode must be one of sync \| async, got .fast."):
        LocalRunOptions(method="fedgkt", flags={"mode": "fast"})
    assert LocalRunOptions(method="fedgkt").flag("server_model") == "resnet55_server"  # the declared default
    with pytest.raises(KeyError, match="declares no flag --model"):
        LocalRunOptions(method="fedkd").flag("model")


def test_methods_sharing_a_flag_share_its_default() -> None:
    from cloud_server.local_run import launcher_flags

    codec = next(f for f in launcher_flags() if f.flag.name == "--codec")
    assert {m for m, _ in codec.helps} >= {"fedavg", "fedgkt", "splitnn"}
    assert "fedgkt: feature maps" in codec.help_text()
