"""Typed records (shared_protocol/records.py, cloud_server/records.py) and the run recorder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloud_server.methods.base import RoundOutcome
from cloud_server.recorder import RunCounters, RunRecorder
from cloud_server.records import AgentInfo, ByteCounts, RoundEvaluation, RoundRecord, RunReport, ServerInfo
from cloud_server.report import load_report, validate_report
from shared_protocol import errors
from shared_protocol.messages import RoundEnd, decode_message, encode_message
from shared_protocol.records import AgentRoundCosts, RecordError


def _costs(**kw: object) -> AgentRoundCosts:
    base: dict[str, object] = {"samples": 40, "train_flops": 4000, "compute_s": 2.0, "encode_s": 0.5, "network_s": 1.0,
                               "idle_s": 0.25, "round_s": 4.0, "peak_rss_bytes": 10**8, "payload_bytes_up": 1000,
                               "wire_bytes_up": 1100, "payload_bytes_down": 50, "wire_bytes_down": 60,
                               "codec": "fp16-zstd", "codec_ratio": 4.5}
    return AgentRoundCosts(**{**base, **kw})  # type: ignore[arg-type]


def _end(agent: str, costs: AgentRoundCosts, **metrics: object) -> RoundEnd:
    return RoundEnd(run="r", round=1, sender=agent, num_samples=costs.samples, costs=costs, metrics=dict(metrics))


# --------------------------------------------------------------------------- #
# the JSON (de)serialiser
# --------------------------------------------------------------------------- #


def test_agent_costs_keep_their_wire_keys_and_round_trip() -> None:
    costs = _costs()
    raw = costs.to_json()
    # The keys agents sent as a plain dict before the record existed, plus skipped_batches (added with
    # the agents' deadline) and peak_rss_per_round (added with the per-round peak): old and new
    # peers interoperate.
    old_keys = {"samples", "train_flops", "compute_s", "encode_s", "network_s", "idle_s", "round_s",
                "peak_rss_bytes", "payload_bytes_up", "wire_bytes_up", "payload_bytes_down",
                "wire_bytes_down", "codec", "codec_ratio"}
    assert set(raw) == old_keys | {"skipped_batches", "peak_rss_per_round"}
    assert AgentRoundCosts.from_json(raw) == costs
    # An older agent's costs (no skipped_batches, no peak_rss_per_round) read as "nothing skipped"
    # and take the record's default for the peak's kind.
    older = AgentRoundCosts.from_json({k: raw[k] for k in old_keys})
    assert older.skipped_batches == 0 and older.peak_rss_per_round is True
    assert decode_message(encode_message(_end("a", costs))).costs == costs
    # A plain dict where the record belongs is a mistake of the sender's code, said before anything is sent.
    with pytest.raises(TypeError, match=r"round_end.costs must be AgentRoundCosts, got dict; build it with"):
        encode_message(RoundEnd(run="r", round=1, sender="a", num_samples=1, costs=raw))  # type: ignore[arg-type]


def test_reading_takes_defaults_ignores_unknown_keys_and_names_bad_fields() -> None:
    assert AgentRoundCosts.from_json({"compute_s": 3, "from_a_newer_agent": 1}) == AgentRoundCosts(compute_s=3.0)
    with pytest.raises(RecordError, match=r"AgentRoundCosts.samples: expected int, got bool"):
        AgentRoundCosts.from_json({"samples": True})
    with pytest.raises(RecordError, match=r"AgentRoundCosts.samples: expected int, got float"):
        AgentRoundCosts.from_json({"samples": 1.5})
    with pytest.raises(RecordError, match=r"codec_ratio = -1.0 must be in \[0, inf\]"):
        AgentRoundCosts.from_json({"codec_ratio": -1})
    with pytest.raises(RecordError, match=r"RoundRecord.status: missing"):
        RoundRecord.from_json({"round": 1})
    with pytest.raises(RecordError, match=r"round status must be one of"):
        RoundRecord(round=1, status="partial")
    # A RecordError is both a protocol error (a peer's message is rejected) and a ValueError.
    assert issubclass(RecordError, errors.ValueRangeError) and issubclass(RecordError, ValueError)


def test_to_json_is_strict_json() -> None:
    import numpy as np

    record = RoundRecord(round=1, status="ok", method={"rank": np.int64(3), "loss": float("nan"), "ranks": np.arange(2)})
    raw = record.to_json()
    assert raw["method"] == {"rank": 3, "loss": None, "ranks": [0, 1]}
    json.dumps(raw, allow_nan=False)
    # Optional sections stay out while empty.
    assert not {"excluded", "server", "server_train_flops"} & set(raw)
    assert "method" not in RoundRecord(round=1, status="ok").to_json()


# --------------------------------------------------------------------------- #
# round_end metrics: one naming rule for every method
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("metrics", [
    {"mentor_accuracy": 1.5},  # FedKD's name
    {"some_new_method_accuracy": -0.1},  # a method the message type has never heard of
    {"probe_accuracy": "high"},
    {"probe_correct": 3, "probe_total": 2},
    {"probe_correct": 1},  # a count of correct answers needs its total
    {"probe_correct": 1.0, "probe_total": 2},
])
def test_round_end_metric_names_are_checked_whatever_the_method(metrics: dict[str, object]) -> None:
    with pytest.raises(errors.ValueRangeError):
        RoundEnd(run="r", round=1, sender="a", num_samples=1, metrics=metrics).validate()


def test_round_end_metrics_outside_the_naming_rule_are_free() -> None:
    metrics = {"train_loss": -0.5, "start_loss_sum": 12.5, "start_loss_total": 2.5, "probe_accuracy": None,
               "probe_correct": 2, "probe_total": 2}
    RoundEnd(run="r", round=1, sender="a", num_samples=1, metrics=metrics).validate()


# --------------------------------------------------------------------------- #
# the recorder
# --------------------------------------------------------------------------- #


def _report(rounds: int = 2) -> RunReport:
    return RunReport(edgesplit_version="0.1.0", run_id="rec", method="fedavg", config={"rounds": rounds},
                     server=ServerInfo(device="cpu", cpu_model="x", torch="t", hostname="h"),
                     models={"edge": {"name": "resnet8", "params": 10, "train_flops_per_sample": 100}, "server": None})


def _agent(cores: int) -> AgentInfo:
    return AgentInfo(cpu_model="arm", arch="aarch64", cores=cores, memory_bytes=1, backend="torch", num_samples=40,
                     class_counts=[20, 20])


def test_recorder_builds_rounds_from_round_ends_and_writes_a_valid_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rejected = {"stale_round": 2}
    recorder = RunRecorder(tmp_path, 2, RunCounters(agents=lambda: {"a": _agent(4), "b": _agent(2)},
                                                    rejected=lambda: rejected, rejected_chunks=lambda: {"bad_chunk": 1}))
    recorder.begin(_report())
    recorder.account(1, "up", 100, 120)
    recorder.account(1, "down", 10, 15)
    recorder.account(None, "up", 7, 9)  # outside any round
    recorder.account(1, "up", 40, 50, evaluation=True)  # an evaluation report: apart from the round's bytes
    ends = {"b": _end("b", _costs(compute_s=4.0)), "a": _end("a", _costs())}
    outcome = RoundOutcome(server_loss=0.5, samples=80, server_train_s=1.5, excluded={"b": "stale"})
    evaluation = RoundEvaluation(accuracy={"model": 0.75, "edge": 0.5}, local_accuracy={"model": 0.8, "edge": 0.6},
                                 labels={"model": "deployed", "edge": "on the device"},
                                 per_agent={"b": {"accuracy": {"model": 0.7, "edge": 0.75}}}, server_eval_s=0.5,
                                 edge_eval_flops=123, edge_eval_s=0.25)
    checkpoints: list[int] = []
    record = recorder.round_record(1, "ok", participants={"a", "b", "c"}, ends=ends, outcomes=[outcome],
                                   started_at=0.0, server=None, method_figures={"note": 1}, evaluation=evaluation,
                                   edge_label="edge")
    recorder.add_round(record, checkpoint=lambda: checkpoints.append(len(recorder.report.rounds)))

    assert (record.completed, record.missing, record.excluded) == (["a"], ["b", "c"], {"b": "stale"})
    assert record.accuracy == 0.75 and record.edge_accuracy == 0.5 and record.server_loss == 0.5
    assert record.local_accuracy == 0.8 and record.edge_local_accuracy == 0.6
    assert record.bytes == ByteCounts(up_payload=100, up_wire=120, down_payload=10, down_wire=15)
    assert record.evaluation is not None and record.evaluation.bytes == ByteCounts(up_payload=40, up_wire=50)
    assert record.evaluation.edge_eval_flops == 123
    assert record.time_s.edge_compute == 3.0 and record.time_s.server_train == 1.5
    assert record.edge_train_flops == 8000 and list(record.per_agent) == ["a", "b"]
    assert record.per_agent["b"].edge_accuracy == 0.75 and record.per_agent["b"].compute_s == 4.0
    assert record.per_agent["a"].edge_accuracy is None  # not scored
    assert checkpoints == [1]  # checkpointed with the round in it, before the files
    assert "round 1/2  global acc 75.00%  (local 80.00%, edge 50.00%)" in capsys.readouterr().out

    on_disk = load_report(tmp_path)
    assert on_disk == recorder.report.to_json()
    totals = on_disk["totals"]
    assert totals["up_wire"] == 120 and totals["outside_rounds"]["up_wire"] == 9
    assert totals["eval_bytes"]["up_wire"] == 50 and totals["final_local_accuracy"] == 0.8
    assert totals["rejected_by_reason"] == rejected and totals["rejected_chunks"] == 1
    assert on_disk["agents"]["b"]["cores"] == 2 and on_disk["rounds"][0]["method"] == {"note": 1}
    assert RunReport.from_json(on_disk) == recorder.report


def test_recorder_checkpoint_carries_the_report_and_counters_over(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, 3, RunCounters(rejected_chunks=lambda: {"bad_chunk": 2}))
    recorder.begin(_report(3))
    recorder.add_round(recorder.round_record(1, "failed_quorum", participants=["a"], ends={}, outcomes=[],
                                             started_at=0.0, server=None))
    recorder.save_checkpoint({"w": [1.0]}, round_=1, config={"c": 1}, method_config={"m": 2}, rejected={"x": 1})
    wall_s = recorder.report.totals.wall_time_s

    again = RunRecorder(tmp_path, 3, RunCounters(rejected_chunks=lambda: {"bad_chunk": 1}))
    saved = again.load_checkpoint()

    assert (saved.round, saved.config, saved.method_config, saved.rejected) == (1, {"c": 1}, {"m": 2}, {"x": 1})
    assert saved.method_state == {"w": [1.0]}
    assert again.report.rounds == recorder.report.rounds and again.report.status == "running"
    again.finish("finished")
    report = load_report(tmp_path)
    validate_report(report)
    assert report["status"] == "finished" and report["finished_at"] is not None
    assert report["totals"]["wall_time_s"] >= wall_s  # the time before the restart counts too
    assert report["totals"]["rejected_chunks_by_reason"] == {"bad_chunk": 3}


def test_recorder_refuses_a_missing_checkpoint_and_a_report_before_begin(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, 1)
    with pytest.raises(FileNotFoundError, match="run without --resume"):
        recorder.load_checkpoint()
    with pytest.raises(RuntimeError, match="begin"):
        recorder.write()



def _dict_keys(path: Path) -> set[str]:
    """The string constants that ``path`` uses as dict-literal keys (``"key": value``)."""
    import tokenize

    keys = set()
    with path.open("rb") as f:
        tokens = [t for t in tokenize.tokenize(f.readline) if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]
    for before, token, following in zip(tokens, tokens[1:], tokens[2:]):
        if token.type == tokenize.STRING and before.string in ("{", ",") and following.string == ":":
            keys.add(token.string.strip("\"'"))
    return keys


def test_no_dict_literal_spells_out_the_run_record() -> None:
    """Records are built in one place (cloud_server/recorder.py, from cloud_server/records.py):
    no module types the record's keys out as a dict literal."""
    root = Path(__file__).resolve().parent.parent
    # Keys only the run record has (names like "round" or "samples" are common elsewhere).
    record_keys = {"edge_train_flops", "per_agent", "payload_bytes_up", "wire_bytes_down", "edge_compute", "edge_idle",
                   "rounds_completed", "final_edge_accuracy", "rejected_by_reason", "gpu_utilization_samples",
                   "edgesplit_version"}
    offenders = sorted(
        f"{path.relative_to(root)}: {key}"
        for package in ("cloud_server", "edge_agent", "shared_protocol")
        for path in (root / package).rglob("*.py")
        for key in _dict_keys(path) & record_keys
    )
    assert offenders == []
