"""Figures quoted outside docs/results.md match the bench JSON they name: a re-measured bench
that changes a figure fails here until the prose says the new one (docs/results.md itself is
checked by the renderer's tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def test_the_readme_quotes_no_measured_figure_outside_its_generated_table() -> None:
    # Figures live in generated text (the table of methods, docs/results.md), where a re-measured
    # bench changes them; README's prose points there instead of quoting them.
    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- The methods: rendered", "<!-- end of the methods -->"
    prose = readme[:readme.index(begin)] + readme[readme.index(end):]
    percent = r"\d+(?:\.\d+)?\s?%"
    assert re.findall(percent, "the server model reaches 78.9% / 73.4 % global") == ["78.9%", "73.4 %"]
    assert re.findall(percent, prose) == []


def test_configuration_quotes_the_compiled_step_of_server_loop_json() -> None:
    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    check = _load("server_loop.json")["compile_check"]
    assert f"{check['compiled_speedup_median']:.2f}x faster (median; `compile_check.compiled_speedup_median`" in text
    assert f"its {check['compile_s']:.0f} s cold compilation after about {check['break_even_steps']:.0f} steps" in text


def test_deploy_quotes_what_watching_costs_from_metrics_overhead_json() -> None:
    text = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    direct = _load("metrics_overhead.json")["summary"]["direct"]
    cpu = direct["cpu_s_per_run"]["values"]
    assert f"spent {min(cpu):.1f}-{max(cpu):.1f} s of CPU on metrics" in text
    assert f"rounds take about {direct['off_round_time_total_s']:.0f} s" in text
    assert f"at most {100 * direct['highest_share']:.2f} % of the round time (`bench/results/metrics_overhead.json`" in text


def _text(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def _signed(points: float) -> str:
    """A difference in points as the docs write it: +1.0, −8.4 (a true minus sign)."""
    return f"{round(points, 1) + 0.0:+.1f}".replace("-", "−")


def _row(text: str, first_cell: str, columns: int) -> list[str]:
    """The cells of the one table row of ``text`` with ``columns`` cells, the first ``first_cell``."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} |")]
    rows = [cells for cells in rows if len(cells) == columns]
    assert len(rows) == 1, f"one row of {columns} cells starting with {first_cell!r} expected, found {len(rows)}"
    return rows[0]


def test_deploy_quotes_the_ejabberd_runs_of_ejabberd_json() -> None:
    text = _text("docs/deploy.md")
    data = _load("ejabberd.json")
    setup = data["setup"]
    assert (f"Result (`bench/results/ejabberd.json`, ejabberd {data['ejabberd']}, {setup['dataset']} data, "
            f"{setup['train_samples']} training samples over {setup['agents']} agents)") in text
    runs = (data["single"], data["cluster"])
    # "both rounds completed with both agents and all 256 samples, no rejected message or chunk, no resend and no reconnect"
    assert f"both rounds completed with both agents and all {setup['train_samples']} samples" in text and setup["rounds"] == 2
    for run in runs:
        assert [(r["status"], len(r["completed"]), r["samples"]) for r in run["rounds"]] == [("ok", setup["agents"], setup["train_samples"])] * 2
        assert (run["rejected_messages"], run["rejected_chunks"], run["server_connection"]["resent_chunks"],
                run["resend_requests_logged"], run["reconnects_logged"]) == (0, 0, 0, 0, 0)
    # The agents on node 1 and the server on node 2.
    node1, node2 = (data["node_mqtt_ports"][n] for n in ("edgesplit1@localhost", "edgesplit2@localhost"))
    ports = data["cluster"]["connected_to_ports"]
    assert ports["agent-0"] == ports["agent-1"] == [node1] and ports["server"] == [node2]
    for connack in (data["node1_connack"], data["node2_connack"]):
        assert connack["max_packet_bytes"] is None and connack["chunk_size_bytes"] == 512 * 1024
        assert (connack["session_expiry_granted_s"], connack["session_expiry_asked_s"]) == (300, 3600)
    assert setup["max_payload_size"] == 1024**2
    assert "of 1 MiB is not announced, so the default 512 KiB chunks were used" in text
    assert f"a session expiry of {connack['session_expiry_granted_s']} s for the {connack['session_expiry_asked_s']} s asked" in text
    assert "Packet too large" in data["publish_over_max_payload_size"] and 'with "Packet too large"' in text
    assert data["cross_node_3MB_delivered"] is True and "A 3 MB blob published on node 1 reached a subscriber on node 2" in text


