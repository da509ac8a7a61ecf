"""Offline diagnosis of a finished ``bench/gkt_balanced.py`` run: where the server model's
balanced-set accuracy goes.

Loads the server's last checkpoint and the agents' final ResNet-8s (``edges.npz``) and, for
every agent k, evaluates extractor_k + server model on the balanced test subset with:

* ``global``: the server's running BatchNorm statistics (report's ``accuracy_global_bn``);
* ``per_agent``: statistics recomputed on agent k's training maps (``accuracy_per_agent_bn``);
* ``test_bn``: statistics recomputed on agent k's balanced test maps (transductive: how much
  is a BatchNorm-statistics mismatch);
* ``stem_bn_pooled``: agent k's extractor with its stem BatchNorm running statistics
  recomputed on every agent's training images (the stem's statistics without the label skew),
  server with global statistics;
* ``train_global``: the agent's own training maps, global statistics (eval-mode training accuracy);

plus, with global statistics, the accuracy on classes the agent holds (>= 5% of its shard)
and on the others, and the total variation distance between the predicted-class histogram
on the balanced set and the agent's training label mix (1 = predicts only its own classes'
mix exactly... 0 = uniform-independent of it; see ``prior_tv``).

    python bench/gkt_diagnose.py runs-gkt/mixed-s0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from _federation import REPO_ROOT  # noqa: F401  (puts the repo first on sys.path)
from edge_agent.agent import agent_data_spec
from edge_agent.config import DataConfig
from edge_agent.simulate import shards
from fldata.torch_data import make_loader
from models import build_model, load_arrays_into
from models.batchnorm import load_bn_statistics, measure_bn_statistics, restoring_bn_statistics
from models.state_io import load_state


def images_of(ds) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for x, y, _ids in make_loader(ds, 1024):
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


@torch.no_grad()
def predict(model: torch.nn.Module, maps: torch.Tensor) -> torch.Tensor:
    model.eval()
    return torch.cat([model(maps[i : i + 500]).argmax(1) for i in range(0, len(maps), 500)])


@torch.no_grad()
def extract(edge: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    edge.eval()
    return torch.cat([edge.extract(images[i : i + 500]) for i in range(0, len(images), 500)])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run", type=Path)
    args = p.parse_args()
    torch.set_num_threads(2)
    summary = json.loads((args.run / "summary.json").read_text())
    d = summary["data"]
    base = DataConfig(dataset=d["dataset"], partition=d["partition"], num_agents=d["agents"], seed=d["seed"],
                      train_samples=d["train_samples"], test_samples=d["test_samples"])
    agent_shards = shards(base, d["agents"])
    test_x, test_y = images_of(agent_data_spec(base).subset()[1])
    num_classes = 10
    state = load_state(args.run / "checkpoint", "method")
    server = build_model(summary["method_config"].get("server_model", "resnet55_server"), num_classes)
    load_arrays_into(server, state["model"])
    edges_npz = np.load(args.run / "edges.npz")
    train = [images_of(tr) for tr, _ in agent_shards]
    pooled_x = torch.cat([x for x, _ in train])
    rows = []
    edges = []
    for k, (tx, _ty) in enumerate(train):
        prefix = f"agent-{k}/model/"
        edge = build_model("resnet8", num_classes, tx.shape[1])
        load_arrays_into(edge, {key[len(prefix):]: edges_npz[key] for key in edges_npz.files if key.startswith(prefix)})
        edges.append(edge)
    # Every agent's training maps through its own extractor: what the server trained on.
    pooled_maps = torch.cat([extract(e, tx) for e, (tx, _) in zip(edges, train)])
    pooled_y = torch.cat([ty for _, ty in train])
    # ... resampled so that every class weighs the same (rows drawn with replacement).
    g = torch.Generator().manual_seed(0)
    weights = (1.0 / torch.bincount(pooled_y, minlength=num_classes).float())[pooled_y]
    balanced_rows = torch.multinomial(weights, len(pooled_y), replacement=True, generator=g)
    calibrations = {}
    for name, maps in (("pooled_train_bn", pooled_maps), ("pooled_balanced_bn", pooled_maps[balanced_rows])):
        calibrations[name] = measure_bn_statistics(server, (maps[i : i + 256] for i in range(0, len(maps), 256)))
    for k, (tx, ty) in enumerate(train):
        edge = edges[k]
        mix = torch.bincount(ty, minlength=num_classes).float() / len(ty)
        held = mix >= 0.05
        test_maps, train_maps = extract(edge, test_x), extract(edge, tx)
        row = {"agent": k, "train_samples": len(ty), "label_mix": [round(float(v), 3) for v in mix]}
        with restoring_bn_statistics(server):
            pred = predict(server, test_maps)
            row["global"] = float((pred == test_y).float().mean())
            on_held = held[test_y]
            row["global_held_classes"] = float((pred == test_y)[on_held].float().mean())
            row["global_other_classes"] = float((pred == test_y)[~on_held].float().mean()) if (~on_held).any() else None
            hist = torch.bincount(pred, minlength=num_classes).float() / len(pred)
            row["pred_hist"] = [round(float(v), 3) for v in hist]
            row["prior_tv"] = float(0.5 * (hist - mix).abs().sum())  # distance of predictions from the agent's label mix
            row["uniform_tv"] = float(0.5 * (hist - 0.1).abs().sum())  # ... from the balanced set's
            row["train_global"] = float((predict(server, train_maps) == ty).float().mean())
        for name, maps in (("per_agent", train_maps[torch.linspace(0, len(ty) - 1, min(len(ty), 256)).round().long().unique()]),
                           ("test_bn", test_maps)):
            with restoring_bn_statistics(server):
                load_bn_statistics(server, measure_bn_statistics(server, (maps[i : i + 256] for i in range(0, len(maps), 256))))
                row[name] = float((predict(server, test_maps) == test_y).float().mean())
        for name, stats in calibrations.items():
            with restoring_bn_statistics(server):
                load_bn_statistics(server, stats)
                row[name] = float((predict(server, test_maps) == test_y).float().mean())
        # The stem's BatchNorm running statistics on every agent's images instead of this agent's.
        stem = edge.extractor if hasattr(edge, "extractor") else None
        if stem is not None:
            stats = measure_bn_statistics(stem, (pooled_x[i : i + 500] for i in range(0, len(pooled_x), 500)))
            load_bn_statistics(stem, stats)
            with restoring_bn_statistics(server):
                row["stem_bn_pooled"] = float((predict(server, extract(edge, test_x)) == test_y).float().mean())
        rows.append(row)
        print(json.dumps({k2: v for k2, v in row.items() if k2 not in ("label_mix", "pred_hist")}), flush=True)
    keys = ("global", "per_agent", "test_bn", "pooled_train_bn", "pooled_balanced_bn", "stem_bn_pooled", "train_global", "global_held_classes", "global_other_classes",
            "prior_tv", "uniform_tv")
    means = {key: float(np.mean([r[key] for r in rows if r.get(key) is not None])) for key in keys}
    print("MEAN", json.dumps({k2: round(v, 4) for k2, v in means.items()}))
    (args.run / "diagnosis.json").write_text(json.dumps({"agents": rows, "mean": means}, indent=2) + "\n")


if __name__ == "__main__":
    main()
