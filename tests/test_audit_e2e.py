"""`edgesplit audit` end to end: a tiny federation over a real mosquitto keeps what its
server received (``[server] audit``), then the audit re-derives the agents' private images
from their data configs and attacks what was kept.

FedGKT is the positive control: its server sent every agent the initial ResNet-8 and the
stems stay there (``train_extractor = false``), so the white-box attack inverts the maps
through the exact stem and must score far above the mean-image baseline by construction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from audithelpers import one_torch_thread  # noqa: F401 (a fixture: importing it applies it here)
from cloud_server.audit.audit_updates import local_schedule, received_update, start_model
from cloud_server.audit.kept import agent_images, load_kept_run
from cloud_server.audit.scoring import PixelSpace
from cloud_server.audit.updates import unrolled_update
from cloud_server.launcher import main as edgesplit
from conftest import Broker
from edge_agent.config import DataConfig, EdgeConfig
from fedhelpers import method_server_config, mqtt_federation, server_config, write_agent_toml

AGENTS = 2


def agent_configs(run_id: str, train_samples: int) -> list[EdgeConfig]:
    return [EdgeConfig(agent_id=f"agent-{i}", run_id=run_id, broker_url="mqtt://127.0.0.1:1", progress=False,
                       data=DataConfig(dataset="fashion-mnist", partition="iid", num_agents=AGENTS, agent_index=i, seed=0,
                                       train_samples=train_samples, test_samples=40))
            for i in range(AGENTS)]


def run_and_keep(config, agents: list[EdgeConfig], broker: Broker) -> Path:  # type: ignore[no-untyped-def]
    """Run the federation, then write the agents' configs where `edgesplit local` writes them."""
    mqtt_federation(config, agents, broker.url).start().join(240)
    run_dir = Path(config.out_dir)
    (run_dir / "configs").mkdir(exist_ok=True)
    for i, agent in enumerate(agents):
        write_agent_toml(run_dir / "configs" / f"agent-{i}.toml", agent)
    return run_dir


