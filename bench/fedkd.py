"""FedKD at reduced scale on Fashion-MNIST: bytes against FedAvg of a mentor-sized
model, ranks per tensor, and accuracy.

The setting is the baselines' quick scale (``bench/accuracy.py``): 8 agents,
a seeded 1,200-image training subset and 400 test images of Fashion-MNIST,
iid and Dirichlet(0.5) partitions, 4 rounds of one pass over each agent's data,
Adam with lr 0.001, batch 64, seed 0. FedKD runs with the ResNet-56 mentor
(the model the baselines' FedAvg trains) and the ResNet-8 mentee, T from 0.95
to 0.98 (Eq. 9), through the real pipeline: a mosquitto on a free loopback
port, the coordinator and 8 :class:`EdgeAgent` s in this process, each agent
with its own MQTT connection, taking turns on the CPU (one compute lock), as
``bench/_federation.py`` runs the baselines.

Communication, per agent and round, both directions:

* ``payload`` figures count the float32 tensor values, the paper's measure:
  FedKD's factors (its upload, and the aggregate it gets back) vs the dense
  mentee update vs FedAvg of the mentor (its float state up and down);
* ``frame`` figures count whole frames: FedKD's from the run report (every
  message of the round on the server's connection, RoundStart/RoundEnd and
  the evaluation exchange included, divided by the agents) vs two frames of
  the mentor's float state coded as FedAvg sends it (``zstd``, lossless);
* the whole-mentee sync of round 1 (every agent gets the initial mentee once)
  is reported separately and included in the "with sync" totals.

Accuracy per round: the global mentee (the federated model) and the agents'
mentors (the model FedKD uses for inference), both on the union of the
agents' test shards. If ``bench/results/accuracy.json`` exists, the FedAvg
ResNet-56 accuracies of the same setting are copied next to them. At the
quick scale every agent takes only 3 optimiser steps a round, too few for any
of the models to learn; a third run (``learning-iid``) uses the baselines'
full-scale data (4,800 training images, 600 per agent), 4 rounds and the
ResNet-20 mentor to show FedKD learning within the time budget.

    python bench/fedkd.py            # about 10 minutes on 2 cores
    python bench/fedkd.py --quick    # the baselines' setting, iid only, 2 rounds: a smoke run

Writes ``bench/results/fedkd.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, machine, write_json  # puts the repository on sys.path

from cloud_server.config import ServerConfig
from cloud_server.coordinator import Coordinator
from cloud_server.launcher import _stop, start_broker
from cloud_server.methods import ServerContext, get_server_method
from cloud_server.methods.fedkd import FedKdServer
from edge_agent.agent import EdgeAgent
from edge_agent.config import DataConfig, EdgeConfig
from edge_agent.simulate import shards
from models import build_model, state_dict_to_arrays
from shared_protocol.messages import RoundStart, encode_message
from shared_protocol.transport import MqttTransport

PARTITIONS = {"iid": "iid", "noniid": "dirichlet:0.5"}


@dataclasses.dataclass(frozen=True)
class Setting:
    agents: int = 8
    train_samples: int = 1200
    test_samples: int = 400
    rounds: int = 4
    dataset: str = "fashion-mnist"
    seed: int = 0
    mentor: str = "resnet56"
    mentee: str = "resnet8"
    threshold_start: float = 0.95
    threshold_end: float = 0.98

    def method_config(self) -> dict[str, Any]:
        return {
            "mentor_model": self.mentor, "mentee_model": self.mentee, "threshold_start": self.threshold_start,
            "threshold_end": self.threshold_end, "schedule_rounds": self.rounds, "local_epochs": 1, "batch_size": 64,
            "optimizer": "adam", "mentor_lr": 0.001, "mentee_lr": 0.001,
        }


def run_fedkd(setting: Setting, partition: str, work: Path) -> tuple[dict[str, Any], FedKdServer, float]:
    """One FedKD run over a fresh broker: (report, the server method with its history, wall seconds)."""
    broker, url = start_broker(work / "broker")
    started = time.monotonic()
    try:
        run_id = f"fedkd-{partition.replace(':', '')}"
        config = ServerConfig(
            run_id=run_id, method="fedkd", broker_url=url, out_dir=str(work / run_id), expected_agents=setting.agents,
            rounds=setting.rounds, round_deadline_s=1800.0, registration_timeout_s=120.0, min_agents=1, min_fraction=0.5,
            dataset=setting.dataset, seed=setting.seed, progress=False, method_config=setting.method_config(),
        )
        ctx = ServerContext(run_id=run_id, num_classes=config.num_classes, in_channels=config.resolved_in_channels, device="cpu", seed=setting.seed)
        method = get_server_method("fedkd")(ctx, config.method_config)
        if not isinstance(method, FedKdServer):
            raise TypeError(f"method 'fedkd' is {type(method).__name__}, expected FedKdServer")
        coordinator = Coordinator(config, method, MqttTransport(config.transport_config()))
        data = DataConfig(dataset=setting.dataset, partition=partition, num_agents=setting.agents, seed=setting.seed,
                          train_samples=setting.train_samples, test_samples=setting.test_samples)
        lock = threading.Lock()
        agents = [
            EdgeAgent(EdgeConfig(agent_id=f"agent-{i}", run_id=run_id, broker_url=url, progress=False, threads=2,
                                 data=dataclasses.replace(data, agent_index=i)), data=shard, compute_lock=lock)
            for i, shard in enumerate(shards(data, setting.agents))
        ]
        report: dict[str, Any] = {}
        errors: list[BaseException] = []

        def serve() -> None:
            try:
                report.update(coordinator.run())
            except BaseException as exc:  # re-raised in the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=serve, name="server", daemon=True)]
        threads += [threading.Thread(target=a.run, name=a.config.agent_id, daemon=True) for a in agents]
        for t in threads:
            t.start()
        threads[0].join()
        for a in agents:
            a.stop()
        for t in threads[1:]:
            t.join(30)
        if errors:
            raise errors[0]
        return report, method, time.monotonic() - started
    finally:
        _stop([broker])


def fedavg_frame_bytes(model_name: str, in_channels: int) -> int:
    """One frame carrying a model's float state as FedAvg moves it (``zstd`` weights)."""
    state = {k: v for k, v in state_dict_to_arrays(build_model(model_name, 10, in_channels)).items() if v.dtype.kind == "f"}
    msg = RoundStart(run="bench", round=1, sender="server", method="fedavg", deadline_s=1.0, weights=state)
    return len(encode_message(msg, codecs={"weights": "zstd"}))


