"""Where one ResNet-8 training step's memory goes, torch and onnxruntime-training, and what --low-memory saves.

Measures, at batch 64 and 3x32x32 (the footprint bench's bare-step setting), one thread:

* ``saved_by_block``: bytes the forward pass keeps for the backward pass (autograd's
  saved-tensor hooks, each storage counted once), per part of the model, plain and
  with checkpointed bottlenecks (``models.memory``);
* ``torch``: a bare training step (CE + KD, the agent's lean Adam) in a fresh process for each of
  {plain, checkpointed, micro-batches of 16 (``models.train_step.Step``)} x {glibc
  malloc as it is, mmap threshold pinned}: peak RSS,
  peak above ``import torch``, file-backed RSS (code pages) before and after, median
  ms per step; the variants alternate, ``--repeats`` times, so time ratios come from
  one session;
* ``ort``: the same step under onnxruntime-training (artifacts exported here) with
  the session options that could matter (the agent's: CPU arena off; memory patterns
  off; graph optimisation off; the training memory optimizer's recompute settings), and
  the agent's step in micro-batches of 16 (``micro16``; every ort variant pins the threshold);
* ``recompute_flops_ratio``: training FLOPs with checkpointed bottlenecks / plain;
* ``import_costs``: what the agent's one-off work adds to ``import torch`` for good, in a
  fresh process each: counting the ResNet-8's FLOPs with ``FlopCounterMode`` or with the
  layer counter the agents use, and three steps of ``torch.optim.Adam`` or of the lean
  Adam they use (VmRSS and modules loaded before and after; ``--import-costs-only``
  measures just these and merges them into the JSON).

    .venv/bin/python bench/step_memory.py [--torch-cpu-dir DIR] [--repeats 2]

``--torch-cpu-dir``: the CPU-only torch (e.g. its wheel unpacked) put first on the
workers' PYTHONPATH, with triton hidden as in a CPU-only install. Writes
``bench/results/step_memory.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "step_memory.json"
BATCH = 64
MICRO_BATCH = 16  # --low-memory's
STEPS = 11  # the first is warm-up


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def saved_by_block(checkpointed: bool) -> dict[str, int]:
    import torch
    import torch.nn.functional as F

    from models import build_model
    from models.losses import kd_loss
    from models.memory import checkpoint_bottlenecks

    torch.manual_seed(0)
    model = build_model("resnet8", 10, 3).train()
    if checkpointed:
        checkpoint_bottlenecks(model)
    parts = {"extractor": "stem", "classifier.stages.layer1.0": "bottleneck 1 (16 -> 64 channels, shortcut conv)",
             "classifier.stages.layer1.1": "bottleneck 2", "classifier.avgpool": "pool, head and loss"}
    current = ["stem"]
    for name, module in model.named_modules():
        if name in parts:
            module.register_forward_pre_hook(lambda m, i, label=parts[name]: current.__setitem__(0, label))
    seen: set[int] = set()
    per: collections.Counter[str] = collections.Counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            per[current[0]] += storage.nbytes()
        return t

    x = torch.randn(BATCH, 3, 32, 32)  # (B, C, H, W)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, _ = model(x)
        F.cross_entropy(logits, torch.randint(0, 10, (BATCH,))) + kd_loss(logits, torch.randn(BATCH, 10), 3.0)
    out = dict(per)
    out["total"] = sum(per.values())
    return out


def torch_worker(checkpointed: bool, pinned: bool, micro_batch: int | None = None) -> dict:
    if pinned:
        from edge_agent.memory import fix_malloc_mmap_threshold

        fix_malloc_mmap_threshold()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    base, base_file = _status_kib("VmHWM") * 1024, _status_kib("RssFile") * 1024
    from models import build_model
    from models.losses import kd_loss
    from models.memory import checkpoint_bottlenecks
    from models.training import Step, make_optimizer

    torch.manual_seed(0)
    model = build_model("resnet8", 10, 3)
    if checkpointed:
        checkpoint_bottlenecks(model)
    # The agent's optimiser: torch.optim's would import torch._dynamo (see import_costs) into every variant.
    opt = make_optimizer("adam", model.parameters(), 1e-3, weight_decay=5e-4, lean=True)
    step = Step(model, opt, lambda output, y, teacher: F.cross_entropy(output[0], y) + kd_loss(output[0], teacher, 3.0),
                forward=lambda m, inputs: m(inputs), micro_batch=micro_batch)
    x, y, teacher = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,)), torch.randn(BATCH, 10)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        step(x, y, teacher)
        times.append(time.perf_counter() - t0)
    peak = _status_kib("VmHWM") * 1024
    return {"checkpointed": checkpointed, "malloc_mmap_threshold_pinned": pinned, "micro_batch": micro_batch, "torch": torch.__version__,
            "triton_loaded": "triton" in sys.modules, "import_peak_rss_bytes": base, "import_rss_file_bytes": base_file,
            "peak_rss_bytes": peak, "peak_above_import_bytes": peak - base, "rss_file_after_bytes": _status_kib("RssFile") * 1024,
            "rss_after_bytes": _status_kib("VmRSS") * 1024, "step_ms_median": sorted(times[1:])[len(times[1:]) // 2] * 1000}


IMPORT_COST_VARIANTS = ("flop_counter_mode", "layer_counter", "torch_optim_adam", "lean_adam")


def import_cost_worker(variant: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from models import build_model
    from models.cost import flops_of, layer_flops_per_sample
    from models.training import make_optimizer

    model = build_model("resnet8", 10, 1)
    before, modules_before = _status_kib("VmRSS") * 1024, len(sys.modules)
    if variant == "flop_counter_mode":
        x = torch.randn(2, 1, 32, 32)
        flops_of(lambda: model(x)[0].sum().backward())
    elif variant == "layer_counter":
        layer_flops_per_sample(model, (1, 32, 32))
    else:
        opt = make_optimizer("adam", model.parameters(), 1e-3, lean=variant == "lean_adam")
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(4, 1, 32, 32))[0].sum().backward()
            opt.step()
    after = _status_kib("VmRSS") * 1024
    return {"variant": variant, "torch": torch.__version__, "rss_before_bytes": before, "rss_after_bytes": after,
            "added_bytes": after - before, "modules_added": len(sys.modules) - modules_before,
            "torch_dynamo_loaded": "torch._dynamo" in sys.modules, "sympy_loaded": "sympy" in sys.modules}


ORT_VARIANTS = ("agent", "mem_pattern_off", "graph_optimization_off", "memory_optimizer_recompute", "micro16")


def ort_worker(artifacts: str, variant: str) -> dict:
    from edge_agent.memory import fix_malloc_mmap_threshold

    fix_malloc_mmap_threshold()  # as --low-memory: otherwise the heap's high-water mark hides the step's own
    import numpy as np

    import edge_agent.backends.ort as ort_backend
    from edge_agent.backends.optim import NumpyAdam

    onnxruntime, _ = ort_backend._ort()
    base = _status_kib("VmHWM") * 1024
    plain_options = onnxruntime.SessionOptions

    def options():  # type: ignore[no-untyped-def]
        o = plain_options()
        if variant == "mem_pattern_off":
            o.enable_mem_pattern = False
        elif variant == "graph_optimization_off":
            o.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        elif variant == "memory_optimizer_recompute":
            config = Path(artifacts) / "memory_optimizer.json"
            config.write_text(json.dumps(["Relu+:1:-1", "BatchNormInternal+:1:-1", "Add+Relu+:1:-1"]))
            o.add_session_config_entry("optimization.memory_optimizer_config", str(config))
            o.add_session_config_entry("optimization.enable_memory_probe_recompute_config", "1")
        return o

    onnxruntime.SessionOptions = options  # OrtEdgeModel builds its options from this
    model = ort_backend.OrtEdgeModel(artifacts, ort_backend.ArtifactMeta.from_json((Path(artifacts) / "meta.json").read_text()), threads=1)
    loaded = _status_kib("VmHWM") * 1024
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 3, 32, 32)).astype(np.float32)
    y, teacher = rng.integers(0, 10, BATCH), rng.normal(size=(BATCH, 10)).astype(np.float32)
    opt, times = NumpyAdam(1e-3, weight_decay=5e-4), []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        model.train_step(x, y, teacher, np.ones(BATCH, np.float32), 3.0, 1.0, opt, micro_batch=MICRO_BATCH if variant == "micro16" else None)
        times.append(time.perf_counter() - t0)
    peak = _status_kib("VmHWM") * 1024
    return {"variant": variant, "onnxruntime": ort_backend.ort_version(), "import_peak_rss_bytes": base,
            "loaded_peak_rss_bytes": loaded, "peak_rss_bytes": peak, "step_above_loaded_bytes": peak - loaded,
            "step_ms_median": sorted(times[1:])[len(times[1:]) // 2] * 1000}


def _run(args: list[str], env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True, cwd="/",
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    sys.path.insert(0, str(REPO))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("torch", "ort", "import"))
    p.add_argument("--checkpointed", action="store_true")
    p.add_argument("--pinned", action="store_true")
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--artifacts")
    p.add_argument("--variant", choices=ORT_VARIANTS + IMPORT_COST_VARIANTS, default="agent")
    p.add_argument("--import-costs-only", action="store_true", help="measure import_costs only, merged into --out")
    p.add_argument("--torch-cpu-dir")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.worker == "torch":
        print(json.dumps(torch_worker(args.checkpointed, args.pinned, args.micro_batch)))
        return 0
    if args.worker == "import":
        print(json.dumps(import_cost_worker(args.variant)))
        return 0
    if args.worker == "ort":
        print(json.dumps(ort_worker(args.artifacts, args.variant)))
        return 0

    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "bench"))
    from footprint import export_artifacts
    from no_torch import write_blocker

    from models.memory import recompute_flops_ratio
    from models import build_model

    work = Path(tempfile.mkdtemp(prefix="edgesplit-step-memory-"))
    torch_env = {"PYTHONPATH": str(REPO)}
    if args.torch_cpu_dir:
        no_triton = write_blocker(work / "no_triton", hidden=("triton",))
        torch_env = {"PYTHONPATH": os.pathsep.join([str(no_triton), str(Path(args.torch_cpu_dir).resolve()), str(REPO)])}
    ort_env = {"PYTHONPATH": os.pathsep.join([str(write_blocker(work / "no_torch")), str(REPO)])}
    import_costs = [_run(["--worker", "import", "--variant", v], torch_env) for v in IMPORT_COST_VARIANTS]
    if args.import_costs_only:
        out = Path(args.out)
        report = json.loads(out.read_text())
        report["import_costs"] = import_costs
        out.write_text(json.dumps(report, indent=2) + "\n")
        for r in import_costs:
            print(f"{r['variant']:18s} +{r['added_bytes'] / 1e6:.0f} MB, +{r['modules_added']} modules")
        return 0
    artifacts = work / "artifacts"
    export_artifacts(artifacts)
    report: dict = {
        "machine": {"arch": platform.machine(), "cores": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "settings": {"model": "resnet8", "input": [3, 32, 32], "batch_size": BATCH, "threads": 1, "steps": STEPS,
                     "step_ms": "median of steps 2..N in each process; the variants alternate, so compare ratios within this file",
                     "torch": "CPU-only wheel from --torch-cpu-dir, triton hidden" if args.torch_cpu_dir else "this venv's torch"},
        "saved_by_block_bytes": {"plain": saved_by_block(False), "checkpointed": saved_by_block(True)},
        "recompute_flops_ratio": round(recompute_flops_ratio(build_model("resnet8", 10, 3), (3, 32, 32)), 4),
        "torch": [], "ort": [], "import_costs": import_costs,
    }
    torch_variants = [(False, None), (True, None), (False, MICRO_BATCH)]  # (checkpointed, micro_batch)
    for _ in range(args.repeats):
        for checkpointed, micro in torch_variants:
            for pinned in (False, True):
                flags = [*(["--checkpointed"] if checkpointed else []), *(["--pinned"] if pinned else []),
                         *(["--micro-batch", str(micro)] if micro else [])]
                report["torch"].append(_run(["--worker", "torch", *flags], torch_env))
        for variant in ORT_VARIANTS:
            report["ort"].append(_run(["--worker", "ort", "--artifacts", str(artifacts), "--variant", variant], ort_env))
    report["machine"]["load_average_at_end"] = os.getloadavg()
    # Per variant: the median over the repeats, and its ratio to the plain step's (the agent's default).
    summary = {}
    for checkpointed, micro in torch_variants:
        for pinned in (False, True):
            runs = [r for r in report["torch"] if r["checkpointed"] == checkpointed and r["malloc_mmap_threshold_pinned"] == pinned
                    and r.get("micro_batch") == micro]
            ms = sorted(r["step_ms_median"] for r in runs)
            name = f"checkpointed={checkpointed} pinned={pinned}" + (f" micro_batch={micro}" if micro else "")
            summary[name] = {
                "step_ms_median": ms[len(ms) // 2], "peak_above_import_bytes_max": max(r["peak_above_import_bytes"] for r in runs)}
    plain = summary["checkpointed=False pinned=False"]["step_ms_median"]
    for entry in summary.values():
        entry["step_time_over_default"] = round(entry["step_ms_median"] / plain, 2)
    report["torch_summary"] = summary
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for r in report["torch"]:
        print(f"torch checkpointed={r['checkpointed']!s:5} pinned={r['malloc_mmap_threshold_pinned']!s:5} micro={r.get('micro_batch')!s:4} "
              f"peak {r['peak_rss_bytes'] / 1e6:.0f} MB ({r['peak_above_import_bytes'] / 1e6:.0f} above import)  {r['step_ms_median']:.0f} ms")
    for r in report["ort"]:
        print(f"ort {r['variant']:28s} peak {r['peak_rss_bytes'] / 1e6:.0f} MB (step {r['step_above_loaded_bytes'] / 1e6:.0f} above loaded)  "
              f"{r['step_ms_median']:.0f} ms")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
