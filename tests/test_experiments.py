"""Experiments as data: every experiment file parses and expands with every name resolved in
the registry, a new method joins a ``"*"`` grid with no edit, bad files fail naming the key and
the fix, the runner resumes, the result schema holds, claims evaluate, and one small
experiment runs end to end over a real broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from cloud_server.experiments import runner as runner_module
from cloud_server.experiments.results import (RUN_FIGURES, ResultsError, leakage_figures, load_results, run_figures,
                                              validate_results)
from cloud_server.experiments.runner import CellOutcome, SubprocessExecutor, cell_command, run_experiment
from cloud_server.experiments.experiment_file import load_experiment
from cloud_server.experiments.spec import CENTRALIZED, UNION, Claim, ExperimentError, Scale
from cloud_server.experiments.tables import (claims_md, claims_summary_md, curves, curves_md, evaluate_claims, long_table, pivot_md, plot,
                                             render, summary, summary_md, unattacked_md)
from shared_protocol import registry
from shared_protocol.registry import MethodSpec, registered_methods

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((ROOT / "bench" / "experiments").glob("*.toml"))

SMALL = """
name = "{name}"
question = "Does the runner resume?"
methods = ["{method}"]
partitions = ["iid"]
seeds = [0, 1, 2]

[scale]
agents = 2
rounds = {rounds}
"""


def write_experiment(directory: Path, text: str, name: str = "small") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.toml"
    path.write_text(text)
    return path


def small(tmp_path: Path, rounds: int = 1, method: str = "fedgkt") -> Path:
    return write_experiment(tmp_path / "experiments", SMALL.format(name="small", method=method, rounds=rounds))


# -- every file of bench/experiments ------------------------------------------------------------ #


def test_there_are_experiment_files() -> None:
    assert {p.stem for p in EXPERIMENTS} >= {"leakage", "smoke"}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_experiment_file_parses_expands_and_resolves(path: Path) -> None:
    from cloud_server.launcher import build_parser

    experiment = load_experiment(path)
    cells = experiment.cells()
    assert cells and len({c.key for c in cells}) == len(cells)
    methods = registered_methods()
    parser = build_parser()
    for cell in cells:
        # The cell's command is one the launcher takes: every scale flag and method flag exists.
        args = parser.parse_args([*cell.command_args(experiment.scale), "--out", "unused"])
        assert args.seed == cell.seed
        if cell.method == CENTRALIZED:
            assert args.model == cell.variant and cell.partition == UNION and cell.variant in experiment.centralized.models
            continue
        assert cell.method in methods
        assert args.method == cell.method and args.partition == cell.partition


def test_the_example_of_the_docs_is_a_valid_experiment(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "experiments.md").read_text()
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    experiment = load_experiment(write_experiment(tmp_path, example, name="leakage"))
    keys = [c.key for c in experiment.cells()]
    assert "fedgkt-u8-dirichlet0.5-s0" in keys and "fedavg-dirichlet0.5-s1" in keys and experiment.claims


def test_every_scale_key_is_an_edgesplit_local_flag() -> None:
    from cloud_server.launcher import build_parser

    scale = Scale(data_root="/data", chunk_size=4096)
    args = build_parser().parse_args(["local", *scale.local_args()])
    assert args.data_root == "/data" and args.chunk_size == 4096 and args.agents == scale.agents


def test_the_leakage_experiment_is_every_method_on_make_demos_data_and_agents() -> None:
    experiment = load_experiment(ROOT / "bench" / "experiments" / "leakage.toml")
    assert experiment.method_names() == tuple(registered_methods())
    assert len(experiment.seeds) >= 2 and experiment.audit is not None
    # The same agents and data as `make demo` (fewer rounds: the audit reads the first round's uploads).
    demo = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "edgesplit local" in line and "demo" in line)
    flags = dict(zip(demo.split()[1::1], demo.split()[2::1]))
    scale = experiment.scale
    assert (str(scale.agents), str(scale.train_samples), str(scale.test_samples), scale.dataset) == (
        flags["--agents"], flags["--train-samples"], flags["--test-samples"], flags["--dataset"])
    assert list(experiment.partitions) == [flags["--partition"]]


def test_a_new_method_joins_a_star_grid_with_no_edit(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = MethodSpec(name="throwaway", summary="a method registered by this test only", server="throwaway.server",
                      edge="throwaway.edge")
    monkeypatch.setitem(registry._METHODS, "throwaway", spec)
    keys = [c.key for c in load_experiment(ROOT / "bench" / "experiments" / "leakage.toml").cells()]
    assert "throwaway-dirichlet0.5-s0" in keys and "throwaway-dirichlet0.5-s1" in keys
    for source in [*(ROOT / "bench").rglob("*"), *(ROOT / "cloud_server" / "experiments").rglob("*.py")]:
        if source.is_file() and source.suffix in (".py", ".toml", ".md"):
            assert "throwaway" not in source.read_text(errors="replace"), source


# -- bad files ---------------------------------------------------------------------------------- #


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t.replace('methods = ["fedgkt"]', 'methods = ["fedgktt"]'), ["methods", "'fedgktt'", "fedavg", "fedgkt"]),
    (lambda t: 'colour = "blue"\n' + t, ["unknown key 'colour'", "question"]),
    (lambda t: t.replace("agents = 2", "agents = 2\nagentz = 3"), ["scale: unknown key 'agentz'", "train_samples"]),
    (lambda t: t.replace('partitions = ["iid"]', 'partitions = ["dirichlet:lots"]'), ["partitions", "dirichlet:ALPHA"]),
    (lambda t: t.replace("seeds = [0, 1, 2]", "seeds = []"), ["seeds is empty", "at least one"]),
    (lambda t: t + '[variants.only-fedavg]\nmethods = ["fedavg"]\n', ["variants.only-fedavg.methods", "'fedavg'"]),
    (lambda t: t.replace('name = "small"', 'name = "other"'), ["name is 'other'", "small.toml", "make them agree"]),
    (lambda t: t + '[method.fedgkt]\nflags = { model = "resnet8" }\n', ["method.fedgkt", "no method flag 'model'", "server_model"]),
    (lambda t: t + '[method.fedgkt]\nflags = { server_epochs = "two" }\n', ["flags.server_epochs", "int"]),
    (lambda t: t + '[set]\n"nowhere.key" = 1\n', ["set nowhere.key", "no table 'nowhere'", "server"]),
    (lambda t: t + '[[claims]]\ntext = "x"\nmethod = "fedgkt"\nfigure = "final_accuracy"\nop = "=="\nvalue = 1\n',
     ["claims: op", ">="]),
    (lambda t: t + '[[claims]]\ntext = "x"\nmethod = "fedgkt"\nfigure = "accuracy"\nop = ">="\nvalue = 1\n',
     ["claims: no figure 'accuracy'", "final_accuracy"]),
])
def test_a_bad_file_names_the_file_the_key_and_the_fix(tmp_path: Path, edit: Any, expected: list[str]) -> None:
    path = write_experiment(tmp_path, edit(SMALL.format(name="small", method="fedgkt", rounds=1)))
    with pytest.raises(ExperimentError) as caught:
        load_experiment(path)
    message = str(caught.value)
    assert message.startswith(str(path))
    for text in expected:
        assert text in message


def test_a_grid_no_variant_applies_to_is_empty(tmp_path: Path) -> None:
    text = SMALL.format(name="small", method="fedgkt", rounds=1).replace(
        'methods = ["fedgkt"]', 'methods = ["fedgkt", "fedavg"]') + '[variants.v]\nmethods = ["fedavg"]\n'
    experiment = load_experiment(write_experiment(tmp_path, text))
    assert [c.key for c in experiment.cells()] == ["fedavg-v-iid-s0", "fedavg-v-iid-s1", "fedavg-v-iid-s2"]


def test_overrides_layer_every_run_then_method_then_variant(tmp_path: Path) -> None:
    text = SMALL.format(name="small", method="fedgkt", rounds=1).replace('methods = ["fedgkt"]', 'methods = ["fedgkt", "fedavg"]') + """
