"""The leakage audit's section of summary.md and its column in the comparison of runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .formatting import DASH, table

__all__ = ["leakage_md", "strongest_attack_cell"]


def leakage_md(report: Mapping[str, Any]) -> list[str]:
    """What the server could reconstruct, once `edgesplit audit` has run on the run directory."""
    leakage = report.get("leakage")
    lines = ["## What the server can reconstruct (leakage audit)", ""]
    if leakage is None:
        return lines + ["Not audited: run with `edgesplit local --audit` (or `[server] audit = true`), then "
                        "`edgesplit audit RUN_DIR`.", ""]
    lines.append(f"The server is assumed to hold: {', '.join(leakage['knowledge']) or 'the uploads only'}."
                 + (f" {leakage['note']}." if leakage.get("note") else ""))
    lines.append("")
    rows = [[name, entry["agent"], f"{entry['psnr_db']:.1f}", f"{entry['baseline_psnr_db']:.1f}",
             f"{entry['ssim']:.3f}", f"{entry['baseline_ssim']:.3f}"]
            for name, entry in sorted(leakage["image_attacks"].items(), key=lambda item: -item[1]["psnr_db"])]
    if rows:
        lines += table(["Image attack", "Best on", "PSNR dB", "Mean image dB", "SSIM", "Mean image SSIM"], rows, right_from=2)
        lines.append("")
    label_rows = [[name, f"{entry['histogram_error']:.3f}",
                   f"{entry['baseline_histogram_error']:.3f}" if "baseline_histogram_error" in entry else DASH]
                  for name, entry in sorted(leakage["label_attacks"].items())]
    if label_rows:
        lines += table(["Label attack", "Histogram error, most exposed agent (0 = exact)", "Uniform guess"], label_rows,
                       right_from=1)
        lines.append("")
    for attack, reason in sorted(leakage.get("skipped", {}).items()):
        lines.append(f"- {attack} not run: {reason}")
    if leakage.get("not_supported"):
        lines.append(f"- Not audited: {leakage['not_supported']}")
    lines += [f"- {note[0].upper()}{note[1:]}." for note in leakage.get("notes", [])]
    if leakage.get("picture"):
        lines.append(f"- Private images beside their reconstructions: `{leakage['picture']}`.")
    return lines + [""]


def strongest_attack_cell(report: Mapping[str, Any]) -> str:
    """``PSNR (mean image PSNR)`` of the run's strongest image attack, or a dash."""
    leakage = report.get("leakage")
    if not leakage or leakage.get("strongest") is None:
        return DASH
    best = leakage["image_attacks"][leakage["strongest"]]
    return f"{best['psnr_db']:.1f} ({best['baseline_psnr_db']:.1f})"


_DEFENCE_LABELS = {
    "cut": "cut after", "private_extractor": "extractor private to the agent", "edge_init": "edge_init",
    "extractor": "split learning's extractor (`ring` / `private`)",
    "map_clip_norm": "map clipping norm C", "map_noise_multiplier": "noise multiplier z", "noise_std": "noise std (z C)",
    "map_noise_delta": "δ", "epsilon_per_map": "ε per released map", "releases_per_image": "releases per image",
    "epsilon_per_image": "ε per image over its releases", "accountant": "accountant", "nopeek_alpha": "NoPeek α",
}


def defences_md(report: Mapping[str, Any]) -> list[str]:
    """The activation defences that were on (report.json ``defences``); nothing when none was."""
    defences = report.get("defences")
    if not defences:
        return []
    rows = [[label, _defence_value(defences[key])] for key, label in _DEFENCE_LABELS.items() if key in defences]
    return ["## Protecting activations", "", *table(["Setting", "Value"], rows), ""]


def _defence_value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
