"""FedGKT's maps go up once, over a real mosquitto: with the default frozen extractor every
round after the first uploads a small part of the first one's bytes and learns exactly what
the same run with ``reuse_maps = false`` learns; a server that lost the held maps asks for them
and the round still trains on the right maps; a trained extractor uploads its maps every round."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_server.report import validate_report

from fedhelpers import agent_config, mqtt_federation, server_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROUNDS = 3


def _run(mosquitto: Any, tmp: Path, name: str, method: dict[str, Any], rounds: int = ROUNDS,
         drop_held_in_round: int | None = None) -> dict[str, Any]:
    """A sync run of two agents; ``drop_held_in_round``: the server forgets the maps it holds
    right after telling each agent of that round that it holds them (as a restart between the
    round config and the uploads would)."""
    out = tmp / name
    cfg = server_config(out, run_id=f"reuse-{name}", rounds=rounds, method_config=method)
    fed = mqtt_federation(cfg, [agent_config(cfg.run_id, i, 2) for i in range(2)], mosquitto.url)
    if drop_held_in_round is not None:
        server = fed.coordinator.method
        told = server.round_config

        def round_config(round_: int, agent: str, evaluate: bool) -> Any:
            config = told(round_, agent, evaluate)
            if round_ == drop_held_in_round:
                assert config[0]["held_maps"], "the server should hold this agent's maps by now"
                server.drop_held_maps(agent)
            return config

        server.round_config = round_config  # type: ignore[method-assign]
    fed.start().join(600)
    report = json.loads((out / "run" / "report.json").read_text())
    validate_report(report)
    assert report["status"] == "finished" and len(report["rounds"]) == rounds
    assert all(r["status"] == "ok" and r["samples"] == 160 and not r.get("excluded") for r in report["rounds"])
    return report


def _up(record: dict[str, Any]) -> tuple[int, int]:
    """(training's, evaluation's) bytes up on the wire in a round."""
    return record["bytes"]["up_wire"], record["evaluation"]["bytes"]["up_wire"]


def _server_model(out: Path) -> dict[str, np.ndarray]:
    """The server model's arrays in the run's last checkpoint."""
    with np.load(out / "run" / "checkpoint" / "method.npz", allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files if k.startswith("s/model/")}


def _global(report: dict[str, Any]) -> list[float]:
    return [r["evaluation"]["accuracy"]["model"] for r in report["rounds"]]


def test_frozen_extractor_sends_maps_once_and_learns_as_if_it_sent_them_every_round(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    reused = _run(mosquitto, tmp_path, "on", {})
    resent = _run(mosquitto, tmp_path, "off", {"reuse_maps": False})
    lost = _run(mosquitto, tmp_path, "lost", {}, drop_held_in_round=2)
    first_train, first_eval = _up(reused["rounds"][0])
    for record in reused["rounds"][1:]:
        train, evaluation = _up(record)
        assert train < first_train / 10 and evaluation < first_eval / 10, (record["round"], train, first_train, evaluation, first_eval)
        figures = record["method"]
        assert figures["maps_reused_samples"] == 160 and figures["maps_reused_batches"] == 4  # 80 samples an agent: 64 + 16
        assert figures["test_maps_reused_samples"] == 80
    assert "maps_reused_batches" not in reused["rounds"][0].get("method", {})
    # Without reuse every round uploads about as much as the first.
    for record in resent["rounds"]:
        assert _up(record)[0] > 0.8 * _up(resent["rounds"][0])[0]
        assert not any(k.startswith(("maps_", "test_maps_")) for k in record.get("method", {}))
    # The same seeds learn the same: the reused maps are the maps that would have been re-sent.
    assert _global(reused) == pytest.approx(_global(resent), abs=1e-9)
    assert [r["server_loss"] for r in reused["rounds"]] == pytest.approx([r["server_loss"] for r in resent["rounds"]], rel=1e-6)
    # Maps lost between the round config and the uploads: asked for in full, trained on as sent.
    assert lost["rounds"][1]["method"]["maps_requested_batches"] == 4
    assert lost["rounds"][1]["method"]["test_maps_requested_batches"] == 2
    assert _up(lost["rounds"][1])[0] > 0.8 * _up(lost["rounds"][0])[0]  # the maps went up again
    assert _global(lost) == pytest.approx(_global(resent), abs=1e-9)
    # The accuracies of so small a run are coarse: the server models they end with are the same too.
    final = {name: _server_model(tmp_path / name) for name in ("on", "off", "lost")}
    assert final["on"].keys() == final["off"].keys() and len(final["on"]) > 10
    for key, value in final["off"].items():
        np.testing.assert_allclose(final["on"][key], value, rtol=1e-6, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(final["lost"][key], value, rtol=1e-6, atol=1e-7, err_msg=key)
    assert "maps_reused_batches" in (tmp_path / "on" / "run" / "summary.md").read_text()


def test_a_trained_extractor_uploads_its_maps_every_round(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report = _run(mosquitto, tmp_path, "trained", {"train_extractor": True}, rounds=2)
    first, second = (_up(r) for r in report["rounds"])
    assert second[0] > 0.8 * first[0] and second[1] > 0.8 * first[1]
    assert not any(k.startswith(("maps_", "test_maps_")) for r in report["rounds"] for k in r.get("method", {}))
