"""Run reports: validation, the files write_report produces, reload and comparison."""

from __future__ import annotations

import re

import copy
import csv
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from cloud_server.report import (
    CSV_COLUMNS,
    REPORT_FILES,
    ReportError,
    compare_runs,
    format_summary_line,
    render_run_dir,
    validate_report,
    write_report,
)
from cloud_server.report.markdown import summary_md  # the summary without plotting, for speed
from cloud_server.report.sanity import sanity_warnings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_report(
    rounds: int = 3,
    run_id: str = "synthetic",
    method: str = "fedgkt",
    accuracies: list[float | None] | None = None,
) -> dict[str, Any]:
    """A consistent report as the coordinator would build it: two agents, ``rounds`` rounds.

    Round 2 of 3 is a failed quorum in which ``pi-2`` went missing, so the
    report exercises partial rounds too. Totals are computed from the rounds.
    """
    accuracies = accuracies if accuracies is not None else [0.5012, 0.6543, 0.8123][:rounds] + [0.85] * max(0, rounds - 3)
    agents = {
        "pi-1": {"cpu_model": "Cortex-A72", "arch": "aarch64", "cores": 4, "memory_bytes": 4 * 2**30,
                 "backend": "torch", "num_samples": 600, "class_counts": [60] * 10},
        "pi-2": {"cpu_model": "Intel(R) Core(TM) i5", "arch": "x86_64", "cores": 2, "memory_bytes": 8 * 2**30,
                 "backend": "torch", "num_samples": 400, "class_counts": [40] * 10},
    }
    records = []
    for i in range(1, rounds + 1):
        failed = i == 2
        completed = ["pi-1"] if failed else ["pi-1", "pi-2"]
        per_agent = {}
        for j, agent in enumerate(completed):
            per_agent[agent] = {
                "samples": agents[agent]["num_samples"], "train_flops": 56_800_000 * agents[agent]["num_samples"],
                "compute_s": 10.0 + j, "encode_s": 0.5, "network_s": 1.25, "idle_s": 2.0 if i > 1 else 0.0,
                "peak_rss_bytes": 300_000_000 + j, "payload_bytes_up": 5_000_000, "wire_bytes_up": 5_100_000,
                "payload_bytes_down": 40_000, "wire_bytes_down": 41_000, "codec": "fp16-zstd",
                "codec_ratio": 4.6 + j / 10, "edge_accuracy": 0.7 + i / 100,
            }
        acc = accuracies[i - 1]
        records.append({
            "round": i, "status": "failed_quorum" if failed else "ok",
            "participants": ["pi-1", "pi-2"], "completed": completed, "missing": ["pi-2"] if failed else [],
            "accuracy": acc, "local_accuracy": None if acc is None else acc + 0.05,
            "edge_accuracy": None if acc is None else 0.7 + i / 100, "edge_local_accuracy": None,
            "server_loss": None if failed else 1.0 / i,
            "samples": sum(agents[a]["num_samples"] for a in completed),
            "bytes": {"up_payload": 10_000_000 * i, "up_wire": 10_200_000 * i, "down_payload": 80_000, "down_wire": 82_000},
            "edge_train_flops": sum(c["train_flops"] for c in per_agent.values()),
            "time_s": {"round": 20.0 + i, "server_train": 3.5, "edge_compute": 10.5, "edge_encode": 0.5,
                       "edge_network": 1.25, "edge_idle": 2.0 if i > 1 else 0.0},
            "per_agent": per_agent,
        })
    accs = [r["accuracy"] for r in records if r["accuracy"] is not None]
    edge_accs = [r["edge_accuracy"] for r in records if r["edge_accuracy"] is not None]
    totals: dict[str, Any] = {
        "rounds_completed": sum(r["status"] == "ok" for r in records),
        "best_accuracy": max(accs) if accs else None,
        "final_accuracy": accs[-1] if accs else None,
        "final_edge_accuracy": edge_accs[-1] if edge_accs else None,
    }
    for key in ("up_payload", "up_wire", "down_payload", "down_wire"):
        totals[key] = sum(r["bytes"][key] for r in records)
    totals.update(
        wire_total=totals["up_wire"] + totals["down_wire"],
        edge_train_flops=sum(r["edge_train_flops"] for r in records),
        wall_time_s=75.5, rejected_messages=3, rejected_by_reason={"stale_message": 2, "bad_shape": 1},
        # Extra keys the coordinator adds; the schema must tolerate them.
        outside_rounds={"up_payload": 1000, "up_wire": 1200, "down_payload": 500, "down_wire": 600},
    )
    return {
        "edgesplit_version": "0.1.0", "run_id": run_id, "method": method,
        "config": {"run_id": run_id, "rounds": rounds, "dataset": "fashion-mnist", "method_config": {"lr": 0.01}},
        "started_at": "2026-11-22T08:00:00+00:00", "finished_at": "2026-11-22T08:01:15+00:00", "status": "finished",
        "server": {"device": "cpu", "cpu_model": "Xeon", "torch": "2.13.0", "hostname": "gpu-vm"},
        "agents": agents,
        "models": {
            "edge": {"name": "resnet8", "params": 10_586, "train_flops_per_sample": 56_800_000},
            "server": {"name": "resnet55", "params": 580_000, "train_flops_per_sample": 522_400_000},
        },
        "rounds": records,
        "totals": totals,
    }


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    assert len(data) > 2000, f"{path} is suspiciously small ({len(data)} bytes)"


