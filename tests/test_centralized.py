"""Centralized training (the Table 1 reference rows): the union of the agents'
data, the same report format with zero bytes, the command lines; and the
full-scale paper configs parse into valid configurations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cloud_server.centralized import CentralizedConfig, CentralizedTrainer, load_union
from cloud_server.config import ServerConfig
from cloud_server.methods.fedavg import FedAvgConfig
from cloud_server.methods.fedgkt import FedGktConfig
from cloud_server.methods.splitnn import SplitNNConfig
from cloud_server.report import load_report, validate_report
from edge_agent.config import EdgeConfig
from fldata import PartitionSpec, agent_shard
from shared_protocol.tomlio import read_toml

from fedhelpers import ROOT

PAPER_CONFIGS = ROOT / "deploy" / "configs" / "paper"


def _config(tmp_path: Path, **method: object) -> ServerConfig:
    return ServerConfig(
        run_id="central", method="centralized", out_dir=str(tmp_path / "run"), rounds=2, dataset="synthetic", seed=3,
        progress=False, method_config={"model": "resnet8", "batch_size": 32, "train_samples": 192, "test_samples": 64, **method},
    )


def test_trains_on_the_union_of_the_agents_data_and_writes_a_report(tmp_path: Path) -> None:
    config = _config(tmp_path)
    train, test = load_union(config, CentralizedConfig.from_dict(config.method_config))
    # The same samples a 4-agent federation with this seed partitions among its agents.
    spec = PartitionSpec.parse("dirichlet:0.5", 4, config.seed)
    shards = [agent_shard(train, spec, k) for k in range(4)]
    np.testing.assert_array_equal(np.sort(np.concatenate([s.sample_ids for s in shards])), np.sort(train.sample_ids))
    assert len(train) == 192 and len(test) == 64

    report = CentralizedTrainer(config).run()
    validate_report(report)
    on_disk = load_report(tmp_path / "run")
    assert on_disk["status"] == "finished" and on_disk["method"] == "centralized"
    assert [r["round"] for r in on_disk["rounds"]] == [1, 2]
    for record in on_disk["rounds"]:
        assert record["samples"] == 192 and record["accuracy"] is not None and record["participants"] == []
        assert record["server_train_flops"] == 192 * on_disk["models"]["server"]["train_flops_per_sample"]
    totals = on_disk["totals"]
    assert totals["wire_total"] == 0 and totals["edge_train_flops"] == 0
    assert on_disk["models"]["edge"] is None and on_disk["models"]["server"]["name"] == "resnet8"
    for name in ("summary.md", "rounds.csv", "accuracy_vs_round.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0


def test_stops_at_the_target_accuracy(tmp_path: Path) -> None:
    import dataclasses

    config = dataclasses.replace(_config(tmp_path), rounds=5, target_accuracy=0.01)
    report = CentralizedTrainer(config).run()
    assert report["status"] == "stopped_target" and len(report["rounds"]) == 1


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="feature maps"):
        CentralizedConfig(model="resnet55_server")
    with pytest.raises(ValueError, match="unknown"):
        CentralizedConfig.from_dict({"epochs": 3})
    with pytest.raises(ValueError, match="centralized"):
        CentralizedTrainer(ServerConfig(method="fedgkt"))


@pytest.mark.slow
def test_edgesplit_centralized_from_flags(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "cloud_server.launcher", "centralized", "--model", "resnet8", "--rounds", "1",
         "--dataset", "synthetic", "--train-samples", "64", "--test-samples", "32", "--out", str(out), "--run-id", "c-cli"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "round 1/1" in result.stdout and "# EdgeSplit run `c-cli` — centralized" in result.stdout
    report = json.loads((out / "report.json").read_text())
    validate_report(report)
    assert read_toml(out / "configs" / "server.toml")["centralized"]["model"] == "resnet8"
    assert not (out / "configs" / "agent-0.toml").exists()  # no agents


@pytest.mark.parametrize("path", sorted(PAPER_CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_paper_configs_are_valid(path: Path) -> None:
    doc = read_toml(path)
    if "agent" in doc:
        doc["agent"].pop("password_file")  # a path on the device
        config = EdgeConfig.from_dict(doc)
        assert config.data.num_agents == 16
        return
    server = ServerConfig.from_dict(doc)
    parse = {"fedgkt": FedGktConfig.from_dict, "fedavg": FedAvgConfig.from_dict, "splitnn": SplitNNConfig.from_dict,
             "centralized": CentralizedConfig.from_dict}[server.method]
    method = parse(server.method_config)
    assert server.dataset in ("cifar10", "cifar100", "cinic10") and server.num_classes == (100 if server.dataset == "cifar100" else 10)
    if server.method == "fedavg":  # Tables 10-12
        local = method.edge  # the agents' local training, sent with every round
        assert (local.optimizer, local.lr, local.weight_decay, local.batch_size, local.local_epochs) == ("adam", 0.001, 1e-4, 64, 20)
    if server.method == "fedgkt":
        assert method.server_epochs == (20 if path.stem.endswith("-iid") else 40)


def test_paper_configs_are_what_the_generator_writes(tmp_path: Path) -> None:
    sys.path.insert(0, str(PAPER_CONFIGS))
    try:
        import generate  # deploy/configs/paper/generate.py
    finally:
        sys.path.remove(str(PAPER_CONFIGS))
    written = generate.generate(tmp_path)
    assert len(written) == len(list(PAPER_CONFIGS.glob("*.toml"))) == 45
    for path in written:
        assert path.read_text() == (PAPER_CONFIGS / path.name).read_text(), path.name


@pytest.mark.parametrize("method", ["fedgkt", "fedavg", "splitnn"])
def test_edgesplit_local_writes_a_valid_table_for_every_baseline(tmp_path: Path, method: str) -> None:
    from cloud_server.launcher import build_parser, write_configs

    args = build_parser().parse_args(["local", "--method", method, "--agents", "2", "--codec", "fp16-zstd", "--model", "resnet110"])
    server_path, agent_paths = write_configs(args, "t", tmp_path, "mqtt://127.0.0.1:1883")
    server = ServerConfig.from_dict(read_toml(server_path))
    parse = {"fedgkt": FedGktConfig.from_dict, "fedavg": FedAvgConfig.from_dict, "splitnn": SplitNNConfig.from_dict}[method]
    config = parse(server.method_config)
    # FedGKT and split learning hold the agents' round config (``edge``); FedAvg's table is its own.
    assert getattr(config, "edge", config).upload_codec == "fp16-zstd"
    if method == "fedavg":
        assert (config.model, config.download_codec) == ("resnet110", "fp16-zstd")
    assert len(agent_paths) == 2


def test_edgesplit_centralized_writes_a_valid_config(tmp_path: Path) -> None:
    from cloud_server.centralized_cli import write_config
    from cloud_server.launcher import build_parser

    args = build_parser().parse_args(["centralized", "--model", "resnet110", "--rounds", "3", "--dataset", "synthetic",
                                      "--set", "centralized.lr=0.01"])
    server = ServerConfig.from_dict(read_toml(write_config(args, "c", tmp_path)))
    config = CentralizedConfig.from_dict(server.method_config)
    assert (server.method, server.rounds, server.out_dir) == ("centralized", 3, str(tmp_path))
    assert (config.model, config.lr, config.train_samples, config.test_samples) == ("resnet110", 0.01, 4000, 1000)