LOW_MEMORY_ROWS = {"default": "default", "micro-batch-16": "micro-batches of 16 (`--low-memory`)",
                   "micro-batch-8": "micro-batches of 8"}


def _near(quoted: str, value: float) -> bool:
    """A figure quoted to one decimal is ``value`` rounded (either way at an exact half)."""
    return abs(float(quoted.rstrip("%")) - value) <= 0.05 + 1e-9


def test_deploy_quotes_the_micro_batch_accuracies_of_low_memory_json() -> None:
    page = (ROOT / "docs" / "deploy.md").read_text()
    assert "(`bench/low_memory.py`, `bench/results/low_memory.json`)" in " ".join(page.split())
    data = _load("low_memory.json")
    runs = {(r["mode"], r["seed"]): r for r in data["runs"]}
    for mode, label in LOW_MEMORY_ROWS.items():
        cells = _row(page, label, 5)
        for figure, by_seed, mean in (("final_accuracy", cells[1], cells[2]), ("final_edge_accuracy", cells[3], cells[4])):
            seeds = [100 * runs[(mode, seed)][figure] for seed in (0, 1)]
            assert by_seed == " / ".join(f"{x:.1f}%" for x in seeds)
            assert _near(mean, sum(seeds) / 2) and _near(mean, 100 * data["summary"][mode][f"{figure}_mean"])
    text = " ".join(page.split())
    deltas = {(d["mode"], d["seed"]): d for d in data["summary"]["micro_minus_default"]}
    d16 = [deltas[("micro-batch-16", seed)] for seed in (0, 1)]
    assert f"(+{d16[0]['server_points']:.1f} and {d16[1]['server_points']:.1f} points)" in text
    assert f"about a point lower ({d16[0]['edge_points']:.1f}, {d16[1]['edge_points']:.1f})" in text
    d8 = [deltas[("micro-batch-8", seed)] for seed in (0, 1)]
    edge8 = sorted(-d["edge_points"] for d in d8)
    assert f"8 the agents lose {edge8[0]:.1f}-{edge8[1]:.1f} points and the server up to {-min(d['server_points'] for d in d8):.1f}" in text
    for (mode, seed), d in deltas.items():  # the JSON's differences are its runs'
        for figure, points in (("final_accuracy", d["server_points"]), ("final_edge_accuracy", d["edge_points"])):
            assert _near(f"{points}", 100 * (runs[(mode, seed)][figure] - runs[("default", seed)][figure]))


def _mb(n_bytes: float) -> str:
    """Bytes as the memory pages write them: decimal megabytes, whole."""
    return f"{n_bytes / 1e6:.0f}"


def test_deploy_quotes_the_install_sizes_and_runtimes_of_footprint_json() -> None:
    text = _text("docs/deploy.md")
    data = _load("footprint.json")
    sizes = {env: data["environments"][env]["site_packages_mb"] for env in ("edge", "edge-lite", "edge-lite-lean")}
    assert (f"site-packages of the torch environment (CPU torch) about {round(sizes['edge'], -1):.0f} MB, `edge-lite` "
            f"{sizes['edge-lite']:.0f} MB, the lean install {sizes['edge-lite-lean']:.0f} MB") in text
    # The runtimes alone in clean venvs (the run before checkpointing: clean venvs, the CUDA build among them).
    clean = {env: v["runtime_baseline"]["peak_rss_bytes"] for env, v in data["agent_before_checkpointing"]["environments"].items()}
    assert (f"`import torch` costs about {round(clean['torch-cpu'] / 1e6, -1):.0f} MB of RSS instead of "
            f"{round(clean['torch-cuda'] / 1e6, -1):.0f} MB (`bench/results/footprint.json`)") in text
    assert (f"the runtime alone measured {_mb(clean['torch-cpu'])} MB in clean venvs, PyPI's CUDA build "
            f"{_mb(clean['torch-cuda'])} MB, the lean ort install {_mb(clean['ort'])} MB") in text


