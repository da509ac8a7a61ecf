"""Each activation defence over a real mosquitto, then attacked by `edgesplit audit` on what
the server received: 2 agents, 1 round, a few images. The run report states what was on;
the audit attacks the noised maps (clipping modelled, its decoder trained on noised public
maps), the deeper cut's 64-channel maps through the deeper extractor where the server holds
it, and says so where it holds no extractor (a private initialisation)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from audithelpers import one_torch_thread  # noqa: F401 (a fixture: importing it applies it here)
from cloud_server.audit.kept import load_kept_run
from cloud_server.launcher import main as edgesplit
from conftest import Broker
from fedhelpers import FAST_GKT, method_server_config
from test_audit_e2e import AGENTS, agent_configs, run_and_keep

NOISE = {"map_clip_norm": 5.0, "map_noise_multiplier": 1.0}
CUT = {"edge_model": "resnet8_stage1", "server_model": "resnet55_server_stage1"}
SL = {"batch_size": 16}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "fedgkt-noise": ("fedgkt", {**FAST_GKT, **NOISE}),
    "fedgkt-per-agent-init": ("fedgkt", {**FAST_GKT, "edge_init": "per_agent"}),
    "fedgkt-nopeek": ("fedgkt", {**FAST_GKT, "nopeek_alpha": 0.5, "train_extractor": True}),
    "fedgkt-deeper-cut": ("fedgkt", {**FAST_GKT, **CUT}),
    "splitnn-noise": ("splitnn", {**SL, **NOISE}),
    "splitnn-nopeek-deeper-cut": ("splitnn", {**SL, **CUT, "nopeek_alpha": 0.5}),
}


def _rows(agent: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["attack"]: row for row in agent["attacks"]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_defended_run_over_mosquitto_is_reported_and_audited(case: str, tmp_path: Path, mosquitto: Broker,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    method, table = CASES[case]
    run_id = case.replace("-", "")[:30]
    config = method_server_config(tmp_path, method, table, run_id=run_id, agents=AGENTS, rounds=1, dataset="fashion-mnist",
                                  eval_samples=40, audit=True, audit_samples_per_agent=16 if method == "splitnn" else 4)
    run_dir = run_and_keep(config, agent_configs(run_id, 32 if method == "splitnn" else 48), mosquitto)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "finished" and report["rounds"][-1]["accuracy"] is not None
    defences = report["defences"]
    summary = (run_dir / "summary.md").read_text()
    assert "## Protecting activations" in summary
    kept = load_kept_run(run_dir)
    channels = {maps.features.shape[1] for maps in kept.maps.values()}
    # Without the extractor the white-box and inverse-network attacks do not apply (the audit refuses to be asked).
    attacks = "architecture_only" if case == "fedgkt-per-agent-init" else "white_box_inversion,inverse_network,architecture_only"
    assert edgesplit(["audit", str(run_dir), "--steps", "25", "--public-samples", "40", "--threads", "1",
                      "--attacks", attacks]) == 0
    leakage = json.loads((run_dir / "audit" / "leakage.json").read_text())
    agents = list(leakage["agents"].values())
    assert len(agents) == AGENTS

    if "noise" in case:
        assert defences["map_noise_multiplier"] == 1.0 and defences["epsilon_per_map"] > 0
        assert "ε per released map" in summary
        # What the audit attacked is what went up: the noise (std 5 per coordinate) is in the kept maps.
        for maps in kept.maps.values():
            assert float(maps.features.float().std()) > 3.0
        for agent in agents:
            rows = _rows(agent)
            assert rows["inverse_network"]["decoder_input"] == "public maps clipped and noised as the agents' were"
            white_box = rows["white_box_inversion"]
            assert white_box["psnr_db"] < white_box["baseline_psnr_db"] + 10.0
    if case == "fedgkt-per-agent-init":
        assert defences["private_extractor"] is True and defences["edge_init"] == "per_agent"
        assert "extractor_weights" not in leakage["knowledge"]["holds"]
        assert "edge_init" in json.dumps(leakage["knowledge"])  # the audit says why it holds none
        for agent in agents:  # the architecture-only attack is what is left
            assert set(_rows(agent)) == {"architecture_only"} and "psnr_db" in _rows(agent)["architecture_only"]
        capsys.readouterr()
        assert edgesplit(["audit", str(run_dir), "--attacks", "white_box_inversion"]) == 2
        assert "do not apply" in capsys.readouterr().err
    if "nopeek" in case:
        assert defences["nopeek_alpha"] == 0.5
    if "deeper-cut" in case:
        assert defences["cut"] == "stage1" and channels == {64}
        for agent in agents:
            white_box = _rows(agent)["white_box_inversion"]
            assert "psnr_db" in white_box  # inverted through the deeper extractor the server held
    else:
        assert channels == {16}
