"""The agent's memory over a long run: per-round peak RSS for tens of rounds (``footprint.py --long-run``).

Each measured agent is a whole ``EdgeAgent`` process, as a device runs it,
connected to a real mosquitto over its own ``MqttTransport`` (its network and
housekeeping threads, its chunking and resend cache are part of what it holds),
against a scripted FedGKT server in the bench's own process: welcome, then per
round ``RoundStart``, the agent's training and feature uploads, ``RoundEnd``,
server logits for every sample, ``EvalRequest``, the agent's test uploads and
``EvalReport``, next round. The server only counts what it receives, so the
agent process holds what an agent holds.

Per round the agent process records (``--worker agent-long``, one JSON line a
round in ``marks.jsonl``, so an interrupted run still leaves its rounds):

* ``peak_rss_bytes``: the peak the agent reported in its ``RoundEnd`` -- its
  own per-round figure (``edge_agent.costs.RoundPeakRss``: since the previous
  round ended, so the previous evaluation is in it);
* ``eval_peak_rss_bytes``: the peak from that ``RoundEnd`` through the round's
  evaluation (the next round's figure includes it as well);
* ``rss_bytes`` after the evaluation, and glibc's ``mallinfo2`` (heap in use,
  free inside the heap, mapped blocks) and the number of malloc arenas;
* the agent's own objects: server logits held, the transport's resend cache,
  queued inbound messages, reassembly state;
* with ``--probe``: tracemalloc's Python-level total and the lines whose
  allocations grew most since round 3.

Each (environment, mode, shard size) is one job, merged into
``footprint.json["long_run"]`` as it finishes; a job already there is skipped
(``--redo`` measures it again), so the bench resumes where it was stopped.
``--collect`` writes the rounds of unfinished jobs (``complete: false``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
AGENT_ID = "bench-agent"
LONG_ROUNDS = 30
LONG_SIZES = (1000, 16000)
TEST_SAMPLES = 1000
#: (environment, mode) pairs measured by default: the torch agent with the CPU build in both
#: modes, the ort agent in --low-memory.
LONG_JOBS = (("torch-cpu", "default"), ("torch-cpu", "low-memory"), ("ort", "low-memory"))


# --------------------------------------------------------------------------- #
# inside the agent process
# --------------------------------------------------------------------------- #


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():  # type: ignore[no-untyped-def]
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def mallinfo2() -> dict[str, int]:
    """glibc's heap figures (bytes): ``arena`` (heap obtained with brk/sbrk, all arenas), ``hblkhd``
    (mmap-ed blocks), ``uordblks`` (in use), ``fordblks`` (free inside the heap: fragmentation
    and what was not trimmed), ``keepcost`` (trimmable top); {} without glibc >= 2.33."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {name: int(getattr(info, name)) for name, _ in _MallInfo2._fields_}


def malloc_arenas(scratch: Path) -> int | None:
    """How many malloc arenas the process has (``malloc_info``'s ``<heap>`` elements)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_info"):
        return None
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    fp = libc.fopen(str(scratch).encode(), b"w")
    if not fp:
        return None
    try:
        libc.malloc_info(0, fp)
    finally:
        libc.fclose(fp)
    return scratch.read_text().count("<heap nr=")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def rss_by_mapping(top: int = 8) -> dict[str, int]:
    """Resident bytes by what is mapped (a file's path, ``[heap]``, ``[anon]`` for anonymous
    mappings), the ``top`` largest: what is resident besides malloc's heap."""
    sizes: dict[str, int] = {}
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=6)
            if len(first) >= 5 and "-" in first[0] and ":" not in first[0]:
                name = first[5].strip() if len(first) > 5 else "[anon]"
            elif line.startswith("Rss:"):
                sizes[name] = sizes.get(name, 0) + int(line.split()[1]) * 1024
    return dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:top])


def agent_objects(agent) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """What the agent holds that could grow with rounds."""
    out: dict[str, Any] = {"deferred_messages": len(agent._deferred), "rounds_started": len(agent._rounds_started)}
    teacher = getattr(agent.method, "teacher", None)
    if teacher is not None:
        out["teacher_bytes"] = int(teacher.ids.nbytes + teacher.logits.nbytes)
    transport = agent.transport
    out["inbox_messages"] = transport.backlog()
    if hasattr(transport, "_sent"):
        out["resend_cache_blobs"] = len(transport._sent)
        out["resend_cache_bytes"] = int(transport._sent.bytes)
    reassembler = getattr(transport, "_reassembler", None)
    if reassembler is not None:
        out["reassembly_held_bytes"] = int(reassembler.held_bytes)
        out["reassembly_completed_ids"] = len(reassembler._completed)
    return out


