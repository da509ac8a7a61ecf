"""Where one ResNet-8 training step's memory goes, under torch and onnxruntime-training, and what
--low-memory saves; batch 64 of 3x32x32, one thread. Memory figures go in ``extra_info``.

* ``test_saved_by_block``: the bytes the forward pass keeps for the backward (autograd's saved-tensor
  hooks, each storage once) per part of the model, plain and with checkpointed bottlenecks
  (``models.memory``), and the training FLOPs the recomputation adds; the forward pass is timed.
* ``test_torch_step``: a bare training step (CE + KD, the agent's lean Adam), plain, checkpointed or
  in micro-batches of 16, with glibc's malloc as it is or its mmap threshold pinned: each round a
  fresh process (peak RSS, peak above ``import torch``, file-backed RSS, median ms per step).
* ``test_ort_step``: the same step under onnxruntime-training with the session options that could
  matter, and the agent's step in micro-batches of 16, in a process without torch.
* ``test_import_cost``: what the agent's one-off work adds to ``import torch`` for good: counting
  FLOPs with ``FlopCounterMode`` or the agents' layer counter, three steps of ``torch.optim.Adam``
  or of the agents' lean Adam.

The timed figure of the process-per-round cases is the whole process (imports, build, 11 steps);
``step_ms_median`` in ``extra_info`` is the step's own. ``EDGESPLIT_TORCH_CPU_DIR``: a CPU-only
torch (e.g. its wheel unpacked) put first on the workers' path, triton hidden.

    make bench-micro MICRO=step_memory     # or: pytest bench/micro/test_step_memory.py [--quick]
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fresh
import pytest

from step_memory_worker import BATCH, MICRO_BATCH

WORKER = Path(__file__).with_name("step_memory_worker.py")
#: Fresh processes per variant, full and --quick.
ROUNDS = {False: 2, True: 1}
ORT_VARIANTS = ("agent", "mem_pattern_off", "graph_optimization_off", "memory_optimizer_recompute", "micro16")
IMPORT_COST_VARIANTS = ("flop_counter_mode", "layer_counter", "torch_optim_adam", "lean_adam")


def in_fresh_processes(benchmark: Any, quick: bool, kind: str, spec: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
    benchmark.extra_info["spec"] = spec
    return fresh.in_fresh_processes(benchmark, ROUNDS[quick], WORKER, [kind, json.dumps(spec)], env)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_saved_by_block(benchmark: Any, checkpointed: bool) -> None:
    import torch
    import torch.nn.functional as F

    from models import build_model
    from models.losses import kd_loss
    from models.memory import checkpoint_bottlenecks, recompute_flops_ratio

    torch.set_num_threads(1)
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

    x, y, teacher = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,)), torch.randn(BATCH, 10)

    def forward() -> None:
        logits, _ = model(x)
        F.cross_entropy(logits, y) + kd_loss(logits, teacher, 3.0)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    benchmark.extra_info.update(saved_bytes=dict(per), saved_total_bytes=sum(per.values()), batch_size=BATCH)
    if checkpointed:
        benchmark.extra_info["recompute_flops_ratio"] = recompute_flops_ratio(build_model("resnet8", 10, 3), (3, 32, 32))
    benchmark.pedantic(forward, warmup_rounds=1, rounds=3)


@pytest.mark.parametrize("pinned", [False, True], ids=["malloc", "pinned"])
@pytest.mark.parametrize(("checkpointed", "micro_batch"), [(False, None), (True, None), (False, MICRO_BATCH)],
                         ids=["plain", "checkpointed", f"micro{MICRO_BATCH}"])
def test_torch_step(benchmark: Any, quick: bool, worker_envs: dict[str, dict[str, str]], checkpointed: bool,
                    micro_batch: int | None, pinned: bool) -> None:
    in_fresh_processes(benchmark, quick, "torch", {"checkpointed": checkpointed, "pinned": pinned, "micro_batch": micro_batch},
                       worker_envs["torch"])


@pytest.mark.parametrize("variant", ORT_VARIANTS)
def test_ort_step(benchmark: Any, quick: bool, worker_envs: dict[str, dict[str, str]], ort_artifacts: Callable[[int], Path],
                  variant: str) -> None:
    in_fresh_processes(benchmark, quick, "ort", {"artifacts": str(ort_artifacts(3)), "variant": variant}, worker_envs["ort"])


@pytest.mark.parametrize("variant", IMPORT_COST_VARIANTS)
def test_import_cost(benchmark: Any, worker_envs: dict[str, dict[str, str]], variant: str) -> None:
    in_fresh_processes(benchmark, True, "import", {"variant": variant}, worker_envs["torch"])
