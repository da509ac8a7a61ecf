"""One process of bench/micro/test_footprint.py; prints one JSON line. ``baseline BACKEND``: a
process that only loads the runtime, as the agent loads it. ``agent SPEC``: a whole ``EdgeAgent``
as a device runs it (its MQTT transport, threads and caches included) with the memory settings of
its mode, until the scripted server in the benchmark's process shuts it down; each round's own
peak travels in its ``RoundEnd``, as it does to a real server. Imports nothing at the top but the
standard library, so that the ort agent runs without torch."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

from fresh import status_bytes

AGENT_ID = "bench-agent"


def memory_for(mode: str):  # type: ignore[no-untyped-def]  # -> edge_agent.config.MemoryConfig
    """The agent's memory settings of each measured mode: its defaults, ``--low-memory``, that with
    micro-batches of 8, and its micro-batches without the pinned malloc threshold."""
    from edge_agent.config import MemoryConfig

    low = MemoryConfig.low()
    return {"default": MemoryConfig(), "low-memory": low, "low-memory-8": dataclasses.replace(low, micro_batch_samples=8),
            "micro-batch": MemoryConfig(micro_batch_samples=low.micro_batch_samples)}[mode]


def baseline(backend: str) -> dict[str, Any]:
    if backend == "torch":
        import torch

        version = {"torch": torch.__version__}
    else:
        from edge_agent.backends.ort import _ort, ort_version

        _ort()
        version = {"onnxruntime": ort_version()}
    return {"backend": backend, **version, "peak_rss_bytes": status_bytes("VmHWM"), "torch_loaded": "torch" in sys.modules}


def agent(backend: str, mode: str, samples: int, test_samples: int, broker_url: str, run_id: str) -> dict[str, Any]:
    from edge_agent.agent import EdgeAgent
    from edge_agent.config import DataConfig, EdgeConfig
    from edge_agent.memory import apply_process_memory

    memory = memory_for(mode)
    pinned = apply_process_memory(memory)  # as `edge-agent run` does with these settings
    config = EdgeConfig(agent_id=AGENT_ID, run_id=run_id, broker_url=broker_url, backend=backend, threads=1, progress=False,
                        data=DataConfig(dataset="fashion-mnist", partition="none", train_samples=samples, test_samples=test_samples,
                                        seed=0),
                        memory=memory)
    started = time.perf_counter()
    code = EdgeAgent(config).run()
    out = {"exit_code": code, "backend": backend, "mode": mode, "memory": dataclasses.asdict(memory), "malloc_mmap_threshold_pinned": pinned,
           "seconds": round(time.perf_counter() - started, 1), "exit_peak_rss_bytes": status_bytes("VmHWM"),
           "torch_loaded": "torch" in sys.modules, "triton_loaded": "triton" in sys.modules}
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].__version__
    if backend == "ort":
        from edge_agent.backends.ort import ort_version

        out["onnxruntime"] = ort_version()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "baseline":
        print(json.dumps(baseline(sys.argv[2])))
    else:
        print(json.dumps(agent(**json.loads(sys.argv[2]))))