#: docs/deploy.md's table of the agent's memory: (agent, mode) per row, in order, as footprint.json's
#: ``agent.environments`` names them.
MEMORY_ROWS = (("torch-cpu", "default (`edge-agent run`)"), ("torch-cpu low-memory", "`--low-memory`"),
               ("torch-cpu low-memory-8", "`--low-memory` with `micro_batch_samples = 8`"),
               ("torch-cpu micro-batch", "`micro_batch_samples = 16` alone (no pinned malloc)"),
               ("ort", "default"), ("ort low-memory", "`--low-memory`"),
               ("ort low-memory-8", "`--low-memory` with `micro_batch_samples = 8`"),
               ("ort micro-batch", "`micro_batch_samples = 16` alone"))


def _table_after(page: str, header: str) -> list[list[str]]:
    """The rows (cells) of the markdown table whose header line is ``header``."""
    lines = page.splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_deploy_quotes_the_agents_memory_of_footprint_json() -> None:
    page = (ROOT / "docs" / "deploy.md").read_text()
    envs = _load("footprint.json")["agent"]["environments"]
    rows = _table_after(page, "| agent | runtime import alone | mode | 1,000 samples | 16,000 samples |")
    assert len(rows) == len(MEMORY_ROWS)
    for cells, (env, mode) in zip(rows, MEMORY_ROWS):
        figures = envs[env]
        assert figures["mode"] == env.partition(" ")[2] or figures["mode"] == "default", env
        assert cells[2] == mode
        # The runtime alone on the first row of each agent (blank below it).
        assert cells[1] in ("", f"{_mb(figures['runtime_baseline']['peak_rss_bytes'])} MB"), env
        assert cells[1] != "" or env.partition(" ")[2] != "", env
        for cell, samples in ((cells[3], "1000"), (cells[4], "16000")):
            assert cell.strip("*") == f"{_mb(figures['runs'][samples]['peak_rss_bytes'])} MB", (env, samples)
    ratios = [figures["peak_largest_over_smallest"] for figures in envs.values()]
    assert f"(16,000 / 1,000 within {min(ratios):.2f}-{max(ratios):.2f} in every mode)" in _text("docs/deploy.md")


def _import_cost(variant: str) -> float:
    costs = [c for c in _load("step_memory.json")["import_costs"] if c["variant"] == variant]
    assert len(costs) == 1, variant
    return costs[0]["added_bytes"]


def test_deploy_quotes_what_each_piece_of_work_costs_from_step_memory_json() -> None:
    text = _text("docs/deploy.md")
    data = _load("step_memory.json")
    flops = [c for c in data["import_costs"] if c["variant"] == "flop_counter_mode"][0]
    assert f"imports about {round(flops['modules_added'], -1):.0f} modules" in text
    assert (f"for the rest of the process: +{_mb(_import_cost('flop_counter_mode'))} MB, against "
            f"+{_mb(_import_cost('layer_counter'))} MB for the same count by the layer counter") in text
    assert (f"leave +{_mb(_import_cost('torch_optim_adam'))} MB with `torch.optim.Adam`, "
            f"+{_mb(_import_cost('lean_adam'))} MB with the lean one") in text
    saved = data["saved_by_block_bytes"]["plain"]
    assert f"({saved['total'] / 1e6:.1f} MB at batch 64: `saved_by_block_bytes`" in text
    map_bytes = 64 * 64 * 32 * 32 * 4  # one fp32 (64, 64, 32, 32) map
    assert f"every `(64, 64, 32, 32)` map is {map_bytes / 1e6:.1f} MB" in text
    upload = 16 * 32 * 32 * 4  # one sample's fp32 (16, 32, 32) feature map
    assert f"an upload of 256 samples holds {256 * upload / 1e6:.1f} MB of maps before encoding (64 samples: {64 * upload / 1e6:.1f} MB)" in text
    ort = {o["variant"]: o for o in data["ort"]}
    # "about 170 MB at batch 64, whatever the session options": every variant in whole batches.
    whole = [o["step_above_loaded_bytes"] for v, o in ort.items() if v != "micro16"]
    assert all(round(b / 1e6, -1) == 170 for b in whole) and "(about 170 MB at batch 64, whatever the session options" in text
    assert (f"The ort step in micro-batches of 16 holds {_mb(ort['micro16']['step_above_loaded_bytes'])} MB above the loaded "
            f"model instead of {_mb(ort['agent']['step_above_loaded_bytes'])} MB, in {ort['micro16']['step_ms_median']:.0f} "
            f"against {ort['agent']['step_ms_median']:.0f} ms") in text
    assert f"1.32x a step's FLOPs (`recompute_flops_ratio`)" in text and round(data["recompute_flops_ratio"], 2) == 1.32
    assert f"(the recomputed first bottleneck still holds its {_mb(saved['bottleneck 1 (16 -> 64 channels, shortcut conv)'])} MB" in text


