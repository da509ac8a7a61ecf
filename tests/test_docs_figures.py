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


def _demo_runs() -> list[dict]:
    runs = [r for r in _load("fedgkt_async.json")["runs"].values() if r["name"] == "fedgkt-sync"]
    return sorted(runs, key=lambda r: r["seed"])


def test_the_readme_quotes_the_demo_figures_of_fedgkt_async_json() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`bench/results/fedgkt_async.json`, the sync runs" in readme
    runs = _demo_runs()
    assert [r["seed"] for r in runs] == [0, 1, 2]
    global_ = " / ".join(_pct(r["final_accuracy"]) for r in runs)
    edges = " / ".join(_pct(r["final_edge_accuracy"]) for r in runs)
    assert f"the server model reaches {global_} global after round 6" in readme
    cell = _load("fedgkt_async.json")["cells"]["fedgkt-sync"]["final_accuracy"]
    assert f"({100 * cell['mean']:.1f} ± {100 * cell['sd']:.1f}%)" in readme
    assert f"the ResNet-8s left on the devices {edges}" in readme
    minutes = re.search(r"seeds 0 and 1 took ([\d.]+) and ([\d.]+) minutes", readme)
    assert minutes is not None
    assert [float(m) for m in minutes.groups()] == [round(r["wall_time_s"] / 60, 1) for r in runs[:2]]


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


def _cosine(x: float, plus: bool = False) -> str:
    """A cosine as the docs write it: 0.636, −0.390 (with ``plus``: +0.322)."""
    return (f"{x:+.3f}" if plus else f"{x:.3f}").replace("-", "−")


