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


def test_the_readme_quotes_no_measured_figure_outside_its_generated_table() -> None:
    # Figures live in generated text (the table of methods, docs/results.md), where a re-measured
    # bench changes them; README's prose points there instead of quoting them.
    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- The methods: rendered", "<!-- end of the methods -->"
    prose = readme[:readme.index(begin)] + readme[readme.index(end):]
    percent = r"\d+(?:\.\d+)?\s?%"
    assert re.findall(percent, "the server model reaches 78.9% / 73.4 % global") == ["78.9%", "73.4 %"]
    assert re.findall(percent, prose) == []


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


def _near(quoted: str, value: float) -> bool:
    """A figure quoted to one decimal is ``value`` rounded (either way at an exact half)."""
    return abs(float(quoted.rstrip("%")) - value) <= 0.05 + 1e-9


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
    for first, variant in (("sync", "sync"), ("async, `async_replay = true` (default)", "async"),
                           ("async, `async_replay = false` (ablation)", "async-noreplay")):
        row = _row(page, first, 4)
        done = sorted((c for c in cells if c["variant"] == variant and c["status"] == "done"), key=lambda c: c["seed"])
        values = [c["run"]["final_accuracy"] for c in done]
        mean = sum(values) / len(values)
        sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        assert row[1] == ", ".join(str(c["seed"]) for c in done)
        quoted_mean, quoted_sd = row[2].rstrip("%").split(" ± ")
        assert _near(quoted_mean, 100 * mean) and _near(quoted_sd, 100 * sd), (first, row[2])
        assert row[3] == " / ".join(f"{100 * v:.1f}" for v in values)


def test_fedgkt_notes_quote_the_server_step_cost_and_epochs() -> None:
    text = _text("docs/methods/fedgkt.md")
    by_batch = _load("server_loop.json")["server_step_cost"]["by_batch"]
    big, small = by_batch["256"]["ms_per_map"], by_batch["64"]["ms_per_map"]
    assert (f"a ResNet-55 step costs {big / small:.1f}x more per image at batch 256 than at 64 ({big:.1f} vs {small:.1f} ms per "
            f"map, fp32, 2 threads, idle; `bench/results/server_loop.json`, `server_step_cost`)") in text
    assert f"costs about {small:.0f} ms per map per epoch at batch 64 on 2 CPU cores (same measurement)" in text
    assert f"20 epochs over 4,000 maps are about {20 * 4000 * small / 1000 / 60:.0f} minutes per round" in text
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