#: docs/deploy.md's table of the torch step: its rows' first cells -> step_memory.json's torch_summary keys.
STEP_ROWS = {"default": "checkpointed=False pinned=False",
             "micro-batches of 16 alone": "checkpointed=False pinned=False micro_batch=16",
             "malloc threshold pinned alone": "checkpointed=False pinned=True",
             "`--low-memory` (micro-batches of 16 + pinned threshold)": "checkpointed=False pinned=True micro_batch=16",
             "checkpointed bottlenecks alone": "checkpointed=True pinned=False",
             "checkpointed + pinned threshold (the earlier `--low-memory`)": "checkpointed=True pinned=True"}


def test_deploy_quotes_the_torch_step_table_of_step_memory_json() -> None:
    page = (ROOT / "docs" / "deploy.md").read_text()
    data = _load("step_memory.json")
    summary = data["torch_summary"]
    rows = _table_after(page, "| torch step | ms | vs default | peak above `import torch` |")
    assert [cells[0] for cells in rows] == list(STEP_ROWS)
    assert set(STEP_ROWS.values()) == set(summary)
    for cells in rows:
        figures = summary[STEP_ROWS[cells[0]]]
        assert cells[1:] == [f"{figures['step_ms_median']:.0f}", f"{figures['step_time_over_default']:.2f}x",
                             f"{_mb(figures['peak_above_import_bytes_max'])} MB"], cells[0]
    loads = data["machine"]["load_average_at_start"] + data["machine"]["load_average_at_end"]
    assert f"whose load average was {min(loads):.1f}-{max(loads):.1f} while they ran" in _text("docs/deploy.md")
    checkpointed, default = summary["checkpointed=True pinned=False"], summary["checkpointed=False pinned=False"]
    assert (f"measured {_mb(checkpointed['peak_above_import_bytes_max'])} MB above `import torch` with it against "
            f"{_mb(default['peak_above_import_bytes_max'])} MB without") in _text("docs/deploy.md")


LONG_RUN_AGENTS = {"ort": "ort (onnxruntime-training 1.19.2)", "torch-cpu": "torch (CPU build 2.13.0)"}


def _long_run_label(run: dict) -> str:
    runtime = run["worker"].get("onnxruntime") or run["worker"].get("torch", "").split("+")[0]
    label = LONG_RUN_AGENTS[run["env"]]
    assert runtime in label, (label, runtime)
    return f"{label}, {run['mode']}"


def test_deploy_quotes_the_long_runs_before_the_fix_of_footprint_json() -> None:
    page = (ROOT / "docs" / "deploy.md").read_text()
    runs = _load("footprint.json")["long_run_before_fix"]["runs"]
    rows = _table_after(page, "| agent | round 1 | 2 | 3 | 4 | 5 | last | resend cache after the round |")
    assert len(rows) == len(runs)
    by_label = {_long_run_label(r): r for r in runs.values()}
    for cells in rows:
        run = by_label[cells[0]]
        peaks = [_mb(r["peak_rss_bytes"]) for r in run["rounds"]]
        last = run["rounds"][-1]
        assert cells[1:6] == peaks[:5], cells[0]
        assert cells[6] == f"{_mb(last['peak_rss_bytes'])} (round {last['round']})"
        assert cells[7] == f"{last['objects']['resend_cache_bytes'] / 2**20:.0f} MiB"
    cache = [r["objects"]["resend_cache_bytes"] / 1e6 for r in runs["torch-cpu low-memory 1000"]["rounds"][:4]]
    assert f"({', '.join(f'{c:.1f}' for c in cache)} MB after rounds 1-4, `--low-memory` torch agent)" in _text("docs/deploy.md")


