"""What the agent costs to put on a device: installed size, peak memory, time per batch.

Builds two fresh virtual environments and measures, for each:

* ``edge``      -- the torch backend: CPU torch + the agent (``edgesplit[edge]``
  without torchvision, which the agent only needs to download CIFAR);
* ``edge-lite`` -- the ort backend: ``pip install edgesplit[edge-lite]``
  (onnxruntime-training-cpu with all its declared dependencies), no torch;
* ``edge-lite-lean`` -- the same backend as ``deploy/edge/install.sh --backend ort``
  installs it: onnxruntime-training-cpu without onnx / sympy / h5py (only the
  server's artifact generation uses them), numpy, the agent;

their installed size (``site-packages``, measured with ``du``-style block
counting) and, in a fresh process in each environment, the peak RSS and
milliseconds per training batch of the bare training step (FedGKT edge step:
ResNet-8, CE + KD, batch 64, 3x32x32, one thread) after warm-up, plus eval
(feature extraction) ms per batch. The ort artifacts are generated here, with
torch, as the server would.

Then the **agent** itself, as a device runs it (``agent`` in the JSON): a whole
``EdgeAgent`` process loading its Fashion-MNIST shard of 1,000 / 4,000 / 16,000
training samples (plus 1,000 test samples) from the Debian package's IDX files,
running two FedGKT rounds at the protocol's defaults (batch 64, 1 edge epoch,
fp16-zstd uploads of 256 samples, evaluation every round, server logits for
every sample before round 2) against a scripted server inside the same process
(no broker: uploads are encoded and counted, then dropped). Measured per run:
peak RSS (``VmHWM``), the runtime's own import baseline (a fresh process that
only imports torch, or onnxruntime-training as the ort backend does) and the
agent's peak above it, RSS after each round. Each agent runs in the modes of ``--modes``:
``default`` (``edge-agent run``), ``low-memory`` (``edge-agent run
--low-memory``: forward passes of at most 16 samples -- training accumulates
them into the round's batch --, uploads of at most 64 samples, glibc's mmap
threshold pinned), ``low-memory-8`` (the same with micro-batches of 8) and
``micro-batch`` (``--low-memory`` without the pinned threshold: ``[memory]
micro_batch_samples = 16``); entries are named ``ENV`` and ``ENV
MODE``. Three environments: the torch
agent with the CPU-only torch build (the ``edge`` venv), the torch agent with
the CUDA build PyPI serves on x86_64 (this venv, when its torch is one), and the
ort agent in the lean ``edge-lite-lean`` venv (no torch installed).

    .venv/bin/python bench/footprint.py                # build the venvs (a few minutes), measure
    .venv/bin/python bench/footprint.py --reuse DIR    # keep / reuse the venvs in DIR
    .venv/bin/python bench/footprint.py --no-install   # only this venv (torch hidden for the ort run)
    .venv/bin/python bench/footprint.py --reuse DIR --only-agent   # only the agent runs, merged into the JSON
    .venv/bin/python bench/footprint.py --no-install --only-agent --torch-cpu-dir DIR   # agents in this venv, with
        # the CPU-only torch wheel unpacked in DIR in front of it (no pip install); --sizes 1000,16000 to be quicker

Writes ``bench/results/footprint.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import replace
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import footprint_long  # noqa: E402  (bench/, next to this script)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "footprint.json"
#: The agent's memory modes measured (see :func:`memory_for`).
MODES = ("default", "low-memory", "low-memory-8", "micro-batch")


def memory_for(mode: str):  # type: ignore[no-untyped-def]  # -> edge_agent.config.MemoryConfig
    sys.path.insert(0, str(REPO))
    from edge_agent.config import MemoryConfig

    return {"default": MemoryConfig(), "low-memory": MemoryConfig.low(), "low-memory-8": replace(MemoryConfig.low(), micro_batch_samples=8),
            "micro-batch": MemoryConfig(micro_batch_samples=MemoryConfig.low().micro_batch_samples)}[mode]


TORCH_CPU_WHEEL_GLOB = "/opt/wheels/torch-*+cpu-*.whl"  # the dev machine's local CPU wheel


# --------------------------------------------------------------------------- #
# worker: runs inside one environment
# --------------------------------------------------------------------------- #


def _rss_bytes() -> int:
    """Peak RSS of this process image. ``ru_maxrss`` would not do: after fork + exec it
    keeps the parent's high-water mark; ``VmHWM`` belongs to the new address space."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(backend: str, artifacts: str | None, batches: int, warmup: int, batch_size: int) -> dict:
    started = time.perf_counter()
    rss_start = _rss_bytes()
    sys.path.insert(0, str(REPO))
    import numpy as np

    from edge_agent.memory import fix_malloc_mmap_threshold

    fix_malloc_mmap_threshold()  # as `edge-agent run --low-memory` does

    import edge_agent.agent  # noqa: F401  (what the agent process imports anyway)
    from fldata import make_synthetic
    from fldata.numpy_data import iterate_batches

    ds = make_synthetic(batch_size * (batches + warmup), num_classes=10, in_channels=3, seed=0)
    data = list(iterate_batches(ds, batch_size, shuffle=True, seed=0))
    teacher = np.random.default_rng(0).normal(size=(batch_size, 10)).astype(np.float32)
    mask = np.ones(batch_size, np.float32)
    times: list[float] = []
    eval_times: list[float] = []
    out: dict = {"backend": backend}
    if backend == "torch":
        import torch
        import torch.nn.functional as F

        from models import build_model
        from models.losses import kd_loss
        from models.training import Step

        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = build_model("resnet8", 10, 3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4, amsgrad=True)
        t_teacher = torch.from_numpy(teacher)

        def ce_and_kd(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # logits (B, 10)
            return F.cross_entropy(logits, labels) + kd_loss(logits, t_teacher, 3.0)

        step = Step(model, opt, ce_and_kd)  # the shared loop's step: forward, loss, backward, one Adam step
        import_s = time.perf_counter() - started
        model.train()
        for i, (x, y, _) in enumerate(data):
            t0 = time.perf_counter()
            step(torch.from_numpy(x), torch.from_numpy(y))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        model.eval()
        with torch.no_grad():
            for i, (x, _, _) in enumerate(data[: warmup + 5]):
                t0 = time.perf_counter()
                model(torch.from_numpy(x))
                if i >= warmup:
                    eval_times.append(time.perf_counter() - t0)
        out["torch"] = torch.__version__
    else:
        from edge_agent.backends.optim import NumpyAdam
        from edge_agent.backends.ort import ArtifactMeta, OrtEdgeModel, ort_version

        assert artifacts is not None
        meta = ArtifactMeta.from_json((Path(artifacts) / "meta.json").read_text())
        model = OrtEdgeModel(artifacts, meta, threads=1)
        opt = NumpyAdam(1e-3, weight_decay=5e-4)
        import_s = time.perf_counter() - started
        for i, (x, y, _) in enumerate(data):
            t0 = time.perf_counter()
            model.train_step(x, y, teacher, mask, 3.0, 1.0, opt)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        for i, (x, _, _) in enumerate(data[: warmup + 5]):
            t0 = time.perf_counter()
            model.forward_eval(x)
            if i >= warmup:
                eval_times.append(time.perf_counter() - t0)
        out["onnxruntime"] = ort_version()
        out["torch_importable"] = _torch_importable()
    times_ms = sorted(t * 1000 for t in times)
    out.update(
        batch_size=batch_size,
        batches_timed=len(times),
        train_ms_per_batch_median=times_ms[len(times_ms) // 2],
        train_ms_per_batch_mean=sum(times_ms) / len(times_ms),
        eval_ms_per_batch_median=sorted(t * 1000 for t in eval_times)[len(eval_times) // 2],
        startup_s=import_s,
        rss_at_start_bytes=rss_start,
        peak_rss_bytes=_rss_bytes(),
        python=platform.python_version(),
        numpy=np.__version__,
    )
    return out


# --------------------------------------------------------------------------- #
# worker: one agent process with a scripted server
# --------------------------------------------------------------------------- #

AGENT_SAMPLES = (1000, 4000, 16000)
AGENT_TEST_SAMPLES = 1000
# Two rounds at the smallest shard (what round 2 keeps from round 1, server logits for every
# sample included), one at the larger ones: a 2-core machine shared with other work takes
# too long otherwise. Shard sizes are compared by the peak of round 1, which every run has.
AGENT_ROUNDS = {1000: 2, 4000: 1, 16000: 1}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def baseline_worker(backend: str) -> dict:
    """Peak RSS of a process that only loads the runtime, as the agent loads it."""
    if backend == "torch":
        import torch

        version = {"torch": torch.__version__}
    else:
        sys.path.insert(0, str(REPO))
        from edge_agent.backends.ort import _ort, ort_version

        _ort()
        version = {"onnxruntime": ort_version()}
    return {"backend": backend, **version, "peak_rss_bytes": _status_kib("VmHWM") * 1024,
            "torch_loaded": "torch" in sys.modules}


def agent_worker(backend: str, artifacts: str | None, samples: int, batch_size: int = 64, rounds: int = 1,
                 mode: str = "default") -> dict:
    """One agent, two FedGKT rounds, its own shard of ``samples`` Fashion-MNIST images,
    with the memory settings of ``mode`` (:data:`MODES`)."""
    sys.path.insert(0, str(REPO))
    import collections
    import hashlib

    import numpy as np

    from edge_agent.agent import EdgeAgent
    from edge_agent.config import DataConfig, EdgeConfig
    from shared_protocol.messages import RoundStart, Shutdown, Welcome, decode_message, encode_message, peek_header
    from shared_protocol.methods.fedgkt import GktRoundConfig, GktServerLogits
    from shared_protocol.transport import Delivery, TrafficStats, Transport

    rss_start = _status_kib("VmHWM") * 1024
    from edge_agent.memory import apply_process_memory

    memory = memory_for(mode)
    malloc_fixed = apply_process_memory(memory)  # as `edge-agent run` does with these settings
    run_id, agent_id = "footprint", "bench-agent"

    class ScriptedServer(Transport):
        """The server's half of a FedGKT run, scripted: welcome, round 1, server logits for
        every sample, round 2, shutdown. Uploads are counted and dropped unread (only
        their header is looked at), so the process holds what the agent holds."""

        def __init__(self) -> None:
            self.stats = TrafficStats()
            self.inbox: collections.deque[bytes] = collections.deque()
            self.round = 0
            self.train_ids = np.zeros(0, np.int64)
            self.marks: list[dict] = []
            self.uploads = 0
            self._connects = 0

        @property
        def connect_count(self) -> int:
            return self._connects

        def set_will(self, topic: str, blob: bytes) -> None:
            pass

        def connect(self) -> None:
            self._connects += 1

        def subscribe(self, topic_filter: str) -> None:
            pass

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

        def _send(self, msg) -> None:  # type: ignore[no-untyped-def]
            self.inbox.append(encode_message(msg))

        def _round_start(self) -> None:
            self.round += 1
            self._send(RoundStart(run=run_id, round=self.round, sender="server", method="fedgkt",
                                  config=dataclasses.asdict(GktRoundConfig(batch_size=batch_size)), deadline_s=3600.0, evaluate=True))

        def publish(self, topic: str, blob: bytes, retain: bool = False, reply_topic: str | None = None, wait: bool = True) -> None:
            self.stats.add(payload_bytes_out=len(blob), wire_bytes_out=len(blob), messages_out=1, chunks_out=1)
            kind = peek_header(blob)["type"]
            if kind == "hello" and self.round == 0:
                self._send(Welcome(run=run_id, round=0, sender="server", accepted=True, method="fedgkt",
                                   settings={"num_classes": 10, "edge_model": "resnet8"}))
                self._round_start()
            elif kind == "fedgkt.features":
                self.uploads += 1
            elif kind == "fedgkt.ort_artifacts_request":
                self._send(_artifacts_message(artifacts, run_id, self.round))
            elif kind == "round_end":
                # The agent's own per-round peak (it resets VmHWM as it takes it, so VmHWM here is not the round's).
                end = decode_message(blob)
                self.marks.append({"round": self.round, "peak_rss_bytes": end.costs.peak_rss_bytes,
                                   "rss_bytes": _status_kib("VmRSS") * 1024})
                if self.round < rounds:
                    rng = np.random.default_rng(self.round)
                    self._send(GktServerLogits(run=run_id, round=self.round, sender="server", sample_ids=self.train_ids,
                                               logits=rng.normal(size=(self.train_ids.size, 10)).astype(np.float32)))
                    self._round_start()
                else:
                    self._send(Shutdown(run=run_id, round=self.round, sender="server", reason="footprint bench done"))
            elif kind == "error":
                raise RuntimeError(f"the agent sent an error: {blob[:400]!r}")

        def receive(self, timeout_s: float | None = None) -> Delivery | None:
            if not self.inbox:
                time.sleep(min(timeout_s or 0.0, 0.01))
                return None
            blob = self.inbox.popleft()
            return Delivery("edgesplit/down", blob, hashlib.sha1(blob[:64]).hexdigest(), len(blob), time.time())

    transport = ScriptedServer()
    config = EdgeConfig(
        agent_id=agent_id, run_id=run_id, backend=backend, threads=1, progress=False,
        data=DataConfig(dataset="fashion-mnist", partition="none", train_samples=samples, test_samples=AGENT_TEST_SAMPLES, seed=0),
        memory=memory,
    )
    started = time.perf_counter()
    agent = EdgeAgent(config, transport=transport)
    loaded_s = time.perf_counter() - started
    rss_loaded = _status_kib("VmHWM") * 1024
    transport.train_ids = np.asarray(agent.train.sample_ids, np.int64)
    code = agent.run()
    if code != 0 or len(transport.marks) != rounds:
        raise RuntimeError(f"the agent exited {code} after {len(transport.marks)} of {rounds} rounds")
    return {
        "backend": backend,
        "batch_size": batch_size,
        "train_samples": len(agent.train),
        "test_samples": len(agent.test),
        "shard_images_bytes": int(agent.train.images.nbytes),
        "shard_is_memmap": isinstance(agent.train.images, np.memmap),
        "rounds": transport.marks,
        "feature_uploads": transport.uploads,
        "payload_bytes_up": transport.stats.snapshot()["payload_bytes_out"],
        "rss_at_start_bytes": rss_start,
        "peak_rss_after_load_bytes": rss_loaded,
        "peak_rss_bytes": max([_status_kib("VmHWM") * 1024] + [m["peak_rss_bytes"] for m in transport.marks]),
        "torch_loaded": "torch" in sys.modules,
        "torchvision_loaded": "torchvision" in sys.modules,
        "triton_loaded": "triton" in sys.modules,
        "malloc_mmap_threshold_fixed": malloc_fixed,
        "mode": mode,
        "memory": dataclasses.asdict(memory),
        "bottlenecks_checkpointed": _checkpointed(agent),
        "seconds": round(time.perf_counter() - started, 1),
        "load_s": round(loaded_s, 2),
    }


def _checkpointed(agent) -> bool:  # type: ignore[no-untyped-def]
    model = getattr(agent.method, "model", None)
    if "torch" not in sys.modules or model is None or not hasattr(model, "modules"):
        return False
    from models.memory import is_checkpointed

    return is_checkpointed(model)


def _artifacts_message(directory: str | None, run_id: str, round_: int):  # type: ignore[no-untyped-def]
    import numpy as np

    from shared_protocol.methods.fedgkt_ort import GktOrtArtifacts, artifacts_sha256

    if directory is None:
        raise ValueError("the ort agent needs --artifacts")
    d = Path(directory)
    files = {"training_model": "training_model.onnx", "eval_model": "eval_model.onnx",
             "optimizer_model": "optimizer_model.onnx", "checkpoint": "checkpoint"}
    blobs = {name: (d / file).read_bytes() for name, file in files.items()}
    meta = json.loads((d / "meta.json").read_text())
    return GktOrtArtifacts(run=run_id, round=round_, sender="server", edge_model="resnet8", sha256=artifacts_sha256(blobs), meta=meta,
                           train_flops_per_sample=0, forward_flops_per_sample=0,
                           **{name: np.frombuffer(blob, np.uint8).copy() for name, blob in blobs.items()})


def _torch_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


# --------------------------------------------------------------------------- #
# orchestration
# --------------------------------------------------------------------------- #


def tree_bytes(path: Path) -> int:
    """Disk usage like ``du -s`` (allocated blocks), hard links counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_blocks * 512
    return total


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def largest_packages(sp: Path, n: int = 8) -> dict[str, float]:
    sizes = {}
    for entry in sp.iterdir():
        if entry.is_dir() and not entry.name.endswith((".dist-info", "__pycache__")):
            sizes[entry.name] = tree_bytes(entry) / 1e6
    return {k: round(v, 1) for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:n]}


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *args], check=True)


def build_env(kind: str, base: Path) -> tuple[Path, float]:
    venv = base / kind
    if (venv / ".complete").exists():
        return venv, 0.0
    shutil.rmtree(venv, ignore_errors=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if kind == "edge":
        wheels = sorted(Path("/").glob(TORCH_CPU_WHEEL_GLOB.lstrip("/")))
        torch_spec = str(wheels[-1]) if wheels else "torch"
        pip(venv, torch_spec)
        # The [edge] extra minus torchvision (CIFAR downloads only; a CPU torchvision is not on this machine).
        pip(venv, "--no-deps", str(REPO))
        pip(venv, "numpy>=1.24", "zstandard>=0.21", "paho-mqtt>=2.0,<3", "tqdm>=4.60", "psutil>=5.9")
    elif kind == "edge-lite":
        pip(venv, f"{REPO}[edge-lite]")
    else:  # edge-lite-lean: what deploy/edge/install.sh --backend ort installs
        pip(venv, "--no-deps", "onnxruntime-training-cpu==1.19.2")
        pip(venv, "numpy>=1.24", "zstandard>=0.21", "paho-mqtt>=2.0,<3", "pillow>=9")
        pip(venv, "--no-deps", str(REPO))
    (venv / ".complete").touch()
    return venv, time.monotonic() - started


def export_artifacts(directory: Path, in_channels: int = 3) -> None:
    import torch

    sys.path.insert(0, str(REPO))
    from models import build_model
    from models.onnx_export import export_edge_artifacts

    from shared_protocol.methods.fedgkt import GktRoundConfig

    torch.manual_seed(0)
    # As the server generates them for the round config the bench sends (GktRoundConfig's defaults).
    artifacts = export_edge_artifacts(build_model("resnet8", 10, in_channels), 10, in_channels,
                                      train_extractor=GktRoundConfig.train_extractor)
    # Written aside and moved in file by file: another bench process may be serving these files.
    staging = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    artifacts.write(staging)
    meta = {"trainable": list(artifacts.trainable), "bn_stats": list(artifacts.bn_stats), "bn_counters": list(artifacts.bn_counters),
            "state_names": list(artifacts.state_names), "input_shape": list(artifacts.input_shape), "num_classes": artifacts.num_classes}
    (staging / "meta.json").write_text(json.dumps(meta))
    directory.mkdir(parents=True, exist_ok=True)
    for f in staging.iterdir():
        os.replace(f, directory / f.name)
    staging.rmdir()


def run_worker(python: str, backend: str, artifacts: Path, args: argparse.Namespace, env: dict[str, str] | None = None) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--worker", backend, "--artifacts", str(artifacts),
           "--batches", str(args.batches), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd="/", env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"{backend} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_json(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd="/", env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-6:])} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure_agents(python: str, backend: str, artifacts: Path, base: Path, env: dict[str, str] | None = None,
                   sizes: tuple[int, ...] = AGENT_SAMPLES, mode: str = "default") -> dict:
    """The agent at each shard size in ``python``'s environment, and the runtime's own baseline."""
    env = {"EDGESPLIT_DATA_DIR": str(base / "data-cache"), **(env or {})}
    me = str(Path(__file__).resolve())
    baseline = run_json([python, me, "--worker", "baseline", "--backend", backend], env)
    from concurrent.futures import ThreadPoolExecutor

    def agent_run(n: int) -> dict:
        return run_json([python, me, "--worker", "agent", "--backend", backend, "--artifacts", str(artifacts), "--samples", str(n),
                         "--rounds", str(AGENT_ROUNDS[n]), "--mode", mode], env)

    with ThreadPoolExecutor(max_workers=len(sizes)) as pool:  # side by side: peak RSS is per process
        results = dict(zip(sizes, pool.map(agent_run, sizes)))
    runs = {}
    for n in sizes:
        run = results[n]
        run["peak_above_runtime_bytes"] = run["peak_rss_bytes"] - baseline["peak_rss_bytes"]
        runs[str(n)] = run
        print(f"  {backend} {n:6d} samples: peak {run['peak_rss_bytes'] / 1e6:.0f} MB "
              f"({run['peak_above_runtime_bytes'] / 1e6:.0f} MB above the runtime's {baseline['peak_rss_bytes'] / 1e6:.0f} MB), "
              f"{run['seconds']:.0f} s", flush=True)
    out = {"mode": mode, "runtime_baseline": baseline, "runs": runs}
    if len(sizes) > 1:
        first, last = runs[str(sizes[0])], runs[str(sizes[-1])]
        out["round1_peak_largest_over_smallest"] = round(last["rounds"][0]["peak_rss_bytes"] / first["rounds"][0]["peak_rss_bytes"], 3)
        out["peak_largest_over_smallest"] = round(last["peak_rss_bytes"] / first["peak_rss_bytes"], 3)
    return out


def agent_section(envs: dict[str, str], artifacts: Path, base: Path, ort_env: dict[str, str] | None = None,
                  modes: tuple[str, ...] = ("default",), sizes: tuple[int, ...] = AGENT_SAMPLES,
                  env_vars: dict[str, dict[str, str]] | None = None) -> dict:
    """Each environment of ``envs`` in each mode of :data:`MODES`; entries are named
    ``ENV`` (default mode) and ``ENV MODE``."""
    out: dict = {
        "setting": {"dataset": "fashion-mnist (Debian package IDX files, 1x32x32)", "method": "fedgkt", "rounds_by_train_samples": {str(k): v for k, v in AGENT_ROUNDS.items()},
                    "train_samples": list(sizes), "test_samples": AGENT_TEST_SAMPLES,
                    "round_config": "GktRoundConfig defaults: batch 64, 1 edge epoch, adam, fp16-zstd uploads of 256 samples",
                    "evaluate": "every round", "server": "scripted in the agent's process; uploads counted and dropped",
                    "threads": 1, "runs": "all side by side (each its own process); 'seconds' are wall times on a shared 2-core machine, not timings",
                    "modes": {"default": "edge-agent run",
                              "low-memory": "edge-agent run --low-memory: forward passes of at most 16 samples (training accumulates "
                                            "them into each batch of 64), uploads of at most 64 samples, glibc mmap threshold pinned at 1 MiB, "
                                            "the shard's images on disk, memory-mapped ([memory] shard_on_disk; runs recorded "
                                            "before it existed have \"shard_on_disk\" missing from their memory settings)",
                              "low-memory-8": "as low-memory with micro-batches of 8 ([memory] micro_batch_samples = 8, pin_malloc = true)",
                              "micro-batch": "[memory] micro_batch_samples = 16: as low-memory without the pinned threshold"}},
        "load_average_at_start": os.getloadavg(),
        "environments": {},
    }
    # The environments run side by side (peak RSS is per process; the seconds recorded are
    # then those of a shared machine, not timings).
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(name, mode) for name in envs for mode in modes if not (name == "torch-cuda" and mode != "default")]

    def one(job: tuple[str, str]) -> dict:
        name, mode = job
        backend = "ort" if name.startswith("ort") else "torch"
        print(f"agent footprint: {name} {mode} ({envs[name]})", flush=True)
        # The CUDA build only at the smallest shard: it is there for its import cost, next to the CPU build.
        env_sizes = sizes[:1] if name == "torch-cuda" else sizes
        env = {**(ort_env if backend == "ort" and ort_env else {}), **(env_vars or {}).get(name, {})}
        return measure_agents(envs[name], backend, artifacts, base, env or None, env_sizes, mode=mode)

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(one, jobs)))
    out["environments"] = {name if mode == "default" else f"{name} {mode}": r for (name, mode), r in results.items()}
    out["load_average_at_end"] = os.getloadavg()  # the seconds recorded are only as quiet as the machine was
    return out


def main() -> int:
    sys.path.insert(0, str(REPO))
    from shared_protocol.hostinfo import cpu_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("torch", "ort", "agent", "baseline", "agent-long"))
    p.add_argument("--backend", choices=("torch", "ort"), help="with --worker agent / baseline")
    p.add_argument("--samples", type=int, default=1000, help="with --worker agent: training samples in the shard")
    p.add_argument("--rounds", type=int, default=1, help="with --worker agent: FedGKT rounds")
    p.add_argument("--mode", choices=tuple(MODES), default="default", help="with --worker agent: its memory settings")
    p.add_argument("--modes", default=",".join(MODES), help="agent modes to measure (comma-separated, from %(default)s)")
    p.add_argument("--sizes", default=",".join(map(str, AGENT_SAMPLES)), help="agent shard sizes (comma-separated, from %(default)s)")
    p.add_argument("--torch-cpu-dir", help="with --no-install --only-agent: a directory holding the CPU-only torch "
                                          "(e.g. its wheel unpacked), put first on PYTHONPATH for the torch-cpu agent")
    p.add_argument("--skip-agent", action="store_true", help="keep the agent section of --out as it is")
    p.add_argument("--only-agent", action="store_true", help="only the agent runs (needs --reuse with built venvs); merged into --out")
    p.add_argument("--artifacts")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--reuse", help="directory for the venvs (kept; reused when complete)")
    p.add_argument("--no-install", action="store_true", help="measure in this venv only (torch hidden for the ort run)")
    p.add_argument("--out", default=str(RESULTS))
    long = p.add_argument_group("long run (bench/footprint_long.py): per-round peak RSS over tens of rounds, over MQTT")
    long.add_argument("--long-run", action="store_true", help="measure the long runs missing from --out's long_run section")
    long.add_argument("--long-rounds", type=int, default=footprint_long.LONG_ROUNDS, help="rounds per long run (default %(default)s)")
    long.add_argument("--long-sizes", default=",".join(map(str, footprint_long.LONG_SIZES)), help="shard sizes (default %(default)s)")
    long.add_argument("--long-jobs", default=",".join(f"{e}:{m}" for e, m in footprint_long.LONG_JOBS),
                      help="ENV:MODE pairs (ENV: torch-cpu, ort, torch-this-venv; default %(default)s)")
    long.add_argument("--parallel", type=int, default=2, help="long-run agents side by side (peak RSS is per process)")
    long.add_argument("--redo", action="store_true", help="measure long runs again that --out already has")
    long.add_argument("--collect", action="store_true", help="only write the rounds of unfinished long runs (complete: false)")
    long.add_argument("--probe", action="store_true", help="tracemalloc in the agent (slower): what grows, by line")
    long.add_argument("--broker", help="with --worker agent-long: the broker URL")
    long.add_argument("--run-id", help="with --worker agent-long: the run id")
    long.add_argument("--marks", help="with --worker agent-long: where to append a JSON line per round")
    args = p.parse_args()
    if args.worker == "agent-long":
        print(json.dumps(footprint_long.long_worker(args.backend, args.artifacts, args.samples, args.rounds, args.mode, args.broker,
                                                    args.run_id, args.marks, args.probe, args.batch_size)))
        return 0
    if args.worker == "agent":
        print(json.dumps(agent_worker(args.backend, args.artifacts, args.samples, args.batch_size, args.rounds, args.mode)))
        return 0
    if args.worker == "baseline":
        print(json.dumps(baseline_worker(args.backend)))
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker, args.artifacts, args.batches, args.warmup, args.batch_size)))
        return 0

    base = Path(args.reuse) if args.reuse else Path(tempfile.mkdtemp(prefix="edgesplit-footprint-"))
    base.mkdir(parents=True, exist_ok=True)
    artifacts = base / "artifacts"
    export_artifacts(artifacts)
    artifacts_1ch = base / "artifacts-1ch"  # the agent runs train on Fashion-MNIST
    export_artifacts(artifacts_1ch, in_channels=1)
    if args.long_run or args.collect:
        return long_run(args, base, artifacts_1ch)
    modes = tuple(m for m in args.modes.split(",") if m)
    if set(modes) - set(MODES):
        raise SystemExit(f"--modes takes {sorted(MODES)}, got {args.modes!r}")
    sizes = tuple(int(n) for n in args.sizes.split(","))
    if set(sizes) - set(AGENT_ROUNDS):
        raise SystemExit(f"--sizes must come from {sorted(AGENT_ROUNDS)}, got {args.sizes!r}")
    if args.only_agent:
        if not args.reuse and not args.no_install:
            raise SystemExit("--only-agent needs --reuse DIR with the venvs built, or --no-install")
        out = Path(args.out)
        report = json.loads(out.read_text()) if out.exists() else {}
        if args.no_install:
            # This venv: the ort agent with torch hidden (what it imports is what the lean venv has); the torch
            # agent with the CPU-only torch from --torch-cpu-dir in front of this venv's (CUDA) build.
            sys.path.insert(0, str(REPO / "tests"))
            from no_torch import write_blocker

            envs = {"torch-cpu" if args.torch_cpu_dir else "torch-this-venv": sys.executable, "ort": sys.executable}
            env_vars = {}
            if args.torch_cpu_dir:
                # triton comes with this venv's CUDA torch, not with the CPU build; torch.utils.flop_counter
                # imports it where it is importable (libtriton.so alone is 70+ MB resident), so hide it.
                no_triton = write_blocker(base / "no_triton", hidden=("triton",))
                env_vars["torch-cpu"] = {"PYTHONPATH": f"{no_triton}{os.pathsep}{Path(args.torch_cpu_dir).resolve()}"}
            report["agent"] = agent_section(envs, artifacts_1ch, base, ort_env={"PYTHONPATH": str(write_blocker(base / "no_torch"))},
                                            modes=modes, sizes=sizes, env_vars=env_vars)
            report["agent"]["setting"]["environments"] = (
                "this venv; torch-cpu: the CPU-only torch wheel unpacked in front of it on PYTHONPATH (triton hidden, as in a "
                "CPU-only install); ort: torch hidden")
        else:
            report["agent"] = agent_section(_agent_envs(base), artifacts_1ch, base, modes=modes, sizes=sizes)
        report["agent"]["machine"] = {"cpu": cpu_model(), "arch": platform.machine(), "cores": os.cpu_count()}
        _write(out, report)
        _print_agent(report["agent"])
        return 0
    report: dict = {
        "machine": {"cpu": cpu_model(), "arch": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": os.getloadavg()},
        "settings": {"model": "resnet8", "input": [3, 32, 32], "batch_size": args.batch_size, "threads": 1,
                     "batches_timed": args.batches, "warmup": args.warmup, "optimizer": "adam (amsgrad), CE + KD"},
        "artifacts_bytes": {f.name: f.stat().st_size for f in sorted(artifacts.iterdir()) if f.name != "meta.json"},
        "environments": {},
    }
    try:
        if args.no_install:
            sys.path.insert(0, str(REPO / "tests"))
            from no_torch import write_blocker

            block = write_blocker(base / "no_torch")
            report["environments"]["edge"] = {"run": run_worker(sys.executable, "torch", artifacts, args), "note": "this venv"}
            report["environments"]["edge-lite"] = {
                "run": run_worker(sys.executable, "ort", artifacts, args, {"PYTHONPATH": str(block)}),
                "note": "this venv with torch hidden (sizes need the real environments)",
            }
        else:
            for kind, backend in (("edge", "torch"), ("edge-lite", "ort"), ("edge-lite-lean", "ort")):
                venv, install_s = build_env(kind, base)
                sp = site_packages(venv)
                entry = {
                    "site_packages_mb": round(tree_bytes(sp) / 1e6, 1),
                    "venv_mb": round(tree_bytes(venv) / 1e6, 1),
                    "largest_packages_mb": largest_packages(sp),
                    "install_s": round(install_s, 1) if install_s else None,
                    "run": run_worker(str(venv / "bin" / "python"), backend, artifacts, args),
                }
                if kind != "edge":
                    entry["torch_installed"] = (sp / "torch").exists()
                    entry["onnx_sympy_h5py_installed"] = [(sp / m).exists() for m in ("onnx", "sympy", "h5py")]
                report["environments"][kind] = entry
        if args.skip_agent:
            previous = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
            if "agent" in previous:
                report["agent"] = previous["agent"]
        elif args.no_install:
            report["agent"] = agent_section({"torch-this-venv": sys.executable, "ort-this-venv": sys.executable}, artifacts_1ch, base,
                                            ort_env={"PYTHONPATH": str(block)}, modes=modes, sizes=sizes)
        else:
            report["agent"] = agent_section(_agent_envs(base), artifacts_1ch, base, modes=modes, sizes=sizes)
    finally:
        if not args.reuse:
            shutil.rmtree(base, ignore_errors=True)
    report["machine"]["load_average_at_end"] = os.getloadavg()  # timings are only as quiet as the machine was
    envs = report["environments"]
    if "site_packages_mb" in envs.get("edge", {}):
        for kind in ("edge-lite", "edge-lite-lean"):
            report[f"{kind}_vs_torch_size_ratio"] = round(envs[kind]["site_packages_mb"] / envs["edge"]["site_packages_mb"], 3)
    report["lite_vs_torch_peak_rss_ratio"] = round(envs["edge-lite"]["run"]["peak_rss_bytes"] / envs["edge"]["run"]["peak_rss_bytes"], 3)
    report["lite_vs_torch_train_time_ratio"] = round(
        envs["edge-lite"]["run"]["train_ms_per_batch_median"] / envs["edge"]["run"]["train_ms_per_batch_median"], 3)
    out = Path(args.out)
    _write(out, report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("environments", "agent")}, indent=2))
    if "agent" in report:
        _print_agent(report["agent"])
    for kind, entry in envs.items():
        run = entry["run"]
        print(f"{kind:10s} size {entry.get('site_packages_mb', '?')} MB  peak RSS {run['peak_rss_bytes'] / 1e6:.0f} MB  "
              f"train {run['train_ms_per_batch_median']:.1f} ms/batch  eval {run['eval_ms_per_batch_median']:.1f} ms/batch")
    print(f"wrote {out}")
    return 0


def long_run(args: argparse.Namespace, base: Path, artifacts: Path) -> int:
    """The long runs of ``--long-jobs`` x ``--long-sizes`` that ``--out`` lacks, side by side, each
    merged into ``--out``'s ``long_run`` section as it finishes (see bench/footprint_long.py)."""
    from concurrent.futures import ThreadPoolExecutor
    import threading

    from shared_protocol.hostinfo import cpu_model
    from shared_protocol.local_broker import LocalBroker

    out = Path(args.out)
    sizes = tuple(int(n) for n in args.long_sizes.split(","))
    pairs = [tuple(j.split(":", 1)) for j in args.long_jobs.split(",") if j]
    if any(len(pair) != 2 or pair[1] not in MODES for pair in pairs):
        raise SystemExit(f"--long-jobs takes ENV:MODE pairs with MODE from {MODES}, got {args.long_jobs!r}")
    if args.no_install:
        sys.path.insert(0, str(REPO / "tests"))
        from no_torch import write_blocker

        envs = {"torch-this-venv": (sys.executable, {}), "ort": (sys.executable, {"PYTHONPATH": str(write_blocker(base / "no_torch"))})}
    else:
        envs = {"torch-cpu": (str(build_env("edge", base)[0] / "bin" / "python"), {}),
                "ort": (str(build_env("edge-lite-lean", base)[0] / "bin" / "python"), {})}
    jobs = [(env, mode, n) for n in sizes for env, mode in pairs]  # the small shards first: they finish first
    unknown = sorted({env for env, _, _ in jobs} - set(envs))
    if unknown:
        raise SystemExit(f"--long-jobs names environments {unknown}; this invocation has {sorted(envs)}")
    data_env = {"EDGESPLIT_DATA_DIR": str(base / "data-cache")}
    os.environ.update(data_env)  # the scripted server loads the same shard (its sample ids)
    lock = threading.Lock()

    def update(change) -> None:  # type: ignore[no-untyped-def]
        with lock:
            report = json.loads(out.read_text()) if out.exists() else {}
            section = report.setdefault("long_run", {"runs": {}})
            change(section)
            # What the section holds, not only this invocation's jobs (a run of one size or mode keeps the others' entries).
            recorded = section["runs"].values()
            section["setting"] = {
                "dataset": "fashion-mnist (Debian package IDX files, 1x32x32)", "method": "fedgkt", "rounds": args.long_rounds,
                "train_samples": sorted({r["train_samples"] for r in recorded} | set(sizes)), "test_samples": footprint_long.TEST_SAMPLES,
                "round_config": "GktRoundConfig defaults: batch 64, 1 edge epoch, adam, fp16-zstd uploads of 256 samples",
                "transport": "the agent's MqttTransport through a local mosquitto; a scripted FedGKT server in the bench's "
                             "process sends welcome, round_start, server logits for every sample and eval_request each round",
                "evaluate": "every round (test shard streamed and scored)", "threads": 1,
                "peak_rss_bytes": "the agent's own per-round figure from its RoundEnd (VmHWM since the previous round "
                                  "ended, reset through /proc/self/clear_refs)",
                "modes": {m: d for m, d in MODE_DESCRIPTIONS.items() if m in {r["mode"] for r in recorded} | {pm for _, pm in pairs}},
                "unfinished": "a run marked complete: false was stopped before its last round (the 16,000-sample runs take "
                              "minutes a round on a shared 2-core machine); `bench/footprint.py --long-run` measures it again "
                              "from round 1 and replaces it"}
            section["machine"] = {"cpu": cpu_model(), "arch": platform.machine(), "cores": os.cpu_count()}
            _write(out, report)

    if args.collect:
        update(lambda section: footprint_long.collect_partial(base, section, jobs))
        print(f"collected unfinished long runs into {out}")
        return 0
    done = json.loads(out.read_text()).get("long_run", {}).get("runs", {}) if out.exists() else {}
    todo = [j for j in jobs if args.redo or not (done.get(footprint_long.job_name(*j), {}).get("complete")
                                                   and len(done[footprint_long.job_name(*j)]["rounds"]) >= args.long_rounds)]
    print(f"long runs: {len(jobs) - len(todo)} of {len(jobs)} already in {out}; measuring {[footprint_long.job_name(*j) for j in todo]}",
          flush=True)
    baselines = {env: run_json([envs[env][0], str(Path(__file__).resolve()), "--worker", "baseline", "--backend",
                                "ort" if env == "ort" else "torch"], {**data_env, **envs[env][1]}) for env in {j[0] for j in jobs}}

    def environments(section: dict) -> None:
        section.setdefault("environments", {}).update({env: {"runtime_baseline": b} for env, b in baselines.items()})

    update(environments)
    broker = LocalBroker(base / "broker").start()
    try:
        def one(job: tuple[str, str, int]) -> None:
            env, mode, n = job
            print(f"long run {footprint_long.job_name(*job)}: {args.long_rounds} rounds", flush=True)
            result = footprint_long.run_job(envs[env][0], env, "ort" if env == "ort" else "torch", mode, n, args.long_rounds, broker.url,
                                            base, artifacts, {**data_env, **envs[env][1]}, args.probe)
            summary = result["summary"]
            print(f"long run {footprint_long.job_name(*job)}: round-3 peak {summary['round3_peak_rss_bytes'] / 1e6:.0f} MB, "
                  f"round {summary['last_round']} {summary['last_peak_rss_bytes'] / 1e6:.0f} MB, max after round 3 "
                  f"x{summary['max_after_round3_over_round3']}", flush=True)
            update(lambda section: section["runs"].__setitem__(footprint_long.job_name(*job), result))

        with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
            for future in [pool.submit(one, job) for job in todo]:
                future.result()
    finally:
        broker.stop()
    return 0


MODE_DESCRIPTIONS = {
    "default": "edge-agent run",
    "low-memory": "edge-agent run --low-memory: forward passes of at most 16 samples (training accumulates them into each batch "
                  "of 64), uploads of at most 64 samples, glibc mmap threshold pinned at 1 MiB",
    "low-memory-8": "as low-memory with micro-batches of 8 ([memory] micro_batch_samples = 8, pin_malloc = true)",
    "micro-batch": "[memory] micro_batch_samples = 16: as low-memory without the pinned threshold",
}


def _agent_envs(base: Path) -> dict[str, str]:
    """torch-cpu: the edge venv's CPU-only torch; torch-cuda: this venv, when its torch is PyPI's CUDA build;
    ort: the lean venv (no torch installed)."""
    envs = {"torch-cpu": str(base / "edge" / "bin" / "python")}
    try:
        import torch

        if torch.version.cuda:
            envs["torch-cuda"] = sys.executable
    except ImportError:
        pass
    envs["ort"] = str(base / "edge-lite-lean" / "bin" / "python")
    return envs


def _write(out: Path, report: dict) -> None:
    report["benchmark"] = "footprint"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)


def _print_agent(agent: dict) -> None:
    for name, env in agent["environments"].items():
        base = env["runtime_baseline"]["peak_rss_bytes"] / 1e6
        peaks = "  ".join(f"{n}: {r['peak_rss_bytes'] / 1e6:.0f} MB" for n, r in env["runs"].items())
        print(f"agent {name:11s} runtime {base:.0f} MB; peak {peaks}; round-1 peak largest/smallest {env.get('round1_peak_largest_over_smallest')}")




if __name__ == "__main__":
    sys.exit(main())
