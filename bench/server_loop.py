"""The FedGKT server step against a bare PyTorch loop over the same tensors, and
whether torch.compile helps the server step on this CPU.

``loop``: both loops train the same server model (same initial weights, batch size,
optimizer, CE + KD loss) for the same number of steps. The bare loop iterates
over pre-made float32 batches; the server step (``FedGktServer._train``, through
the shared step of ``cloud_server/server_step.py`` in its ``auto`` mode) works
from what it staged: float16 feature maps gathered by shuffled index, converted
per batch, logits recorded by sample id.

``compile``: the shared server step (ResNet-55 server on 16x32x32 maps, batch 64,
FedGKT's loss) eagerly and through ``torch.compile``, timed after compilation
(``bench/server_gpu.py``'s measurement); the verdict says whether compiling helps
here and whether ``server_step = "auto"`` (``AUTO_STEP["cpu"]``) follows it.

``batch``: the server step's cost per map at batch 32, 64 and 256 (ResNet-55 server,
Adam, fp32, CE on 16x32x32 maps, the torch threads of ``--threads``): why FedGKT's CPU
defaults take batch 64 and one server epoch where the paper's Table 10 says 256 and 20.

Writes ``bench/results/server_loop.json``; ``--parts`` re-measures some parts and keeps
the others' recorded figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

from _common import RESULTS, machine, write_json

import numpy as np
import torch
import torch.nn.functional as F

from cloud_server.methods import ServerContext
from cloud_server.feature_store import ArrayStaging
from cloud_server.feature_store import StagedBatch, gather_batches
from cloud_server.methods.fedgkt import FedGktServer
from models.losses import kd_loss
from shared_protocol.methods.fedgkt import GktFeatures


def staged_data(samples: int, agents: int, seed: int = 0) -> dict[str, tuple]:
    rng = np.random.default_rng(seed)
    per = samples // agents
    data = {}
    staging = ArrayStaging(1 << 40)  # in memory, as the server stages when within its bound
    for a in range(agents):
        msg = GktFeatures(
            run="b", round=1, sender=f"a{a}", split="train", seq=0, instance="i",
            features=np.maximum(rng.normal(size=(per, 16, 32, 32)), 0).astype(np.float32),
            logits=rng.normal(size=(per, 10)).astype(np.float32),
            labels=rng.integers(0, 10, per).astype(np.int64),
            sample_ids=np.arange(a * per, (a + 1) * per, dtype=np.int64),
        )
        data[f"a{a}"] = gather_batches([StagedBatch(staging.stage(msg.features), msg.logits, msg.labels, msg.sample_ids)], staging)
    return data


def bare_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: dict[str, tuple], batch: int, temperature: float) -> float:
    features = torch.cat([d[0][:].float() for d in data.values()])  # (N, 16, 32, 32), ready in float32
    edge_logits = torch.cat([d[1] for d in data.values()])
    labels = torch.cat([d[2] for d in data.values()])
    model.train()
    start = time.perf_counter()
    for i in range(0, len(labels), batch):
        logits = model(features[i : i + batch])
        loss = F.cross_entropy(logits, labels[i : i + batch]) + kd_loss(logits, edge_logits[i : i + batch], temperature)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def run(samples: int, agents: int, repeats: int, model_name: str) -> dict:
    torch.manual_seed(0)
    ctx = ServerContext(run_id="bench", num_classes=10, in_channels=1, device="cpu", seed=0)
    server = FedGktServer(ctx, {"server_model": model_name, "server_batch_size": 64, "server_epochs": 1, "lr_schedule": "none"})
    initial = copy.deepcopy(server.model.state_dict())
    data = staged_data(samples, agents)
    server_times, bare_times = [], []

    def time_server() -> float:
        server.model.load_state_dict(initial)
        server.optimizer = server._make_optimizer()
        t0 = time.perf_counter()
        server._train(data, round_=1)
        return time.perf_counter() - t0

    def time_bare() -> float:
        model = copy.deepcopy(server.model)
        model.load_state_dict(initial)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.001, weight_decay=5e-4, amsgrad=True)
        return bare_loop(model, optimizer, data, 64, 3.0)

    time_server(), time_bare()  # warm-up: allocator and kernel caches for both
    for i in range(repeats):
        # Alternate which goes first so drift in machine load hits both alike.
        if i % 2 == 0:
            server_times.append(time_server())
            bare_times.append(time_bare())
        else:
            bare_times.append(time_bare())
            server_times.append(time_server())
    s, b = statistics.median(server_times), statistics.median(bare_times)
    return {
        "benchmark": "server_loop",
        "machine": machine(),
        "setup": {"server_model": model_name, "samples": samples, "agents": agents, "batch_size": 64, "repeats": repeats},
        "server_step_s": server_times,
        "bare_loop_s": bare_times,
        "median_server_step_s": s,
        "median_bare_loop_s": b,
        "overhead_median": s / b - 1.0,
        # On a shared machine the fastest run of each is the least disturbed one.
        "overhead_min": min(server_times) / min(bare_times) - 1.0,
        "claim_within_10_percent": min(server_times) <= 1.10 * min(bare_times),
    }


def compile_check(model_name: str, steps: int, warmup: int, repeats: int) -> dict:
    """The shared server step eagerly and through torch.compile on the CPU, from the same initial
    weights on the same batches, timed in alternation (the machine is shared: load drift hits
    both alike). ``helps`` when the compiled step is >= 5 % faster by the medians and by the
    best runs; the first step's losses (same weights, same batch) are compared too."""
    import os
    import tempfile

    from server_gpu import _data, _gkt_loss

    from cloud_server.server_step import AUTO_CPU_COMPILE_MIN_STEPS, AUTO_STEP, DeviceSum, TrainStep
    from models.training import make_optimizer
    from models import build_model

    # A cold compilation, as the first run on a machine pays it: an empty inductor cache.
    cache = tempfile.mkdtemp(prefix="edgesplit-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache

    cpu = torch.device("cpu")
    batch = 64
    n = batch * 8
    bank, labels, edge_logits = _data(n, cpu)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    initial = build_model(model_name, 10)
    runs: dict[str, dict] = {}
    for mode in ("eager", "compiled"):
        model = copy.deepcopy(initial).train()
        optimizer = make_optimizer("adam", model.parameters(), lr=1e-3, weight_decay=5e-4)
        runs[mode] = {"step": TrainStep(model, optimizer, _gkt_loss, mode, name=f"bench {mode}"), "position": 0,
                      "total": DeviceSum(cpu), "times": [], "losses": []}

    def run_steps(mode: str, count: int, record: bool = False) -> float:
        r = runs[mode]
        t0 = time.perf_counter()
        for _ in range(count):
            if r["position"] + batch > n:
                r["position"] = 0
            idx = order[r["position"] : r["position"] + batch]
            r["position"] += batch
            out = r["step"](bank.gather(idx, torch.float32), labels[idx], edge_logits[idx])
            r["total"].add(out.loss, batch)
            if record:
                r["losses"].append(float(out.loss))
        return time.perf_counter() - t0

    warmup_s = {mode: run_steps(mode, 1, record=True) + run_steps(mode, max(warmup - 1, 0)) for mode in runs}
    for i in range(repeats):
        for mode in (("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")):
            runs[mode]["times"].append(run_steps(mode, steps) / steps)
    compiled_step = runs["compiled"]["step"]
    out = {
        "machine": machine(),
        "setup": {"server_model": model_name, "batch_size": batch, "precision": "fp32", "timed_steps_per_run": steps,
                  "warmup_steps": warmup, "repeats": repeats, "order": "alternating", "loss": "CE + KD (T=3)",
                  "optimizer": "adam (amsgrad)"},
        "auto_cpu_step": AUTO_STEP["cpu"],
        "auto_cpu_compile_min_steps": AUTO_CPU_COMPILE_MIN_STEPS,
        "inductor_cache": "empty at the start (a cold compilation)",
    }
    for mode, r in runs.items():
        out[mode] = {"step_s_per_run": r["times"], "median_step_s": statistics.median(r["times"]), "best_step_s": min(r["times"]),
                     "warmup_s": warmup_s[mode], "steps_run": dict(r["step"].steps)}
    if compiled_step.mode != "compiled":
        out.update(helps=False, auto_follows_verdict=AUTO_STEP["cpu"] == "eager",
                   verdict=f"torch.compile could not run the step here ({compiled_step.fallback_reason}); it ran eagerly")
        return out
    median_speedup = out["eager"]["median_step_s"] / out["compiled"]["median_step_s"]
    best_speedup = out["eager"]["best_step_s"] / out["compiled"]["best_step_s"]
    helps = median_speedup >= 1.05 and best_speedup >= 1.05
    # Compilation time: the compiled warm-up beyond the eager one's.
    compile_s = warmup_s["compiled"] - warmup_s["eager"]
    saved_per_step_s = out["eager"]["median_step_s"] - out["compiled"]["median_step_s"]
    break_even = compile_s / saved_per_step_s if saved_per_step_s > 0 else None
    rule_ok = (helps and break_even is not None and AUTO_CPU_COMPILE_MIN_STEPS >= break_even) or (
        not helps and AUTO_STEP["cpu"] != "compiled")
    out.update(
        compile_s=compile_s,
        break_even_steps=break_even,
        first_step_loss={mode: r["losses"][0] for mode, r in runs.items()},
        first_step_loss_abs_diff=abs(runs["eager"]["losses"][0] - runs["compiled"]["losses"][0]),
        compiled_speedup_median=median_speedup,
        compiled_speedup_best=best_speedup,
        helps=helps,
        auto_follows_verdict=rule_ok,
        verdict=(f"torch.compile {'helps' if helps else 'does not help'} the server step on this CPU: "
                 f"{1000 * out['compiled']['median_step_s']:.0f} ms vs {1000 * out['eager']['median_step_s']:.0f} ms eager "
                 f"per step (medians; {median_speedup:.2f}x, best runs {best_speedup:.2f}x), after a {compile_s:.0f} s "
                 f"cold compilation, repaid after {'-' if break_even is None else f'{break_even:.0f}'} steps; "
                 f"server_step = \"auto\" on a CPU compiles training calls of >= {AUTO_CPU_COMPILE_MIN_STEPS} steps"
                 + ("" if AUTO_STEP["cpu"] == "compiled" else " (but AUTO_STEP['cpu'] is not 'compiled')")),
    )
    return out


LOOP_KEYS = ("setup", "server_step_s", "bare_loop_s", "median_server_step_s", "median_bare_loop_s", "overhead_median",
             "overhead_min", "claim_within_10_percent")


STEM_CHANNELS = 16  # ResNet-8's stem: the maps FedGKT's default edge uploads


def step_cost(model_name: str, batches: tuple[int, ...] = (32, 64, 256), steps: int = 3) -> dict:
    """The server step's cost per map at each batch size: the median of ``steps`` timed steps after one warm-up step."""
    from models import build_model

    torch.manual_seed(0)
    out: dict = {"model": model_name, "threads": torch.get_num_threads(), "by_batch": {}}
    for batch in batches:
        model = build_model(model_name, 10)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4, amsgrad=True)
        x, y = torch.randn(batch, STEM_CHANNELS, 32, 32), torch.randint(0, 10, (batch,))
        times = []
        for i in range(steps + 1):
            started = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i:
                times.append(time.perf_counter() - started)
        step_s = statistics.median(times)
        out["by_batch"][str(batch)] = {"step_ms": 1000 * step_s, "ms_per_map": 1000 * step_s / batch}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="resnet55_server")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps timings stable on a shared machine)")
    parser.add_argument("--parts", default="loop,compile", help="loop, compile and/or batch; a part not run keeps its recorded figures")
    parser.add_argument("--compile-steps", type=int, default=4, help="timed steps per run of the compile check")
    parser.add_argument("--compile-warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--compile-repeats", type=int, default=6, help="timed runs of each, alternating")
    parser.add_argument("--out", default=str(RESULTS / "server_loop.json"))
    args = parser.parse_args()
    parts = {p for p in args.parts.split(",") if p}
    if not parts or parts - {"loop", "compile", "batch"}:
        parser.error(f"--parts takes loop, compile and/or batch, got {args.parts!r}")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    recorded = json.loads(out.read_text()) if out.exists() else {}
    if "loop" in parts:
        result = run(args.samples, args.agents, args.repeats, args.model)
        print(f"server step {result['median_server_step_s']:.2f} s vs bare loop {result['median_bare_loop_s']:.2f} s (medians): "
              f"overhead {100 * result['overhead_median']:+.1f}% median, {100 * result['overhead_min']:+.1f}% best-of")
    else:
        if not all(k in recorded for k in LOOP_KEYS):
            parser.error(f"{out} has no recorded loop figures to keep: run with --parts loop")
        result = {"benchmark": "server_loop", "machine": recorded["machine"], **{k: recorded[k] for k in LOOP_KEYS}}
    if "compile" in parts:
        result["compile_check"] = compile_check(args.model, args.compile_steps, args.compile_warmup, args.compile_repeats)
        print(result["compile_check"]["verdict"])
    elif "compile_check" in recorded:
        result["compile_check"] = recorded["compile_check"]
    if "batch" in parts:
        result["server_step_cost"] = step_cost(args.model)
        print(f"server step per map: {json.dumps(result['server_step_cost']['by_batch'])}")
    elif "server_step_cost" in recorded:
        result["server_step_cost"] = recorded["server_step_cost"]
    write_json(out, result)


if __name__ == "__main__":
    main()
