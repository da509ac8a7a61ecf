"""Samples per second of the server's training step on whatever device is present.

For ResNet-55 and ResNet-109 server models on 16x32x32 feature maps, at batch 64 and
256, in float32 and under bfloat16 autocast, it times

* ``bare``: a bare PyTorch loop (batches pre-made on the device, Adam, cross-entropy;
  the plain reference loop a user would write first), and
* the server step (``cloud_server/server_step.py``'s :class:`TrainStep` with FedGKT's
  CE + KD loss, batches gathered by shuffled index from rows staged on the device,
  losses summed on the device) in each mode the device can run: ``eager``,
  ``compiled`` (torch.compile) and ``graph`` (a whole-step CUDA graph; CUDA only).

Each figure is the median over ``--repeats`` timed runs of ``--steps`` steps, after
warm-up steps (and compilation / capture) that are not timed; ``epoch_60k_s`` is the
time one epoch over 60,000 maps would take at that rate. What cannot run here (a mode
that needs CUDA, or a compilation that fails) is listed with the reason instead of a
figure. For each mode the first steps' losses are compared with the eager step's from
the same weights over the warm-up steps (``max_abs_loss_diff_vs_eager``; in ``graph``
mode the steps after the first three are replays of the captured step), so a GPU run also checks that the
captured step computes the same thing.

Writes ``bench/results/server_gpu.json`` (``device`` says where it ran). On a GPU::

    python3 bench/server_gpu.py                # every model, batch, precision, mode
    python3 bench/server_gpu.py --quick        # one repeat, fewer steps

On the development CPU (2 shared cores: a ResNet-55 step at batch 64 takes seconds) use
``--quick --models resnet55_server --batches 64 --modes bare,eager,graph``: compilation
takes minutes per configuration there (bench/micro/test_server_loop.py has the CPU compile verdict),
and ``not_run`` lists the rest of the grid.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, machine, write_json

import torch
import torch.nn.functional as F

from cloud_server.server_step import DeviceSum, RowBank, TrainStep
from models.training import make_optimizer
from models import build_model
from models.losses import kd_loss

MODES = ("bare", "eager", "compiled", "graph")
EPOCH_SAMPLES = 60_000
TEMPERATURE = 3.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gkt_loss(logits: torch.Tensor, labels: torch.Tensor, edge_logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels) + kd_loss(logits, edge_logits, TEMPERATURE)


def _data(n: int, device: torch.device) -> tuple[RowBank, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    features = torch.relu(torch.randn(n, 16, 32, 32, generator=g)).half()  # staged as the server stages: float16
    labels = torch.randint(0, 10, (n,), generator=g)
    edge_logits = torch.randn(n, 10, generator=g)
    return RowBank(features, device), labels.to(device), edge_logits.to(device)


def measure(model_name: str, batch: int, precision: str, mode: str, device: torch.device, steps: int, warmup: int,
            repeats: int) -> dict[str, Any]:
    """One configuration: samples/s (median of ``repeats``), or why it was not measured."""
    amp = torch.bfloat16 if precision == "bf16" else None
    if mode == "graph" and device.type != "cuda":
        return {"measured": False, "why": "CUDA graphs need a CUDA device"}
    torch.manual_seed(0)
    model = build_model(model_name, 10).to(device).train()
    optimizer = make_optimizer("adam", model.parameters(), lr=1e-3, weight_decay=5e-4, device=device)
    bank, labels, edge_logits = _data(batch * 8, device)
    losses: list[float] = []  # the server step's cumulative loss after each warm-up step
    if mode == "bare":
        step, session, extra_warmup = None, contextlib.nullcontext(), 0
        f, y = bank.gather(torch.arange(batch, device=device), torch.float32), labels[:batch]

        def one_step() -> None:
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = F.cross_entropy(model(f), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    else:
        step = TrainStep(model, optimizer, _gkt_loss, mode, autocast_dtype=amp, name=f"bench {mode}")
        session, extra_warmup = step.session(), step.warmup_steps if mode == "graph" else 0
        total = DeviceSum(device)
        batches = itertools.cycle(torch.randperm(batch * 8, generator=torch.Generator().manual_seed(1)).to(device).split(batch))

        def one_step() -> None:
            idx = next(batches)
            total.add(step(bank.gather(idx, torch.float32), labels[idx], edge_logits[idx]).loss, batch)

    def fell_back() -> bool:
        return step is not None and step.mode != mode

    if fell_back():
        return {"measured": False, "why": step.fallback_reason}
    timings: list[float] = []
    with session:
        started = time.perf_counter()
        for _ in range(warmup + extra_warmup):
            one_step()
            if step is not None:
                losses.append(float(total.total))
        _sync(device)
        warmup_s = time.perf_counter() - started
        if fell_back():
            return {"measured": False, "why": step.fallback_reason}
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                one_step()
            _sync(device)
            timings.append(time.perf_counter() - t0)
        if step is not None:
            total.item()  # the one read of the summed loss
    if fell_back():
        return {"measured": False, "why": step.fallback_reason}
    s = statistics.median(timings)
    out: dict[str, Any] = {
        "measured": True,
        "step_ms": 1000 * s / steps,
        "samples_per_s": batch * steps / s,
        "epoch_60k_s": EPOCH_SAMPLES / (batch * steps / s),
        "timed_runs_s": timings,
    }
    if step is not None:
        out["warmup_s"] = warmup_s
        out["first_cumulative_losses"] = losses
    if device.type == "cuda":
        out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
    return out


def run(models: list[str], batches: list[int], precisions: list[str], modes: list[str], steps: int, warmup: int,
        repeats: int, device: torch.device) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for model_name in models:
        for batch in batches:
            for precision in precisions:
                key = f"{model_name}/bs{batch}/{precision}"
                row: dict[str, Any] = {mode: {"measured": False, "why": "not run (--modes)"} for mode in MODES if mode not in modes}
                for mode in modes:
                    started = time.perf_counter()
                    row[mode] = measure(model_name, batch, precision, mode, device, steps, warmup, repeats)
                    figure = row[mode]
                    text = (f"{figure['samples_per_s']:,.0f} samples/s, {figure['step_ms']:.1f} ms/step, "
                            f"60k epoch {figure['epoch_60k_s']:.1f} s" if figure["measured"] else f"not measured: {figure['why']}")
                    print(f"{key} {mode}: {text} ({time.perf_counter() - started:.0f} s)", flush=True)
                eager = row.get("eager", {})
                for mode in ("compiled", "graph"):
                    figure = row.get(mode, {})
                    if figure.get("measured") and eager.get("measured"):
                        figure["max_abs_loss_diff_vs_eager"] = max(
                            abs(a - b) for a, b in zip(figure["first_cumulative_losses"], eager["first_cumulative_losses"]))
                results[key] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:N")
    parser.add_argument("--models", default="resnet55_server,resnet109_server")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="3 timed steps after 1 warm-up, one repeat")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    parser.add_argument("--out", default=str(RESULTS / "server_gpu.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    steps, warmup, repeats = (3, 1, 1) if args.quick else (args.steps, args.warmup, args.repeats)
    split = lambda text: [t for t in text.split(",") if t]  # noqa: E731
    modes = split(args.modes)
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    models, batches, precisions = split(args.models), [int(b) for b in split(args.batches)], split(args.precisions)
    results = run(models, batches, precisions, modes, steps, warmup, repeats, device)
    # The full grid, and which of it this run left out (so a partial run says so).
    not_run = [f"{m}/bs{b}/{p}" for m in ("resnet55_server", "resnet109_server") for b in (64, 256) for p in ("fp32", "bf16")
               if f"{m}/bs{b}/{p}" not in results]
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    write_json(Path(args.out), {
        "benchmark": "server_gpu",
        "machine": machine(),
        "device": str(device),
        "device_name": gpu_name or "cpu",
        "gpu_figures_measured": device.type == "cuda",
        "note": None if device.type == "cuda" else (
            "Run on a CPU: no GPU figure here is measured. On a GPU machine run `python3 bench/server_gpu.py` "
            "(see the module docstring) to measure the issue's targets (one 60k epoch <= 2 s at batch 256, <= 5 s at 64)."),
        "setup": {"steps": steps, "warmup": warmup, "repeats": repeats, "modes": modes, "loss": "CE + KD (T=3)",
                  "optimizer": "adam (amsgrad), fused on CUDA", "features": "16x32x32 float16 staged, gathered by index"},
        "results": results,
        "not_run": not_run,
    })


if __name__ == "__main__":
    main()
