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
counting) and, in a fresh process in each environment, the agent's peak RSS and
milliseconds per training batch (FedGKT edge step: ResNet-8, CE + KD, batch
64, 3x32x32, one thread) after warm-up, plus eval (feature extraction) ms per
batch. The ort artifacts are generated here, with torch, as the server would.

    .venv/bin/python bench/footprint.py                # build both venvs (a few minutes), measure
    .venv/bin/python bench/footprint.py --reuse DIR    # keep / reuse the venvs in DIR
    .venv/bin/python bench/footprint.py --no-install   # only this venv (torch hidden for the ort run)

Writes ``bench/results/footprint.json``.
"""

from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "footprint.json"
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

        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = build_model("resnet8", 10, 3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4, amsgrad=True)
        t_teacher = torch.from_numpy(teacher)
        import_s = time.perf_counter() - started
        for i, (x, y, _) in enumerate(data):
            t0 = time.perf_counter()
            model.train()
            opt.zero_grad()
            logits, _ = model(torch.from_numpy(x))
            loss = F.cross_entropy(logits, torch.from_numpy(y)) + kd_loss(logits, t_teacher, 3.0)
            loss.backward()
            opt.step()
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


def export_artifacts(directory: Path) -> None:
    import torch

    sys.path.insert(0, str(REPO))
    from models import build_model
    from models.onnx_export import export_edge_artifacts

    torch.manual_seed(0)
    artifacts = export_edge_artifacts(build_model("resnet8", 10, 3), 10, 3)
    artifacts.write(directory)
    meta = {"trainable": list(artifacts.trainable), "bn_stats": list(artifacts.bn_stats), "bn_counters": list(artifacts.bn_counters),
            "state_names": list(artifacts.state_names), "input_shape": list(artifacts.input_shape), "num_classes": artifacts.num_classes}
    (directory / "meta.json").write_text(json.dumps(meta))


def run_worker(python: str, backend: str, artifacts: Path, args: argparse.Namespace, env: dict[str, str] | None = None) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--worker", backend, "--artifacts", str(artifacts),
           "--batches", str(args.batches), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd="/", env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"{backend} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("torch", "ort"))
    p.add_argument("--artifacts")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--reuse", help="directory for the venvs (kept; reused when complete)")
    p.add_argument("--no-install", action="store_true", help="measure in this venv only (torch hidden for the ort run)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.artifacts, args.batches, args.warmup, args.batch_size)))
        return 0

    base = Path(args.reuse) if args.reuse else Path(tempfile.mkdtemp(prefix="edgesplit-footprint-"))
    base.mkdir(parents=True, exist_ok=True)
    artifacts = base / "artifacts"
    export_artifacts(artifacts)
    report: dict = {
        "machine": {"cpu": _cpu(), "arch": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)
    print(json.dumps({k: v for k, v in report.items() if k != "environments"}, indent=2))
    for kind, entry in envs.items():
        run = entry["run"]
        print(f"{kind:10s} size {entry.get('site_packages_mb', '?')} MB  peak RSS {run['peak_rss_bytes'] / 1e6:.0f} MB  "
              f"train {run['train_ms_per_batch_median']:.1f} ms/batch  eval {run['eval_ms_per_batch_median']:.1f} ms/batch")
    print(f"wrote {out}")
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
