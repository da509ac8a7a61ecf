"""Classes whole (a module does one job; a long cohesive class is fine, as paho's client
shows): no class of the packages is half of another, reading state that only some other
class sets up. Such a mixin re-declares the other half's attributes (or just uses them) and
can be read, tested and changed only together with it; fold it back into its class.

A class's own state is what it (or a base class of the packages) assigns to ``self.X``,
declares with a value or as a dataclass / NamedTuple / Protocol field, or defines as a
method or property. An attribute only annotated in a plain class is a re-declaration.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cloud_server", "edge_agent", "shared_protocol", "fldata", "models")
# Bases whose subclasses declare fields by annotation (their annotations are state).
_FIELD_BASES = {"Protocol", "NamedTuple", "TypedDict", "Enum", "IntEnum", "StrEnum"}
# Bases outside the packages whose attributes a subclass may read (the state they set up).
_FOREIGN_BASES = {"nn.Module", "Module", "Exception", "ValueError", "RuntimeError", "TypeError", "KeyError", "OSError",
                  "LookupError", "ABC", "Generic", "object", "threading.Thread", "Thread", "argparse.Action",
                  "logging.Handler", "logging.Filter", "logging.Formatter", "json.JSONEncoder", "BaseHTTPRequestHandler",
                  "http.server.BaseHTTPRequestHandler", "ThreadingHTTPServer", "socketserver.ThreadingMixIn",
                  "torch.optim.Optimizer", "Optimizer", "torch.utils.data.Dataset", "Dataset", "IterableDataset",
                  "torch.autograd.Function", "Function", "TorchDispatchMode", "unittest.TestCase", "dict", "list",
                  "str", "int", "float", "tuple", "Mapping", "MutableMapping", "Sequence", "Iterator", "Iterable"}


class _Class:
    def __init__(self, node: ast.ClassDef, path: Path) -> None:
        self.name = node.name
        self.path = path
        self.bases = [ast.unparse(b).split("[")[0] for b in node.bases]
        decorators = {ast.unparse(d).split("(")[0].split(".")[-1] for d in node.decorator_list}
        fields = "dataclass" in decorators or any(b.split(".")[-1] in _FIELD_BASES for b in self.bases)
        self.defines: set[str] = set()
        self.reads: set[str] = set()
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defines.add(item.name)
            elif isinstance(item, ast.Assign):
                self.defines |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and (fields or item.value is not None):
                self.defines.add(item.target.id)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                (self.defines if isinstance(sub.ctx, (ast.Store, ast.Del)) else self.reads).add(sub.attr)


def classes(root: Path, packages: tuple[str, ...]) -> dict[str, list[_Class]]:
    found: dict[str, list[_Class]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(_Class(node, path.relative_to(root)))
    return found


def _state(name: str, found: dict[str, list[_Class]], seen: frozenset[str] = frozenset()) -> set[str] | None:
    """What class ``name`` and its bases set up; None when a base lies outside what this
    check can read (then nothing is claimed about the class)."""
    if name not in found or len(found[name]) != 1 or name in seen:
        return None
    cls = found[name][0]
    state = set(cls.defines)
    for base in cls.bases:
        short = base.split(".")[-1]
        if base in _FOREIGN_BASES or short in _FIELD_BASES:
            if base not in ("ABC", "Generic", "object") and short not in _FIELD_BASES:
                return None  # a library base sets up state of its own
            continue
        inherited = _state(short, found, seen | {name})
        if inherited is None:
            return None
        state |= inherited
    return state


def mixin_halves(root: Path, packages: tuple[str, ...]) -> dict[str, list[str]]:
    """``path::Class`` -> the attributes it reads that neither it nor its bases set up."""
    found = classes(root, packages)
    halves = {}
    for name, defs in found.items():
        state = _state(name, found)
        if state is None:
            continue
        missing = sorted(a for a in defs[0].reads - state if not (a.startswith("__") and a.endswith("__")))
        if missing:
            halves[f"{defs[0].path}::{name}"] = missing
    return halves


def test_no_class_is_half_of_another() -> None:
    assert mixin_halves(ROOT, PACKAGES) == {}, "fold each of these into the class whose state it reads"


def test_the_check_sees_a_mixin_half(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        "from dataclasses import dataclass\n"
        "class Half:\n    stats: dict\n    def report(self):\n        return self.stats, self._total\n"
        "class Whole(Half):\n    def __init__(self):\n        self.stats = {}\n        self._total = 0\n"
        "class Alone:\n    def __init__(self):\n        self.x = 1\n    def get(self):\n        return self.x, self.get\n"
        "@dataclass\nclass Point:\n    x: int\n    def norm(self):\n        return self.x\n"
        "class Model(nn.Module):\n    def f(self):\n        return self.training\n")
    assert mixin_halves(tmp_path, ("pkg",)) == {"pkg/a.py::Half": ["_total", "stats"]}
