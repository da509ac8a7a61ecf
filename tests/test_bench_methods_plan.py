"""The methods benchmark plans the runs the registry declares (bench/methods.py writes none out):
the plan is pinned, run by run and key by key, to what bench/methods.py planned when it still
wrote FedGKT's Table 2 ablation out by hand (tests/golden/methods_bench_runs.json, computed from
that version at both scales and both ablation partitions). A declaration that changes a run
fails here until the golden file is re-made on purpose."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fedhelpers import ROOT
from benchhelpers import load_bench

GOLDEN = ROOT / "tests" / "golden" / "methods_bench_runs.json"




def _plan(scale: str, ablation: str) -> list[list[Any]]:
    methods = load_bench("methods")
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
    declared = [run for spec in registered_methods().values() for run in spec.bench if run.partitions == "ablation"]
    # A declared run that is Table 1's own (Table 2's S<->E) is not run again: Table 1's cells serve it.
    ablations = [run for run in declared if not run.reuses_table1]
    reused = [run for run in declared if run.reuses_table1]
    assert ablations, "no method declares an ablation run"
    for run in ablations:
        assert run.name not in source, f"bench/methods.py names {run.name}: the method's registry entry declares it"
    planned = _plan("full", "iid")
    assert {run[2] for run in planned if run[0] != "methods"} == {f"{run.name}-iid" for run in ablations}
    assert reused and not {f"{run.name}-iid" for run in reused} & {run[2] for run in planned}


def test_an_unknown_ablation_partition_is_refused() -> None:
    methods = load_bench("methods")
    with pytest.raises(ValueError, match="ablation partition"):
        methods.runs(2, 400, "dirichlet:0.5")


def _table2_declared() -> list[Any]:
    from shared_protocol.registry import registered_methods

    return [run for spec in registered_methods().values() for run in spec.bench if run.results == "table2"]


def _render():  # type: ignore[no-untyped-def]
    return load_bench("render_results")


def _cell(accuracy: float, local: float) -> dict[str, Any]:
    return {"final_accuracy": {"mean": accuracy, "sd": 0.01, "n": 3}, "final_local_accuracy": {"mean": local, "sd": 0.02, "n": 3}}


def test_table2_takes_its_runs_and_the_papers_figures_from_fedgkts_declaration() -> None:
    declared = _table2_declared()
    assert {run.name for run in declared} >= {"fedgkt-kd-none", "fedgkt-kd-s2e"}
    assert all(row.paper is not None for run in declared for row in run.rows), "a Table 2 row without the paper's figure"
    render = _render()
    # Every run's cells under the name it declares; Table 1's run among Table 1's cells.
    ours = {f"{run.name}-noniid": _cell(0.5 + i / 10, 0.4 + i / 10) for i, run in enumerate(declared) if not run.reuses_table1}
    table1 = {f"{run.name}-noniid": _cell(0.9, 0.85) for run in declared if run.reuses_table1}
    assert table1, "Table 2's S<->E row is Table 1's run: declared with reuses_table1"
    rows = render.table2_rows(ours, table1, "noniid")
    expected = []
    for i, run in enumerate(declared):
        for row in run.rows:
            paper = row.paper if isinstance(row.paper, str) else f"{row.paper:.2f}%"
            cells = ("90.0 ± 1.0%", "85.0 ± 2.0%") if run.reuses_table1 else (f"{50 + 10 * i:.1f} ± 1.0%", f"{40 + 10 * i:.1f} ± 2.0%")
            expected.append([row.label, *cells, paper])
    assert sorted(map(tuple, rows)) == sorted(map(tuple, expected))
    assert rows[-1][0].startswith("S<->E")  # None, S->E, then Table 1's S<->E (declared order)
    # Another partition's cells are not this one's.
    assert all(r[1] == r[2] == render.DASH for r in render.table2_rows(ours, table1, "iid"))
    # The bench writes the same figures, read from the same declaration.
    methods = load_bench("methods")
    assert methods.paper_figures()["table2"] == {run.name: row.paper for run in declared for row in run.rows}
    # Neither script types a run name or a figure of the declaration.
    for script in ("render_results.py", "methods.py"):
        text = (ROOT / "bench" / script).read_text()
        for run in declared:
            if not run.reuses_table1:
                assert run.name not in text, (script, run.name)
            for row in run.rows:
                assert str(row.paper) not in text, (script, row.paper)


def test_table2_follows_a_changed_declaration(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from shared_protocol import registry
    from shared_protocol.registry import BenchRun, ResultsRow

    spec = registry.registered_methods()["fedgkt"]
    renamed = tuple(dataclasses.replace(run, name=f"{run.name}-v2", rows=(ResultsRow(f"{run.rows[0].label} (v2)", paper=12.5),))
                    if not run.reuses_table1 else run for run in spec.bench)
    monkeypatch.setitem(registry._METHODS, "fedgkt", dataclasses.replace(spec, bench=renamed))
    render, methods = _render(), load_bench("methods")
    cells = {f"{run.name}-noniid": _cell(0.7, 0.6) for run in renamed if not run.reuses_table1}
    rows = render.table2_rows(cells, {}, "noniid")
    changed = [r for r in rows if r[0].endswith("(v2)")]
    assert len(changed) == len(renamed) - 1 and all(r[1:] == ["70.0 ± 1.0%", "60.0 ± 2.0%", "12.50%"] for r in changed)
    assert set(methods.paper_figures()["table2"]) == {run.name for run in renamed}
    assert {run.name for _, _, run in methods.runs(2, 400, "noniid", "quick") if run.name.endswith("-v2-noniid")} == {
        f"{run.name}-noniid" for run in renamed if not run.reuses_table1}
    # A run declared as Table 1's that Table 1 does not run is refused when the bench plans.
    wrong = BenchRun("fedgkt-nowhere", shared="table1", partitions="ablation", results="table2", reuses_table1=True)
    monkeypatch.setitem(registry._METHODS, "fedgkt", dataclasses.replace(spec, bench=(*spec.bench, wrong)))
    with pytest.raises(ValueError, match="fedgkt-nowhere.*Table 1 runs no"):
        methods.runs(2, 400, "noniid", "quick")


def test_a_run_reusing_table1_has_no_keys_of_its_own() -> None:
    from shared_protocol.registry import BenchRun, ResultsRow

    with pytest.raises(ValueError, match="reuses Table 1"):
        BenchRun("x", {"kd": "none"}, shared="table1", reuses_table1=True)
    with pytest.raises(ValueError, match="reuses Table 1"):
        BenchRun("x", shared="whole_model", reuses_table1=True)
    with pytest.raises(ValueError, match="paper"):
        ResultsRow("x", paper=[90.5])  # type: ignore[arg-type]