[flags]
edge_epochs = 2
[set]
"server.round_deadline_s" = 60
"fedgkt.server_epochs" = 3
[method.fedavg]
flags = { model = "resnet8" }
[variants.default]
[variants.long]
set = { server = { round_deadline_s = 120 } }
"""
    cells = {c.key: c for c in load_experiment(write_experiment(tmp_path, text)).cells()}
    fedavg, fedgkt_long = cells["fedavg-iid-s0"], cells["fedgkt-long-iid-s0"]
    assert dict(fedavg.overrides.flags) == {"edge_epochs": 2, "model": "resnet8"}
    assert dict(fedavg.overrides.settings) == {"server.round_deadline_s": 60}  # fedgkt's table is not fedavg's
    assert dict(fedgkt_long.overrides.settings) == {"server.round_deadline_s": 120, "fedgkt.server_epochs": 3}
    args = fedgkt_long.local_args(Scale())
    assert "--set" in args and "server.round_deadline_s=120" in args and "--model" not in args


def test_a_variant_makes_an_agent_faulty_with_the_launchers_flag(tmp_path: Path) -> None:
    """``faulty_agents`` (every run, a method's, a variant's) becomes ``--faulty-agent``, the
    variant's fault replacing an earlier one for the same agent; a bad entry or an agent outside
    the run fails naming the key, as the launcher would."""
    text = SMALL.format(name="small", method="fedavg", rounds=1).replace(
        "seeds = [0, 1, 2]", 'seeds = [0, 1, 2]\nfaulty_agents = ["0:random_labels"]') + """
[variants.default]
[variants.flip]
faulty_agents = ["1:sign_flip:4", "0:nan"]
"""
    cells = {c.key: c for c in load_experiment(write_experiment(tmp_path, text)).cells()}
    assert cells["fedavg-iid-s0"].overrides.faulty_agents == ("0:random_labels",)
    args = cells["fedavg-flip-iid-s0"].local_args(Scale(agents=2))
    assert [args[i + 1] for i, a in enumerate(args) if a == "--faulty-agent"] == ["0:nan", "1:sign_flip:4"]
    assert "--faulty-agent" not in load_experiment(small(tmp_path / "plain", method="fedavg")).cells()[0].local_args(Scale())
    for bad, said in (('faulty_agents = ["2:sign_flip"]', "no agent 2 in a run of scale.agents = 2"),
                      ('faulty_agents = ["1:bogus"]', "unknown fault 'bogus'; faults: sign_flip, scale, random_labels, nan"),
                      ('faulty_agents = "1:nan"', "faulty_agents is a list")):
        path = write_experiment(tmp_path / "bad", SMALL.format(name="small", method="fedavg", rounds=1)
                                + f"[variants.v]\n{bad}\n")
        with pytest.raises(ExperimentError, match=said.replace("(", r"\(")):
            load_experiment(path)


# -- the runner --------------------------------------------------------------------------------- #


FIGURES = {k: None for k in RUN_FIGURES} | {"final_accuracy": 0.5, "edge_train_gflops": 1.0, "train_up_wire_bytes": 1000}


class FakeExecutor:
    """Records the cells it is asked to run; fails those named in ``fail``."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.fail = fail
        self.ran: list[str] = []

    def __call__(self, experiment: Any, cell: Any, run_dir: Path) -> CellOutcome:
        self.ran.append(cell.key)
        if cell.key in self.fail:
            return CellOutcome("failed", error="it broke")
        return CellOutcome("done", run={**FIGURES, "final_accuracy": 0.5 + 0.1 * cell.seed})

    def audit(self, experiment: Any, run_dir: Path) -> CellOutcome:
        self.ran.append(f"audit {run_dir.name}")
        if run_dir.name in self.fail:
            return CellOutcome("failed", error="the audit broke")
        scores = {"psnr_db": 40.0, "ssim": 0.9, "baseline_psnr_db": 12.0, "baseline_ssim": 0.2}
        return CellOutcome("done", leakage={"attacks": {"white_box_inversion": {"agent": "agent-0", **scores}},
                                            "strongest": {"attack": "white_box_inversion", **scores}, "not_supported": None})


