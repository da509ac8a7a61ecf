"""One measurement of bench/micro/test_step_memory.py in a fresh process (peak RSS is a process's
own): ``torch``, ``ort`` or ``import`` with its variant; prints one JSON line. Imports nothing at
the top but the standard library, so that the ``ort`` worker runs without torch."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from fresh import status_bytes

BATCH = 64
MICRO_BATCH = 16  # --low-memory's
STEPS = 11  # the first is warm-up


def _median_ms(times: list[float]) -> float:
    rest = sorted(times[1:])
    return 1000 * rest[len(rest) // 2]


def torch_step(checkpointed: bool, pinned: bool, micro_batch: int | None) -> dict:
    """A bare training step (CE + KD, the agent's lean Adam): peak RSS and median ms per step."""
    if pinned:
        from edge_agent.memory import fix_malloc_mmap_threshold

        fix_malloc_mmap_threshold()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    base, base_file = status_bytes("VmHWM"), status_bytes("RssFile")
    from models import build_model
    from models.losses import kd_loss
    from models.memory import checkpoint_bottlenecks
    from models.training import Step, make_optimizer

    torch.manual_seed(0)
    model = build_model("resnet8", 10, 3)
    if checkpointed:
        checkpoint_bottlenecks(model)
    # The agent's optimiser: torch.optim's would import torch._dynamo (see the import costs) into every variant.
    opt = make_optimizer("adam", model.parameters(), 1e-3, weight_decay=5e-4, lean=True)
    step = Step(model, opt, lambda output, y, teacher: F.cross_entropy(output[0], y) + kd_loss(output[0], teacher, 3.0),
                forward=lambda m, inputs: m(inputs), micro_batch=micro_batch)
    x, y, teacher = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,)), torch.randn(BATCH, 10)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        step(x, y, teacher)
        times.append(time.perf_counter() - t0)
    peak = status_bytes("VmHWM")
    return {"torch": torch.__version__, "triton_loaded": "triton" in sys.modules, "import_peak_rss_bytes": base,
            "import_rss_file_bytes": base_file, "peak_rss_bytes": peak, "peak_above_import_bytes": peak - base,
            "rss_file_after_bytes": status_bytes("RssFile"), "rss_after_bytes": status_bytes("VmRSS"),
            "step_ms_median": _median_ms(times)}


def import_cost(variant: str) -> dict:
    """What one piece of the agent's one-off work adds to ``import torch`` for good."""
    import torch

    torch.set_num_threads(1)
    from models import build_model
    from models.cost import flops_of, layer_flops_per_sample
    from models.training import make_optimizer

    model = build_model("resnet8", 10, 1)
    before, modules_before = status_bytes("VmRSS"), len(sys.modules)
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
    after = status_bytes("VmRSS")
    return {"torch": torch.__version__, "rss_before_bytes": before, "rss_after_bytes": after, "added_bytes": after - before,
            "modules_added": len(sys.modules) - modules_before, "torch_dynamo_loaded": "torch._dynamo" in sys.modules,
            "sympy_loaded": "sympy" in sys.modules}


def ort_step(artifacts: str, variant: str) -> dict:
    """The same step under onnxruntime-training with one session option changed (``agent``: the agent's)."""
    from edge_agent.memory import fix_malloc_mmap_threshold

    fix_malloc_mmap_threshold()  # as --low-memory: otherwise the heap's high-water mark hides the step's own
    import numpy as np

    import edge_agent.backends.ort as ort_backend
    from edge_agent.backends.optim import NumpyAdam

    onnxruntime, _ = ort_backend._ort()
    base, plain_options = status_bytes("VmHWM"), onnxruntime.SessionOptions

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
    loaded = status_bytes("VmHWM")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 3, 32, 32)).astype(np.float32)
    y, teacher = rng.integers(0, 10, BATCH), rng.normal(size=(BATCH, 10)).astype(np.float32)
    opt, times = NumpyAdam(1e-3, weight_decay=5e-4), []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        model.train_step(x, y, teacher, np.ones(BATCH, np.float32), 3.0, 1.0, opt, micro_batch=MICRO_BATCH if variant == "micro16" else None)
        times.append(time.perf_counter() - t0)
    peak = status_bytes("VmHWM")
    return {"onnxruntime": ort_backend.ort_version(), "import_peak_rss_bytes": base, "loaded_peak_rss_bytes": loaded,
            "peak_rss_bytes": peak, "step_above_loaded_bytes": peak - loaded, "step_ms_median": _median_ms(times)}


if __name__ == "__main__":
    kind, spec = sys.argv[1], json.loads(sys.argv[2])
    work = {"torch": torch_step, "import": import_cost, "ort": ort_step}[kind]
    print(json.dumps(work(**spec)))