def test_deploy_quotes_the_long_runs_after_the_fix_of_footprint_json() -> None:
    page = (ROOT / "docs" / "deploy.md").read_text()
    text = _text("docs/deploy.md")
    long_run = _load("footprint.json")["long_run"]["runs"]
    rows = _table_after(page, "| agent | samples | round 1 | round 3 | highest after round 3 | last round | highest / round 3 |")
    assert len(rows) == len(long_run)
    by_label = {(_long_run_label(r), f"{r['train_samples']:,}"): r for r in long_run.values()}
    for cells in rows:
        run = by_label[(cells[0], cells[1])]
        assert run["complete"]
        peaks = {r["round"]: r["peak_rss_bytes"] for r in run["rounds"]}
        s = run["summary"]
        assert cells[2:] == [_mb(peaks[1]), _mb(peaks[3]), _mb(max(v for k, v in peaks.items() if k > 3)),
                             f"{_mb(s['last_peak_rss_bytes'])} (round {s['last_round']})", f"{s['max_after_round3_over_round3']:.3f}"]
    assert all(r["summary"]["last_over_round3"] <= 1.05 for r in long_run.values())
    assert "Every mode stays within 5 % of its round-3 peak at round 30" in text
    low = {env: max(r["summary"]["max_peak_rss_bytes"] for r in long_run.values() if r["env"] == env and r["mode"] == "low-memory")
           for env in ("torch-cpu", "ort")}
    assert f"(torch at most {_mb(low['torch-cpu'])} MB against 350, ort at most {_mb(low['ort'])} MB against 150)" in text
    # The default torch agent's noise at 1,000 samples.
    default = long_run["torch-cpu default 1000"]
    later = [r["peak_rss_bytes"] / 1e6 for r in default["rounds"] if r["round"] >= 3]
    mean = sum(later) / len(later)
    sd = (sum((x - mean) ** 2 for x in later) / (len(later) - 1)) ** 0.5
    assert f"(standard deviation {sd:.0f} MB around {mean:.0f} MB over rounds 3-30, at 1,000 samples)" in text
    between = [r["rss_bytes"] for r in default["rounds"]]
    assert f"its RSS between rounds stays at {_mb(min(between))}-{_mb(max(between))} MB after every round" in text
    s = default["summary"]
    assert f"its highest later round is {100 * (s['max_after_round3_over_round3'] - 1):.1f} % above round 3's" in text
    assert f"although the last round is {100 * (s['last_over_round3'] - 1):.1f} % above it" in text
    peaks = {r["round"]: r["peak_rss_bytes"] for r in default["rounds"]}
    last_ten, early = max(peaks[k] for k in range(21, 31)), max(peaks[k] for k in range(3, 13))
    assert f"the highest of the last ten rounds is {100 * (last_ten / early - 1):.1f} % above the highest of rounds 3-12" in text


