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
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from step_memory_worker import BATCH, MICRO_BATCH

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("step_memory_worker.py")
#: Fresh processes per variant, full and --quick.
ROUNDS = {False: 2, True: 1}
ORT_VARIANTS = ("agent", "mem_pattern_off", "graph_optimization_off", "memory_optimizer_recompute", "micro16")
IMPORT_COST_VARIANTS = ("flop_counter_mode", "layer_counter", "torch_optim_adam", "lean_adam")


def _blocker(directory: Path, hidden: tuple[str, ...]) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from no_torch import write_blocker

    return write_blocker(directory, hidden=hidden)


@pytest.fixture(scope="module")
def envs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """The workers' PYTHONPATH: torch's (this venv's, or the CPU-only one asked for), and one that hides torch."""
    work = tmp_path_factory.mktemp("step-memory")
    torch_path = [str(ROOT)]
    if os.environ.get("EDGESPLIT_TORCH_CPU_DIR"):
        torch_path = [str(_blocker(work / "no_triton", ("triton",))), str(Path(os.environ["EDGESPLIT_TORCH_CPU_DIR"]).resolve()), str(ROOT)]
    no_torch = str(_blocker(work / "no_torch", ("torch", "torchvision", "torchaudio")))
    return {"torch": {"PYTHONPATH": os.pathsep.join(torch_path)}, "ort": {"PYTHONPATH": os.pathsep.join([no_torch, str(ROOT)])}}


def worker(kind: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run([sys.executable, str(WORKER), kind, json.dumps(spec)], capture_output=True, text=True, cwd="/",
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env}, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{kind} {spec} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def in_fresh_processes(benchmark: Any, quick: bool, kind: str, spec: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
    """Time ``ROUNDS`` fresh worker processes; their reports, summed up, in extra_info."""
    runs: list[dict[str, Any]] = []
    benchmark.pedantic(lambda: runs.append(worker(kind, spec, env)), rounds=ROUNDS[quick], iterations=1)
    benchmark.extra_info.update(spec=spec, runs=runs, **{f"{k}_max": max(r[k] for r in runs) for k in runs[0] if k.endswith("_bytes")})
    if "step_ms_median" in runs[0]:
        benchmark.extra_info["step_ms_median"] = statistics.median(r["step_ms_median"] for r in runs)
    return runs


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
def test_torch_step(benchmark: Any, quick: bool, envs: dict[str, dict[str, str]], checkpointed: bool,
                    micro_batch: int | None, pinned: bool) -> None:
    in_fresh_processes(benchmark, quick, "torch", {"checkpointed": checkpointed, "pinned": pinned, "micro_batch": micro_batch},
                       envs["torch"])


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agents' onnxruntime-training artifacts, as the server generates them for the default round config."""
    pytest.importorskip("onnxruntime.training", reason="the ort step needs onnxruntime-training (the [edge-lite] extra)")
    import torch

    from models import build_model
    from models.onnx_export import export_edge_artifacts
    from shared_protocol.methods.fedgkt import GktRoundConfig

    torch.manual_seed(0)
    exported = export_edge_artifacts(build_model("resnet8", 10, 3), 10, 3, train_extractor=GktRoundConfig.train_extractor)
    directory = tmp_path_factory.mktemp("artifacts")
    exported.write(directory)
    meta = {"trainable": list(exported.trainable), "bn_stats": list(exported.bn_stats), "bn_counters": list(exported.bn_counters),
            "state_names": list(exported.state_names), "input_shape": list(exported.input_shape), "num_classes": exported.num_classes}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


@pytest.mark.parametrize("variant", ORT_VARIANTS)
def test_ort_step(benchmark: Any, quick: bool, envs: dict[str, dict[str, str]], artifacts: Path, variant: str) -> None:
    in_fresh_processes(benchmark, quick, "ort", {"artifacts": str(artifacts), "variant": variant}, envs["ort"])


@pytest.mark.parametrize("variant", IMPORT_COST_VARIANTS)
def test_import_cost(benchmark: Any, envs: dict[str, dict[str, str]], variant: str) -> None:
    in_fresh_processes(benchmark, True, "import", {"variant": variant}, envs["torch"])