def reduction(ours: float, theirs: float) -> float:
    return round(1.0 - ours / theirs, 4)


def summarize(setting: Setting, partition: str, report: dict[str, Any], method: FedKdServer, wall_s: float,
              fedavg_frame: int) -> dict[str, Any]:
    agents = setting.agents
    rounds = []
    totals = {"svd": 0.0, "dense": 0.0, "fedavg": 0.0, "frames": 0.0, "fedavg_frames": 0.0, "sync": 0.0}
    for record, history in zip(report["rounds"], method.history):
        per_agent = history["bytes_per_agent"]
        sync_per_agent = history["sync"]["bytes"] / agents
        frames_per_agent = (record["bytes"]["up_payload"] + record["bytes"]["down_payload"]) / agents
        uploads = list(history["agents"].values())
        totals["svd"] += per_agent["fedkd_svd"]
        totals["dense"] += per_agent["dense_mentee"]
        totals["fedavg"] += per_agent["fedavg_mentor"]
        totals["frames"] += frames_per_agent
        totals["fedavg_frames"] += 2 * fedavg_frame
        totals["sync"] += sync_per_agent
        ranks = [k for u in uploads for k in u["ranks"].values()]
        rounds.append({
            "round": record["round"],
            "threshold": history["threshold"],
            "global_mentee_accuracy": record["accuracy"],
            "mentor_accuracy": record["edge_accuracy"],
            "local_mentee_accuracy_mean": float(np.mean([u["mentee_accuracy"] for u in uploads if "mentee_accuracy" in u])) if uploads else None,
            "ranks": {
                "aggregate": history["aggregate"]["ranks"],
                "aggregate_dense_fallback": history["aggregate"]["dense_fallback_ranks"],
                "uploads_by_agent": {agent: u["ranks"] for agent, u in history["agents"].items()},
                "uploads_dense_fallback_by_agent": {agent: u["dense_fallback_ranks"] for agent, u in history["agents"].items()},
                "upload_rank_mean": float(np.mean(ranks)) if ranks else None,
                "factored_tensors_per_upload": float(np.mean([len(u["ranks"]) for u in uploads])) if uploads else 0.0,
            },
            "payload_bytes_per_agent": {
                "fedkd_up_svd": float(np.mean([u["svd_bytes"] for u in uploads])),
                "fedkd_down_svd": history["aggregate"]["svd_bytes"],
                "fedkd_total_svd": per_agent["fedkd_svd"],
                "dense_mentee_total": per_agent["dense_mentee"],
                "fedavg_mentor_total": per_agent["fedavg_mentor"],
                "sync_whole_mentee": sync_per_agent,
            },
            "frame_bytes_per_agent": {"fedkd_all_messages": frames_per_agent, "fedavg_mentor_model_frames": 2 * fedavg_frame},
            "reduction": {
                "svd_vs_dense_mentee": reduction(per_agent["fedkd_svd"], per_agent["dense_mentee"]),
                "payload_vs_fedavg_mentor": reduction(per_agent["fedkd_svd"], per_agent["fedavg_mentor"]),
                "frames_vs_fedavg_mentor": reduction(frames_per_agent, 2 * fedavg_frame),
            },
            "round_s": record["time_s"]["round"],
        })
    return {
        "partition": partition,
        "status": report["status"],
        "wall_time_s": round(wall_s, 1),
        "final_global_mentee_accuracy": rounds[-1]["global_mentee_accuracy"] if rounds else None,
        "final_mentor_accuracy": rounds[-1]["mentor_accuracy"] if rounds else None,
        "communication": {
            "per_agent_all_rounds_bytes": {k: round(v, 1) for k, v in totals.items()},
            "reduction_vs_fedavg_mentor": {
                "payload": reduction(totals["svd"], totals["fedavg"]),
                "payload_with_sync": reduction(totals["svd"] + totals["sync"], totals["fedavg"]),
                "frames": reduction(totals["frames"], totals["fedavg_frames"]),
            },
            "reduction_svd_vs_dense_mentee": reduction(totals["svd"], totals["dense"]),
        },
        "rounds": rounds,
        "edge_train_flops_per_round": [r["edge_train_flops"] for r in report["rounds"]],
        "report_totals": {k: report["totals"][k] for k in ("wire_total", "up_wire", "down_wire", "rounds_completed")},
    }


