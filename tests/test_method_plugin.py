"""A method is its own files: a throw-away method written only into a temporary package
(outside the repository, found through ``EDGESPLIT_METHODS``) registers, runs two rounds
over the in-memory transport, shows in ``edgesplit local --help``, in the grid of an
experiment that runs every method and in docs/configuration.md's tables of keys, and no
file of the repository changes. The shared modules name no registered method (their one default
aside)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cloud_server.config_docs as config_docs
from fedhelpers import ROOT, agent_config, in_memory_federation, method_server_config
from benchhelpers import load_bench

# The whole method: what docs/adding-a-method.md says a method is, and nothing else.
TOY_FILES = {
    "toymean/__init__.py": '''
        """The registry entry of a throw-away method: the agents' label counts, summed."""

        from shared_protocol.registry import LauncherFlag, MethodSpec, register_method

        register_method(MethodSpec(
            name="toymean",
            summary="a throw-away method: the agents' label counts, summed; every agent predicts the top class",
            server="toymean.server",
            edge="toymean.edge",
            config="toymean.server:ToyConfig",
            messages=("toymean.messages",),
            flags=(LauncherFlag("--toy-scale", 1.0, "how much each agent weighs its counts", type="float", minimum=0.0),),
        ))
    ''',
    "toymean/messages.py": '''
        """Toy mean messages: an agent's label counts up."""

        from __future__ import annotations

        from dataclasses import dataclass
        from typing import ClassVar

        import numpy as np

        from shared_protocol.errors import ValueRangeError
        from shared_protocol.messages import Message, register_message, tensor


        @register_message
        @dataclass(kw_only=True)
        class ToyCounts(Message):
            TYPE: ClassVar[str] = "toymean.counts"
            num_samples: int
            counts: np.ndarray = tensor("float32", ndim=1)  # (K,)

            def validate(self) -> None:
                if self.num_samples < 1 or not np.isfinite(self.counts).all() or (self.counts < 0).any():
                    raise ValueRangeError(f"{self.TYPE}: bad counts")
    ''',
    "toymean/edge.py": '''
        """Toy mean edge step: count the shard's labels, send them; evaluate the top class."""

        import numpy as np

        from edge_agent.methods.base import EdgeMethod, EvalAnswer, RoundResult, register_edge_method, shard_result

        from .messages import ToyCounts


        @register_edge_method
        class ToyEdge(EdgeMethod):
            name = "toymean"

            def run_round(self, start, meter):
                self.top = int(start.config["top"])
                num_classes = int(self.ctx.settings["num_classes"])
                counts = np.bincount(self.ctx.train.labels, minlength=num_classes).astype(np.float32)
                counts *= float(start.config["scale"])
                self.ctx.send(ToyCounts(run=self.ctx.run_id, round=start.round, sender=self.ctx.agent_id,
                                        num_samples=len(self.ctx.train), counts=counts), meter)
                return RoundResult(num_samples=len(self.ctx.train))

            def on_message(self, msg):
                return False

            def evaluate(self, request, meter):
                labels = self.ctx.test.labels
                return EvalAnswer(results={"model": shard_result(int((labels == self.top).sum()), len(labels))})
    ''',
    "toymean/server.py": '''
        """Toy mean server step: sum the agents' counts; the deployed model predicts the top class."""

        from dataclasses import dataclass
        from typing import ClassVar

        import numpy as np
        import torch

        from cloud_server.evaluation import HEADLINE, EvalModel, Evaluation, local_results
        from cloud_server.local_run import LocalRunOptions
        from cloud_server.methods.base import RoundOutcome, ServerMethod, register_server_method
        from shared_protocol.configs import config_from_table
        from shared_protocol.errors import ValueRangeError

        from .messages import ToyCounts


        @dataclass(frozen=True)
        class ToyConfig:
            KEY_MEANINGS: ClassVar[dict[str, str]] = {"scale": "how much each agent weighs its counts"}
            scale: float = 1.0

            def __post_init__(self):
                if self.scale < 0:
                    raise ValueError(f"toymean.scale must be >= 0, got {self.scale}")


        @register_server_method
        class ToyServer(ServerMethod):
            name = "toymean"
            upload_types = (ToyCounts,)

            def __init__(self, ctx, method_config):
                super().__init__(ctx, method_config)
                self.config = config_from_table(ToyConfig, method_config, "toymean")
                self.totals = np.zeros(ctx.num_classes, np.float64)
                self.staged = {}

            def welcome_settings(self):
                return {"num_classes": self.ctx.num_classes}

            def round_config(self, round_, agent, evaluate):
                return {"top": int(self.totals.argmax()), "scale": self.config.scale}, {}

            def on_upload(self, agent, msg):
                if not isinstance(msg, ToyCounts) or msg.counts.shape != (self.ctx.num_classes,):
                    raise ValueRangeError(f"toymean takes {self.ctx.num_classes} counts")
                self.staged[agent] = msg

            def discard(self, agent):
                self.staged.pop(agent, None)

            def complete(self, round_, ends, evaluate):
                used = {a: self.staged.pop(a) for a in sorted(ends) if a in self.staged}
                for msg in used.values():
                    self.totals += msg.counts
                return RoundOutcome(used_agents=list(used), samples=sum(m.num_samples for m in used.values()))

            def evaluation(self, round_, reports):
                top = int(self.totals.argmax())

                def forward(images):  # (B, C, H, W) -> (B, K): the top class, whatever the image
                    logits = torch.zeros(images.shape[0], self.ctx.num_classes, device=images.device)
                    logits[:, top] = 1.0
                    return logits

                return Evaluation(global_models={HEADLINE: {Evaluation.GLOBAL: EvalModel(forward)}},
                                  local=local_results(reports), labels={HEADLINE: "the top class of the summed counts"})

            def model_info(self):
                return {"edge": None, "server": None}


        def launcher_table(options: LocalRunOptions) -> dict:
            return {"scale": options.flag("toy_scale")}
    ''',
}
#: Modules outside the package that a registry or the tests keep: restored after the test.
_REGISTRIES = (
    ("shared_protocol.registry", "_METHODS"), ("shared_protocol.registry", "_IMPORTED"),
    ("shared_protocol.message_base", "_MESSAGE_TYPES"), ("cloud_server.methods.base", "_SERVER_METHODS"),
    ("edge_agent.methods.base", "_EDGE_METHODS"),
)


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout




@pytest.fixture
def toy_method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The throw-away method's package under ``tmp_path``, on sys.path and named in
    EDGESPLIT_METHODS; the registries it joins are restored afterwards."""
    import importlib

    from shared_protocol.registry import registered_methods

    # The built-in methods' modules register themselves at their first import: imported now, they
    # register into the registries restored afterwards, not into the copies this test works on.
    for spec in registered_methods().values():
        for part in (spec.server, spec.edge, *spec.messages):
            importlib.import_module(part)
    for module, attr in _REGISTRIES:
        held = getattr(importlib.import_module(module), attr)
        monkeypatch.setattr(importlib.import_module(module), attr, type(held)(held))
    packages = tmp_path / "plugins"
    for name, text in TOY_FILES.items():
        path = packages / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setenv("EDGESPLIT_METHODS", "toymean")
    yield sorted(str(p.relative_to(packages)) for p in packages.rglob("*.py"))
    for name in [m for m in sys.modules if m == "toymean" or m.startswith("toymean.")]:
        del sys.modules[name]


def test_a_method_in_its_own_files_registers_runs_and_is_listed(toy_method: list[str], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    before = _git_status()
    from cloud_server.launcher import main
    from shared_protocol.registry import get_method, registered_methods

    # Registered: found through EDGESPLIT_METHODS, nothing in the repository names it.
    assert "toymean" in registered_methods() and get_method("toymean").server == "toymean.server"

    # In `edgesplit local --help`: in the list of methods and with its own flag.
    with pytest.raises(SystemExit):
        main(["local", "--help"])
    help_text = capsys.readouterr().out
    assert re.search(r"toymean\s+a throw-away method", help_text)
    assert "--toy-scale" in help_text and "toymean: how much each agent weighs its counts" in help_text

    # In the grid of every experiment that runs every method ("*"), by name, with no edit in bench/.
    from cloud_server.experiments.experiment_file import load_experiment
    from cloud_server.experiments.runner import cell_command

    every = [load_experiment(p) for p in sorted((ROOT / "bench" / "experiments").glob("*.toml")) if "*" in load_experiment(p).methods]
    assert every, "an experiment runs every registered method"
    for experiment in every:
        toy = [cell for cell in experiment.cells() if cell.method == "toymean"]
        assert toy and all(cell_command(experiment, cell)[:4] == ["edgesplit", "local", "--method", "toymean"] for cell in toy)

    # Two rounds end to end over the in-memory transport, with the real coordinator and agents.
    config = method_server_config(tmp_path, "toymean", {"scale": 2.0}, run_id="toy", agents=2, rounds=2)
    federation = in_memory_federation(config, [agent_config("toy", i, 2) for i in range(2)]).start()
    report = federation.join(timeout_s=600)
    assert report["status"] == "finished" and [r["status"] for r in report["rounds"]] == ["ok", "ok"]
    assert all(r["completed"] == ["agent-0", "agent-1"] for r in report["rounds"])
    assert report["rounds"][-1]["accuracy"] is not None and report["config"]["method_config"] == {"scale": 2.0}

    # The method needed exactly its own four files; the repository is as it was.
    print("files the throw-away method needed:", ", ".join(toy_method))
    assert toy_method == ["toymean/__init__.py", "toymean/edge.py", "toymean/messages.py", "toymean/server.py"]
    assert _git_status() == before


def test_a_method_in_its_own_files_gets_its_table_of_keys(toy_method: list[str], tmp_path: Path) -> None:
    before = _git_status()
    render = config_docs
    tables = render.config_tables()
    assert "`[toymean]` (`toymean/server.py`, `ToyConfig`)" in tables
    assert "| `scale` | float | `1.0` | how much each agent weighs its counts |" in tables
    # Rewriting a copy of the page puts it there; the repository's page is as it was.
    page = tmp_path / "configuration.md"
    page.write_text((ROOT / "docs" / "configuration.md").read_text())
    assert render.update_config_doc(page) is True
    assert "| `scale` | float | `1.0` | how much each agent weighs its counts |" in page.read_text().splitlines()
    assert _git_status() == before


#: The shared modules that must name no method: the registry's default aside.
SHARED = ("cloud_server/launcher.py", "cloud_server/local_run.py", "edge_agent/backends/__init__.py",
          "cloud_server/feature_store.py", "cloud_server/keys.py", "cloud_server/config.py", "cloud_server/coordinator.py",
          "cloud_server/schedulers.py", "cloud_server/agents.py", "cloud_server/assemble.py", "cloud_server/methods/__init__.py",
          "cloud_server/methods/base.py", "edge_agent/methods/__init__.py", "edge_agent/methods/base.py",
          "shared_protocol/methods/__init__.py")


def method_mentions(text: str, names: list[str]) -> list[str]:
    """The registered method names ``text`` mentions, as words, in any case ("FedAvg's" counts)."""
    return sorted({m.group(0) for name in names for m in re.finditer(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text, re.I)})


@pytest.mark.parametrize("path", SHARED)
def test_shared_modules_name_no_method(path: str) -> None:
    from shared_protocol.registry import method_names

    names = list(method_names())
    assert names, "no methods registered"
    assert method_mentions((ROOT / path).read_text(), names) == [], f"{path} names a method: only its registry entry may"


def test_the_one_default_is_the_registrys() -> None:
    from shared_protocol.registry import DEFAULT_METHOD, method_names

    assert DEFAULT_METHOD in method_names()
    registry = (ROOT / "shared_protocol" / "registry.py").read_text()
    # The registry's module names its default and nothing else (its docstring speaks of no method).
    assert method_mentions(registry, list(method_names())) == [DEFAULT_METHOD]


def test_the_grep_sees_a_method_name() -> None:
    assert method_mentions("the sample-weighted mean (FedAvg's C), fedgkt.mode", ["fedavg", "fedgkt"]) == ["FedAvg", "fedgkt"]
    assert method_mentions("not-fedavg or fedavg_x or myfedavg", ["fedavg"]) == []


#: Modules kept so that outside code's imports keep working: they gather names other modules define.
FACADES = ("cloud_server/robust/__init__.py", "cloud_server/server_step.py")


def _defined(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (classes, functions, assignments), not those it imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def facade_imports(source: str, package: str) -> list[str]:
    """``module.name`` of every name ``source`` (a module of ``package``, e.g. ``cloud_server.methods``)
    imports through a facade that does not define it, and every facade imported whole."""
    facades = {path.removesuffix(".py").removesuffix("/__init__").replace("/", "."): _defined(ast.parse((ROOT / path).read_text()))
               for path in FACADES}
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names if alias.name in facades]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) + 1 - node.level]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            if module in facades:
                out += [f"{module}.{alias.name}" for alias in node.names if alias.name not in facades[module]]
            else:
                out += [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in facades]
    return sorted(out)


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "cloud_server" / "methods").glob("*.py")))
def test_method_servers_import_names_from_the_modules_that_define_them(path: str) -> None:
    assert facade_imports((ROOT / path).read_text(), "cloud_server.methods") == [], (
        f"{path} imports through a facade ({', '.join(FACADES)}): import from the module that defines the name")


def test_the_facade_check_sees_a_re_exported_name() -> None:
    assert facade_imports("from ..robust import ImplausibleUploadError, screen_uploads\n", "cloud_server.methods") == [
        "cloud_server.robust.ImplausibleUploadError", "cloud_server.robust.screen_uploads"]
    assert facade_imports("from cloud_server.server_step import TrainStep, RowBank\n", "cloud_server.methods") == [
        "cloud_server.server_step.RowBank"]  # TrainStep is server_step's own
    assert facade_imports("from .. import robust\nimport cloud_server.server_step\n", "cloud_server.methods") == [
        "cloud_server.robust", "cloud_server.server_step"]
    assert facade_imports("from ..robust.config import ImplausibleUploadError\nfrom ..server_step import TrainStep\n",
                          "cloud_server.methods") == []
    # The facades still hand out what they gathered, for outside code.
    from cloud_server.robust import ImplausibleUploadError, screen_uploads  # noqa: F401
    from cloud_server.server_step import RowBank, normalised_images  # noqa: F401


def test_the_readme_lists_every_registered_method_from_its_registry_entry() -> None:
    render = load_bench("render_results")
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(render.README_BEGIN):readme.index(render.README_END) + len(render.README_END)]
    leakage = render.load_experiment_results(ROOT / "bench" / "results" / "leakage.json")
    defence_docs = load_bench("defence_docs")
    defences = defence_docs.defence_rows(defence_docs.load_defences(ROOT / "bench" / "results"))
    assert block.splitlines() == render.readme_methods(leakage, defences), \
        "rerun `python bench/render_results.py` (it rewrites the table)"
    privacy = (ROOT / "docs" / "privacy.md").read_text()
    block = privacy[privacy.index(defence_docs.PRIVACY_BEGIN):privacy.index(defence_docs.PRIVACY_END) + len(defence_docs.PRIVACY_END)]
    assert block.splitlines() == defence_docs.privacy_block(defences), "rerun `python bench/render_results.py`"


def test_every_method_notes_say_what_the_server_sees_with_the_current_figure(tmp_path: Path) -> None:
    import shutil

    render = load_bench("render_results")
    leakage_docs = load_bench("leakage_docs")
    from shared_protocol.registry import registered_methods

    docs = ROOT / "docs" / "methods"
    text = "".join(path.read_text() for path in sorted(docs.glob("*.md")))
    for method in registered_methods():
        assert leakage_docs.METHOD_NOTE_BEGIN.format(method=method) in text, f"docs/methods lacks {method}'s leakage figure"
    # The figures between the markers are the renderer's from the committed JSON.
    copy = tmp_path / "methods"
    shutil.copytree(docs, copy)
    figures = leakage_docs.method_figures(render.load_experiment_results(ROOT / "bench" / "results" / "leakage.json"))
    assert leakage_docs.update_method_notes(copy, figures) == [], "rerun `python bench/render_results.py`"
