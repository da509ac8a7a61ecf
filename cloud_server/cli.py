"""``cloud-server``: run the coordinator, or re-render a run's report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path

from shared_protocol.logs import setup_logging
from shared_protocol.tomlio import read_toml
from shared_protocol.transport import TransportError
from shared_protocol.version import add_version_flag

from .assemble import build_server
from .config import ServerConfig
from .device_target import add_target_flags
from .report.per_device_md import per_device_lines
from .local_checks import int_at_least

log = logging.getLogger("cloud_server")

#: Exit codes: 2 a configuration error (a bad config or flag, the TLS files, a run directory
#: already holding a run), as `edgesplit local` and `edge-agent run` give.
EXIT_CONFIG = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cloud-server", description="EdgeSplit cloud server (coordinator + server side of each method).")
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a federation")
    run.add_argument("--config", required=True, help="server TOML ([server] and a table for the method)")
    run.add_argument("--broker", help="override the broker URL, mqtt://HOST:PORT or mqtts://HOST:PORT")
    run.add_argument("--out", help="override the run directory")
    run.add_argument("--run-id", help="override the run id")
    run.add_argument("--rounds", type=int_at_least(1), help="override the number of rounds")
    run.add_argument("--resume", action="store_true", help="continue from the checkpoint in the run directory")
    run.add_argument("--resume-if-checkpoint", action="store_true",
                     help="continue from the run directory's checkpoint when there is one, else start (for systemd restarts)")
    run.add_argument("--force", action="store_true",
                     help="start a new run in a run directory that holds one (its report and checkpoint are replaced)")
    run.add_argument("--log-json", action="store_true", help="log JSON lines on stderr")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--metrics", metavar="HOST:PORT",
                     help="serve Prometheus metrics (/metrics) and the status page (/) there ([server] metrics_address; "
                          "off by default; an address other than loopback needs metrics_password_file, metrics_cert_file and "
                          "metrics_key_file)")
    report = sub.add_parser("report", help="re-render report.json, rounds.csv, plots and summary.md of a run; with "
                            "several runs, also print a table comparing them (accuracy, edge FLOPs, wire MB, leakage)")
    report.add_argument("run_dir", nargs="+")
    add_target_flags(report, for_report=True)
    return parser


def load_config(args: argparse.Namespace) -> ServerConfig:
    config = ServerConfig.from_dict(read_toml(args.config))
    overrides = {
        "broker_url": args.broker,
        "out_dir": args.out,
        "run_id": args.run_id,
        "rounds": args.rounds,
        "log_json": True if args.log_json else None,
        "progress": False if args.no_progress else None,
        "metrics_address": args.metrics,
    }
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})


def cmd_run(args: argparse.Namespace) -> int:
    import time

    from shared_protocol.metrics_endpoint import MetricsEndpointError

    from .coordinator import RunAborted

    try:
        config = load_config(args)
    except (ValueError, OSError) as exc:  # OSError: the config or a file it names is missing or unreadable
        print(f"cloud-server: error: {exc}\n  -> fix {args.config} (keys in docs/configuration.md)", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(config.log_json, name="server ")
    run_dir = Path(config.out_dir)
    checkpoint = run_dir / "checkpoint" / "coordinator.json"
    resume = args.resume or (args.resume_if_checkpoint and checkpoint.exists())
    if not resume and (held := _run_held_in(run_dir)) is not None:
        if not args.force:
            print(f"cloud-server: error: {run_dir} already holds {held}: --resume to continue it, --force to start a new "
                  f"run there (its report and checkpoint are replaced), or --out DIR for another directory", file=sys.stderr)
            return EXIT_CONFIG
        log.warning("--force: starting a new run in %s, which held %s; its report and checkpoint are replaced", run_dir, held)
        shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    try:
        coordinator = build_server(config, progress=config.progress and sys.stderr.isatty())
    except TransportError as exc:  # the TLS files (ca_file, cert_file, key_file), before any connection
        log.error("%s", exc)
        log.error("  -> fix ca_file / cert_file / key_file in [server] of %s", args.config)
        return EXIT_CONFIG
    method = coordinator.method
    log.info("run %s: method %s (%s), %d rounds, device %s, out %s", config.run_id, config.method,
             method.schedule, config.rounds, method.ctx.device, config.out_dir)
    try:
        report = coordinator.run(resume=resume)
        totals = report["totals"]
        acc = totals.get("final_accuracy")
        print(
            f"run {config.run_id} {report['status']}: {totals['rounds_completed']} rounds, "
            f"final accuracy {'—' if acc is None else f'{acc:.2%}'}, {totals['wire_total'] / 1e6:.1f} MB on the wire; "
            f"report in {Path(config.out_dir) / 'summary.md'}",
            flush=True,
        )
        for line in per_device_lines(report):
            print(line, flush=True)
        if coordinator.metrics is not None and config.metrics_linger_s > 0:
            until = coordinator.metrics.linger(config.metrics_linger_s)
            notice = (f"the run has ended; serving the final metrics and the status page ({coordinator.metrics.url}) "
                      f"for {config.metrics_linger_s:.0f} s more, until {time.strftime('%H:%M:%S', time.localtime(until))} "
                      "(metrics_linger_s)")
            log.info("%s", notice)
            print(notice, flush=True)
            time.sleep(config.metrics_linger_s)
    except (RunAborted, TransportError, FileNotFoundError, MetricsEndpointError) as exc:
        log.error("%s", exc)
        return EXIT_CONFIG  # not a configuration error, but not to be restarted either (cloud-server.service)
    finally:
        coordinator.close_metrics()
    return 0


def _run_held_in(run_dir: Path) -> str | None:
    """What run ``run_dir`` holds ("run X (finished, 3 rounds)"), or None if it holds none."""
    report, checkpoint = run_dir / "report.json", run_dir / "checkpoint" / "coordinator.json"
    if report.exists():
        try:
            held = json.loads(report.read_text())
            return f"run {held.get('run_id', '?')!r} ({held.get('status', '?')}, {len(held.get('rounds', []))} round(s) in report.json)"
        except (OSError, ValueError):
            return "a report.json"
    return "a checkpoint" if checkpoint.exists() else None


def cmd_report(args: argparse.Namespace) -> int:
    from .report import compare_runs, render_run_dir

    target = {key: getattr(args, key) for key in ("link_mbit", "device_memory") if getattr(args, key, None) is not None}
    for run_dir in args.run_dir:
        paths = render_run_dir(run_dir, target)
        for name, path in sorted(paths.items()):
            print(f"{name}: {path}")
    if len(args.run_dir) > 1:
        print()
        print(compare_runs(args.run_dir, target), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args)
        return cmd_report(args)
    except ValueError as exc:
        print(f"cloud-server: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