def test_the_runner_skips_done_cells_and_reruns_failed_ones(tmp_path: Path) -> None:
    path = small(tmp_path)
    results, runs = tmp_path / "results" / "small.json", tmp_path / "runs"
    lines: list[str] = []
    first = FakeExecutor(fail=("fedgkt-iid-s1",))
    run_experiment(load_experiment(path), results_path=results, runs_dir=runs, executor=first, progress=lines.append)
    assert first.ran == ["fedgkt-iid-s0", "fedgkt-iid-s1", "fedgkt-iid-s2"]
    doc = load_results(results)
    assert [c["status"] for c in doc["cells"]] == ["done", "failed", "done"]
    assert any("[2/3] fedgkt-iid-s1: FAILED: it broke" in line for line in lines)
    assert any(line.startswith("[1/3] fedgkt-iid-s0: running (2 left") for line in lines)

    again = FakeExecutor()
    run_experiment(load_experiment(path), results_path=results, runs_dir=runs, executor=again, progress=lines.append)
    assert again.ran == ["fedgkt-iid-s1"]  # the done cells are skipped, the failed one runs again
    assert [c["status"] for c in load_results(results)["cells"]] == ["done", "done", "done"]

    nothing = FakeExecutor()
    run_experiment(load_experiment(path), results_path=results, runs_dir=runs, executor=nothing, progress=lines.append)
    assert nothing.ran == []

    # A cell whose command changed (here the scale) is not the cell recorded: it runs again.
    changed = small(tmp_path, rounds=2)
    rerun = FakeExecutor()
    run_experiment(load_experiment(changed), results_path=results, runs_dir=runs, executor=rerun, only="*-s2",
                   progress=lines.append)
    assert rerun.ran == ["fedgkt-iid-s2"]


def test_reaudit_audits_the_done_cells_again_on_what_their_runs_kept(tmp_path: Path) -> None:
    path = write_experiment(tmp_path / "experiments", SMALL.format(name="small", method="fedgkt", rounds=1))
    path.write_text(path.read_text().replace('seeds = [0, 1, 2]\n', 'seeds = [0, 1, 2]\naudit = true\n'))
    results, runs = tmp_path / "results" / "small.json", tmp_path / "runs"
    run_experiment(load_experiment(path), results_path=results, runs_dir=runs, executor=FakeExecutor(), progress=lambda _: None)
    assert [c["leakage"] for c in load_results(results)["cells"]] == [None, None, None]
    for key in ("fedgkt-iid-s0", "fedgkt-iid-s1"):  # s2's run directory is gone
        (runs / key / "audit").mkdir(parents=True)
        (runs / key / "audit" / "kept.json").write_text("{}")
    lines: list[str] = []
    again = FakeExecutor(fail=("fedgkt-iid-s1",))
    run_experiment(load_experiment(path), results_path=results, runs_dir=runs, executor=again, reaudit=True,
                   progress=lines.append)
    assert again.ran == ["audit fedgkt-iid-s0", "audit fedgkt-iid-s1"]  # nothing trained again
    cells = load_results(results)["cells"]
    assert cells[0]["leakage"]["strongest"]["psnr_db"] == 40.0 and cells[0]["run"]["final_accuracy"] == 0.5
    assert cells[1]["leakage"] is None and cells[2]["leakage"] is None  # a failed audit and a lost run keep theirs
    assert any("fedgkt-iid-s1: the audit failed" in line for line in lines)
    assert any("fedgkt-iid-s2: not audited again" in line for line in lines)
    with pytest.raises(ExperimentError, match="--reaudit needs an experiment that audits"):
        run_experiment(load_experiment(small(tmp_path / "plain")), results_path=tmp_path / "p.json", runs_dir=runs,
                       executor=FakeExecutor(), reaudit=True, progress=lambda _: None)


def test_recollect_reads_the_done_cells_figures_again_from_their_reports(tmp_path: Path) -> None:
    path = small(tmp_path)
    results, runs = tmp_path / "results" / "small.json", tmp_path / "runs"
    run_experiment(load_experiment(path), results_path=results, runs_dir=runs, executor=FakeExecutor(), progress=lambda _: None)
    (runs / "fedgkt-iid-s0").mkdir(parents=True)
    (runs / "fedgkt-iid-s0" / "report.json").write_text(json.dumps({
        "totals": {"final_accuracy": 0.9, "edge_train_flops": 4e9, "rounds_completed": 1}, "agents": {"a": {}, "b": {}},
        "config": {"rounds": 1}, "defences": {"epsilon_per_image": 3.5}}))
    again = FakeExecutor()
    run_experiment(load_experiment(path), results_path=results, runs_dir=runs, executor=again, recollect=True,
                   progress=lambda _: None)
    assert again.ran == []  # nothing ran
    cells = load_results(results)["cells"]
    assert cells[0]["run"]["final_accuracy"] == 0.9 and cells[0]["run"]["activation_epsilon_per_image"] == 3.5
    assert cells[0]["run"]["edge_train_gflops_per_agent"] == 2.0
    assert cells[1]["run"]["final_accuracy"] == 0.6  # its run directory holds no report: its figures stay


def test_a_dry_run_runs_nothing_and_only_picks_cells_by_glob(tmp_path: Path) -> None:
    lines: list[str] = []
    fake = FakeExecutor()
    run_experiment(load_experiment(small(tmp_path)), results_path=tmp_path / "r.json", runs_dir=tmp_path, only="*-s[01]",
                   dry_run=True, executor=fake, progress=lines.append)
    assert fake.ran == [] and not (tmp_path / "r.json").exists()
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["fedgkt-iid-s0", "fedgkt-iid-s1"]
    with pytest.raises(ExperimentError, match="matches no cell; cells: fedgkt-iid-s0"):
        run_experiment(load_experiment(small(tmp_path)), results_path=tmp_path / "r.json", runs_dir=tmp_path, only="fedavg-*",
                       executor=fake)


def test_a_run_past_its_budget_is_stopped_with_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module, "STOP_GRACE_S", 1.0)
    pids = tmp_path / "pids"
    # A parent and a child that both ignore Ctrl-C and SIGTERM, as a hung run might: the kill after the grace.
    ignore = "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    script = (f"import os, signal, subprocess, sys, time; {ignore}; "
              f"child = subprocess.Popen([sys.executable, '-c', 'import signal, time; {ignore}; time.sleep(60)']); "
              f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); print('started', flush=True); time.sleep(60)")
    started = time.monotonic()
    code, tail = runner_module._run_bounded([sys.executable, "-c", script], tmp_path / "log", 4.0, dict(os.environ))
    assert code is None and "started" in tail and time.monotonic() - started < 20
    for pid in map(int, pids.read_text().split()):
        deadline = time.monotonic() + 10
        while True:  # gone, or killed and not yet reaped by its new parent
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, f"process {pid} outlived its run's budget"
            time.sleep(0.1)