def _row(text: str, first_cell: str, columns: int) -> list[str]:
    """The cells of the one table row of ``text`` with ``columns`` cells, the first ``first_cell``."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} |")]
    rows = [cells for cells in rows if len(cells) == columns]
    assert len(rows) == 1, f"one row of {columns} cells starting with {first_cell!r} expected, found {len(rows)}"
    return rows[0]


def _robustness_run(method: str, aggregation: str, attack: str, checks: bool = True, min_cosine: float | None = None) -> float:
    runs = [r for r in _load("robustness.json")["runs"] if (r["method"], r["aggregation"], r["attack"], r["checks"],
                                                            r.get("min_cosine")) == (method, aggregation, attack, checks, min_cosine)]
    assert len(runs) == 1, f"one robustness run of {method} {aggregation} {attack} checks={checks} expected, found {len(runs)}"
    return 100 * runs[0]["final_accuracy"]


def test_configuration_quotes_the_rules_table_of_robustness_json() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert "(`bench/results/robustness.json`;" in page
    clean_mean = _robustness_run("fedavg", "mean", "none")
    for rule in ("mean", "trimmed_mean", "median", "krum", "multi_krum"):
        clean, flipped = _robustness_run("fedavg", rule, "none"), _robustness_run("fedavg", rule, "sign_flip")
        cells = _row(page, f"`{rule}`", 5)
        assert cells[1] == f"{clean:.1f}%"
        assert cells[2] == ("—" if rule == "mean" else _signed(clean - clean_mean))
        assert cells[3].split(" ")[0] == f"{flipped:.1f}%"
        assert cells[4] == _signed(flipped - clean)


def test_configuration_quotes_the_attacks_of_robustness_json() -> None:
    text = _text("docs/configuration.md")
    run = _robustness_run
    assert f"weights ×1e3 were refused in every round (`implausible_norm`; {run('fedavg', 'mean', 'weights_x1e3'):.1f}%" in text
    maps, logits, clean = run("fedgkt", "mean", "maps_6e4"), run("fedgkt", "mean", "logits_1e30"), run("fedgkt", "mean", "none")
    assert maps == logits  # the prose quotes one figure for both
    assert f"(`out_of_range`, every batch; {maps:.1f}% against {clean:.1f}% with five honest agents" in text
    assert (f"the maps held the server model at chance, {run('fedgkt', 'mean', 'maps_6e4', checks=False):.1f}%, while the "
            f"logits did no harm, {run('fedgkt', 'mean', 'logits_1e30', checks=False):.1f}%") in text
    assert f"(FedGKD the same: {run('fedgkd', 'mean', 'sign_flip'):.1f}%)" in text
    assert (f"FedAvg ended at {run('fedavg', 'mean', 'sign_flip', min_cosine=0):.1f}% "
            f"({run('fedavg', 'mean', 'none', min_cosine=0):.1f}% clean), FedGKD at "
            f"{run('fedgkd', 'mean', 'sign_flip', min_cosine=0):.1f}% ({run('fedgkd', 'mean', 'none', min_cosine=0):.1f}% clean)") in text
    assert f"(FedGKD with `median`: {run('fedgkd', 'median', 'sign_flip'):.1f}%, {run('fedgkd', 'median', 'none'):.1f}% clean)" in text
    shuffled = run("fedavg", "mean", "random_labels")
    assert f"shuffled labels cost the `mean` {run('fedavg', 'mean', 'none') - shuffled:.1f} points ({shuffled:.1f}%)" in text
    losses = {rule: run("fedavg", rule, "none") - run("fedavg", rule, "random_labels")
              for rule in ("trimmed_mean", "median", "krum", "multi_krum")}
    assert losses["krum"] <= 0  # quoted as "none"
    assert (f"`trimmed_mean` lost {losses['trimmed_mean']:.1f} points, `median` {losses['median']:.1f}, `krum` none and "
            f"`multi_krum` {losses['multi_krum']:.1f}") in text
    unchecked = {rule: run("fedavg", rule, "weights_x1e3", checks=False) for rule in ("trimmed_mean", "median", "krum", "multi_krum")}
    assert ("kept weights ×1e3 out: " + ", ".join(f"{acc:.1f}% (`{rule}`)" for rule, acc in unchecked.items())) in text


PARTITION_LABELS = {"iid": "IID", "dir0.5": "Dirichlet(0.5)", "dir0.1": "Dirichlet(0.1)"}


def test_configuration_quotes_the_cosines_of_update_directions_json() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert "`bench/update_directions.py` (`bench/results/update_directions.json`)" in page
    summary = _load("update_directions.json")["summary"]["by_partition"]
    for key, label in PARTITION_LABELS.items():
        figures = summary[key]
        cells = _row(page, label, 6)
        honest = [figures["per_run"][f"{method}-none-{key}-s{seed}"] for method in ("fedavg", "fedgkd") for seed in (0, 1)]
        assert cells[1:5] == [_cosine(x) for x in honest]
        flips = [figures["sign_flip_cosines"][f"{method}-sign_flip-median-{key}-s0"] for method in ("fedavg", "fedgkd")]
        assert cells[5].replace("**", "") == " / ".join(f"{_cosine(min(c), plus=True)} to {_cosine(max(c), plus=True)}" for c in flips)


def test_configuration_quotes_the_trimmed_mean_runs_of_update_directions_json() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    runs = {r["name"]: 100 * r["final_accuracy"] for r in _load("update_directions.json")["runs"]}
    differences = []
    for key in ("dir0.5", "dir0.1"):
        cells = _row(page, PARTITION_LABELS[key], 3)[1:]  # the cosine table has a row of the same name, of 6 cells
        for seed, cell in zip((0, 1), cells):
            trimmed, mean = runs[f"fedavg-none-trimmed_mean-{key}-s{seed}"], runs[f"fedavg-none-{key}-s{seed}"]
            assert cell == f"{trimmed:.1f}% vs {mean:.1f}% ({_signed(trimmed - mean)})"
            differences.append(trimmed - mean)
    quoted = re.search(r"([−-][\d.]+) points on average, ([−-][\d.]+) in two runs of four", _text("docs/configuration.md"))
    assert quoted is not None
    assert abs(float(quoted.group(1).replace("−", "-")) - sum(differences) / len(differences)) <= 0.05 + 1e-9
    assert float(quoted.group(2).replace("−", "-")) == round(min(differences), 1)
    assert sum(round(d, 1) == round(min(differences), 1) for d in differences) == 2


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
