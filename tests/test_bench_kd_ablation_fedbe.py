"""bench/kd_ablation_fedbe.py: the variants change only FedBE's server work, and
docs/methods/fedbe.md quotes bench/results/kd_ablation_fedbe.json as recorded."""

from __future__ import annotations

import json
from pathlib import Path

from test_bench_baselines import load

ROOT = Path(__file__).resolve().parents[1]


def test_a_variant_changes_only_fedbe_s_server_work() -> None:
    ablation = load("kd_ablation_fedbe")
    kd = load("kd_methods")
    base = kd.SCALES["full"]
    for name, changes in ablation.VARIANTS.items():
        scale = ablation.variant_scale(name)
        assert scale.fedbe_server == {**base.fedbe_server, **changes}
        assert {k: v for k, v in vars(scale).items() if k != "fedbe_server"} == {
            k: v for k, v in vars(base).items() if k != "fedbe_server"}
    paper = ablation.VARIANTS["u1000-paper"]
    # 20 epochs of 1,000 images at batch 128 (8 batches an epoch), SWA warm-up at the paper's share (250 of 1,580)
    assert paper["distill_steps"] == 20 * -(-1000 // 128) and paper["swa_warmup_steps"] == round(160 * 250 / 1580)


def test_fedbe_doc_quotes_the_ablation() -> None:
    data = json.loads((ROOT / "bench" / "results" / "kd_ablation_fedbe.json").read_text())
    doc = (ROOT / "docs" / "methods" / "fedbe.md").read_text()
    grid = data["summary"]["grid"]
    assert (f"| {100 * grid['fedbe']['mean']:.1f} ± {100 * grid['fedbe']['sd']:.1f}% | "
            f"{100 * grid['fedbe_vs_fedavg']['mean_difference']:+.1f} ({100 * grid['fedbe_vs_fedavg']['sd_difference']:.1f}): within noise"
            ).replace("-", "−") in doc
    for name in ("u1000-steps16", "u1000-paper"):
        v = data["summary"][name]
        verdict = "**above**" if v["vs_fedavg"]["differ"] and v["vs_fedavg"]["mean_difference"] > 0 else "within noise"
        cell = (f"| {100 * v['final_accuracy']['mean']:.1f} ± {100 * v['final_accuracy']['sd']:.1f}% | "
                f"{100 * v['vs_fedavg']['mean_difference']:+.1f} ({100 * v['vs_fedavg']['sd_difference']:.1f}): {verdict} | "
                f"{v['server_tflops']['mean']:.2f} |")
        assert cell in doc, cell
    steps16 = data["summary"]["u1000-steps16"]["vs_fedavg"]["differences"]
    assert f"by {100 * min(steps16):.1f} to {100 * max(steps16):.1f} points" in doc
