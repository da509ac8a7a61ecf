"""``edgesplit local`` checks every flag and ``--set`` before anything starts: each mistake
a newcomer made (the exact command lines) fails with the configuration-error exit code,
naming the flag or key and the closest valid one, with no broker started, no run
announced and no run directory written. ``cloud-server run`` and ``edge-agent run`` give
the same code for a bad config; the three programs have ``--version``; every flag of
``edgesplit local`` has help and shows its default, the models listed from the registry."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_server import launcher
from cloud_server.launcher import build_parser, main, write_configs
from edge_agent.config import EdgeConfig
from shared_protocol.local_broker import LocalBroker
from shared_protocol.tomlio import read_toml

from fedhelpers import ROOT

EXIT_CONFIG = 2


def _run_local(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    """``edgesplit local ARGV --out tmp_path/run`` in this process: (exit code, stdout, stderr).
    Starting mosquitto fails the test: every mistake must be caught before."""

    def no_broker(self: LocalBroker) -> LocalBroker:
        raise AssertionError("the broker was started before the mistake was caught")

    monkeypatch.setattr(LocalBroker, "start", no_broker)
    try:
        code = main(["local", *argv, "--out", str(tmp_path / "run")])
    except SystemExit as exc:  # argparse's own refusal of a flag
        code = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert "broker" not in out and not (tmp_path / "run").exists(), "something started before the check"
    return code, out, err


@pytest.mark.parametrize(("argv", "expected"), [
    (["--method", "fedgtk"], ["argument --method", "unknown method 'fedgtk'", "did you mean fedgkt?", "fedavg, fedbe"]),
    (["--set", "fedgkt.server_epoch=2"], ["[fedgkt]", "'server_epoch'", "did you mean server_epochs?", "edge_epochs, "]),
    (["--set", "server.round_deadline=60"], ["--set server.round_deadline", "did you mean round_deadline_s?",
                                             "keys of [server]: aggregation, "]),
    (["--agents", "0"], ["argument --agents", "must be an integer >= 1, got 0"]),
    (["--rounds", "-1"], ["argument --rounds", "must be an integer >= 1, got -1"]),
    (["--partition", "dirichlet"], ["argument --partition", "dirichlet", "iid | dirichlet:A | step:K | table:FILE"]),
    (["--set", "memry.micro_batch_samples=16"], ["no table [memry]", "did you mean memory?", "tables: server, fedgkt, agent, data, memory"]),
    (["--set", "memory.micro_batch_sample=16"], ["unknown [memory] keys", "did you mean micro_batch_samples?", "keys of [memory]: "]),
    (["--set", "memory.micro_batch_samples=1"], ["memory.micro_batch_samples must be 0 (off) or >= 2"]),
    (["--set", "data.partition=step"], ["--set data.partition step", "iid | dirichlet:A | step:K | table:FILE"]),
    (["--method", "fedavg", "--model", "simplecn"], ["--model", "did you mean simplecnn?", "resnet56 | resnet8"]),
    (["--method", "fedkd", "--codec", "raw"], ["--codec does not apply to --method fedkd"]),
    (["--dataset", "fashion-mnst"], ["argument --dataset", "did you mean fashion-mnist?"]),
    (["--partition", "table:no-such-counts.csv"], ["argument --partition", "no-such-counts.csv: no such file"]),
    (["--audit-steps", "3"], ["--audit-steps needs --audit"]),
    (["--method", "fedkd", "--backend", "ort"], ["--backend ort: --method fedkd has no ort edge step", "methods with one: fedgkt"]),
])
def test_a_mistake_stops_edgesplit_local_before_anything_starts(argv: list[str], expected: list[str], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = _run_local(["--agents", "2", "--rounds", "1", "--dataset", "synthetic", *argv], tmp_path, capsys, monkeypatch)
    assert code == EXIT_CONFIG, err
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"


def test_a_mistake_as_typed_in_a_shell_announces_nothing(tmp_path: Path) -> None:
    """The issue's first command as a user runs it: no broker line, no run, exit code 2."""
    result = subprocess.run([sys.executable, "-m", "cloud_server.launcher", "local", "--method", "fedgtk",
                             "--out", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_CONFIG and result.stdout == ""
    assert "did you mean fedgkt?" in result.stderr and not (tmp_path / "run").exists()


def test_memory_is_a_table_set_reaches_on_every_agent(tmp_path: Path) -> None:
    args = build_parser().parse_args(["local", "--agents", "2", "--dataset", "synthetic",
                                      "--set", "memory.micro_batch_samples=16", "--set", "memory.shard_on_disk=true"])
    server_path, agent_paths = write_configs(args, "mem", tmp_path, "mqtt://127.0.0.1:1883")
    assert "memory" not in read_toml(server_path)
    for path in agent_paths:
        memory = EdgeConfig.from_dict(read_toml(path)).memory
        assert memory.micro_batch_samples == 16 and memory.shard_on_disk
    plain = build_parser().parse_args(["local", "--agents", "1", "--dataset", "synthetic"])
    assert "memory" not in read_toml(write_configs(plain, "plain", tmp_path / "plain", "mqtt://127.0.0.1:1883")[1][0])


def test_a_good_command_passes_the_checks(tmp_path: Path) -> None:
    from cloud_server.local_checks import check_generated_configs, check_local_args

    args = build_parser().parse_args(["local", "--method", "fedavg", "--model", "simplecnn", "--agents", "2", "--dataset",
                                      "synthetic", "--set", "memory.micro_batch_samples=16",
                                      "--set", "server.round_deadline_s=60"])
    check_local_args(args)
    check_generated_configs(args, "ok", tmp_path / "run", None)
    assert not (tmp_path / "run").exists()


def test_every_flag_has_help_and_shows_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    local = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["local"]
    for action in local._actions:
        assert action.help, f"{action.option_strings} has no help"
    with pytest.raises(SystemExit):
        main(["local", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--agents AGENTS agents, each its own process (default: 4)", "(default: 8)", "(default: fashion-mnist)",
                  "(default: 0)", "evaluate every N rounds (and the last) (default: 1)", "(default: dirichlet:0.5)"):
        assert shown in text, shown
    # --model lists every registered model fed images, from the registry: simplecnn too.
    options = text[text.index("options:"):]
    model_help = options[options.index("--model MODEL"):options.index("--edge-epochs")]
    from models import get_model_spec, list_models

    for name in list_models():
        assert (name in model_help) == (get_model_spec(name).input_kind == "image"), name


def test_the_three_programs_say_their_version(capsys: pytest.CaptureFixture[str]) -> None:
    from cloud_server.cli import build_parser as server_parser
    from edge_agent.cli import build_parser as agent_parser
    from shared_protocol.version import package_version

    version = package_version()
    assert version and version != "unknown"
    for parser, prog in ((launcher.build_parser(), "edgesplit"), (server_parser(), "cloud-server"), (agent_parser(), "edge-agent")):
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args(["--version"])
        assert stopped.value.code == 0 and capsys.readouterr().out.strip() == f"{prog} {version}"


def test_the_version_without_an_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from shared_protocol import version

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version.metadata, "version", missing)
    stated = read_toml(ROOT / "pyproject.toml")["project"]["version"]
    assert version.package_version().startswith(f"{stated} (not installed")


def test_the_servers_and_the_agents_config_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cloud_server.cli import main as server_main
    from edge_agent.cli import main as agent_main

    assert server_main(["run", "--config", str(tmp_path / "missing.toml")]) == EXIT_CONFIG
    assert "missing.toml" in capsys.readouterr().err
    server = tmp_path / "server.toml"
    server.write_text('[server]\nround_deadline = 60\n')
    assert server_main(["run", "--config", str(server)]) == EXIT_CONFIG
    assert "did you mean round_deadline_s?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        server_main(["run", "--config", str(server), "--rounds", "-1"])
    assert stopped.value.code == EXIT_CONFIG and "argument --rounds" in capsys.readouterr().err
    agent = tmp_path / "agent.toml"
    agent.write_text('[agent]\nagent_id = "a"\n[data]\npartion = "iid"\n')  # an unknown [data] key was a TypeError
    assert agent_main(["run", "--config", str(agent)]) == EXIT_CONFIG
    assert "did you mean partition?" in capsys.readouterr().err
    # `edge-agent check`, which edgesplit local asks of its agents' config: the same code and message.
    assert agent_main(["check", "--config", str(agent)]) == EXIT_CONFIG
    assert "did you mean partition?" in capsys.readouterr().err
    agent.write_text('[agent]\nagent_id = "a"\n[data]\npartition = "iid"\n')
    assert agent_main(["check", "--config", str(agent)]) == 0