# -- the schema, the figures, the tables -------------------------------------------------------- #


def test_the_demo_experiment_is_make_demos_command() -> None:
    experiment = load_experiment(ROOT / "bench" / "experiments" / "demo.toml")
    demo = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "edgesplit local" in line and "demo" in line)
    words = demo.split()
    flags = {k: v for k, v in zip(words, words[1:]) if k.startswith("--")}
    cell = next(c for c in experiment.cells() if c.variant == "default")
    # The cell's command is make demo's, the run id and output directory apart; every other flag is the launcher's default.
    args = experiment.scale.local_args() + ["--method", cell.method, "--partition", cell.partition]
    given = {k: v for k, v in zip(args, args[1:]) if k.startswith("--")}
    for flag, value in flags.items():
        if flag not in ("--run-id", "--out"):
            assert given.get(flag) == value, f"{flag}: make demo says {value}, the experiment {given.get(flag)}"
    assert not cell.overrides.settings and not cell.overrides.flags and cell.seed == 0
    assert {c.variant for c in experiment.cells()} == {"default", "no-reuse"}


def test_a_variant_can_run_only_some_seeds(tmp_path: Path) -> None:
    text = SMALL.format(name="small", method="fedgkt", rounds=1) + "\n[variants.default]\n\n[variants.once]\nseeds = [1]\n"
    experiment = load_experiment(write_experiment(tmp_path, text))
    assert [c.key for c in experiment.cells()] == ["fedgkt-iid-s0", "fedgkt-iid-s1", "fedgkt-iid-s2", "fedgkt-once-iid-s1"]
    with pytest.raises(ExperimentError, match="variants.bad.seeds"):
        load_experiment(write_experiment(tmp_path, SMALL.format(name="small", method="fedgkt", rounds=1)
                                         + '\n[variants.bad]\nseeds = "0"\n'))


def test_a_variant_can_run_only_some_partitions(tmp_path: Path) -> None:
    text = SMALL.format(name="small", method="fedgkt", rounds=1).replace(
        'partitions = ["iid"]', 'partitions = ["iid", "dirichlet:0.5"]').replace("seeds = [0, 1, 2]", "seeds = [0]")
    experiment = load_experiment(write_experiment(tmp_path, text + "\n[variants.default]\n\n[variants.skewed]\n"
                                                  'partitions = ["dirichlet:0.5"]\n'))
    assert [c.key for c in experiment.cells()] == ["fedgkt-iid-s0", "fedgkt-dirichlet0.5-s0", "fedgkt-skewed-dirichlet0.5-s0"]
    with pytest.raises(ExperimentError, match="variants.bad.partitions: 'dirichlet:0.1' is not a partition of this grid"):
        load_experiment(write_experiment(tmp_path, text + '\n[variants.bad]\npartitions = ["dirichlet:0.1"]\n'))


CENTRAL = """
[centralized]
models = ["resnet8"]
set = { "centralized.batch_size" = 16 }
"""


def test_reference_cells_train_each_model_on_the_union_with_edgesplit_centralized(tmp_path: Path) -> None:
    from cloud_server.launcher import build_parser

    text = SMALL.format(name="small", method="fedgkt", rounds=2).replace("seeds = [0, 1, 2]", "seeds = [0, 1]") + CENTRAL
    experiment = load_experiment(write_experiment(tmp_path, text))
    keys = [c.key for c in experiment.cells()]
    assert keys == ["fedgkt-iid-s0", "fedgkt-iid-s1", "centralized-resnet8-union-s0", "centralized-resnet8-union-s1"]
    reference = experiment.cells()[2]
    command = cell_command(experiment, reference)
    assert command[:6] == ["edgesplit", "centralized", "--model", "resnet8", "--seed", "0"]
    assert "--agents" not in command and "--partition" not in command  # the union of the agents' data
    args = build_parser().parse_args([*command[1:], "--out", "unused"])
    assert (args.rounds, args.train_samples, args.test_samples, args.dataset) == (2, 4000, 1000, "fashion-mnist")
    assert args.set == ["centralized.batch_size=16"]
    # A claim may name the reference cells; a reference model or table that cannot be is refused, naming the key.
    load_experiment(write_experiment(tmp_path, text + '[[claims]]\ntext = "x"\nmethod = "centralized"\nfigure = "final_accuracy"\n'
                                     'op = ">="\nvalue = 0.5\n'))
    for bad, expected in (('models = ["resnet 8"]', "centralized.models"), ('models = "resnet8"', "centralized: models is a list"),
                          ('set = { "fedavg.lr" = 0.1 }', "centralized.set: fedavg.lr"), ('colour = 1', "centralized: unknown key 'colour'")):
        broken = text.replace('models = ["resnet8"]', bad) if bad.startswith("models") else text.replace(
            'set = { "centralized.batch_size" = 16 }', bad)
        with pytest.raises(ExperimentError, match=expected):
            load_experiment(write_experiment(tmp_path, broken))