def test_deploy_quotes_the_shard_run_of_footprint_json() -> None:
    text = _text("docs/deploy.md")
    data = _load("footprint.json")
    before = data["long_run_before_shard_on_disk"]["runs"]["ort low-memory 16000"]
    s = before["summary"]
    over = [r["round"] for r in before["rounds"] if r["peak_rss_bytes"] > 150e6]
    assert f"(round 30 at {s['last_over_round3']:.3f}x round 3)" in text
    assert (f"over its 150 MB target in rounds {', '.join(str(r) for r in over[:-1])} and {over[-1]}, highest "
            f"{s['max_peak_rss_bytes'] / 1e6:.1f} MB") in text
    shard = data["agent"]["environments"]["ort low-memory"]["runs"]["16000"]["shard_images_bytes"]
    assert f"{shard / 1e6:.1f} MB at 16,000 32x32 images" in text
    # glibc's mapped blocks after every round: the same in each run, 16,000 samples before the fix and 1,000 after.
    mapped = {name: {r["mallinfo2"]["hblkhd"] for r in run["rounds"]}
              for name, run in (("before", before), ("1000", data["long_run"]["runs"]["ort low-memory 1000"]),
                                ("16000", data["long_run"]["runs"]["ort low-memory 16000"]))}
    assert all(len(v) == 1 for v in mapped.values())
    before_mb, at_1000, at_16000 = (f"{next(iter(mapped[k])) / 1e6:.1f}" for k in ("before", "1000", "16000"))
    assert f"glibc's mapped blocks after a round: {before_mb} MB at 16,000 samples against {at_1000} MB at 1,000" in text
    assert f"at 16,000 samples the ort agent's mapped blocks are {at_16000} MB" in text
    teacher = {r["objects"]["teacher_bytes"] for r in data["long_run_before_fix"]["runs"]["torch-cpu default 1000"]["rounds"]}
    assert len(teacher) == 1 and f"The server's logits ({next(iter(teacher)) / 1e3:.0f} KB at 1,000 samples)" in text


def _pm_text(cell: dict) -> str:
    """A mean ± sd over seeds as the method notes write it: 80.9 ± 0.3%."""
    return f"{100 * cell['mean']:.1f} ± {100 * cell['sd']:.1f}%"


def test_fedgkt_notes_quote_table_1_of_accuracy_json() -> None:
    text = _text("docs/methods/fedgkt.md")
    cells = _load("accuracy.json")["cells"]
    acc = {name: cell["final_accuracy"] for name, cell in cells.items()}
    assert (f"FedGKT {_pm_text(acc['fedgkt-iid'])} IID and {_pm_text(acc['fedgkt-noniid'])} Dirichlet(0.5), FedAvg (ResNet-56) "
            f"{_pm_text(acc['fedavg-resnet56-iid'])} and {_pm_text(acc['fedavg-resnet56-noniid'])}, centralized ResNet-56 "
            f"{_pm_text(acc['centralized-resnet56'])} and ResNet-8 {_pm_text(acc['centralized-resnet8'])}") in text
    fedavg = cells["fedavg-resnet56-iid"]
    assert (f"(IID: about {round(100 * fedavg['accuracy_round2']['mean'], -1):.0f}% after round 2, "
            f"{100 * fedavg['final_accuracy']['mean']:.0f}% after round 5)") in text
    edges = [100 * cells[f"fedgkt-{key}"]["final_edge_accuracy"]["mean"] for key in ("iid", "noniid")]
    assert f"the agents' own ResNet-8s stay far below ({edges[0]:.0f}% IID, {edges[1]:.0f}% Dirichlet on the balanced set)" in text


#: docs/methods/fedgkt.md's table of the balanced-set runs: its rows' first two cells -> gkt_balanced.json's run.
BALANCED_ROWS = {("before: `shuffled`, extractor trains, KD S<->E", "0"): "base-s0", ("before", "1"): "base-s1",
                 ("`server_order = \"mixed\"`", "0"): "mixed-s0", ("mixed + `kd = \"s2e\"`", "0"): "mixed-s2e-s0",
                 ("mixed + s2e + `edge_lr = 1e-4`", "0"): "mixed-s2e-elr1e-4-s0",
                 ("mixed + s2e + `train_extractor = false`", "0"): "mixed-s2e-frozen-s0",
                 ("`train_extractor = false` (one-agent batches)", "0"): "frozen-s0",
                 ("**mixed + `train_extractor = false` (new defaults)**", "0"): "mixed-frozen-s0",
                 ("**new defaults**", "1"): "mixed-frozen-s1"}


