"""``summary.md``: the run in the shape of the FedGKT paper's Table 1, Fig. 4 and
Fig. 5, then per-round tables; and the table comparing several runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .formatting import DASH, EDGE_PHASES, duration, figure_cell, gflops, is_scalar, mb, pct, ratio, seconds, table
from ..privacy import privacy_line
from .leakage_md import defences_md, leakage_md, strongest_attack_cell
from .per_device_md import COMPARISON_HEADER, comparison_cells, per_device_md
from .sanity import sanity_warnings
from .schema import BYTE_KEYS, kind_ok

__all__ = ["comparison_md", "summary_md"]


def _server_device_md(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rounds' ``server`` entries: the device, its training seconds, peak memory and
    utilisation per round; empty if no round has them (reports from before they existed)."""
    measured = [r for r in rounds if isinstance(r.get("server"), dict)]
    if not measured:
        return []
    lines = ["## Server device per round", ""]
    rows = []
    for r in measured:
        srv = r["server"]
        util = srv.get("gpu_utilization_percent")
        rows.append([r["round"], srv.get("device_name", DASH), srv.get("device", DASH), seconds(srv.get("train_s")),
                     mb(srv.get("peak_memory_bytes"), 0),
                     DASH if util is None else f"{util:.0f}% / {srv.get('gpu_utilization_max_percent', 0):.0f}%"])
    lines += table(["Round", "Device", "", "Train s", "Peak GPU MB", "GPU util. mean / max"], rows, right_from=3)
    reasons = sorted({r["server"].get("gpu_utilization_unavailable") for r in measured} - {None})
    lines += ["", "Train s: the server's own training in the round (the method's training or distillation). "
              "Peak GPU MB: the most memory torch held on the GPU since the previous round closed. "
              "GPU util.: the driver's utilisation sampled while the server trained."]
    if reasons:
        lines.append("No GPU utilisation where shown " + DASH + ": " + "; ".join(reasons) + ".")
    lines.append("")
    return lines


def _method_table_md(key: str, value: Any) -> tuple[list[str], list[list[Any]]] | None:
    """A dict of scalars, or of dicts of scalars, as (header, rows); None for anything deeper
    (it stays in report.json only)."""
    if not isinstance(value, dict) or not value:
        return None
    if all(is_scalar(v) for v in value.values()):
        return [key, "value"], [[k, figure_cell(v)] for k, v in value.items()]
    if all(isinstance(v, dict) and all(is_scalar(x) for x in v.values()) for v in value.values()):
        columns: list[str] = []
        for v in value.values():
            columns += [c for c in v if c not in columns]
        return [key, *columns], [[k, *(figure_cell(v.get(c)) for c in columns)] for k, v in value.items()]
    return None


