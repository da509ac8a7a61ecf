"""``python -m fldata.export``: write one agent's share of a dataset as ``.npz`` files.

For devices that should not hold (or cannot parse) the whole dataset, e.g. an
agent with the torch-free ort backend: the partition is computed here, with
the same seeded spec a local simulation uses, and the device reads
``train.npz`` / ``test.npz`` with ``dataset = "npz"``, ``partition = "none"``.
Sample ids are kept, so the shard is the same samples, with the same ids, as
the simulated agent's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fldata.datasets import save_npz
from fldata.subsets import AgentDataSpec, load_agent_subset


def export_partition(
    dataset: str,
    out_dir: str | Path,
    partition: str = "iid",
    num_agents: int = 1,
    agent_index: int = 0,
    seed: int = 0,
    root: str | None = None,
    train_samples: int = 0,
    test_samples: int = 0,
) -> tuple[Path, Path]:
    """Write ``out_dir/train.npz`` and ``out_dir/test.npz`` for one agent; returns their paths."""
    spec = AgentDataSpec(dataset, partition, num_agents, seed, root, train_samples=train_samples, test_samples=test_samples)
    train, test = load_agent_subset(spec, agent_index)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_npz(train, out / "train.npz")
    save_npz(test, out / "test.npz")
    return out / "train.npz", out / "test.npz"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fldata.export", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--root")
    p.add_argument("--partition", default="iid", help="iid | dirichlet:A | step:K | table:path.csv | none")
    p.add_argument("--agents", type=int, default=1)
    p.add_argument("--index", type=int, default=0, help="this agent's index in the partition")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-samples", type=int, default=0)
    p.add_argument("--test-samples", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        train, test = export_partition(args.dataset, args.out, args.partition, args.agents, args.index, args.seed,
                                       args.root, args.train_samples, args.test_samples)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fldata.export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {train} and {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