# --------------------------------------------------------------------------- #
# writing
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The synthetic report written once; the tests below only read it (plots take time)."""
    report = make_report()
    validate_report(report)
    return write_report(tmp_path_factory.mktemp("report") / "run", report)


def test_write_report_writes_every_file(written: dict[str, Path]) -> None:
    assert set(written) == set(REPORT_FILES)
    run_dir = written["report"].parent
    for name, path in written.items():
        assert path == run_dir / REPORT_FILES[name]
        assert path.stat().st_size > 0
    assert not list(run_dir.glob(".*.tmp")), "temporary files left behind"
    assert json.loads(written["report"].read_text()) == make_report()
    for name in ("accuracy_vs_round", "accuracy_vs_wire_mb", "edge_cost"):
        assert_png(written[name])


def test_rounds_csv_rows_and_columns(written: dict[str, Path]) -> None:
    paths = written

    with paths["rounds_csv"].open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        rows = list(reader)
    assert [r["round"] for r in rows] == ["1", "2", "3"]
    assert rows[1]["status"] == "failed_quorum"
    assert rows[1]["completed"] == "pi-1" and rows[1]["missing"] == "pi-2"
    assert rows[0]["participants"] == "pi-1;pi-2"
    assert rows[1]["server_loss"] == ""  # None is an empty cell, not "None"
    assert float(rows[2]["accuracy"]) == pytest.approx(0.8123)
    # Cumulative wire MB, up + down: (10.2 + 0.082) + (20.4 + 0.082) + (30.6 + 0.082).
    assert float(rows[2]["cum_wire_mb"]) == pytest.approx(61.446)
    assert int(rows[0]["edge_train_flops"]) == 56_800_000 * 1000
    assert float(rows[2]["round_s"]) == pytest.approx(23.0)


def test_summary_contains_the_runs_numbers(written: dict[str, Path]) -> None:
    text = written["summary"].read_text()

    assert "synthetic" in text and "fedgkt" in text
    assert "81.23%" in text  # final accuracy
    assert "73.00%" in text  # final edge accuracy
    assert "resnet8" in text and "resnet55" in text
    assert "10,586" in text and "0.0568" in text  # edge params, train GFLOPs per sample
    assert "9.2×" in text and "54.8×" in text  # server / edge FLOPs and params
    assert "61.45" in text  # total wire MB
    assert "fp16-zstd" in text
    assert "**Status:** finished" in text and "**Agents:** 2" in text
    assert "## Agents in round 3" in text and "Cortex-A72" in text
    assert "failed_quorum" in text
    assert "stale_message: 2" in text


def test_render_run_dir_round_trip(tmp_path: Path) -> None:
    report = make_report()
    paths = write_report(tmp_path, report)
    summary = paths["summary"].read_text()
    for name in ("rounds_csv", "summary", "edge_cost"):
        paths[name].unlink()

    again = render_run_dir(tmp_path)

    assert again == paths
    assert again["summary"].read_text() == summary
    assert json.loads(again["report"].read_text()) == report
    assert_png(again["edge_cost"])


def test_render_run_dir_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="report.json does not exist"):
        render_run_dir(tmp_path)
    (tmp_path / "report.json").write_text('{"run_id": ')
    with pytest.raises(ReportError, match="not valid JSON"):
        render_run_dir(tmp_path)
    (tmp_path / "report.json").write_text('{"run_id": "x"}')
    with pytest.raises(ReportError, match="rounds: missing"):
        render_run_dir(tmp_path)


@pytest.mark.parametrize("case", ["zero_rounds", "no_accuracy"])
def test_degenerate_reports_still_render(tmp_path: Path, case: str) -> None:
    report = make_report(rounds=0) if case == "zero_rounds" else make_report(accuracies=[None, None, None])
    if case == "zero_rounds":
        report["status"] = "aborted"
        report["finished_at"] = None

    paths = write_report(tmp_path, report)

    for name in ("accuracy_vs_round", "accuracy_vs_wire_mb", "edge_cost"):
        assert_png(paths[name])
    summary = paths["summary"].read_text()
    assert "| fedgkt | resnet8 | resnet55 | — | — | — |" in summary
    rows = list(csv.reader(paths["rounds_csv"].open(newline="")))
    assert len(rows) == 1 + len(report["rounds"])


# --------------------------------------------------------------------------- #
# validation
# --------------------------------------------------------------------------- #


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets a dotted path (integers index lists)."""

    def mutate(report: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = report
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = value

    return mutate


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(report: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = report
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]

    return mutate


BROKEN: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "missing top-level key": (_delete("totals"), "totals: missing"),
    "missing round key": (_delete("rounds.1.bytes"), r"rounds\[1\] \(round 2\)\.bytes: missing"),
    "wrong type": (_set("rounds.0.samples", "600"), r"samples: expected int, got str"),
    "bool is not an int": (_set("agents.pi-1.cores", True), r"cores: expected int, got bool"),
    "rounds not increasing": (_set("rounds.2.round", 2), "strictly increasing"),
    "accuracy above 1": (_set("rounds.0.accuracy", 81.2), r"accuracy: must be <= 1"),
    "negative accuracy": (_set("rounds.0.per_agent.pi-1.edge_accuracy", -0.1), r"edge_accuracy: must be >= 0"),
    "negative bytes": (_set("rounds.0.bytes.up_wire", -5), r"up_wire: must be >= 0"),
    "totals bytes disagree": (_set("totals.up_payload", 1), r"totals.up_payload is 1, but the rounds"),
    "totals flops disagree": (_set("totals.edge_train_flops", 0), r"totals.edge_train_flops is 0"),
    "wire total disagrees": (_set("totals.wire_total", 7), r"wire_total is 7"),
    "best accuracy disagrees": (_set("totals.best_accuracy", 0.5), r"best_accuracy is 0.5"),
    "rounds_completed disagrees": (_set("totals.rounds_completed", 3), r"rounds_completed is 3"),
    "unknown status": (_set("status", "done"), r"status: expected one of"),
    "unknown round status": (_set("rounds.0.status", "partial"), r"status: expected one of"),
    "not a participant": (_set("rounds.0.completed", ["pi-1", "pi-9"]), r"\['pi-9'\] are not participants"),
    "NaN loss": (_set("rounds.0.server_loss", float("nan")), r"server_loss: expected a finite number"),
    "numpy scalar": (_set("config.seed", __import__("numpy").int64(3)), r"not strict JSON"),
    "edge model flops missing": (_set("models.edge.train_flops_per_sample", None), r"train_flops_per_sample: expected int, got None"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_validation_catches(name: str) -> None:
    mutate, expected = BROKEN[name]
    report = copy.deepcopy(make_report())
    mutate(report)

    with pytest.raises(ReportError, match=expected) as info:
        validate_report(report)
    assert info.value.problems


def test_validation_lists_every_problem_and_refuses_to_write(tmp_path: Path) -> None:
    report = make_report()
    report["rounds"][0]["accuracy"] = 2.0
    report["rounds"][1]["bytes"]["down_wire"] = -1
    report["server"]["hostname"] = None

    with pytest.raises(ReportError) as info:
        write_report(tmp_path, report)

    assert len(info.value.problems) >= 3
    assert isinstance(info.value, ValueError)  # the CLI turns ValueError into a clean message
    assert not (tmp_path / "report.json").exists()


def test_server_model_without_flops_is_valid() -> None:
    report = make_report()
    report["models"]["server"]["train_flops_per_sample"] = None
    validate_report(report)
    text = summary_md(report)
    assert "54.8× fewer parameters than the server model." in text
    report["models"]["server"] = None
    validate_report(report)
    assert "| edge | resnet8 | 10,586 | 0.0568 |" in summary_md(report)


def test_summary_lists_the_agents_refused_at_join() -> None:
    report = make_report()
    assert "refused at join" not in summary_md(report)
    reason = "this agent's images are (channels, height, width) = (1, 48, 48), the run's are (1, 32, 32)"
    report["refused_agents"] = [{"agent": "pi-garage", "code": "data_mismatch", "reason": reason}]
    validate_report(report)
    text = summary_md(report)
    assert "## Agents refused at join" in text
    assert f"| pi-garage | data_mismatch | {reason} |" in text


# --------------------------------------------------------------------------- #
# one-liners and comparisons
# --------------------------------------------------------------------------- #


def test_format_summary_line() -> None:
    rounds = make_report()["rounds"]

    assert format_summary_line(rounds[2], 8) == (
        "round 3/8  global acc 81.23%  (local 86.23%, edge 73.00%)  up 30.6 MB  down 0.1 MB  2/2 agents  23.0 s"
    )
    assert format_summary_line(rounds[1], 8).endswith("1/2 agents  22.0 s  [failed_quorum]")
    rounds[0]["accuracy"] = rounds[0]["local_accuracy"] = rounds[0]["edge_accuracy"] = None
    assert "global acc —  (local —)" in format_summary_line(rounds[0], 8)  # no edge models: no edge figure


def test_compare_runs_lists_both_runs(tmp_path: Path) -> None:
    write_report(tmp_path / "a", make_report(run_id="gkt-run", method="fedgkt"))
    write_report(tmp_path / "b", make_report(run_id="avg-run", method="fedavg", rounds=0))

    table = compare_runs([tmp_path / "a", tmp_path / "b"])

    lines = table.strip().splitlines()
    assert len(lines) == 4  # header, alignment, two runs
    assert "gkt-run" in lines[2] and "81.23%" in lines[2]
    assert "avg-run" in lines[3] and "fedavg" in lines[3]
    with pytest.raises(ReportError, match="does not exist"):
        compare_runs([tmp_path / "nowhere"])


LEAKAGE = {"knowledge": ["extractor_weights", "public_images", "architecture"], "note": "the server sent the stem",
           "image_attacks": {"white_box_inversion": {"agent": "agent-1", "psnr_db": 41.25, "ssim": 0.99,
                                                     "baseline_psnr_db": 12.0, "baseline_ssim": 0.3},
                             "architecture_only": {"agent": "agent-0", "psnr_db": 15.5, "ssim": 0.5,
                                                   "baseline_psnr_db": 12.0, "baseline_ssim": 0.3}},
           "label_attacks": {"labels_in_the_clear": {"histogram_error": 0.0}}, "strongest": "white_box_inversion",
           "skipped": {"inverse_network": "no public set"}, "picture": "leakage.png"}


def test_the_leakage_section_is_checked_shown_and_compared(tmp_path: Path) -> None:
    audited = make_report(run_id="gkt-run", method="fedgkt")
    audited["leakage"] = LEAKAGE
    write_report(tmp_path / "a", audited)
    write_report(tmp_path / "b", make_report(run_id="avg-run", method="fedavg"))

    summary = (tmp_path / "a" / "summary.md").read_text()
    section = summary[summary.index("## What the server can reconstruct"):]
    assert "extractor_weights, public_images, architecture" in section
    # The strongest attack first, beside the mean image's scores.
    assert section.index("white_box_inversion | agent-1 | 41.2") < section.index("architecture_only")
    assert "inverse_network not run: no public set" in section and "`leakage.png`" in section
    assert "Not audited: run with `edgesplit local --audit`" in (tmp_path / "b" / "summary.md").read_text()
    lines = compare_runs([tmp_path / "a", tmp_path / "b"]).strip().splitlines()
    assert "Strongest attack PSNR" in lines[0] and "41.2 (12.0)" in lines[2] and "41.2" not in lines[3]

    for broken, problem in ((dict(LEAKAGE, strongest="dlg"), "leakage.strongest is 'dlg'"),
                            (dict(LEAKAGE, image_attacks={"x": {"agent": "a", "psnr_db": 1.0}}), "image_attacks[x].ssim: missing"),
                            (dict(LEAKAGE, label_attacks={"y": {"histogram_error": 2.0}}), "must be <= 1.0")):
        with pytest.raises(ReportError, match=re.escape(problem)):
            write_report(tmp_path / "c", dict(audited, leakage=broken))


def test_an_audit_of_a_run_whose_report_an_older_version_wrote_keeps_its_findings(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Attaching the leakage to a report this version cannot load (fields added since) leaves
    that report as it is and says where the findings are, instead of failing the audit after
    its attacks ran. Positive control: a current report gets the section."""
    from cloud_server.audit.leakage_report import attach_to_report

    write_report(tmp_path / "now", make_report(method="fedgkt"))
    assert attach_to_report(tmp_path / "now", LEAKAGE)
    assert json.loads((tmp_path / "now" / "report.json").read_text())["leakage"] == LEAKAGE

    write_report(tmp_path / "old", make_report(method="fedgkt"))
    old = json.loads((tmp_path / "old" / "report.json").read_text())
    del old["config"]  # a field this version's reports must carry
    (tmp_path / "old" / "report.json").write_text(json.dumps(old))
    with caplog.at_level("WARNING"):
        assert not attach_to_report(tmp_path / "old", LEAKAGE)
    assert json.loads((tmp_path / "old" / "report.json").read_text()) == old
    assert "does not load with this version" in caplog.text and "run the run again" in caplog.text


def test_a_run_at_chance_or_far_below_its_own_local_figure_is_warned_about(tmp_path: Path) -> None:
    at_chance = make_report(accuracies=[0.1, 0.1, 0.1])
    (warning,) = sanity_warnings(at_chance)
    assert "at chance (10.00%, chance 10.00%) after 3 evaluated rounds" in warning
    assert "400-600 training images per agent" in warning and "--train-samples" in warning and "--rounds" in warning
    write_report(tmp_path / "chance", at_chance)
    summary = (tmp_path / "chance" / "summary.md").read_text()
    assert summary.index("## Warnings") < summary.index("## Accuracy")  # read before the figures

    learning = make_report()
    assert sanity_warnings(learning) == []
    write_report(tmp_path / "ok", learning)
    assert "## Warnings" not in (tmp_path / "ok" / "summary.md").read_text()
    # One evaluated round is too early to say.
    assert sanity_warnings(make_report(accuracies=[0.1, None, None])) == []

    # Learning locally, not globally: the global figure far below the run's local one.
    skewed = make_report(accuracies=[0.3, 0.3, 0.3])
    for record in skewed["rounds"]:
        record["local_accuracy"] = 0.9
    (warning,) = sanity_warnings(skewed)
    assert "far below this run's local 90.00%" in warning and "--partition iid" in warning


def _with_cosines(report: dict[str, Any], per_round: list[dict[str, float | None]], **server: Any) -> dict[str, Any]:
    report["config"].update({"aggregation": "mean", "validation_samples": 0, "plausible_min_cosine": -1.0, **server})
    for record, cosines in zip(report["rounds"], per_round):
        record["robustness"] = {"update_directions": {"reference": "coordinate-wise median of the round's updates",
                                                      "threshold": -1.0, "agents": cosines}}
    return report


def test_an_update_that_keeps_pointing_against_the_others_is_warned_about_with_the_settings_that_stop_it(tmp_path: Path) -> None:
    honest = {"a-0": 0.99, "a-1": 0.98, "a-2": 0.97}
    flipped = _with_cosines(make_report(rounds=5, method="fedavg"),
                            [{**honest, "a-3": -0.99}, {**honest, "a-3": -0.95}, {**honest, "a-3": 0.2},
                             {**honest, "a-3": -0.91}, {**honest, "a-3": None}])
    (warning,) = sanity_warnings(flipped)
    assert warning.startswith("a-3's weight update pointed against the other agents' in 3 of the 4 rounds")
    assert "as low as -0.99" in warning and 'aggregation = "mean"' in warning
    assert 'aggregation = "median"' in warning and "validation_samples" in warning
    write_report(tmp_path / "flip", flipped)
    assert "a-3's weight update pointed against" in (tmp_path / "flip" / "summary.md").read_text()

    # An honest agent on skewed data that dips below the line in a minority of rounds is not named.
    dips = _with_cosines(make_report(rounds=5, method="fedavg"),
                         [{**honest, "a-3": -0.6}, {**honest, "a-3": 0.1}, {**honest, "a-3": -0.7}, {**honest, "a-3": 0.3},
                          {**honest, "a-3": 0.4}])
    assert sanity_warnings(dips) == []
    # One judged round is too few to say while the run goes on training ...
    assert sanity_warnings(_with_cosines(make_report(rounds=3, method="fedavg"), [{**honest, "a-3": -0.99}])) == []
    # ... but not when that round's aggregate broke the run: every round after it failed (each agent's loss NaN),
    # the run aborted, and only the accuracy of that one round was evaluated.
    for status in ("aborted", "finished"):
        broken = _with_cosines(make_report(rounds=4, method="fedavg"), [{**honest, "a-3": -0.95}])
        broken["status"] = status
        for record in broken["rounds"][1:]:
            record.update(status="failed_quorum", accuracy=None, local_accuracy=None)
        (warning,) = sanity_warnings(broken)
        assert warning.startswith("a-3's weight update pointed against the other agents' in 1 of the 1 rounds")
        assert "no round after round 1 trained" in warning and 'aggregation = "median"' in warning
        # Positive control for the rule, not the data: the same run with an honest a-3 names nobody.
        assert sanity_warnings(_with_cosines(broken, [{**honest, "a-3": 0.9}])) == []
    # An agent judged once in a run that judged others in later rounds is not named on that one round.
    late = _with_cosines(make_report(rounds=3, method="fedavg"), [{**honest, "a-3": -0.99}, honest, honest])
    assert sanity_warnings(late) == []
    # A setting that acts on such an update is on: nothing to add.
    for server in ({"aggregation": "median"}, {"aggregation": "multi_krum"}, {"validation_samples": 500},
                   {"plausible_min_cosine": 0.0}):
        report = _with_cosines(make_report(rounds=5, method="fedavg"), [{**honest, "a-3": -0.99}] * 5, **server)
        assert sanity_warnings(report) == [], server
    # A method that shares no weights records no cosines.
    assert sanity_warnings(make_report(rounds=5)) == []
