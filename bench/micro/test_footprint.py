"""What the agent costs a device: its peak memory in each memory mode, over its first rounds and
over a long run, and what each install weighs. Memory figures go in ``extra_info``; the timed
figure is the whole process.

* ``test_runtime_alone``: a process that only loads the runtime (torch, or onnxruntime-training
  as the ort backend loads it);
* ``test_first_rounds`` / ``test_long_run``: a whole ``EdgeAgent`` process (``agent_worker.py``)
  on its Fashion-MNIST shard, over MQTT through a local mosquitto to a scripted FedGKT server in
  this process (round start, feature uploads, server logits for every sample, an evaluation,
  every round; what it receives is counted and dropped), in each memory mode
  (``agent_worker.memory_for``); each round's peak is the one the agent reports in its
  ``RoundEnd`` (the most it held since the previous round ended);
* ``test_environment``: the ``edge``, ``edge-lite`` and ``edge-lite-lean`` installs built as
  fresh venvs (``EDGESPLIT_FOOTPRINT_VENVS``: where to keep and reuse them; needs pip's index):
  their site-packages, and the bare training step in each (``step_memory_worker.py``). With
  ``--quick``, this venv stands in (torch hidden for the lite ones) and nothing is installed.

The agents' ``torch-cpu`` environment is this venv's torch, or the CPU-only one
``EDGESPLIT_TORCH_CPU_DIR`` names (conftest's ``worker_envs``); ``ort`` hides torch.

    make bench-micro MICRO=footprint     # or: pytest bench/micro/test_footprint.py [--quick] [-k first_rounds]
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fresh
import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("agent_worker.py")
#: The agents' environments and their backends.
ENVS = {"torch-cpu": "torch", "ort": "ort"}
MODES = ("default", "low-memory", "low-memory-8", "micro-batch")
#: Rounds by shard size for the first rounds: two at the smallest (what round 2 keeps from round 1),
#: one at the largest; shard sizes are compared by their first round's peak.
FIRST_ROUNDS = {1000: 2, 16000: 1}
LONG_ROUNDS, LONG_SIZES = 30, (1000, 16000)
LONG_JOBS = (("torch-cpu", "default"), ("torch-cpu", "low-memory"), ("ort", "low-memory"))
TEST_SAMPLES = 1000
#: --quick: (train samples, test samples, rounds of a long run).
QUICK = (64, 32, 3)
TORCH_CPU_WHEEL_GLOB = "opt/wheels/torch-*+cpu-*.whl"  # the dev machine's local CPU wheel
INSTALLS = ("edge", "edge-lite", "edge-lite-lean")


class ScriptedGktServer(threading.Thread):
    """FedGKT's server side for one agent over MQTT: answers in protocol order, keeps nothing but
    each round's ``RoundEnd`` peak (``marks``)."""

    def __init__(self, broker_url: str, run_id: str, train_ids: Any, rounds: int, artifacts: Any) -> None:
        super().__init__(name=f"server-{run_id}", daemon=True)
        self.broker_url, self.run_id, self.train_ids, self.rounds, self.artifacts = broker_url, run_id, train_ids, rounds, artifacts
        self.round, self.marks, self.error = 0, [], None  # type: ignore[var-annotated]
        self.ready, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        try:
            self._serve()
        except (RuntimeError, OSError, ValueError) as exc:  # reported with the agent's exit
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ready.set()

    def _serve(self) -> None:
        import numpy as np

        from shared_protocol.messages import EvalRequest, RoundStart, Shutdown, Welcome, decode_message, encode_message, peek_header
        from shared_protocol.methods.fedgkt import GktRoundConfig, GktServerLogits
        from shared_protocol.topics import Topics
        from shared_protocol.transport import MqttTransport, TransportConfig

        from agent_worker import AGENT_ID

        topics = Topics(self.run_id)
        transport = MqttTransport(TransportConfig(broker_url=self.broker_url, client_id=f"server-{self.run_id}"))
        transport.subscribe(topics.up(AGENT_ID))
        transport.connect()
        self.ready.set()
        base = {"run": self.run_id, "sender": "server"}

        def send(msg) -> None:  # type: ignore[no-untyped-def]
            transport.publish(topics.down(AGENT_ID), encode_message(msg))

        def round_start() -> None:
            self.round += 1
            send(RoundStart(**base, round=self.round, method="fedgkt", config=dataclasses.asdict(GktRoundConfig()), deadline_s=86400.0,
                            evaluate=True))

        try:
            while not self.stop.is_set():
                delivery = transport.receive(timeout_s=1.0)
                if delivery is None:
                    continue
                kind = peek_header(delivery.payload)["type"]
                if kind == "hello" and self.round == 0:
                    send(Welcome(**base, round=0, accepted=True, method="fedgkt", settings={"num_classes": 10, "edge_model": "resnet8"}))
                    round_start()
                elif kind == "fedgkt.ort_artifacts_request" and self.artifacts is not None:
                    send(dataclasses.replace(self.artifacts, run=self.run_id, round=self.round))
                elif kind == "round_end":
                    costs = decode_message(bytes(delivery.payload)).costs
                    self.marks.append({"round": self.round, "peak_rss_bytes": costs.peak_rss_bytes,
                                       "peak_is_per_round": costs.peak_rss_per_round})
                    rng = np.random.default_rng(self.round)
                    send(GktServerLogits(**base, round=self.round, sample_ids=self.train_ids,
                                         logits=rng.normal(size=(self.train_ids.size, 10)).astype(np.float32)))
                    send(EvalRequest(**base, round=self.round))
                elif kind == "eval_report":
                    if self.round < self.rounds:
                        round_start()
                    else:
                        send(Shutdown(**base, round=self.round, reason="footprint bench done"))
                elif kind == "error":
                    raise RuntimeError(f"the agent sent an error: {bytes(delivery.payload[:600])!r}")
        finally:
            transport.close()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from shared_protocol.local_broker import LocalBroker

    running = LocalBroker(tmp_path_factory.mktemp("broker")).start()
    yield running
    running.stop()