def long_worker(backend: str, artifacts: str | None, samples: int, rounds: int, mode: str, broker_url: str, run_id: str,
                marks_path: str, probe: bool, batch_size: int = 64) -> dict:
    """One agent over MQTT for ``rounds`` rounds; a JSON line per round into ``marks_path``."""
    sys.path.insert(0, str(REPO))
    import gc
    import tracemalloc

    if probe:
        tracemalloc.start(1)
    from footprint import memory_for  # bench/ is the script's directory

    from edge_agent.agent import EdgeAgent
    from edge_agent.config import DataConfig, EdgeConfig
    from edge_agent.memory import apply_process_memory

    memory = memory_for(mode)
    malloc_pinned = apply_process_memory(memory)  # as `edge-agent run` does with these settings
    config = EdgeConfig(
        agent_id=AGENT_ID, run_id=run_id, broker_url=broker_url, backend=backend, threads=1, progress=False,
        data=DataConfig(dataset="fashion-mnist", partition="none", train_samples=samples, test_samples=TEST_SAMPLES, seed=0),
        memory=memory,
    )
    started = time.perf_counter()
    agent = EdgeAgent(config)
    scratch = Path(marks_path).with_suffix(".malloc_info.xml")
    marks = open(marks_path, "a")
    baseline = Path(marks_path).with_suffix(".round3.tracemalloc")  # on disk: kept in memory it would be part of what is measured
    evaluate = agent._on_eval_request

    def on_eval_request(msg):  # type: ignore[no-untyped-def]
        evaluate(msg)
        end = agent._last_round_end
        mark: dict[str, Any] = {
            "round": msg.round,
            "peak_rss_bytes": end.costs.peak_rss_bytes if end is not None else None,
            "peak_is_per_round": agent._round_peak.per_round,
            "eval_peak_rss_bytes": _status_bytes("VmHWM"),
            "rss_bytes": _status_bytes("VmRSS"),
            "rss_anon_bytes": _status_bytes("RssAnon"),
            "rss_file_bytes": _status_bytes("RssFile"),
            "rss_by_mapping": rss_by_mapping() if probe else None,
            "mallinfo2": mallinfo2(),
            "malloc_arenas": malloc_arenas(scratch),
            "threads": threading.active_count(),
            "objects": agent_objects(agent),
            "seconds": round(time.perf_counter() - started, 1),
        }
        if probe:
            gc.collect()
            mark["tracemalloc_bytes"] = tracemalloc.get_traced_memory()[0]
            if msg.round == 3:
                tracemalloc.take_snapshot().dump(str(baseline))
            elif msg.round == rounds and baseline.exists():
                no_tracemalloc = [tracemalloc.Filter(False, tracemalloc.__file__)]
                snapshot = tracemalloc.take_snapshot().filter_traces(no_tracemalloc)
                mark["tracemalloc_growth_since_round_3"] = [
                    {"where": str(stat.traceback), "bytes": stat.size_diff, "blocks": stat.count_diff}
                    for stat in snapshot.compare_to(tracemalloc.Snapshot.load(str(baseline)).filter_traces(no_tracemalloc), "lineno")[:8]]
        marks.write(json.dumps(mark) + "\n")
        marks.flush()

    agent._on_eval_request = on_eval_request  # type: ignore[method-assign]
    code = agent.run()
    marks.close()
    out: dict[str, Any] = {"exit_code": code, "backend": backend, "mode": mode, "train_samples": len(agent.train),
                           "malloc_mmap_threshold_pinned": malloc_pinned, "memory": dataclasses.asdict(memory),
                           "seconds": round(time.perf_counter() - started, 1), "torch_loaded": "torch" in sys.modules}
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].__version__
    if backend == "ort":
        from edge_agent.backends.ort import ort_version

        out["onnxruntime"] = ort_version()
    return out


# --------------------------------------------------------------------------- #
# the scripted server, in the bench's process
# --------------------------------------------------------------------------- #


class ScriptedGktServer(threading.Thread):
    """FedGKT's server side for one agent over MQTT: answers in protocol order, keeps nothing."""

    def __init__(self, broker_url: str, run_id: str, train_ids, rounds: int, batch_size: int,  # type: ignore[no-untyped-def]
                 artifacts: str | None, worker: subprocess.Popen) -> None:
        super().__init__(name=f"server-{run_id}", daemon=True)
        self.broker_url, self.run_id, self.train_ids, self.rounds = broker_url, run_id, train_ids, rounds
        self.batch_size, self.artifacts, self.worker = batch_size, artifacts, worker
        self.round = 0
        self.error: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # noqa: BLE001  (reported by the orchestrator with the worker's log)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    def _serve(self) -> None:
        import numpy as np

        from footprint import _artifacts_message
        from shared_protocol.messages import EvalRequest, RoundStart, Shutdown, Welcome, encode_message, peek_header
        from shared_protocol.methods.fedgkt import GktRoundConfig, GktServerLogits
        from shared_protocol.topics import Topics
        from shared_protocol.transport import MqttTransport, TransportConfig

        topics = Topics(self.run_id)
        transport = MqttTransport(TransportConfig(broker_url=self.broker_url, client_id=f"server-{self.run_id}"))
        transport.subscribe(topics.up(AGENT_ID))
        transport.connect()
        base = {"run": self.run_id, "sender": "server"}

        def send(msg) -> None:  # type: ignore[no-untyped-def]
            transport.publish(topics.down(AGENT_ID), encode_message(msg))

        def round_start() -> None:
            self.round += 1
            send(RoundStart(**base, round=self.round, method="fedgkt", config=dataclasses.asdict(GktRoundConfig(batch_size=self.batch_size)),
                            deadline_s=86400.0, evaluate=True))

        try:
            while True:
                delivery = transport.receive(timeout_s=1.0)
                if delivery is None:
                    if self.worker.poll() is not None:
                        return
                    continue
                kind = peek_header(delivery.payload)["type"]
                if kind == "hello" and self.round == 0:
                    send(Welcome(**base, round=0, accepted=True, method="fedgkt", settings={"num_classes": 10, "edge_model": "resnet8"}))
                    round_start()
                elif kind == "fedgkt.ort_artifacts_request":
                    send(_artifacts_message(self.artifacts, self.run_id, self.round))
                elif kind == "round_end":
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