def _method_figures_md(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rounds' ``method`` entries (a method's own figures, ``ServerMethod.round_report``),
    whatever the method: its scalars as one table over the rounds; of the last round, each
    dict of scalars, or of dicts of scalars, as a table of its own. Empty if no round has any."""
    figured = [r for r in rounds if isinstance(r.get("method"), dict) and r["method"]]
    if not figured:
        return []
    lines = ["## Method figures per round", ""]
    keys: list[str] = []
    for r in figured:
        keys += [k for k, v in r["method"].items() if is_scalar(v) and k not in keys]
    if keys:
        lines += table(["Round", *keys], [[r["round"], *(figure_cell(r["method"].get(k)) for k in keys)] for r in figured])
        lines.append("")
    last = figured[-1]
    for key, value in last["method"].items():
        tabled = _method_table_md(key, value)
        if tabled is not None:
            lines += [f"`{key}` in round {last['round']}:", "", *table(*tabled), ""]
    lines += ["The method's own figures (`method` in each round of report.json).", ""]
    return lines


def _model_name(model: Mapping[str, Any] | None) -> str:
    return DASH if model is None else model["name"]


def _header_md(report: Mapping[str, Any]) -> list[str]:
    rounds, totals, config, srv = report["rounds"], report["totals"], report["config"], report["server"]
    planned = config.get("rounds")
    rounds_text = f"{len(rounds)}" + (f" of {planned}" if isinstance(planned, int) else "")
    facts = [
        f"**Agents:** {len(report['agents'])}",
        f"**Rounds:** {rounds_text} ({totals['rounds_completed']} ok)",
        f"**Status:** {report['status']}",
        f"**Wall time:** {duration(totals['wall_time_s'])}",
    ]
    if isinstance(config.get("dataset"), str):
        facts.append(f"**Dataset:** {config['dataset']}")
    return [
        f"# EdgeSplit run `{report['run_id']}` — {report['method']}", "",
        " · ".join(facts), "",
        *_faulty_md(report),
        f"Started {report['started_at']}, finished {report['finished_at'] or DASH}. "
        f"Server: {srv['hostname']}, {srv['device']} ({srv['cpu_model']}), torch {srv['torch']}; "
        f"EdgeSplit {report['edgesplit_version']}.",
        "",
    ]


def _faulty_md(report: Mapping[str, Any]) -> list[str]:
    """One line naming the agents made faulty on purpose (``[agent] fault``); none when all were honest."""
    faulty = [f"{agent_id} ({info['fault']})" for agent_id, info in sorted(report["agents"].items())
              if isinstance(info, Mapping) and info.get("fault")]
    return [f"**Faulty on purpose:** {', '.join(faulty)} ([agent] fault: a simulated misbehaving device)", ""] if faulty else []


def _warnings_md(report: Mapping[str, Any]) -> list[str]:
    warnings = sanity_warnings(report)
    return ["## Warnings", "", *(f"- {w}" for w in warnings), ""] if warnings else []


def _eval_set_line(report: Mapping[str, Any]) -> str:
    es = report.get("eval_set")
    if not es:
        return "No global test set: accuracies are the agents' own shards only."
    counts = es.get("class_counts", [])
    balance = f"{min(counts)}-{max(counts)} per class" if counts else ""
    return (f"Global test set: {es['samples']:,} {es['dataset']} {es['split']} images ({balance}, seed {es['seed']}, "
            f"ids sha256 {es['ids_sha256'][:12]}), the same for every method of a run.")


def _accuracy_md(report: Mapping[str, Any]) -> list[str]:
    totals, models = report["totals"], report["models"]
    row = [report["method"], _model_name(models["edge"]), _model_name(models["server"]), pct(totals["final_accuracy"]),
           pct(totals["best_accuracy"]), pct(totals.get("final_local_accuracy")), pct(totals["final_edge_accuracy"])]
    last = next((r["evaluation"] for r in reversed(report["rounds"]) if r.get("evaluation")), None)
    lines = [
        "## Accuracy (FedGKT Table 1 layout)", "",
        *table(["Method", "Edge model", "Server model", "Global acc.", "Best global", "Local acc.", "Edge acc."], [row],
               right_from=3),
        "", _eval_set_line(report), "",
        "Global acc.: the deployed model(s) on the global test set (the mean over agents where each agent has its own), "
        "last evaluated round. Local acc.: the same models on the agents' own test shards, sample-weighted. "
        "Edge acc.: the models left on the devices where they differ from the deployed one, on the global set.", "",
    ]
    if last is not None and last.get("labels"):
        rows = [[f"`{label}`", text, pct(last["accuracy"].get(label)), pct(last["local_accuracy"].get(label))]
                for label, text in last["labels"].items()]
        lines += ["Last evaluated round, every model scored:", "",
                  *table(["Model", "What it is", "Global", "Local"], rows, right_from=2), ""]
    if last is not None and last.get("models_reused"):
        lines += [f"The server scored {last['models_scored']} model(s) on the global set in that round; "
                  f"{last['models_reused']} more had the same weights as one scored already and took its score.", ""]
    return lines


def _edge_cost_md(models: Mapping[str, Any]) -> list[str]:
    edge, server = models["edge"], models["server"]
    lines = ["## Edge model cost (FedGKT Fig. 4 layout)", ""]
    if edge is None:
        return lines + ["No edge model recorded for this method.", ""]
    rows = [["edge", edge["name"], f"{edge['params']:,}", gflops(edge["train_flops_per_sample"])]]
    if server is not None:
        rows.append(["server", server["name"], f"{server['params']:,}", gflops(server["train_flops_per_sample"])])
        rows.append(["server ÷ edge", "", ratio(server["params"], edge["params"]),
                     ratio(server["train_flops_per_sample"], edge["train_flops_per_sample"])])
    lines += table(["Role", "Model", "Params", "Train GFLOPs / sample (fwd+bwd)"], rows, right_from=2)
    lines.append("")
    if server is not None:
        sentence = f"The edge model has {ratio(server['params'], edge['params'])} fewer parameters"
        if server["train_flops_per_sample"] is not None:
            sentence += f" and needs {ratio(server['train_flops_per_sample'], edge['train_flops_per_sample'])} fewer training FLOPs per sample"
        lines += [sentence + " than the server model.", ""]
    return lines


def _communication_md(rounds: Sequence[Mapping[str, Any]], totals: Mapping[str, Any]) -> list[str]:
    rows = []
    for label, pay_key, wire_key in (("up", "up_payload", "up_wire"), ("down", "down_payload", "down_wire"), ("total", None, None)):
        payload = totals["up_payload"] + totals["down_payload"] if pay_key is None else totals[pay_key]
        wire = totals["wire_total"] if wire_key is None else totals[wire_key]
        overhead = f"{100 * (wire - payload) / payload:.1f}%" if payload > 0 else DASH
        rows.append([label, mb(wire / len(rounds)) if rounds else DASH, mb(wire), mb(payload), overhead])
    lines = ["## Communication (FedGKT Fig. 5 layout)", ""]
    lines += table(["Direction", "Wire MB / round", "Wire MB total", "Payload MB total", "Wire overhead"], rows)
    return lines + ["", _codecs_line(rounds), *_outside_and_rejected(totals), ""]


def _codecs_line(rounds: Sequence[Mapping[str, Any]]) -> str:
    entries = [a for r in rounds for a in r["per_agent"].values()]
    codecs = sorted({a["codec"] for a in entries if a["codec"]})
    ratios = [a["codec_ratio"] for a in entries if a["payload_bytes_up"] > 0]
    return (f"Upload codec: {', '.join(codecs) or DASH}; mean codec ratio (raw ÷ encoded) "
            f"{f'{float(np.mean(ratios)):.2f}×' if ratios else DASH} over {len(ratios)} agent-rounds. "
            "Wire = MQTT packets as the server's connection saw them; payload = frames before chunking.")


def _outside_and_rejected(totals: Mapping[str, Any]) -> list[str]:
    lines = []
    outside = totals.get("outside_rounds")
    if isinstance(outside, dict) and all(kind_ok(outside.get(k), "int") for k in BYTE_KEYS):
        lines.append(f"Outside rounds (registration, status, stale messages): "
                     f"{mb(outside['up_wire'] + outside['down_wire'])} MB on the wire, not counted above.")
    if totals["rejected_messages"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(totals["rejected_by_reason"].items()))
        lines.append(f"Rejected messages: {totals['rejected_messages']} ({reasons}).")
    if totals.get("rejected_chunks"):
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(totals.get("rejected_chunks_by_reason", {}).items()))
        lines.append(f"Rejected chunks (never became messages): {totals['rejected_chunks']} ({reasons}).")
    return lines


def _rounds_md(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    if not rounds:
        return ["## Rounds", "", "No rounds yet.", ""]
    rows = [[r["round"], r["status"] + (" (warning)" if r.get("warnings") else ""),
             f"{len(r['completed'])}/{len(r['participants'])}", pct(r["accuracy"]),
             pct(r.get("local_accuracy")), pct(r["edge_accuracy"]), mb(r["bytes"]["up_wire"]), mb(r["bytes"]["down_wire"]),
             gflops(r["edge_train_flops"]), seconds(r["time_s"]["round"]),
             mb(_eval_wire(r)), seconds((r.get("evaluation") or {}).get("server_eval_s"))] for r in rounds]
    header = ["Round", "Status", "Agents", "Global acc.", "Local acc.", "Edge acc.", "MB up", "MB down", "Edge GFLOPs",
              "Round s", "Eval MB", "Eval s (server)"]
    return ["## Rounds", "", *table(header, rows, right_from=2), ""]


def _eval_wire(r: Mapping[str, Any]) -> float | None:
    ev = r.get("evaluation")
    if not ev:
        return None
    b = ev["bytes"]
    return b["up_wire"] + b["down_wire"]


def _agents_md(report: Mapping[str, Any]) -> list[str]:
    """The agents of the last round any agent finished: CPU, samples, time by phase, memory."""
    last = next((r for r in reversed(report["rounds"]) if r["per_agent"]), None)
    if last is None:
        return []
    rows = []
    for agent_id, cost in sorted(last["per_agent"].items()):
        # After a resume only re-registered agents are in report["agents"].
        info = report["agents"].get(agent_id)
        cpu = DASH if info is None else f"{info['cpu_model']} ({info['arch']}, {info['cores']} cores)"
        # Two decimals: encode and network times are often well under a second.
        rows.append([agent_id, cpu, cost["samples"], *(f"{cost[f'{phase}_s']:.2f}" for phase in EDGE_PHASES),
                     mb(cost["peak_rss_bytes"])])
    header = ["Agent", "CPU", "Samples", "Compute s", "Encode s", "Network s", "Idle s", "Peak RSS MB"]
    # Each round's own peak (the agent resets its high-water mark every round): a peak that keeps
    # growing is named here, as the agent's log names it.
    warnings = [f"**Memory warning**: {w['message']}" for w in report.get("memory_warnings") or []
                if isinstance(w, dict) and isinstance(w.get("message"), str)]
    return [f"## Agents in round {last['round']}", "", *table(header, rows, right_from=2), "",
            *(line for w in warnings for line in (w, ""))]


def _refused_md(report: Mapping[str, Any]) -> list[str]:
    """The agents the server refused at join (``refused_agents``: not in the allow-list, or
    data that does not fit the run), each with the reason it was sent; empty when none."""
    refused = [r for r in report.get("refused_agents") or [] if isinstance(r, dict)]
    if not refused:
        return []
    rows = [[r.get("agent", DASH), r.get("code") or DASH, r.get("reason") or DASH] for r in refused]
    return ["## Agents refused at join", "", *table(["Agent", "Code", "Reason"], rows, right_from=3), ""]


def _robustness_md(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rounds' ``robustness`` entries (cloud_server/robust/): per round and agent, the
    uploads refused as implausible (by reason, with the first figure and threshold), clipped
    updates, skipped server steps, quarantine; empty when no round has any."""
    # A round whose only entries are the figures every screened round records is not marked.
    marked = [r for r in rounds if set(r.get("robustness") or {}) - SCREENED_FIGURES or r.get("warnings")]
    if not marked:
        return []
    rows = []
    for r in marked:
        rb = r.get("robustness") or {}
        agents = sorted(set(rb.get("refused", {})) | set(rb.get("clipped", {})) | set(rb.get("skipped_steps", {}))
                        | set(rb.get("quarantine_excluded", [])))
        for agent in agents:
            refused = rb.get("refused", {}).get(agent, {})
            rows.append([
                r["round"], agent,
                "; ".join(f"{why} x{v['count']}: {v['detail']}" for why, v in sorted(refused.items())) or DASH,
                ", ".join(f"{w} x{n}" for w, n in sorted(rb.get("clipped", {}).get(agent, {}).items())) or DASH,
                rb.get("skipped_steps", {}).get(agent, 0) or DASH,
                "yes" if agent in rb.get("quarantine_excluded", []) else DASH,
            ])
    lines = ["## Robustness: refused and clipped uploads", ""]
    if rows:
        lines += table(["Round", "Agent", "Refused (reason x count: first figure)", "Clipped", "Skipped server steps",
                        "Quarantined"], rows, right_from=4)
        lines.append("")
    events = [e for r in marked for e in (r.get("robustness") or {}).get("quarantine_events", [])]
    for e in events:
        lines.append(f"- round {e['round']}: {e['agent']} {e['event']} ({e['why']})")
    fallbacks = [(r["round"], r["robustness"]["aggregation"]) for r in marked
                 if (r.get("robustness") or {}).get("aggregation", {}).get("fallback")]
    for rnd, agg in fallbacks:
        lines.append(f"- round {rnd}: aggregation {agg['fallback']}")
    if events or fallbacks:
        lines.append("")
    named = sorted({why for r in marked for reasons in (r.get("robustness") or {}).get("refused", {}).values() for why in reasons})
    lines += [f"- `{why}`: {REFUSAL_REASONS[why]}" for why in named if why in REFUSAL_REASONS]
    lines += ["", "Refused uploads were not used; the round went on with the other agents "
              "(`robustness` and `warnings` in each round of report.json).", ""]
    return lines