@pytest.mark.parametrize("env", list(ENVS))
def test_runtime_alone(benchmark: Any, worker_envs: dict[str, dict[str, str]], env: str) -> None:
    fresh.in_fresh_processes(benchmark, 1, WORKER, ["baseline", ENVS[env]], worker_envs[ENVS[env]])


def run_agent(benchmark: Any, quick: bool, broker: Any, worker_envs: dict[str, dict[str, str]], ort_reply: Callable[[int], Any],
              env: str, mode: str, samples: int, rounds: int) -> None:
    import numpy as np

    from fldata import AgentDataSpec, load_agent_subset

    if quick:
        samples, test_samples, rounds = QUICK[0], QUICK[1], min(rounds, QUICK[2])
    else:
        test_samples = TEST_SAMPLES
    backend, run_id = ENVS[env], f"fp-{env}-{mode}-{samples}-{rounds}"
    spec = AgentDataSpec(dataset="fashion-mnist", partition="none", seed=0, train_samples=samples, test_samples=test_samples)
    train_ids = np.asarray(load_agent_subset(spec, 0)[0].sample_ids, np.int64)
    server = ScriptedGktServer(broker.url, run_id, train_ids, rounds, ort_reply(1) if backend == "ort" else None)
    result: dict[str, Any] = {}

    def agent() -> None:
        server.start()
        server.ready.wait(30)
        args = {"backend": backend, "mode": mode, "samples": samples, "test_samples": test_samples, "broker_url": broker.url, "run_id": run_id}
        result.update(fresh.run_worker(WORKER, ["agent", json.dumps(args)], worker_envs[backend]))

    try:
        benchmark.pedantic(agent, rounds=1, iterations=1)
    finally:
        server.stop.set()
        server.join(30)
    if result.get("exit_code") != 0 or server.error or len(server.marks) != rounds:
        raise RuntimeError(f"{run_id}: agent exit {result.get('exit_code')}, server {server.error or 'ok'}, "
                           f"{len(server.marks)} of {rounds} rounds")
    benchmark.extra_info.update(env=env, backend=backend, mode=mode, train_samples=samples, test_samples=test_samples, rounds=server.marks,
                                peak_rss_bytes=max([result["exit_peak_rss_bytes"]] + [m["peak_rss_bytes"] for m in server.marks]),
                                memory=result["memory"], worker=result)


