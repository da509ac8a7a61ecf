"""``edge-agent doctor``'s memory check: the agent's measured peaks against the device's memory."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from edge_agent.config import MemoryConfig
from edge_agent.doctor import FAIL, OK, SKIP, WARN, check_memory, meminfo_bytes
from edge_agent.memory import MEASURED_PEAK_MB, PEAK_FROM_LONG_RUN, memory_mode
from shared_protocol.memory_growth import growing_since

ROOT = Path(__file__).resolve().parents[1]
MB = 1_000_000


def footprint_cases(test: str) -> list[dict[str, Any]]:
    """The extra_info of each case of ``test`` in bench/micro/test_footprint.py's recorded JSON."""
    from test_micro_benchmarks import micro_docs

    data = micro_docs().load_micro(ROOT / "bench" / "results" / "footprint.json")
    assert data is not None, "bench/results/footprint.json: run make bench-micro MICRO=footprint"
    return [b["extra_info"] for b in data["benchmarks"] if b["name"].startswith(test + "[")]


def test_the_peaks_the_doctor_uses_are_the_footprint_bench_s() -> None:
    """The long run's figures (the most any round held, over every round and shard size: the
    plateau, not the first rounds) where the long run measured the mode; the short runs'
    otherwise."""
    long, first = footprint_cases("test_long_run"), footprint_cases("test_first_rounds")
    for (backend, mode), peak_mb in MEASURED_PEAK_MB.items():
        rounds = [m for run in long if (run["backend"], run["mode"]) == (backend, mode) for m in run["rounds"]]
        assert bool(rounds) == ((backend, mode) in PEAK_FROM_LONG_RUN), (backend, mode)  # what the doctor says it is
        if rounds:
            measured = max(m["peak_rss_bytes"] for m in rounds) / MB
        else:
            measured = max(run["peak_rss_bytes"] for run in first if (run["backend"], run["mode"]) == (backend, mode)) / MB
        assert peak_mb == math.ceil(measured), (backend, mode, peak_mb, measured)


def test_memory_modes_are_named_from_the_settings() -> None:
    assert memory_mode(MemoryConfig()) == "default"
    assert memory_mode(MemoryConfig.low()) == "low-memory"
    assert memory_mode(MemoryConfig(micro_batch_samples=8)) == "custom"


def test_a_device_with_room_passes_and_a_small_one_is_told_to_use_low_memory() -> None:
    default, low = MEASURED_PEAK_MB[("torch", "default")], MEASURED_PEAK_MB[("torch", "low-memory")]
    roomy = check_memory("torch", MemoryConfig(), {"MemTotal": 8000 * MB, "MemAvailable": 4000 * MB})
    assert roomy.status == OK and f"{default} MB" in roomy.detail and "long runs" in roomy.detail
    assert "no long run" in check_memory("ort", MemoryConfig(), {"MemTotal": 8000 * MB, "MemAvailable": 4000 * MB}).detail
    between = {"MemTotal": 1000 * MB, "MemAvailable": int(1.3 * low) * MB}
    assert int(1.3 * low) < 1.2 * default  # fits the low-memory peak only
    told = check_memory("torch", MemoryConfig(), between)
    assert told.status == WARN and "--low-memory" in told.fix
    assert check_memory("torch", MemoryConfig.low(), between).status == OK
    tiny = check_memory("torch", MemoryConfig.low(), {"MemTotal": 512 * MB, "MemAvailable": 200 * MB})
    assert tiny.status == WARN and "ort" in tiny.fix and tiny.status != FAIL  # the agent may still run with swap
    assert check_memory("ort", MemoryConfig(), {}).status == SKIP


def test_meminfo_is_read_in_bytes(tmp_path: Path) -> None:
    sample = tmp_path / "meminfo"
    sample.write_text("MemTotal:        1918456 kB\nMemFree:          101232 kB\nMemAvailable:     812345 kB\n")
    assert meminfo_bytes(str(sample)) == {"MemTotal": 1918456 * 1024, "MemAvailable": 812345 * 1024}
    assert meminfo_bytes(str(tmp_path / "missing")) == {}


def test_the_recorded_footprint_is_of_the_current_low_memory_preset() -> None:
    """bench/results/footprint.json's agent runs were made with the settings they name, and its
    --low-memory runs with today's preset (a key missing from a run's settings did not exist when
    it was measured): a changed preset leaves the doctor's peaks unmeasured. (Whether the peaks
    meet the targets is the benchmark's verdict, not a test's.)"""
    runs = footprint_cases("test_first_rounds") + footprint_cases("test_long_run")
    assert runs and all(r["memory"] for r in runs)  # recorded with the settings it ran
    preset = dataclasses.asdict(MemoryConfig.low())
    low = [r["memory"] for r in runs if r["mode"] == "low-memory"]
    assert low and all(memory == {k: preset[k] for k in memory} for memory in low), low


#: The long run's modes and shard sizes, and the least rounds of a complete run.
LONG_ROUNDS, LONG_SIZES = 30, (1000, 16000)
LONG_MODES = (("torch-cpu", "default"), ("torch-cpu", "low-memory"), ("ort", "low-memory"))


def test_the_agents_growth_warning_stays_quiet_on_the_recorded_long_runs() -> None:
    """bench/results/footprint.json's long runs hold every mode at both shard sizes, each round's
    own peak (from the agent's RoundEnd); the agent's own growth warning (growing_since), run on
    those real series, raises nothing: a warning that fires on a healthy agent's round-to-round
    noise would be read as a leak. (How flat the runs are and whether they meet the targets is
    the bench's verdict, on docs/results.md.)"""
    long = {(r["env"], r["mode"], r["train_samples"]): r for r in footprint_cases("test_long_run")}
    for env, mode in LONG_MODES:
        for size in LONG_SIZES:
            run = long[(env, mode, size)]
            rounds = [m["round"] for m in run["rounds"]]
            assert rounds == list(range(1, len(rounds) + 1)), (env, mode, size, rounds)
            assert all(m["peak_is_per_round"] for m in run["rounds"])
            if run.get("complete", True):
                assert len(rounds) >= LONG_ROUNDS, (env, mode, size)
            series = [m["peak_rss_bytes"] for m in run["rounds"]]
            assert all(growing_since(series[:end]) is None for end in range(1, len(series) + 1)), (env, mode, size, series)
    # The positive control: the same check on a series that rises every round does warn.
    rising = [100 * MB + i * 5 * MB for i in range(10)]
    assert growing_since(rising) is not None
