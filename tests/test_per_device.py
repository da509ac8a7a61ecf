"""Per-device figures (cloud_server/report/per_device.py): every byte an agent sends is in
its own round's training or evaluation bytes, as the agent itself sent them; the link seconds
follow from the stated link speed (`edgesplit local --link-mbit`, `cloud-server report
--link-mbit`); an agent peaking above the stated device memory's share is warned about, with
the setting that lowers it, and one below it is not; the schema refuses a broken section."""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cloud_server.cli import main as cloud_server_main
from cloud_server.config import ServerConfig
from cloud_server.device_target import MEMORY_SHARE, DeviceTarget, parse_memory_size
from cloud_server.launcher import build_parser
from cloud_server.local_run import write_configs
from cloud_server.report import ReportError, validate_report, write_report
from cloud_server.report.per_device import per_device_section
from cloud_server.report.per_device_md import per_device_lines, per_device_md
from shared_protocol.frame import FrameLimits
from shared_protocol.messages import decode_message
from shared_protocol.tomlio import read_toml

from fedhelpers import agent_config, in_memory_federation, method_server_config

LINK_MBIT = 2.5


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[tuple[str, int, bool], int], Path]:
    """A two-agent, two-round FedAvg run in memory, with what each agent published: payload
    bytes by (agent, round, evaluation or not)."""
    tmp = tmp_path_factory.mktemp("per-device")
    cfg = replace(method_server_config(tmp, "fedavg", {"model": "resnet8", "batch_size": 32}, run_id="pd", rounds=2),
                  link_mbit=LINK_MBIT)
    fed = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2, train_samples=64, test_samples=32) for i in range(2)])
    sent: dict[tuple[str, int, bool], int] = defaultdict(int)
    for agent in fed.agents:
        transport, agent_id = agent.transport, agent.config.agent_id
        publish = transport.publish

        def counted(topic: str, blob: bytes, *args: Any, _publish: Any = publish, _agent: str = agent_id, **kw: Any) -> None:
            msg = decode_message(bytes(blob), FrameLimits(max_body_bytes=1 << 28))
            sent[(_agent, msg.round, msg.for_evaluation)] += len(blob)
            _publish(topic, blob, *args, **kw)

        transport.publish = counted  # type: ignore[method-assign]
    report = fed.start().join()
    return report, dict(sent), Path(cfg.out_dir)


def test_each_agents_evaluation_bytes_are_recorded_as_it_sent_them(run) -> None:  # type: ignore[no-untyped-def]
    report, sent, _ = run
    validate_report(report)
    for record in report["rounds"]:
        assert record["evaluation"] is not None
        assert sorted(record["device_bytes"]) == ["agent-0", "agent-1"]
        for agent, held in record["device_bytes"].items():
            assert held["evaluation"]["up_payload"] == sent[(agent, record["round"], True)] > 0
            assert held["evaluation"]["down_payload"] > 0  # the evaluation request
            assert held["train"]["up_payload"] >= sent.get((agent, record["round"], False), 0) > 0
        # Every up byte of the round is some agent's; the evaluation's are apart from training's.
        for kind, total in (("train", record["bytes"]), ("evaluation", record["evaluation"]["bytes"])):
            for key in ("up_payload", "up_wire"):
                assert sum(h[kind][key] for h in record["device_bytes"].values()) == total[key]


def test_link_seconds_follow_from_the_stated_link(run) -> None:  # type: ignore[no-untyped-def]
    report, _, _ = run
    section = report["per_device"]
    assert section["link_mbit"] == LINK_MBIT
    for agent, entry in section["agents"].items():
        rounds = [r["device_bytes"][agent] for r in report["rounds"]]
        up = sum(b["train"]["up_wire"] + b["evaluation"]["up_wire"] for b in rounds) / len(rounds)
        down = sum(b["train"]["down_wire"] + b["evaluation"]["down_wire"] for b in rounds) / len(rounds)
        assert entry["rounds"] == 2 and entry["up_wire"] == pytest.approx(up) and entry["down_wire"] == pytest.approx(down)
        assert entry["eval_up_wire"] > 0 and entry["up_wire"] == pytest.approx(entry["train_up_wire"] + entry["eval_up_wire"])
        assert entry["up_link_s"] == pytest.approx(up * 8 / (LINK_MBIT * 1e6))
        assert entry["down_link_s"] == pytest.approx(down * 8 / (LINK_MBIT * 1e6))
        assert entry["max_up_link_s"] >= entry["up_link_s"]
        assert entry["train_up_wire_per_image"] == pytest.approx(entry["train_up_wire"] / report["agents"][agent]["num_samples"])
        costs = [r["per_agent"][agent] for r in report["rounds"]]
        assert entry["compute_s"] == pytest.approx(sum(c["compute_s"] for c in costs) / 2) and entry["compute_s"] > 0
        assert entry["round_s"] == pytest.approx(sum(c["round_s"] for c in costs) / 2) and entry["round_s"] >= entry["compute_s"]
    text = "\n".join(per_device_md(report))
    assert "## Per device" in text and f"{LINK_MBIT:g} Mbit/s" in text and "| agent-0 |" in text and "Compute s" in text
    console = per_device_lines(report)
    assert console[0].startswith(f"per device, per round at {LINK_MBIT:g} Mbit/s: up ") and "evaluation" in console[0]


