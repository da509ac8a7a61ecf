"""FedGKT end to end through the in-memory transport (fast; no broker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_server.report import validate_report

from fedhelpers import agent_config, in_memory_federation, server_config


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_agents_two_rounds(tmp_path: Path, mode: str) -> None:
    cfg = server_config(tmp_path, run_id=f"mem-{mode}", method_config={"mode": mode})
    fed = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)]).start()
    report = fed.join()
    validate_report(report)
    assert report["status"] == "finished"
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    for record in report["rounds"]:
        assert record["status"] == "ok"
        assert record["completed"] == ["agent-0", "agent-1"]
        assert record["samples"] == 160
        assert record["accuracy"] is not None and record["edge_accuracy"] is not None
        if record["round"] == 1:
            assert record["bytes"]["up_payload"] > 160 * 16 * 32 * 32 * 2 / 10  # feature maps went up
        else:  # the extractors stood still: the maps the server holds are reused, logits go up
            assert record["bytes"]["up_payload"] < 160 * 16 * 32 * 32 * 2 / 100
            assert record["method"]["maps_reused_samples"] == 160
        assert record["edge_train_flops"] > 0
    assert (tmp_path / "run" / "report.json").exists()
    # Round 2 trained with the server's logits of round 1 for every sample.
    for agent in fed.agents:
        assert len(agent.method.teacher) == 80
        assert agent.rounds_done == [1, 2]
