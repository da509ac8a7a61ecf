"""The defences' price in the docs (bench/defence_docs.py): each variant read against the same
experiment's undefended runs of the same method, the README cell naming the defence that
leaves the least over the mean image."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from benchhelpers import load_bench

ROOT = Path(__file__).resolve().parents[1]
FIGURES = {"final_accuracy": 0.7, "best_accuracy": 0.7, "local_accuracy": 0.7, "edge_accuracy": None,
           "personalised_accuracy": None, "rounds": 3, "rounds_planned": 3, "edge_train_gflops": 400.0,
           "edge_train_gflops_per_agent": 100.0, "train_up_payload_bytes": 1e7, "train_up_wire_bytes": 1e7,
           "train_down_payload_bytes": 1e5, "train_down_wire_bytes": 1e5, "eval_up_payload_bytes": 0,
           "eval_up_wire_bytes": 0, "eval_down_payload_bytes": 0, "eval_down_wire_bytes": 0,
           "peak_agent_rss_bytes": 1e9, "run_wall_s": 10.0}




def _cell(method: str, variant: str, seed: int, accuracy: float, psnr: float | None, **run: Any) -> dict[str, Any]:
    scores = None if psnr is None else {"psnr_db": psnr, "ssim": 0.5, "baseline_psnr_db": 12.0, "baseline_ssim": 0.1}
    return {"key": f"{method}-{variant}-iid-s{seed}", "method": method, "partition": "iid", "seed": seed, "variant": variant,
            "overrides": {"flags": {}, "settings": {}}, "command": [], "status": "done", "wall_s": 1.0, "error": None,
            "run": {**FIGURES, "final_accuracy": accuracy, **run},
            "leakage": None if scores is None else {"attacks": {"white_box_inversion": {"agent": "agent-0", **scores}},
                                                    "strongest": {"attack": "white_box_inversion", **scores},
                                                    "not_supported": None}}


def _results(tmp_path: Path) -> Path:
    cells = [_cell("fedgkt", "default", s, 0.70 + 0.02 * s, 90.0) for s in (0, 1)]
    cells += [_cell("fedgkt", "noise", s, 0.60 + 0.02 * s, 14.0, train_up_wire_bytes=2e7, activation_epsilon_per_image=8.0)
              for s in (0, 1)]
    cells += [_cell("fedgkt", "cut", s, 0.68, 30.0) for s in (0, 1)]
    cells += [_cell("fedgkt", "late", 1, 0.70, 20.0)]  # one seed done so far
    cells += [_cell("fedavg", "default", 0, 0.5, None), _cell("fedavg", "dp", 0, 0.4, None, dp_fedavg_epsilon=4.0)]
    doc = {"schema": 1, "experiment": {"name": "defences_x", "question": "?"},
           "machine": {"cpu_model": "x", "cores": 2, "torch": "2", "python": "3.11"}, "cells": cells}
    (tmp_path / "defences_x.json").write_text(json.dumps(doc))
    (tmp_path / "defences_x_small.json").write_text(json.dumps({**doc, "cells": cells[:2]}))  # the fuller one is read
    (tmp_path / "leakage.json").write_text(json.dumps({**doc, "experiment": {"name": "leakage", "question": "?"}}))
    return tmp_path


def test_each_defence_is_read_against_the_undefended_runs_of_its_experiment(tmp_path: Path) -> None:
    docs = load_bench("defence_docs")
    experiments = docs.load_defences(_results(tmp_path))
    assert list(experiments) == ["defences_x"]
    rows = {(r["method"], r["variant"]): r for r in docs.defence_rows(experiments)}
    noise = rows[("fedgkt", "noise")]
    assert abs(noise["accuracy_points"] - (-10.0)) < 1e-9 and noise["gain_change_db"] == -76.0
    assert noise["up_ratio"] == 2.0 and noise["flops_ratio"] == 1.0 and noise["epsilon"] == 8.0
    assert rows[("fedgkt", "default")]["accuracy_points"] == 0.0
    # Read against the undefended run of its own seed (72 %), not the mean over both seeds (71 %).
    late = rows[("fedgkt", "late")]
    assert late["paired_seeds"] == 1 and abs(late["accuracy_points"] - (-2.0)) < 1e-9 and late["gain_change_db"] == -70.0
    assert rows[("fedavg", "dp")]["epsilon"] == 4.0 and rows[("fedavg", "dp")]["gain_db"]["mean"] is None
    # README: the defence that leaves the least over the mean image, with what it costs.
    assert docs.readme_defence_cell(list(rows.values()), "fedgkt") == "noise: 2.0 dB over the mean image, accuracy -10.0 points"
    assert docs.readme_defence_cell(list(rows.values()), "fedavg") == "dp: accuracy -10.0 points"
    cheaper = {**rows[("fedavg", "dp")], "variant": "dp-cheap", "accuracy_points": -5.0}
    assert docs.readme_defence_cell([*rows.values(), cheaper], "fedavg") == "dp-cheap: accuracy -5.0 points"
    assert docs.readme_defence_cell(list(rows.values()), "splitnn") == "not measured yet"
    # Only defences within the accuracy budget compete; none within it: said, with the least-leaking one.
    ruinous = {**rows[("fedgkt", "noise")], "variant": "ruinous", "accuracy_points": -60.0, "gain_db": {"mean": 0.1}}
    assert docs.readme_defence_cell([*rows.values(), ruinous], "fedgkt") == (
        "noise: 2.0 dB over the mean image, accuracy -10.0 points; the least left: ruinous: 0.1 dB over the mean image, "
        "accuracy -60.0 points")
    assert docs.readme_defence_cell([ruinous], "fedgkt") == ("none within 20 points of accuracy; the least left: ruinous: "
                                                            "0.1 dB over the mean image, accuracy -60.0 points")
    block = "\n".join(docs.privacy_block(list(rows.values())))
    assert "| `fedgkt` | noise | defences_x | 2 | -10.0 | -76.0 | 8 | 2.00x |" in block
    # A defence measured in two experiments: the one with more paired seeds speaks, named.
    other = {**noise, "experiment": "defences_y_small", "paired_seeds": 3, "gain_db": {"mean": 5.0}, "accuracy_points": -1.0}
    assert docs.readme_defence_cell([*rows.values(), other], "fedgkt") == (
        "noise (defences_y_small, 3 seeds): 5.0 dB over the mean image, accuracy -1.0 points")
    tied = {**other, "paired_seeds": 2}  # equal seeds: the full experiment over a `_small` one
    assert docs.readme_defence_cell([noise, tied], "fedgkt") == (
        "noise (defences_x, 2 seeds): 2.0 dB over the mean image, accuracy -10.0 points")
    assert "| `fedgkt` | default |" not in block  # the reference itself is no row


def test_the_privacy_page_table_is_rewritten_between_its_markers_only(tmp_path: Path) -> None:
    docs = load_bench("defence_docs")
    page = tmp_path / "privacy.md"
    page.write_text(f"# Privacy\n\nbefore\n\n{docs.PRIVACY_BEGIN}\nold\n{docs.PRIVACY_END}\n\nafter\n")
    rows = docs.defence_rows(docs.load_defences(_results(tmp_path)))
    assert docs.update_privacy_page(page, rows) and not docs.update_privacy_page(page, rows)
    text = page.read_text()
    assert text.startswith("# Privacy\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    assert "| `fedgkt` | cut |" in text


def test_the_decision_table_has_every_method_of_the_leakage_experiment_on_one_setting(tmp_path: Path) -> None:
    docs = load_bench("defence_docs")
    results = _results(tmp_path)
    leakage = json.loads((results / "leakage.json").read_text())
    leakage["cells"] = [c for c in leakage["cells"] if c["variant"] == "default"]  # the methods at their defaults
    leakage["experiment"]["scale"] = {"agents": 2, "rounds": 5, "train_samples": 100, "dataset": "synthetic"}
    leakage["experiment"]["partitions"] = ["dirichlet:0.5"]
    rows = docs.defence_rows(docs.load_defences(results))
    text = "\n".join(docs.decision_section(leakage, rows))
    assert "2 agents, 5 rounds, 100 synthetic training images (Dirichlet 0.5)" in text
    # 1e7 bytes up over 2 agents and 5 rounds; the attack's 90 dB over the mean image's 12; its best defence.
    assert ("| `fedgkt` | 2 | 71.0 ± 1.4 | 100 ± 0 | 1.00 ± 0.00 | 1000 ± 0 | 78.0 ± 0.0 | "
            "noise: 2.0 dB over the mean image, accuracy -10.0 points |") in text
    assert "| `fedavg` | 1 | 50.0 | 100 | 1.00 | 1000 | — | dp: accuracy -10.0 points |" in text
    assert docs.decision_section(None, rows)[-2].startswith("*`bench/results/leakage.json` not found")