def fedavg_reference() -> dict[str, Any] | None:
    """FedAvg ResNet-56 accuracies of the same setting, if the baselines benchmark has run."""
    path = RESULTS / "accuracy.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    found = {}
    for run in data.get("runs", []) if isinstance(data, dict) else []:
        if isinstance(run, dict) and run.get("method") == "fedavg":
            found[str(run.get("name", run.get("partition")))] = {k: run.get(k) for k in ("partition", "final_accuracy", "best_accuracy")}
    return {"source": "bench/results/accuracy.json", "runs": found} if found else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the baselines' setting, iid, 2 rounds: a smoke run")
    parser.add_argument("--no-learning-run", action="store_true", help="skip the larger ResNet-20 run")
    parser.add_argument("--out", default=str(RESULTS / "fedkd.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    baseline = Setting(rounds=2) if args.quick else Setting()
    plan: list[tuple[str, Setting, str, str]] = [
        (key, baseline, partition, "the baselines' quick scale (bench/accuracy.py): same data, partitions, rounds, passes, optimiser")
        for key, partition in (PARTITIONS if not args.quick else {"iid": "iid"}).items()
    ]
    if not args.quick and not args.no_learning_run:
        # At the quick scale each agent takes 3 optimiser steps a round: nothing learns yet
        # (BatchNorm statistics alone need more). This run shows FedKD learning: the
        # baselines' full-scale data (600 images per agent), the cheaper ResNet-20 mentor.
        plan.append(("learning-iid", Setting(train_samples=4800, test_samples=1600, rounds=4, mentor="resnet20"), "iid",
                     "the baselines' full-scale data (4,800 / 1,600 images), 4 rounds, ResNet-20 mentor: to show learning"))
    work = Path(tempfile.mkdtemp(prefix="edgesplit-fedkd-"))
    in_channels = 1
    started = time.monotonic()
    runs = {}
    for key, setting, partition, purpose in plan:
        print(f"{key}: FedKD {setting.mentor}/{setting.mentee}, {partition}, {setting.agents} agents x {setting.rounds} rounds, "
              f"{setting.train_samples} images ...", flush=True)
        frame = fedavg_frame_bytes(setting.mentor, in_channels)
        report, method, wall_s = run_fedkd(setting, partition, work / key)
        summary = summarize(setting, partition, report, method, wall_s, frame)
        models = {}
        for role, name in (("mentee", setting.mentee), ("mentor", setting.mentor)):
            state = state_dict_to_arrays(build_model(name, 10, in_channels))
            models[role] = {"name": name, "float_values": int(sum(v.size for v in state.values() if v.dtype.kind == "f"))}
        models["fedavg_mentor_frame_bytes_zstd"] = frame
        runs[key] = {
            "purpose": purpose,
            "scale": {**dataclasses.asdict(setting), "partition": partition, "in_channels": in_channels, "image_size": 32,
                      "per_round": "one pass over each agent's data (local_epochs = 1)"},
            "method_config": setting.method_config(),
            "models": models,
            **summary,
        }
        comm = summary["communication"]["reduction_vs_fedavg_mentor"]
        print(f"  global mentee {summary['final_global_mentee_accuracy']}, mentor {summary['final_mentor_accuracy']}, "
              f"reduction vs FedAvg: payload {comm['payload']:.2%}, frames {comm['frames']:.2%} ({wall_s:.0f} s)", flush=True)
    write_json(Path(args.out), {
        "benchmark": "fedkd",
        "machine": machine(),
        "paper_claim": "communication reduced by up to about 95% vs FedAvg (Wu et al. 2022)",
        "definitions": {
            "payload": "float32 tensor values per agent and round, both directions: FedKD's factors (upload + aggregate) "
                       "vs the dense mentee update (up + down) vs FedAvg of the mentor (its float state up + down)",
            "frames": "FedKD: every message of the round on the server's connection / agents (report bytes); "
                      "FedAvg: 2 frames of the mentor's float state, zstd-coded",
            "sync": "the whole initial mentee each agent gets once (round 1), zstd frame, not in 'payload'",
            "global_mentee_accuracy": "the shared mentee after each round's aggregate, on the union of the agents' test shards",
            "mentor_accuracy": "the agents' private mentors (FedKD's inference model) on the same shards",
        },
        "runs": runs,
        "fedavg_resnet56_accuracy_same_setting": fedavg_reference(),
        "wall_time_s": round(time.monotonic() - started, 1),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