def test_fedgkt_notes_quote_the_balanced_runs_of_gkt_balanced_json() -> None:
    page = (ROOT / "docs" / "methods" / "fedgkt.md").read_text()
    runs = {r["run"]: r for r in _load("gkt_balanced.json")["runs"]}
    rows = _table_after(page, "| variant (changes from Algorithm 1's order and trained extractors) | seed | server BN | "
                              "per-agent BN | agents' ResNet-8 | server train acc. |")
    assert [(c[0], c[1]) for c in rows] == list(BALANCED_ROWS) and set(BALANCED_ROWS.values()) == set(runs)
    for cells in rows:
        run = runs[BALANCED_ROWS[(cells[0], cells[1])]]
        assert int(cells[1]) == run["seed"]
        final = run["final"]
        expected = [final[k] for k in ("accuracy_global_bn", "accuracy_per_agent_bn", "edge_accuracy", "server_train_accuracy")]
        for cell, value in zip(cells[2:], expected):
            assert _near(cell.strip("*"), 100 * value), (cells[0], cell, value)
    text = _text("docs/methods/fedgkt.md")
    base, new = (runs["base-s0"]["final"], runs["base-s1"]["final"]), (runs["mixed-frozen-s0"]["final"], runs["mixed-frozen-s1"]["final"])
    pct = r"([\d.]+)%"
    quoted = re.search(rf"scored {pct} / {pct} \(seeds 0 / 1\) while the server's own training accuracy was {pct} / {pct}", text)
    assert quoted is not None
    for figure, value in zip(quoted.groups(), (base[0]["accuracy_global_bn"], base[1]["accuracy_global_bn"],
                                               base[0]["server_train_accuracy"], base[1]["server_train_accuracy"])):
        assert _near(figure, 100 * value), (figure, value)
    quoted = re.search(rf"{pct} / {pct}\. The ResNet-8s left", text)
    assert quoted is not None
    assert all(_near(f, 100 * r["accuracy_global_bn"]) for f, r in zip(quoted.groups(), new))


def test_fedgkt_notes_quote_the_async_runs_of_fedgkt_async_json() -> None:
    page = (ROOT / "docs" / "methods" / "fedgkt.md").read_text()
    cells = _load("fedgkt_async.json")["cells"]
    for first, name in (("sync", "fedgkt-sync"), ("async, `async_replay = true` (default)", "fedgkt-async"),
                        ("async, `async_replay = false` (ablation)", "fedgkt-async-noreplay")):
        row = _row(page, first, 4)
        cell = cells[name]
        acc = cell["final_accuracy"]
        assert row[1] == ", ".join(str(s) for s in cell["seeds"])
        mean, sd = row[2].rstrip("%").split(" ± ")
        assert _near(mean, 100 * acc["mean"]) and _near(sd, 100 * acc["sd"]), (first, row[2])
        assert row[3] == " / ".join(f"{100 * v:.1f}" for v in acc["values"])


def test_fedgkt_notes_quote_the_server_step_cost_and_epochs() -> None:
    text = _text("docs/methods/fedgkt.md")
    by_batch = _load("fedgkt_ablation.json")["server_step_cost"]["by_batch"]
    big, small = by_batch["256"]["ms_per_map"], by_batch["64"]["ms_per_map"]
    assert (f"a ResNet-55 step costs {big / small:.1f}x more per image at batch 256 than at 64 ({big:.1f} vs {small:.1f} ms per "
            f"map, fp32, 2 threads, idle; `bench/results/fedgkt_ablation.json`, `server_step_cost`)") in text
    assert f"costs about {small:.0f} ms per map per epoch at batch 64 on 2 CPU cores (same measurement)" in text
    assert f"20 epochs over 4,000 maps are about {20 * 4000 * small / 1000 / 60:.0f} minutes per round" in text
    runs = _load("gkt_server_epochs.json")["runs"]
    gain = 100 * (runs["3"]["final_accuracy"] - runs["1"]["final_accuracy"])
    time_ratio = runs["3"]["server_train_s_total"] / runs["1"]["server_train_s_total"]
    assert f"3 epochs instead of 1 gave {_signed(gain).replace('−', '-')} points for {time_ratio:.1f}x the server's time" in text
    ratio = _load("codecs.json")["claims"]["fp16_zstd_ratio_ge_4_trained"]["measured_ratio"]
    assert f"Feature maps travel as `fp16-zstd` by default ({ratio:.1f}x smaller than fp32 on ResNet-8 maps of Fashion-MNIST" in text


