"""The methods benchmark plans the runs the registry declares (bench/methods.py writes none out):
the plan is pinned, run by run and key by key, to what bench/methods.py planned when it still
wrote FedGKT's Table 2 ablation out by hand (tests/golden/methods_bench_runs.json, computed from
that version at both scales and both ablation partitions). A declaration that changes a run
fails here until the golden file is re-made on purpose."""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any

import pytest

from fedhelpers import ROOT

GOLDEN = ROOT / "tests" / "golden" / "methods_bench_runs.json"


def _load_bench(name: str):  # type: ignore[no-untyped-def]
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(scale: str, ablation: str) -> list[list[Any]]:
    methods = _load_bench("methods")
    s = methods.SCALES[scale]  # bench/accuracy.py's
    # Through JSON, as pinned: tuples and lists compare alike, key order is kept.
    return json.loads(json.dumps([[table, key, run.name, run.method, run.method_config, run.rounds]
                                  for table, key, run in methods.runs(s.rounds, s.train_samples, ablation, scale)]))


@pytest.mark.parametrize("case", sorted(json.loads(GOLDEN.read_text())))
def test_the_planned_runs_are_the_pinned_ones(case: str) -> None:
    scale, ablation = case.split("/")
    pinned = json.loads(GOLDEN.read_text())[case]
    planned = _plan(scale, ablation)
    assert [run[2] for run in planned] == [run[2] for run in pinned]  # names and order first: a readable failure
    assert planned == pinned
    for got, want in zip(planned, pinned):  # and the key order of every table (the TOML the run writes)
        assert list(got[4]) == list(want[4]), got[2]


def test_the_ablation_runs_are_declared_by_the_method_not_by_the_bench() -> None:
    from shared_protocol.registry import registered_methods

    source = (ROOT / "bench" / "methods.py").read_text()
    ablations = [run for spec in registered_methods().values() for run in spec.bench if run.partitions == "ablation"]
    assert ablations, "no method declares an ablation run"
    for run in ablations:
        assert run.name not in source, f"bench/methods.py names {run.name}: the method's registry entry declares it"
    planned = _plan("full", "iid")
    assert {run[2] for run in planned if run[0] != "methods"} == {f"{run.name}-iid" for run in ablations}


def test_an_unknown_ablation_partition_is_refused() -> None:
    methods = _load_bench("methods")
    with pytest.raises(ValueError, match="ablation partition"):
        methods.runs(2, 400, "dirichlet:0.5")