def test_a_reference_cell_runs_centralized_with_no_broker_and_no_audit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = SMALL.format(name="small", method="fedgkt", rounds=1).replace("seeds = [0, 1, 2]", "seeds = [0]\naudit = true") + CENTRAL
    experiment = load_experiment(write_experiment(tmp_path, text))
    ran: list[list[str]] = []

    def fake_run(argv: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> tuple[int, str]:
        ran.append(argv)
        if argv[3] == "audit":
            return 1, "not audited in this test"
        report = {"totals": {"final_accuracy": 0.5, "edge_train_flops": 0}, "rounds": []}
        (Path(argv[argv.index("--out") + 1]) / "report.json").write_text(json.dumps(report))
        return 0, ""

    monkeypatch.setattr(runner_module, "_run_bounded", fake_run)
    reference = experiment.cells()[-1]
    outcome = SubprocessExecutor(broker="mqtt://127.0.0.1:1")(experiment, reference, tmp_path / "run")
    assert outcome.status == "done" and outcome.leakage is None and outcome.run["final_accuracy"] == 0.5
    (argv,) = ran  # no audit after it
    assert argv[3:5] == ["centralized", "--model"] and "--broker" not in argv and "server.audit=true" not in argv
    # The positive control: the experiment's federated cell gets the broker, keeps what the audit reads, and is audited.
    federated = experiment.cells()[0]
    SubprocessExecutor(broker="mqtt://127.0.0.1:1")(experiment, federated, tmp_path / "fed")
    assert ran[1][3] == "local" and "--broker" in ran[1] and "server.audit=true" in ran[1] and ran[2][3] == "audit"


def test_run_figures_say_where_each_rounds_time_and_upload_bytes_go() -> None:
    def round_(n: int, up: int, train: float, evaluator: float | None, hook: float) -> dict[str, Any]:
        evaluation = None if evaluator is None else {"server_eval_s": evaluator}
        return {"round": n, "bytes": {"up_wire": up}, "time_s": {"round": train + 5.0, "server_train": train},
                "server_hooks_s": {"evaluation": hook}, "evaluation": evaluation}

    report = {"totals": {"edge_train_flops": 0}, "config": {"rounds": 3},
              "rounds": [round_(1, 1000, 10.0, 2.0, 1.0), round_(2, 40, 12.0, None, 0.0), round_(3, 60, 14.0, 3.0, 2.0)]}
    figures = run_figures(report)
    assert figures["server_train_s_per_round"] == pytest.approx(12.0)
    # Only the evaluated rounds, the evaluator's scoring and the method's hook together.
    assert figures["server_eval_s_per_round"] == pytest.approx(4.0)
    assert figures["server_eval_over_train"] == pytest.approx(4.0 / 12.0)
    assert figures["round_s_per_round"] == pytest.approx(17.0)
    assert (figures["up_wire_bytes_first_round"], figures["up_wire_bytes_per_later_round"]) == (1000, 50.0)
    assert figures["later_over_first_round_up"] == pytest.approx(0.05)
    empty = run_figures({"totals": {"edge_train_flops": 0}, "rounds": []})
    assert empty["server_eval_over_train"] is None and empty["up_wire_bytes_first_round"] is None
    assert figures["agents_warned_against_peers"] is None  # no update's direction judged
    report["config"].update(aggregation="mean", validation_samples=0)
    for record in report["rounds"]:
        record["robustness"] = {"update_directions": {"agents": {"a": 0.9, "b": 0.9, "flipped": -0.95}}}
    assert run_figures(report)["agents_warned_against_peers"] == 1
    report["config"]["aggregation"] = "median"
    assert run_figures(report)["agents_warned_against_peers"] == 0
    results = good_results()
    results["cells"][0]["run"].update(figures)
    validate_results(results)
    timing = render("{{timing}}", results, [], Path("unused.md"))
    assert "Server evaluation s / round" in timing and "| 4.0 |" in timing and "0.33" in timing


def test_the_agents_idle_share_is_waiting_over_waiting_plus_working_mean_over_agents() -> None:
    def round_(costs: dict[str, tuple[float, float]]) -> dict[str, Any]:
        return {"per_agent": {a: {"idle_s": idle, "round_s": busy} for a, (idle, busy) in costs.items()}}

    # agent-0 waits 9 s of 10 over its two rounds, agent-1 never waits: 0.45.
    report = {"totals": {"edge_train_flops": 0}, "rounds": [round_({"agent-0": (4.0, 0.5), "agent-1": (0.0, 3.0)}),
                                                             round_({"agent-0": (5.0, 0.5), "agent-1": (0.0, 3.0)})]}
    assert run_figures(report)["agent_idle_share"] == pytest.approx(0.45)
    assert run_figures({"totals": {"edge_train_flops": 0}, "rounds": [round_({})]})["agent_idle_share"] is None
    results = good_results()
    results["cells"][0]["run"]["agent_idle_share"] = 0.45
    validate_results(results)
    assert "Agents idle %" in render("{{timing}}", results, [], Path("unused.md"))


def good_results() -> dict[str, Any]:
    def cell(method: str, seed: int, accuracy: float, psnr: float | None) -> dict[str, Any]:
        leakage = None if psnr is None else {
            "attacks": {"white_box": {"agent": "agent-0", "psnr_db": psnr, "ssim": 0.5, "baseline_psnr_db": 10.0, "baseline_ssim": 0.1},
                        "labels_in_the_clear": {"agent": "agent-1", "histogram_error": 0.0}},
            "strongest": {"attack": "white_box", "psnr_db": psnr, "ssim": 0.5, "baseline_psnr_db": 10.0, "baseline_ssim": 0.1},
            "not_supported": None}
        return {"key": f"{method}-iid-s{seed}", "method": method, "partition": "iid", "seed": seed, "variant": "default",
                "overrides": {"flags": {}, "settings": {}}, "command": [], "status": "done", "wall_s": 10.0, "error": None,
                "run": {**FIGURES, "final_accuracy": accuracy}, "leakage": leakage}

    return {"schema": 1, "experiment": {"name": "hand", "question": "?"},
            "machine": {"cpu_model": "x", "cores": 2, "torch": "2", "python": "3.11"},
            "cells": [cell("fedgkt", 0, 0.70, 20.0), cell("fedgkt", 1, 0.80, 22.0), cell("fedavg", 0, 0.60, None)]}


def test_the_validator_accepts_good_results_and_rejects_broken_ones() -> None:
    validate_results(good_results())
    breakages = [
        (lambda d: d.pop("machine"), "machine"),
        (lambda d: d.update(schema=2), "schema: expected 1"),
        (lambda d: d["cells"][0].pop("run"), "missing run"),
        (lambda d: d["cells"][0]["run"].update(final_accuracy=78.9), "fraction in [0, 1]"),
        (lambda d: d["cells"][0]["run"].pop("train_up_wire_bytes"), "missing train_up_wire_bytes"),
        (lambda d: d["cells"][0].update(status="ok"), "status"),
        (lambda d: d["cells"][0].update(run=None), "a done cell has its run's figures"),
        (lambda d: d["cells"][1].update(key=d["cells"][0]["key"]), "recorded twice"),
        (lambda d: d["cells"][0]["leakage"]["strongest"].update(attack="nothing"), "leakage.strongest"),
        (lambda d: d["cells"][0]["leakage"]["attacks"]["white_box"].pop("ssim"), "leakage.attacks.white_box"),
    ]
    for breakage, expected in breakages:
        doc = good_results()
        breakage(doc)
        with pytest.raises(ResultsError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            validate_results(doc)


def test_every_committed_results_file_of_the_schema_is_valid() -> None:
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and "cells" in doc and "schema" in doc:
            validate_results(doc, str(path))


def test_the_curves_follow_each_group_round_by_round(tmp_path: Path) -> None:
    results = good_results()
    for cell, accuracy in zip(results["cells"], ([0.4, 0.7], [0.6, 0.8], [0.3, 0.6])):
        cell["run"].update(accuracy_by_round=accuracy, edge_train_gflops_by_round=[2.0, 2.0],
                           train_wire_bytes_by_round=[1e6, None] if cell["method"] == "fedavg" else [1e6, 3e6])
    validate_results(results)
    points = curves(long_table(results))
    gkt = [p for p in points if p["method"] == "fedgkt"]
    assert [p["round"] for p in gkt] == [1, 2]
    assert gkt[1]["accuracy"]["mean"] == pytest.approx(0.75) and gkt[1]["accuracy"]["sd"] == pytest.approx(0.0707, abs=1e-4)
    assert gkt[1]["edge_train_gflops_so_far"] == pytest.approx(4.0) and gkt[1]["train_wire_bytes_so_far"] == pytest.approx(4e6)
    avg = [p for p in points if p["method"] == "fedavg"]
    assert avg[0]["train_wire_bytes_so_far"] == 1e6 and avg[1]["train_wire_bytes_so_far"] is None  # unmeasured: no sum
    md = curves_md(points)
    assert "| `fedgkt` | iid | 2 | 75.0 ± 7.1 | 4 | 4.0 |" in md and "| `fedavg` | iid | 2 | 60.0 | 4 | — |" in md
    text = render("{{curves}}", results, [], tmp_path / "page.md")
    assert text.startswith("![hand by round](page-curves.png)") and (tmp_path / "page-curves.png").stat().st_size > 0
    results["cells"][0]["run"]["accuracy_by_round"] = 0.7
    with pytest.raises(ResultsError, match="one per round, for accuracy_by_round"):
        validate_results(results)


def test_claims_are_met_not_met_or_without_data() -> None:
    groups = summary(long_table(good_results()))
    fedgkt = next(g for g in groups if g["method"] == "fedgkt")
    assert fedgkt["n"] == 2 and fedgkt["final_accuracy"]["mean"] == pytest.approx(0.75)
    assert fedgkt["final_accuracy"]["sd"] == pytest.approx(0.0707, abs=1e-4)
    claims = [Claim("FedGKT reaches 70%", "fedgkt", "final_accuracy", ">=", 0.7),
              Claim("FedGKT reaches 80%", "fedgkt", "final_accuracy", ">=", 0.8, partition="iid"),
              Claim("FedAvg leaks less than 15 dB", "fedavg", "leakage_psnr_db", "<", 15.0),
              Claim("FedAvg on step:2", "fedavg", "final_accuracy", ">", 0.1, partition="step:2")]
    assert [c["met"] for c in evaluate_claims(claims, groups)] == [True, False, None, None]


def test_a_claim_against_a_baseline_is_judged_on_the_per_seed_differences(tmp_path: Path) -> None:
    results = good_results()
    results["cells"].append({**results["cells"][2], "key": "fedavg-iid-s1", "seed": 1, "run": {**FIGURES, "final_accuracy": 0.85}})
    groups = summary(long_table(results))
    # fedgkt 0.70 / 0.80 against fedavg 0.60 / 0.85: differences +0.10 and -0.05, mean +0.025.
    above = Claim("FedGKT above FedAvg", "fedgkt", "final_accuracy", ">", 0.0, baseline="fedavg")
    by_far = Claim("FedGKT 5 points above FedAvg", "fedgkt", "final_accuracy", ">", 0.05, baseline="fedavg")
    elsewhere = Claim("FedGKT above FedAvg's other variant", "fedgkt", "final_accuracy", ">", 0.0, baseline="fedavg",
                      baseline_variant="u8")
    judged = evaluate_claims([above, by_far, elsewhere], groups)
    assert [c["met"] for c in judged] == [True, False, None]
    assert judged[0]["observed"] == [pytest.approx(0.025)] and judged[0]["spread"] == [pytest.approx(0.1061, abs=1e-4)]
    assert "fedgkt final_accuracy - fedavg's > 0" in above.describe()
    # Only the seeds both ran pair: without fedavg's seed 1 the difference is seed 0's alone.
    results["cells"].pop()
    assert evaluate_claims([above], summary(long_table(results)))[0]["observed"] == [pytest.approx(0.10)]
    text = SMALL.format(name="small", method="fedgkt", rounds=1)
    with pytest.raises(ExperimentError, match="claims: baseline 'fedavg' is not in the grid"):
        load_experiment(write_experiment(tmp_path, text + '[[claims]]\ntext = "x"\nmethod = "fedgkt"\nbaseline = "fedavg"\n'
                                         'figure = "final_accuracy"\nop = ">"\nvalue = 0\n'))


def test_a_claim_with_an_alternative_is_judged_seed_by_seed() -> None:
    results = good_results()
    results["cells"].append({**results["cells"][2], "key": "fedavg-iid-s1", "seed": 1, "run": {**FIGURES, "final_accuracy": 0.85}})
    groups = summary(long_table(results))
    # fedgkt 0.70 / 0.80 against fedavg 0.60 / 0.85: seed 0 is 10 points above, seed 1 five below.
    warned = {"figure": "report_warnings", "op": ">=", "value": 1}
    within = Claim("FedGKT within 2 points of FedAvg, or warned", "fedgkt", "final_accuracy", ">=", -0.02, baseline="fedavg",
                   unless=warned)
    assert evaluate_claims([within], groups)[0]["met"] is False  # seed 1: five points below, and no warning
    for row in results["cells"]:
        if row["key"] == "fedgkt-iid-s1":
            row["run"] = {**row["run"], "report_warnings": 1}
    judged = evaluate_claims([within], summary(long_table(results)))[0]
    assert judged["met"] is True and judged["saved_by_unless"] == ["iid, default, seed 1"]
    assert "or report_warnings >= 1, seed by seed" in within.describe() and "(1 by the alternative)" in claims_md([judged])
    # The mean alone would have passed the first run (mean +0.025 >= -0.02): seed by seed is stricter, as meant.
    assert evaluate_claims([Claim("mean", "fedgkt", "final_accuracy", ">=", -0.02, baseline="fedavg")], groups)[0]["met"] is True
    with pytest.raises(ExperimentError, match="unless"):
        Claim("x", "fedgkt", "final_accuracy", ">=", 0.0, unless={"figure": "no_such_figure", "op": ">=", "value": 1})


def test_the_tables_and_the_template(tmp_path: Path) -> None:
    results = good_results()
    groups = summary(long_table(results))
    md = summary_md(groups)
    assert "| `fedgkt` | iid | 2 | 75.0 ± 7.1 |" in md and "| `fedavg` | iid | 1 | 60.0 |" in md
    assert "Strongest attack PSNR dB" in md
    out = tmp_path / "page.md"
    text = render("# {{name}}\n{{question}}\n{{table}}\n{{claims}}\n{{plot}}\n", results,
                  [Claim("FedGKT reaches 70%", "fedgkt", "final_accuracy", ">=", 0.7)], out)
    assert "# hand" in text and "| FedGKT reaches 70% |" in text and "| met |" in text and "![hand](page.png)" in text
    assert (tmp_path / "page.png").stat().st_size > 0



def test_a_pivot_puts_partitions_or_methods_in_the_columns() -> None:
    results = good_results()
    flip = {**results["cells"][2], "key": "fedavg-iid-s0-flip", "variant": "flip", "run": {**FIGURES, "final_accuracy": 0.10}}
    results["cells"].append(flip)
    groups = summary(long_table(results))
    by_partition = render("{{pivot:final_accuracy}}", results, [], Path("unused.md"))
    assert by_partition.splitlines()[:4] == ["| Method | Variant | iid |", "| --- | --- | --- |",
                                             "| `fedgkt` | default | 75.0 ± 7.1 |", "| `fedavg` | default | 60.0 |"]
    assert by_partition.endswith("Global acc. %, by partition.")
    by_method = render("{{pivot:final_accuracy, method}}", results, [], Path("unused.md"))
    # One row per variant (the single partition is said by no column), a method missing a variant: a dash.
    assert by_method.splitlines() == ["| Variant | `fedgkt` | `fedavg` |", "| --- | --- | --- |",
                                      "| default | 75.0 ± 7.1 | 60.0 |", "| flip | — | 10.0 |", "",
                                      "Global acc. %, by method."]
    with pytest.raises(ValueError, match="pivots across 'seed'"):
        pivot_md(groups, "final_accuracy", "seed")


def test_the_claims_summary_names_the_furthest_of_variants_checked_alike_by_its_variant() -> None:
    results = good_results()
    for variant, accuracy in (("a", 0.58), ("b", 0.50)):
        results["cells"].append({**results["cells"][2], "key": f"fedavg-iid-s0-{variant}", "variant": variant,
                                 "run": {**FIGURES, "final_accuracy": accuracy}})
    groups = summary(long_table(results))
    alike = [Claim(f"{v} keeps FedAvg", "fedavg", "final_accuracy", ">=", -0.05, partition="iid", variant=v,
                   baseline="fedavg") for v in ("a", "b")]
    one = Claim("FedGKT reaches 70%", "fedgkt", "final_accuracy", ">=", 0.7)
    md = claims_summary_md([*alike, one], groups)
    assert "| Each of 2 variants at iid: `fedavg (VARIANT) final_accuracy - fedavg's >= -0.05` | 1 of 2 | -0.1: b |" in md
    assert f"| FedGKT reaches 70% | 1 of 1 | 0.75 ± 0.071 at iid: `{one.describe()}` |" in md

def test_the_label_columns_and_the_unattacked_list_explain_each_dash() -> None:
    results = good_results()
    results["cells"][2]["leakage"] = {
        "attacks": {"bias_update_labels": {"agent": "agent-0", "histogram_error": 0.2, "baseline_histogram_error": 0.5}},
        "strongest": None, "not_supported": None, "skipped": {"update_inversion": "the update covers 900 images"}}
    rows = long_table(results)
    assert [r["leakage_label_error"] for r in rows] == [0.0, 0.0, 0.2]
    assert rows[2]["leakage_label_baseline_error"] == 0.5 and rows[2]["leakage_psnr_db"] is None
    assert rows[0]["leakage_gain_db"] == 10.0 and rows[2]["leakage_gain_db"] is None  # 20 dB over a 10 dB mean image
    md = summary_md(summary(rows))
    assert "Label histogram error" in md and "| — | — | — | 0.20 | 0.50 |" in md
    assert unattacked_md(results) == "- `fedavg`, update_inversion: the update covers 900 images"
    assert unattacked_md(good_results()) == ""


def test_a_group_has_one_colour_in_both_panels_of_the_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    seen: list[tuple[str, Any]] = []
    real = Axes.errorbar

    def spy(self: Axes, *args: Any, **kwargs: Any) -> Any:
        seen.append((kwargs["label"], kwargs["color"]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", spy)
    assert plot(summary(long_table(good_results())), tmp_path / "p.png")
    # fedgkt (attacked) is drawn in both panels in one colour; fedavg (not attacked) in the first only.
    assert [label for label, _ in seen] == ["fedgkt iid", "fedavg iid", "fedgkt iid"]
    assert seen[0][1] == seen[2][1] != seen[1][1]


def test_leakage_figures_take_each_attacks_best_agent_and_the_strongest_image_attack() -> None:
    leakage = {
        "best": {"white_box": {"agent": "agent-1", "psnr_db": 18.0, "ssim": 0.4, "baseline_psnr_db": 11.0, "baseline_ssim": 0.2},
                 "inverse_network": {"agent": "agent-0", "psnr_db": 21.0, "ssim": 0.6, "baseline_psnr_db": 11.0, "baseline_ssim": 0.2}},
        "agents": {"agent-0": {"attacks": [{"attack": "label_histogram", "histogram_error": 0.3}]},
                   "agent-1": {"attacks": [{"attack": "label_histogram", "histogram_error": 0.1}, {"attack": "x", "skipped": "no"}]}},
    }
    figures = leakage_figures(leakage)
    assert figures["strongest"]["attack"] == "inverse_network" and figures["strongest"]["psnr_db"] == 21.0
    assert figures["attacks"]["label_histogram"] == {"agent": "agent-1", "histogram_error": 0.1}
    assert "x" not in figures["attacks"]


# -- one experiment end to end ------------------------------------------------------------------ #


def test_the_smoke_experiment_runs_end_to_end(mosquitto: Any, tmp_path: Path) -> None:
    from cloud_server.launcher import main

    results, runs = tmp_path / "smoke.json", tmp_path / "runs"
    smoke = ROOT / "bench" / "experiments" / "smoke.toml"
    started = time.monotonic()
    assert main(["bench", "run", str(smoke), "--results", str(results), "--runs-dir", str(runs), "--broker", mosquitto.url]) == 0
    wall_s = time.monotonic() - started
    print(f"the smoke experiment took {wall_s:.1f} s")  # a figure for the reader, not a verdict: timings belong in bench/
    doc = load_results(results)
    (cell,) = doc["cells"]
    assert cell["status"] == "done", cell["error"]
    report = json.loads((runs / cell["key"] / "report.json").read_text())
    assert cell["run"] == run_figures(report)
    assert cell["run"]["final_accuracy"] == report["totals"]["final_accuracy"] is not None
    assert cell["run"]["train_up_wire_bytes"] == report["totals"]["up_wire"] > 0
    assert cell["run"]["rounds"] == 1
    # The audit ran on what the run kept, and its scores are the cell's and the report's.
    audit = json.loads((runs / cell["key"] / "audit" / "leakage.json").read_text())
    assert audit["options"]["steps"] == 5 and audit["options"]["public_samples"] == 32
    strongest = cell["leakage"]["strongest"]
    assert strongest["attack"] in ("white_box_inversion", "inverse_network", "architecture_only")
    assert strongest["psnr_db"] == audit["best"][strongest["attack"]]["psnr_db"] == max(b["psnr_db"] for b in audit["best"].values())
    assert report["leakage"]["strongest"] == strongest["attack"]
    assert report["config"]["round_deadline_s"] == 60  # the method's --set reached the run

    # The table from the results, and the page from a template.
    out = tmp_path / "page.md"
    assert main(["bench", "table", str(smoke), "--results", str(results), "--render", str(out)]) == 0
    assert "| `fedgkt` | iid | 1 |" in out.read_text()
    listing = subprocess.run([sys.executable, "-m", "cloud_server.launcher", "bench", "check", str(smoke)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and "fedgkt-iid-s0" in listing.stdout


def test_a_reference_cell_runs_end_to_end(tmp_path: Path) -> None:
    text = (SMALL.format(name="small", method="fedgkt", rounds=1).replace("seeds = [0, 1, 2]", "seeds = [0]")
            + 'train_samples = 64\ntest_samples = 32\ndataset = "synthetic"\n' + CENTRAL)
    path = write_experiment(tmp_path / "experiments", text)
    results, runs = tmp_path / "results" / "small.json", tmp_path / "runs"
    run_experiment(load_experiment(path), results_path=results, runs_dir=runs, only="centralized-*", progress=lambda line: None)
    (cell,) = load_results(results)["cells"]
    assert cell["status"] == "done", cell["error"]
    report = json.loads((runs / cell["key"] / "report.json").read_text())
    assert report["config"]["method_config"]["batch_size"] == 16 and report["config"]["method_config"]["model"] == "resnet8"
    assert cell["run"] == run_figures(report) and cell["run"]["final_accuracy"] is not None and cell["run"]["rounds"] == 1


def test_the_setting_lists_a_joined_variant_once_as_its_parts_changes() -> None:
    from cloud_server.experiments.tables import setting_md

    def variant(name: str, **settings: Any) -> dict[str, Any]:
        return {"name": name, "overrides": {"settings": settings}}

    spec = {"name": "x", "seeds": [0], "methods": ["fedavg"], "partitions": ["iid"],
            "scale": {"agents": 2, "rounds": 1, "train_samples": 10, "test_samples": 10, "dataset": "d"},
            "variants": [variant("default"), variant("a", **{"server.p": 1}), variant("b_c", **{"server.q": 2}),
                         variant("a_b_c", **{"server.p": 1, "server.q": 2}), variant("a_odd", **{"server.p": 1, "server.r": 3})]}
    text = setting_md({"experiment": spec})
    assert "- `a`: `server.p=1`" in text and "- `b_c`: `server.q=2`" in text
    assert "- `a_b_c`" not in text and "(`a_b_c`): their changes together" in text
    # A name that joins others' but changes something else is listed with its changes.
    assert "- `a_odd`: `server.p=1`, `server.r=3`" in text


def test_the_honest_accuracy_leaves_out_the_faulty_agents_own_models() -> None:
    """A method with a model per agent: the mean of the honest agents' headline figures, not the
    faulty agent's own model (which it trained on its garbage); with one deployed model, or no
    faulty agent, the global figure."""
    evaluation = {"accuracy": {"model": 0.58}, "per_agent": {
        "agent-0": {"accuracy": {"model": 0.7, "edge": 0.1}}, "agent-1": {"accuracy": {"model": 0.74}},
        "agent-2": {"accuracy": {"model": 0.12}}}}
    report = {"totals": {"edge_train_flops": 0, "final_accuracy": 0.52}, "rounds": [{"round": 1, "evaluation": evaluation}],
              "agents": {"agent-0": {}, "agent-1": {}, "agent-2": {"fault": "random_labels"}}}
    assert run_figures(report)["honest_accuracy"] == pytest.approx(0.72)
    assert run_figures({**report, "agents": {a: {} for a in report["agents"]}})["honest_accuracy"] == 0.52
    one_model = {**report, "rounds": [{"round": 1, "evaluation": {"accuracy": {"model": 0.52}}}]}
    assert run_figures(one_model)["honest_accuracy"] == 0.52