def test_audit_of_a_fedgkt_run_recovers_the_private_images(tmp_path: Path, mosquitto: Broker, capsys) -> None:  # type: ignore[no-untyped-def]
    config = server_config(tmp_path, run_id="audit-gkt", agents=AGENTS, rounds=1, dataset="fashion-mnist", eval_samples=40,
                           audit=True, audit_samples_per_agent=4)
    run_dir = run_and_keep(config, agent_configs("audit-gkt", 64), mosquitto)
    assert edgesplit(["audit", str(run_dir), "--steps", "150", "--public-samples", "40", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "white_box_inversion" in printed and "local simulation" in printed
    leakage = json.loads((run_dir / "audit" / "leakage.json").read_text())
    assert leakage["method"] == "fedgkt" and "extractor_weights" in leakage["knowledge"]["holds"]
    assert set(leakage["agents"]) == {"agent-0", "agent-1"}
    for agent in leakage["agents"].values():
        rows = {row["attack"]: row for row in agent["attacks"]}
        assert set(rows) == {"white_box_inversion", "inverse_network", "architecture_only", "labels_in_the_clear",
                             "logit_histogram"}
        white_box = rows["white_box_inversion"]
        assert white_box["num_images"] == 4
        assert white_box["psnr_db"] > white_box["baseline_psnr_db"] + 25.0 and white_box["ssim"] > 0.95
        # Every round is evaluated here: the extractor is the ResNet-8 that came with the round's evaluation report.
        assert white_box["extractor"] == "the edge model of the agent's evaluation report of the round"
        assert rows["labels_in_the_clear"]["histogram_error"] < 1e-9  # every label of the round went up in the clear
        assert all("wall_s" in row and "assumes" in row for row in agent["attacks"] if "psnr_db" in row)
    # Evaluation's upload, the maps of the agents' local test images, is attacked too: private images as well.
    for agent in leakage["agents"].values():
        evaluation = {row["attack"]: row for row in agent["evaluation_uploads"]["attacks"]}
        assert set(evaluation) == {"white_box_inversion", "inverse_network", "architecture_only"}
        assert evaluation["white_box_inversion"]["psnr_db"] > evaluation["white_box_inversion"]["baseline_psnr_db"] + 25.0
    assert (run_dir / "audit" / "leakage.png").stat().st_size > 0
    # The fourth column: the run's own report carries the audit, summary.md shows it, the grid sits beside the plots.
    report = json.loads((run_dir / "report.json").read_text())
    section = report["leakage"]
    assert section["strongest"] in ("white_box_inversion", "inverse_network", "architecture_only")
    best = section["image_attacks"][section["strongest"]]
    assert best["psnr_db"] == max(row["psnr_db"] for agent in leakage["agents"].values() for row in agent["attacks"]
                                  if "psnr_db" in row)
    assert section["label_attacks"]["labels_in_the_clear"]["histogram_error"] < 1e-9
    summary = (run_dir / "summary.md").read_text()
    assert "## What the server can reconstruct (leakage audit)" in summary
    assert f"{best['psnr_db']:.1f}" in summary and "extractor_weights" in summary
    assert (run_dir / "leakage.png").read_bytes() == (run_dir / "audit" / "leakage.png").read_bytes()
    # A deployment's server holds no agent data configs: the private images are on the devices.
    for path in (run_dir / "configs").glob("agent-*.toml"):
        path.unlink()
    capsys.readouterr()
    assert edgesplit(["audit", str(run_dir), "--attacks", "white_box_inversion"]) == 2
    assert "private images are on their devices" in capsys.readouterr().err


def test_audit_of_a_fedavg_run(tmp_path: Path, mosquitto: Broker) -> None:
    config = method_server_config(tmp_path, "fedavg", {"model": "resnet8", "batch_size": 4}, run_id="audit-avg", agents=AGENTS,
                                  rounds=1, dataset="fashion-mnist", eval_samples=40, audit=True)
    run_dir = run_and_keep(config, agent_configs("audit-avg", 8), mosquitto)
    kept = json.loads((run_dir / "audit" / "kept.json").read_text())
    assert sorted(kept["files"]) == ["update-agent-0.npz", "update-agent-1.npz"]
    # What was kept is exact: the round config's schedule, replayed from the kept global model on the
    # agent's private images (derived from its data config), gives the kept update.
    run = load_kept_run(run_dir)
    images = agent_images(run_dir, sorted(run.updates))
    for agent, update in run.updates.items():
        private, labels = images.all_of(agent)
        schedule, _ = local_schedule(update)
        replayed = unrolled_update(start_model(run, update), PixelSpace.of_dataset("fashion-mnist", 1).to_model(private),
                                   torch.from_numpy(labels).long(), schedule)
        received = received_update(update)
        for name, delta in replayed.items():
            assert F.cosine_similarity(delta.detach().flatten(), received[name].flatten(), dim=0) > 0.999, name
    assert edgesplit(["audit", str(run_dir), "--steps", "30", "--public-samples", "40", "--threads", "1"]) == 0
    leakage = json.loads((run_dir / "audit" / "leakage.json").read_text())
    assert leakage["knowledge"]["holds"] == ["start_model", "local_schedule", "public_images", "architecture"]
    for agent in leakage["agents"].values():
        assert agent["kept"] == "fedavg.update" and agent["num_samples"] == 4
        rows = {row["attack"]: row for row in agent["attacks"]}
        assert set(rows) == {"update_inversion", "bias_update_labels"}
        inversion = rows["update_inversion"]
        # One epoch of Adam on 4 images: the schedule the attack unrolls is the round config's.
        assert inversion["schedule"]["optimizer"] == "adam" and inversion["schedule"]["local_steps"] == 1
        assert inversion["num_images"] == 4 and inversion["baseline_psnr_db"] > 0
        assert 0.0 <= rows["bias_update_labels"]["histogram_error"] <= 1.0


def test_audit_of_a_split_learning_run(tmp_path: Path, mosquitto: Broker) -> None:
    # A turn's first batch, kept whole however few rows audit_samples_per_agent asks for, with the extractor
    # the server sent at the turn's start: the white box runs it with the batch's own normalisation
    # statistics, as the agent's training did.
    config = method_server_config(tmp_path, "splitnn", {"batch_size": 16}, run_id="audit-sl", agents=AGENTS, rounds=1,
                                  dataset="fashion-mnist", eval_samples=40, audit=True, audit_samples_per_agent=4)
    run_dir = run_and_keep(config, agent_configs("audit-sl", 32), mosquitto)
    assert edgesplit(["audit", str(run_dir), "--steps", "150", "--public-samples", "40", "--threads", "1",
                      "--attacks", "white_box_inversion,labels_in_the_clear"]) == 0
    leakage = json.loads((run_dir / "audit" / "leakage.json").read_text())
    for agent in leakage["agents"].values():
        rows = {row["attack"]: row for row in agent["attacks"]}
        assert set(rows) == {"white_box_inversion", "labels_in_the_clear"}
        white_box = rows["white_box_inversion"]
        assert white_box["num_images"] == 16 and "matched" in white_box  # the uploads carry no sample ids
        assert white_box["psnr_db"] > white_box["baseline_psnr_db"] + 15.0
        # Evaluation's activations of the agent's local test images, through the round's final extractor
        # in eval mode: kept (audit_samples_per_agent rows) and inverted like the training batch.
        evaluation = agent["evaluation_uploads"]
        assert evaluation["maps"] == 4
        (eval_white_box,) = evaluation["attacks"]
        assert eval_white_box["attack"] == "white_box_inversion" and "final extractor" in eval_white_box["extractor"]
        assert eval_white_box["psnr_db"] > eval_white_box["baseline_psnr_db"] + 15.0


def test_a_run_that_kept_nothing_names_the_fix(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "report.json").write_text(json.dumps({"config": {"method": "fedgkt"}}))
    assert edgesplit(["audit", str(tmp_path)]) == 2
    assert "rerun with `edgesplit local --audit`" in capsys.readouterr().err


def test_uploads_the_audit_does_not_read_are_named_not_reported_safe(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "report.json").write_text(json.dumps({"config": {"method": "mymethod"}}))
    (tmp_path / "audit").mkdir()
    (tmp_path / "audit" / "kept.json").write_text(json.dumps({"method": "mymethod", "files": {},
                                                              "not_kept": {"mymethod.upload": 3}}))
    assert edgesplit(["audit", str(tmp_path)]) == 2
    assert "mymethod.upload" in capsys.readouterr().err


# The other weight-sharing methods (FedGKD, FedDistill and FedBE upload as FedAvg does): each keeps
# its upload and its audit reads it (the update attacks' strength is tested in test_audit_updates.py).
OTHER_METHODS = {
    "fedgkd": ("fedavg.update", {"model": "resnet8", "batch_size": 4, "buffer_size": 2}),
    "feddistill": ("fedavg.update", {"model": "resnet8", "batch_size": 4}),
    "fedbe": ("fedavg.update", {"model": "resnet8", "batch_size": 4, "unlabeled_dataset": "fashion-mnist", "agent_train_samples": 8,
                               "unlabeled_samples": 16, "sampled_models": 2, "distill_steps": 2, "distill_batch_size": 8,
                               "swa_warmup_steps": 1, "swa_cycle_steps": 1}),
    "fedkd": ("fedkd.update", {"mentor_model": "resnet20", "mentee_model": "resnet8", "batch_size": 4}),
}


@pytest.mark.parametrize("method", sorted(OTHER_METHODS))
def test_audit_of_every_other_weight_sharing_method(method: str, tmp_path: Path, mosquitto: Broker) -> None:
    kind, table = OTHER_METHODS[method]
    config = method_server_config(tmp_path, method, table, run_id=f"audit-{method}", agents=AGENTS, rounds=1,
                                  dataset="fashion-mnist", eval_samples=40, audit=True)
    run_dir = run_and_keep(config, agent_configs(f"audit-{method}", 8), mosquitto)
    assert edgesplit(["audit", str(run_dir), "--steps", "10", "--public-samples", "40", "--threads", "1"]) == 0
    leakage = json.loads((run_dir / "audit" / "leakage.json").read_text())
    assert leakage["method"] == method and set(leakage["agents"]) == {"agent-0", "agent-1"}
    for agent in leakage["agents"].values():
        assert agent["kept"] == kind and agent["num_samples"] == 4
        rows = {row["attack"]: row for row in agent["attacks"]}
        assert set(rows) == {"update_inversion", "bias_update_labels"}
        assert rows["update_inversion"]["num_images"] == 4
        assert 0.0 <= rows["bias_update_labels"]["histogram_error"] <= 1.0
        assert 0.0 <= rows["bias_update_labels"]["baseline_histogram_error"] <= 1.0  # a uniform guess, beside it
    section = json.loads((run_dir / "report.json").read_text())["leakage"]
    assert section["strongest"] == "update_inversion" and "start_model" in section["knowledge"]
    # No evaluation report hands a model over: FedKD's mentor is scored on the device.
    handed = json.loads((run_dir / "audit" / "kept.json").read_text())["eval_models"]
    assert handed == {} and section["notes"] == []