# The figures every screened round records (not marked by themselves): update norms and
# directions (cloud_server/robust/), validation losses and label agreement (robust/validation.py).
SCREENED_FIGURES = {"update_norms", "update_directions", "update_validation", "label_agreement"}
# What each refusal reason means, for the summary's legend (docs/configuration.md has the keys).
REFUSAL_REASONS = {
    "out_of_range": "FedGKT maps or edge logits beyond feature_abs_limit / logit_abs_limit",
    "implausible_norm": "an update far larger than the global model or the other agents' (plausible_global_ratio, "
                        "plausible_peer_ratio, plausible_mad)",
    "implausible_direction": "an update pointing away from the round's median update (plausible_min_cosine)",
    "implausible_factors": "FedKD factors that cannot come from an SVD",
    "implausible_statistics": "FedGKT maps or logits far larger than the other agents'",
    "implausible_validation": "the global model plus the update does far worse on the server's validation set than "
                              "the other agents' (validation_samples, validation_loss_margin)",
    "implausible_labels": "FedGKT: the server model agrees with far fewer of the agent's labels than of the other "
                          "agents' (plausible_min_label_agreement)",
}


def summary_md(report: Mapping[str, Any]) -> str:
    """``summary.md`` of a (valid) report."""
    rounds = report["rounds"]
    sections = [
        _header_md(report),
        _warnings_md(report),
        _accuracy_md(report),
        _edge_cost_md(report["models"]),
        _communication_md(rounds, report["totals"]),
        per_device_md(report),
        defences_md(report),
        leakage_md(report),
        [privacy_line(report.get("privacy")), ""] if report.get("privacy") else [],
        _rounds_md(rounds),
        _robustness_md(rounds),
        _server_device_md(rounds),
        _method_figures_md(rounds),
        _agents_md(report),
        _refused_md(report),
    ]
    return "\n".join(line for section in sections for line in section)


def comparison_md(reports: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table comparing several runs (e.g. one per method in a benchmark)."""
    rows = []
    for report in reports:
        totals, edge = report["totals"], report["models"]["edge"]
        rows.append([
            f"`{report['run_id']}`", report["method"], report["status"], totals["rounds_completed"],
            pct(totals["final_accuracy"]), pct(totals["best_accuracy"]), pct(totals.get("final_local_accuracy")),
            pct(totals["final_edge_accuracy"]),
            gflops(None if edge is None else edge["train_flops_per_sample"]),
            mb(totals["wire_total"]), *comparison_cells(report), strongest_attack_cell(report), duration(totals["wall_time_s"]),
        ])
    header = ["Run", "Method", "Status", "Rounds", "Global acc.", "Best global", "Local acc.", "Edge acc.",
              "Edge GFLOPs / sample", "Wire MB", *COMPARISON_HEADER, "Strongest attack PSNR dB (mean image)", "Wall time"]
    return "\n".join(table(header, rows, right_from=3)) + "\n"