# --------------------------------------------------------------------------- #
# orchestration
# --------------------------------------------------------------------------- #


def job_name(env: str, mode: str, samples: int) -> str:
    return f"{env} {mode} {samples}"


def read_marks(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(rounds: list[dict]) -> dict[str, Any]:
    """Round 3's peak against every later round's, and the plateau (the peak from round 3 on)."""
    peaks = {m["round"]: m["peak_rss_bytes"] for m in rounds if m.get("peak_rss_bytes")}
    out: dict[str, Any] = {"rounds_measured": len(peaks), "max_peak_rss_bytes": max(peaks.values()) if peaks else None}
    if 3 in peaks:
        r3 = peaks[3]
        later = [p for r, p in peaks.items() if r > 3]
        last = max(peaks)
        out.update(round3_peak_rss_bytes=r3, last_round=last, last_peak_rss_bytes=peaks[last],
                   last_over_round3=round(peaks[last] / r3, 4),
                   max_after_round3_over_round3=round(max(later) / r3, 4) if later else None,
                   plateau_peak_rss_bytes=max(p for r, p in peaks.items() if r >= 3))
    return out


def run_job(env_python: str, env_name: str, backend: str, mode: str, samples: int, rounds: int, broker_url: str, base: Path,
            artifacts: Path, env: dict[str, str], probe: bool) -> dict[str, Any]:
    """One agent process for ``rounds`` rounds against a scripted server; its rounds and summary."""
    sys.path.insert(0, str(REPO))
    import numpy as np

    from fldata import AgentDataSpec, load_agent_subset

    run_id = f"fp-{env_name}-{mode}-{samples}".replace(" ", "-")
    jobdir = base / "long" / run_id
    jobdir.mkdir(parents=True, exist_ok=True)
    marks = jobdir / "marks.jsonl"
    marks.unlink(missing_ok=True)
    spec = AgentDataSpec(dataset="fashion-mnist", partition="none", seed=0, train_samples=samples, test_samples=TEST_SAMPLES)
    train_ids = np.asarray(load_agent_subset(spec, 0)[0].sample_ids, np.int64)
    me = str(Path(__file__).resolve().with_name("footprint.py"))
    cmd = [env_python, me, "--worker", "agent-long", "--backend", backend, "--artifacts", str(artifacts), "--samples", str(samples),
           "--rounds", str(rounds), "--mode", mode, "--broker", broker_url, "--run-id", run_id, "--marks", str(marks)]
    if probe:
        cmd.append("--probe")
    log = open(jobdir / "worker.log", "w")
    started = time.time()
    worker = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd="/",
                              env={**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", **env})
    server = ScriptedGktServer(broker_url, run_id, train_ids, rounds, 64, str(artifacts), worker)
    server.start()
    stdout, _ = worker.communicate()
    server.done.wait(30)
    log.close()
    measured = read_marks(marks)
    if worker.returncode != 0 or server.error or len(measured) != rounds:
        tail = (jobdir / "worker.log").read_text()[-3000:]
        raise RuntimeError(f"{run_id}: worker exit {worker.returncode}, server {server.error or 'ok'}, "
                           f"{len(measured)} of {rounds} rounds; log tail:\n{tail}")
    result = json.loads(stdout.strip().splitlines()[-1])
    return {"env": env_name, "mode": mode, "train_samples": samples, "complete": True, "worker": result,
            "wall_s": round(time.time() - started, 1), "summary": summarise(measured), "rounds": measured}


def collect_partial(base: Path, section: dict[str, Any], jobs: list[tuple[str, str, int]]) -> None:
    """Unfinished jobs' rounds so far, marked ``complete: false`` (a finished job's entry is kept)."""
    for env_name, mode, samples in jobs:
        name = job_name(env_name, mode, samples)
        if section["runs"].get(name, {}).get("complete"):
            continue
        marks = read_marks(base / "long" / f"fp-{env_name}-{mode}-{samples}".replace(" ", "-") / "marks.jsonl")
        if marks:
            section["runs"][name] = {"env": env_name, "mode": mode, "train_samples": samples, "complete": False,
                                     "summary": summarise(marks), "rounds": marks}