@pytest.mark.parametrize("samples", list(FIRST_ROUNDS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("env", list(ENVS))
def test_first_rounds(benchmark: Any, quick: bool, broker: Any, worker_envs: dict[str, dict[str, str]],
                      ort_reply: Callable[[int], Any], env: str, mode: str, samples: int) -> None:
    run_agent(benchmark, quick, broker, worker_envs, ort_reply, env, mode, samples, FIRST_ROUNDS[samples])


@pytest.mark.parametrize("samples", LONG_SIZES)
@pytest.mark.parametrize(("env", "mode"), LONG_JOBS)
def test_long_run(benchmark: Any, quick: bool, broker: Any, worker_envs: dict[str, dict[str, str]],
                  ort_reply: Callable[[int], Any], env: str, mode: str, samples: int) -> None:
    run_agent(benchmark, quick, broker, worker_envs, ort_reply, env, mode, samples, LONG_ROUNDS)


def tree_bytes(path: Path) -> int:
    """Disk usage like ``du -s`` (allocated blocks), hard links counted once."""
    seen = {(st.st_dev, st.st_ino): st.st_blocks * 512 for root, _, files in os.walk(path)
            for st in (os.lstat(os.path.join(root, name)) for name in files)}
    return sum(seen.values())


def build_venv(kind: str, base: Path) -> Path:
    """The install ``kind`` in a fresh venv under ``base`` (reused once complete): ``edge``: the CPU-only
    torch and the agent without torchvision (it only downloads CIFAR); ``edge-lite``: ``edgesplit[edge-lite]``;
    ``edge-lite-lean``: what ``deploy/edge/install.sh --backend ort`` installs (no onnx, sympy or h5py)."""
    venv = base / kind
    if (venv / ".complete").exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)

    def pip(*args: str) -> None:
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *args], check=True)

    if kind == "edge":
        wheels = sorted(Path("/").glob(TORCH_CPU_WHEEL_GLOB))
        pip(str(wheels[-1]) if wheels else "torch")
        pip("--no-deps", str(ROOT))
        pip("numpy>=1.24", "zstandard>=0.21", "paho-mqtt>=2.0,<3", "tqdm>=4.60", "psutil>=5.9")
    elif kind == "edge-lite":
        pip(f"{ROOT}[edge-lite]")
    else:
        pip("--no-deps", "onnxruntime-training-cpu==1.19.2")
        pip("numpy>=1.24", "zstandard>=0.21", "paho-mqtt>=2.0,<3", "pillow>=9")
        pip("--no-deps", str(ROOT))
    (venv / ".complete").touch()
    return venv


@pytest.mark.parametrize("kind", INSTALLS)
def test_environment(benchmark: Any, quick: bool, worker_envs: dict[str, dict[str, str]], ort_artifacts: Callable[[int], Path],
                     tmp_path_factory: pytest.TempPathFactory, kind: str) -> None:
    backend = "torch" if kind == "edge" else "ort"
    step = {"checkpointed": False, "pinned": False, "micro_batch": None} if backend == "torch" else {
        "artifacts": str(ort_artifacts(3)), "variant": "agent"}
    python, env = sys.executable, worker_envs[backend]
    if not quick:
        base = Path(os.environ.get("EDGESPLIT_FOOTPRINT_VENVS") or tmp_path_factory.mktemp("venvs"))
        venv = build_venv(kind, base)
        site = next((venv / "lib").glob("python3*/site-packages"))
        packages = {p.name: tree_bytes(p) / 1e6 for p in site.iterdir() if p.is_dir() and not p.name.endswith((".dist-info", "__pycache__"))}
        benchmark.extra_info.update(site_packages_mb=round(tree_bytes(site) / 1e6, 1), venv_mb=round(tree_bytes(venv) / 1e6, 1),
                                    largest_packages_mb={k: round(v, 1) for k, v in sorted(packages.items(), key=lambda kv: -kv[1])[:8]},
                                    torch_installed=(site / "torch").exists())
        python, env = str(venv / "bin" / "python"), {"PYTHONPATH": ""}
    benchmark.extra_info.update(kind=kind, backend=backend, spec=step)
    fresh.in_fresh_processes(benchmark, 1, Path(__file__).with_name("step_memory_worker.py"), [backend, json.dumps(step)], env, python)