def test_cloud_server_report_reads_a_run_against_another_link(run, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    report, _, _ = run
    first, second = tmp_path / "a", tmp_path / "b"
    write_report(first, report)
    write_report(second, report)
    assert cloud_server_main(["report", str(first), str(second), "--link-mbit", "1", "--device-memory", "1TiB"]) == 0
    again = json.loads((first / "report.json").read_text())
    for agent, entry in again["per_device"]["agents"].items():
        assert entry["up_link_s"] == pytest.approx(report["per_device"]["agents"][agent]["up_link_s"] * LINK_MBIT)
        assert entry["memory_bytes"] == 2**40 and entry["memory_warning"] is None
    assert "at 1 Mbit/s each way" in (first / "summary.md").read_text()
    table = capsys.readouterr().out
    assert "MB up / device / round" in table and "at 1 Mbit/s" in table


def test_a_peak_above_the_devices_share_is_warned_with_the_setting_that_lowers_it(run) -> None:  # type: ignore[no-untyped-def]
    report, _, _ = run
    peak = max(e["peak_rss_bytes"] for e in report["per_device"]["agents"].values())
    small = per_device_section(report, DeviceTarget(device_memory=str(int(peak / MEMORY_SHARE) - 1)))  # just under
    assert small is not None and len(small["warnings"]) >= 1
    warned = [e for e in small["agents"].values() if e["memory_warning"]]
    assert all("--low-memory" in e["memory_warning"] and "memory.micro_batch_samples" in e["memory_warning"] for e in warned)
    big = per_device_section(report, DeviceTarget(device_memory=str(int(peak / MEMORY_SHARE) + 1)))
    assert big is not None and big["warnings"] == [] and all(e["memory_warning"] is None for e in big["agents"].values())
    shown = {**report, "per_device": small}
    validate_report(shown)
    assert "- **Memory warning**: agent" in "\n".join(per_device_md(shown))
    assert any(line.startswith("warning: agent") for line in per_device_lines(shown))
    # An agent already micro-batching is told to lower its micro-batch.
    micro = copy.deepcopy(report)
    for info in micro["agents"].values():
        info["memory"] = {"micro_batch_samples": 16}
    hinted = per_device_section(micro, DeviceTarget(device_memory="1MB"))
    assert hinted is not None
    assert all("now 16; e.g. --set memory.micro_batch_samples=8" in w for w in hinted["warnings"])


def test_the_schema_refuses_a_broken_per_device_section(run) -> None:  # type: ignore[no-untyped-def]
    report, _, _ = run
    validate_report(report)
    breakages = {
        "per_device.agents[agent-0].up_link_s": lambda r: r["per_device"]["agents"]["agent-0"].update(up_link_s=123.0),
        "per_device.agents[agent-1].eval_up_wire: missing": lambda r: r["per_device"]["agents"]["agent-1"].pop("eval_up_wire"),
        "per_device.link_mbit": lambda r: r["per_device"].update(link_mbit="fast"),
        "per_device.agents[agent-0].memory_warning": lambda r: r["per_device"]["agents"]["agent-0"].update(
            memory_bytes=1, memory_share=float(r["per_device"]["agents"]["agent-0"]["peak_rss_bytes"])),
        "rounds[0] (round 1).device_bytes[agent-0].evaluation.up_wire": lambda r: r["rounds"][0]["device_bytes"]["agent-0"][
            "evaluation"].update(up_wire=-1),
    }
    for where, breakage in breakages.items():
        broken = copy.deepcopy(report)
        breakage(broken)
        with pytest.raises(ReportError) as caught:
            validate_report(broken)
        assert any(p.startswith(where) for p in caught.value.problems), (where, caught.value.problems)


def test_the_device_target_is_checked_and_edgesplit_local_writes_it(tmp_path: Path) -> None:
    assert parse_memory_size("2GiB") == 2 * 2**30 and parse_memory_size("512MB") == 512 * 10**6
    for bad in ("2 gigs", "0", "-1GB"):
        with pytest.raises(ValueError, match="device_memory must be"):
            parse_memory_size(bad)
    with pytest.raises(ValueError, match="server.link_mbit must be a link speed"):
        ServerConfig(link_mbit=0)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["local", "--device-memory", "lots"])
    assert exited.value.code == 2
    args = build_parser().parse_args(["local", "--method", "fedavg", "--link-mbit", "1", "--device-memory", "2GiB"])
    server_cfg, _ = write_configs(args, "t", tmp_path, "mqtt://127.0.0.1:1883")
    config = ServerConfig.from_dict(read_toml(server_cfg))
    assert config.link_mbit == 1.0 and config.device_memory == "2GiB"
    assert DeviceTarget.of_config(config.to_dict()).memory_bytes == 2 * 2**30
