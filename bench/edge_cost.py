"""Edge compute cost of FedGKT's ResNet-8 versus the full ResNet-56 / ResNet-110.

Reproduces the FedGKT paper's motivation (Fig. 1 / Table 1: the edge model
needs ~9x / ~17x fewer FLOPs and ~54x / ~105x fewer parameters) on the machine
it runs on, and writes ``bench/results/edge_cost.json`` with:

* parameters and their ratio to ResNet-8;
* training FLOPs per image (forward + CE loss + backward) and forward FLOPs per
  image, counted by ``torch.utils.flop_counter.FlopCounterMode`` (2 x MACs);
* CPU wall time of one training batch (forward + CE + backward, no optimiser
  step): median over timed iterations after warm-up, with torch's default
  thread count unless ``--threads`` is given;
* the paper's ratios, the torch version, CPU model and date.

Usage::

    python bench/edge_cost.py [--batch-size 64] [--warmup 3] [--iters 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Run from a checkout without installing the package.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from models import (  # noqa: E402  (needs the path above)
    build_model,
    count_parameters,
    forward_flops_per_sample,
    training_flops_per_sample,
)
from shared_protocol.hostinfo import cpu_model  # noqa: E402

MODEL_NAMES = ("resnet8", "resnet56", "resnet110")
BASELINE = "resnet8"
INPUT_SHAPE = (3, 32, 32)  # CIFAR-10 image (C, H, W)
NUM_CLASSES = 10
# FLOPs per sample do not depend on the batch for conv/matmul ops, and the
# counter is slow, so count on a small batch.
FLOP_BATCH_SIZE = 2

# FedGKT paper (He et al., NeurIPS 2020): edge ResNet-8 vs ResNet-56 / ResNet-110.
PAPER_FLOPS_RATIO = {"resnet56": 9.0, "resnet110": 17.0}
PAPER_PARAMS_RATIO = {"resnet56": 54.0, "resnet110": 105.0}

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "edge_cost.json"


@dataclass(frozen=True)
class ModelCost:
    """Measured cost of one model."""

    name: str
    params: int
    training_flops_per_sample: int
    forward_flops_per_sample: int
    training_mflops_per_sample: float
    cpu_ms_per_batch_median: float
    cpu_ms_per_batch_samples: list[float]
    flops_ratio_vs_resnet8: float
    params_ratio_vs_resnet8: float
    paper_flops_ratio_vs_resnet8: float | None
    paper_params_ratio_vs_resnet8: float | None


def time_training_batch_ms(name: str, batch_size: int, warmup: int, iters: int) -> list[float]:
    """Wall time (ms) of forward + CE + backward on one random batch, per timed iteration."""
    model = build_model(name, num_classes=NUM_CLASSES, in_channels=INPUT_SHAPE[0]).train()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, *INPUT_SHAPE, generator=generator)  # (B, 3, 32, 32)
    y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)  # (B,)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        output = model(x)
        logits = output[0] if isinstance(output, tuple) else output  # ResNet8Edge: (logits, features)
        F.cross_entropy(logits, y).backward()

    for _ in range(warmup):
        step()
    samples_ms: list[float] = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        samples_ms.append((time.perf_counter() - start) * 1e3)
    return samples_ms


def measure(batch_size: int, warmup: int, iters: int) -> list[ModelCost]:
    """Count and time every model; ratios are relative to ResNet-8."""
    raw: dict[str, tuple[int, int, int, list[float]]] = {}
    for name in MODEL_NAMES:
        model = build_model(name, num_classes=NUM_CLASSES, in_channels=INPUT_SHAPE[0])
        params = count_parameters(model)
        train_flops = training_flops_per_sample(model, INPUT_SHAPE, batch_size=FLOP_BATCH_SIZE, loss="ce")
        fwd_flops = forward_flops_per_sample(model, INPUT_SHAPE, batch_size=FLOP_BATCH_SIZE)
        samples_ms = time_training_batch_ms(name, batch_size, warmup, iters)
        raw[name] = (params, train_flops, fwd_flops, samples_ms)
        print(
            f"{name:>10}: {params:>10,} params  {train_flops / 1e6:8.1f} MFLOPs/img train  "
            f"{fwd_flops / 1e6:7.1f} fwd  {statistics.median(samples_ms):8.1f} ms/batch",
            flush=True,
        )

    base_params, base_flops = raw[BASELINE][0], raw[BASELINE][1]
    return [
        ModelCost(
            name=name,
            params=params,
            training_flops_per_sample=train_flops,
            forward_flops_per_sample=fwd_flops,
            training_mflops_per_sample=round(train_flops / 1e6, 1),
            cpu_ms_per_batch_median=round(statistics.median(samples_ms), 1),
            cpu_ms_per_batch_samples=[round(s, 1) for s in samples_ms],
            flops_ratio_vs_resnet8=round(train_flops / base_flops, 2),
            params_ratio_vs_resnet8=round(params / base_params, 2),
            paper_flops_ratio_vs_resnet8=PAPER_FLOPS_RATIO.get(name, 1.0 if name == BASELINE else None),
            paper_params_ratio_vs_resnet8=PAPER_PARAMS_RATIO.get(name, 1.0 if name == BASELINE else None),
        )
        for name, (params, train_flops, fwd_flops, samples_ms) in raw.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="images per timed batch (default 64)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per model (default 3)")
    parser.add_argument("--iters", type=int, default=7, help="timed iterations per model (default 7)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output JSON (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.warmup < 0 or args.iters < 1:
        parser.error("need --batch-size >= 1, --warmup >= 0, --iters >= 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)

    # Other processes on the box inflate the timings; record how busy it was.
    load_before = os.getloadavg()
    costs = measure(args.batch_size, args.warmup, args.iters)
    load_after = os.getloadavg()
    report = {
        "benchmark": "edge_cost",
        "description": "FedGKT edge model (ResNet-8) vs full ResNet-56/110: parameters, FLOPs and CPU time",
        "config": {
            "input_shape": list(INPUT_SHAPE),
            "num_classes": NUM_CLASSES,
            "timed_batch_size": args.batch_size,
            "warmup_iters": args.warmup,
            "timed_iters": args.iters,
            "flop_count_batch_size": FLOP_BATCH_SIZE,
            "flop_counter": "torch.utils.flop_counter.FlopCounterMode (FLOPs = 2 x MACs; conv/matmul only)",
            "training_step": "train mode, forward + cross-entropy + backward; no optimiser step",
        },
        "environment": {
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "cpu_model": cpu_model(),
            "machine": platform.machine(),
            "load_average_1m_before": round(load_before[0], 2),
            "load_average_1m_after": round(load_after[0], 2),
            "platform": platform.platform(),
            "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        },
        "paper": {
            "source": "He et al., Group Knowledge Transfer (FedGKT), NeurIPS 2020",
            "flops_ratio_vs_resnet8": PAPER_FLOPS_RATIO,
            "params_ratio_vs_resnet8": PAPER_PARAMS_RATIO,
        },
        "models": {cost.name: asdict(cost) for cost in costs},
    }

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)  # atomic: a reader never sees a half-written report
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
