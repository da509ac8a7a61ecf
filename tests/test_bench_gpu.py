"""bench/gpu_collect.py (what a GPU checklist call brings back, into bench/results) and the
results page's GPU section: the nvidia-smi samples cut by step, the targets' verdicts, a run
stopped early said so, and a page with no GPU figure saying how to get one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from test_bench_baselines import load


def _server_json(epoch_s: dict[str, float]) -> dict[str, Any]:
    results = {}
    for batch, seconds in epoch_s.items():
        results[f"resnet55_server/{batch}/fp32"] = {
            "bare": {"measured": True, "epoch_60k_s": seconds * 2, "step_ms": 1.0},
            "eager": {"measured": True, "epoch_60k_s": seconds * 1.5, "step_ms": 1.0},
            "graph": {"measured": True, "epoch_60k_s": seconds, "step_ms": 1.0, "peak_memory_bytes": 2**30},
        }
    return {"benchmark": "server_gpu", "machine": {"torch": "2.11", "cores": 16, "date": "2026-11-26T04:16:29Z"},
            "device": "cuda", "device_name": "NVIDIA H200", "gpu_figures_measured": True,
            "setup": {"steps": 40, "repeats": 2, "warmup": 5}, "results": results}


def _round(n: int, accuracy: float) -> dict[str, Any]:
    agent = {"compute_s": 30.0, "encode_s": 1.0, "network_s": 0.0, "idle_s": 29.0}
    return {"round": n, "accuracy": accuracy, "local_accuracy": accuracy, "edge_accuracy": 0.3, "bytes": {"up_wire": 10},
            "time_s": {"round": 65.0, "server_train": 5.0, "edge_compute": 30.0, "edge_idle": 29.0},
            "per_agent": {"agent-0": agent, "agent-1": dict(agent, idle_s=0.0)},
            "server": {"device": "cuda", "device_name": "NVIDIA H200", "peak_memory_bytes": 2**31,
                       "gpu_utilization_percent": 95.0, "gpu_utilization_samples": 10}}


def _checklist_folder(root: Path) -> Path:
    folder = root / "gpu-res"
    (folder / "fullscale").mkdir(parents=True)
    t0 = 1795666560.0  # 2026-11-26 04:16:00 UTC
    (folder / "steps.csv").write_text(f"server55,start,{t0}\nserver55,end,{t0 + 10}\nfullscale,start,{t0 + 10}\n"
                                      f"fullscale,end,{t0 + 20}\ncompiled,start,{t0 + 20}\ncompiled,end,{t0 + 64}\n")
    # two samples inside the server bench (40 % and 80 %), one inside the full-scale run (100 %), one outside
    (folder / "smi.csv").write_text("2026/11/26 04:15:50.000, 0 %, 0 MiB, 77 W\n2026/11/26 04:16:02.000, 40 %, 900 MiB, 300 W\n"
                                    "2026/11/26 04:16:05.500, 80 %, 1000 MiB, 400 W\n2026/11/26 04:16:15.000, 100 %, 5000 MiB, 600 W\n"
                                    "garbled line\n")
    (folder / "server_gpu_55.json").write_text(json.dumps(_server_json({"bs64": 4.0, "bs256": 5.0})))
    (folder / "compiled.log").write_text("resnet55_server/bs256/fp32 eager: 10,782 samples/s, 23.7 ms/step, 60k epoch 5.6 s (7 s)\n")
    report = {"status": "running", "server": {"device": "cuda"}, "eval_set": None,
              "config": {"expected_agents": 2, "dataset": "fashion-mnist", "rounds": 10,
                         "method_config": {"server_epochs": 20, "server_batch_size": 256, "server_order": "per_agent",
                                           "edge_epochs": 1, "edge_batch_size": 256}},
              "rounds": [_round(1, 0.85), _round(2, 0.881)], "totals": {}}
    (folder / "fullscale" / "report.json").write_text(json.dumps(report))
    for name in ("fedavg", "splitnn"):
        (folder / "methods" / name).mkdir(parents=True)
        (folder / "methods" / name / "report.json").write_text(json.dumps(
            {"status": "finished", "server": {"device": "cuda"}, "rounds": [{"accuracy": 0.2, "time_s": {"round": 3.0}}]}))
    (folder / "tests.log").write_text("....\n4 passed, 17 deselected, 16 warnings in 56.78s\nrc=0\n")
    return folder


def test_collect_cuts_the_samples_by_step_and_judges_the_targets(tmp_path: Path) -> None:
    collect = load("gpu_collect")
    folder = _checklist_folder(tmp_path)
    windows, samples = collect.steps(folder), collect.smi_samples(folder)
    assert len(samples) == 4  # the garbled line is skipped
    util = collect.utilisation(samples, windows["server55"])
    assert util["samples"] == 2 and util["mean_percent"] == 60.0 and util["max_memory_used_mib"] == 1000.0
    assert collect.utilisation(samples, (0.0, 1.0)) == {"samples": 0}

    server = collect.server_gpu(folder, windows, samples, "note")
    verdicts = server["targets"]["verdicts"]
    assert verdicts["bs64"] == {"target_epoch_s": 5.0, "best_epoch_s": 4.0, "best_mode": "graph", "met": True}
    assert verdicts["bs256"]["met"] is False and verdicts["bs256"]["best_epoch_s"] == 5.0
    compiled = server["results"]["resnet55_server/bs256/fp32"]["compiled"]
    assert compiled["measured"] is False and "44 s" in compiled["why"]  # the compiled step's window: 44 s
    assert server["repeat_of_eager_bs256_fp32_before_compiling"]["samples_per_s"] == 10782.0

    full = collect.fullscale(folder, windows, samples, "")
    assert full["rounds_completed"] == 2 and full["status"].startswith("stopped after 2 of 10 rounds")
    assert full["rounds"][0]["agents_idle_share_mean"] == (29 / 60 + 0.0) / 2
    assert full["target"] == {"what": "global accuracy >= 88 % by round 10", "best_so_far": 0.881, "reached": True}
    assert full["gpu_utilization_nvidia_smi"]["mean_percent"] == 100.0

    assert "ResNet-109" in server["not_run_why"] and not any(k.startswith("resnet109") for k in server["results"])
    # The checklist's last step measured ResNet-109: its rows join the ResNet-55 ones, and nothing says it was not run.
    big = _server_json({"bs64": 9.0, "bs256": 8.0})
    big["results"] = {k.replace("resnet55", "resnet109"): v for k, v in big["results"].items()}
    (folder / "server_gpu_109.json").write_text(json.dumps(big))
    both = collect.server_gpu(folder, windows, samples, "note")
    assert "not_run_why" not in both and both["results"]["resnet109_server/bs64/fp32"]["graph"]["epoch_60k_s"] == 9.0
    assert both["targets"]["verdicts"] == verdicts  # the targets are the ResNet-55's

    methods = collect.methods(folder / "methods", folder / "tests.log", "")
    assert methods["runs"]["fedavg"]["finished"] and methods["runs"]["fedavg"]["device"] == "cuda"
    assert methods["runs"]["fedkd"] == {"finished": False, "why": "no report.json"}
    assert methods["cuda_tests"]["summary"] == "4 passed, 17 deselected, 16 warnings" and not methods["cuda_tests"]["failed"]


def test_the_results_page_shows_the_gpu_figures_or_says_how_to_get_them(tmp_path: Path) -> None:
    collect, render = load("gpu_collect"), load("render_results")
    folder = _checklist_folder(tmp_path)
    windows, samples = collect.steps(folder), collect.smi_samples(folder)
    page = "\n".join(render.gpu_section(collect.server_gpu(folder, windows, samples, "the note"),
                                        collect.fullscale(folder, windows, samples, "why"),
                                        collect.methods(folder / "methods", folder / "tests.log", "")))
    assert "| resnet55 | 64 | fp32 | 8.0 | 6.0 | 4.0 | — | 1,024 |" in page
    assert "Batch 256: best 5.0 s per epoch (graph), target <= 2 s: **missed**." in page
    assert "Batch 64: best 4.0 s per epoch (graph), target <= 5 s: met." in page
    assert "the server trained 20 epoch(s) a round" in page and "| 2 | 88.10% |" in page
    assert "| fedkd | **no** |" in page and "4 passed" in page
    # Every run finished on CUDA: the two constant columns go.
    methods = collect.methods(folder / "methods", folder / "tests.log", "")
    methods["runs"] = {"fedavg": methods["runs"]["fedavg"]}
    server = collect.server_gpu(folder, windows, samples, "the note")
    assert "| Method | Global accuracy per round |" in "\n".join(render.gpu_section(server, None, methods))
    cpu_only = {"gpu_figures_measured": False}
    assert "No GPU figure recorded" in "\n".join(render.gpu_section(cpu_only, None, None))
    assert "No GPU figure recorded" in "\n".join(render.gpu_section(None, None, None))