FEDKD_ROWS = {"iid (baselines' quick scale)": "iid", "Dirichlet(0.5) (quick scale)": "noniid",
              "learning-iid (2,000 / 500 images, 4 rounds)": "learning-iid"}
MODEL_LABELS = {"resnet56": "ResNet-56", "resnet20": "ResNet-20"}


def test_fedkd_notes_quote_the_runs_of_fedkd_json() -> None:
    page = (ROOT / "docs" / "methods" / "fedkd.md").read_text()
    runs = _load("fedkd.json")["runs"]
    rows = _table_after(page, "| run | mentor | final global mentee acc. | final mentor acc. | payload vs FedAvg(mentor) | "
                              "frames vs FedAvg(mentor) | SVD vs dense mentee | wall |")
    assert [c[0] for c in rows] == list(FEDKD_ROWS) and set(FEDKD_ROWS.values()) == set(runs)
    for cells in rows:
        run = runs[FEDKD_ROWS[cells[0]]]
        saved = run["communication"]["saved_vs_fedavg_mentor"]
        assert cells[1:] == [MODEL_LABELS[run["setting"]["mentor"]], f"{100 * run['final_global_mentee_accuracy']:.1f}%",
                             f"{100 * run['final_mentor_accuracy']:.1f}%", f"-{100 * saved['payload']:.1f}%",
                             f"-{100 * saved['frames']:.1f}%", f"-{100 * run['communication']['saved_svd_vs_dense_mentee']:.1f}%",
                             cells[7]], cells[0]
        assert cells[7].endswith(" s") and abs(float(cells[7][:-2]) - run["wall_time_s"]) <= 0.5, cells[0]  # whole seconds
    iid = runs["iid"]["communication"]
    text = _text("docs/methods/fedkd.md")
    assert f"the one-time sync of the whole mentee adds {iid['per_agent_all_rounds_bytes']['sync_payload'] / 1e3:.0f} KB per agent " \
           f"(-{100 * iid['saved_vs_fedavg_mentor']['payload_with_sync']:.1f}% with it)" in text
    per_round = iid["per_agent_all_rounds_bytes"]["fedavg_mentor_payload"] / runs["iid"]["setting"]["rounds"]
    assert (f"FedAvg of ResNet-56 moves {per_round / 1e6:.1f} MB (a {iid['fedavg_mentor_frame_bytes_zstd'] / 1e6:.1f} MB "
            f"zstd frame each way)") in text


def test_fedkd_notes_quote_the_learning_run_against_fedavg_and_the_codec_alone() -> None:
    text = _text("docs/methods/fedkd.md")
    run = _load("fedkd.json")["runs"]["learning-iid"]
    fedavg = run["fedavg_resnet56_same_setting"]
    ours = [r["global_mentee_accuracy"] for r in run["rounds"]][:fedavg["rounds_compared"]]
    assert (f"over the first {fedavg['rounds_compared']} rounds: "
            f"{' / '.join(f'{100 * a:.1f}' for a in fedavg['accuracy_by_round'])}% where FedKD's global mentee had "
            f"{' / '.join(f'{100 * a:.1f}' for a in ours)}%") in text
    updates = _load("codecs.json")["results"]["model_updates"]
    thresholds = ("0.9", "0.95", "0.98", "0.99")
    ratios = {model: [updates[model]["epoch1_update"]["svd"][f"T={t}"]["ratio"] for t in thresholds] for model in ("resnet8", "resnet56")}
    assert (f"one epoch's update of a ResNet-8 (ratio {' / '.join(f'{r:.2f}' for r in ratios['resnet8'])} at T = "
            f"{' / '.join(thresholds)}) and of a ResNet-56 ({' / '.join(f'{r:.2f}' for r in ratios['resnet56'])})") in text
    fp16 = [updates[model]["epoch1_update"]["other_codecs"]["fp16-zstd"]["ratio"] for model in ("resnet8", "resnet56")]
    assert f"the lossy `fp16-zstd` makes the same updates {min(fp16):.1f}-{max(fp16):.1f}x smaller" in text
