"""``edge-agent``: run an agent."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from pathlib import Path

from shared_protocol.logs import setup_logging
from shared_protocol.tomlio import read_toml
from shared_protocol.transport_interface import TransportError
from shared_protocol.version import add_version_flag

from .config import EdgeConfig, MemoryConfig
from .memory import apply_process_memory

log = logging.getLogger("edge_agent")

# Exit codes: 2 a configuration error (not retried by edge-agent.service: see
# edge_agent.agent), 3 refused by the server, 1 the broker could not be reached (retried).
EXIT_UNREACHABLE, EXIT_CONFIG = 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-agent", description="EdgeSplit edge agent.")
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="join a federation and train")
    run.add_argument("--config", required=True, help="agent TOML ([agent] and [data] tables)")
    run.add_argument("--low-memory", action="store_true",
                     help="lower peak and idle RSS ([memory] preset): forward passes of at most 16 samples (training "
                          "accumulates them into the round's batch; BatchNorm sees 16-sample batches), uploads of at most 64 "
                          "samples, freed activation memory given back to the system; training steps about 2x slower "
                          "(see docs/deploy.md)")
    run.add_argument("--broker", help="override the broker URL")
    run.add_argument("--agent-id", help="override the agent id")
    run.add_argument("--state-dir", help="override where local state is kept")
    run.add_argument("--log-json", action="store_true", help="log JSON lines on stderr")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--backend", choices=("torch", "ort"), help="local training backend (ort: onnxruntime-training, no torch)")
    run.add_argument("--data-root", help="override [data] root: the directory holding the dataset")
    run.add_argument("--download", action="store_true",
                     help="allow downloading the dataset if it is not on disk ([data] download = true; off by default)")
    run.add_argument("--metrics", metavar="HOST:PORT",
                     help="serve this agent's Prometheus metrics there ([agent] metrics_address; off by default; an address "
                          "other than loopback needs metrics_password_file, metrics_cert_file and metrics_key_file)")
    doctor = sub.add_parser("doctor", help="check this device: Python, backend, broker, TLS, credentials, data")
    doctor.add_argument("--config", default="/etc/edgesplit/agent.toml", help="agent TOML (default: %(default)s)")
    doctor.add_argument("--backend", choices=("torch", "ort"), help="check this backend instead of the config's")
    doctor.add_argument("--timeout", type=float, default=5.0, help="seconds per network check (default: %(default)s)")
    doctor.add_argument("--no-load-data", action="store_true", help="only look at the data directory, do not load the dataset")
    doctor.add_argument("--data-root", help="check this data directory instead of [data] root (as run's --data-root)")
    doctor.add_argument("--state-dir", help="check this state directory instead of [agent] state_dir (as run's --state-dir)")
    check = sub.add_parser("check", help="read a config as run reads it, without joining: exit 0, or 2 naming the mistake "
                           "(what edgesplit local asks of its agents' configs before it starts anything)")
    check.add_argument("--config", required=True, help="agent TOML")
    sim = sub.add_parser("simulate", help="many agents in one process (each its own MQTT client), for scale tests")
    sim.add_argument("--config", required=True, help="agent TOML; [data] is partitioned across the simulated agents")
    sim.add_argument("--agents", type=int, required=True)
    sim.add_argument("--low-memory", action="store_true", help="as for run")
    sim.add_argument("--broker", help="override the broker URL")
    sim.add_argument("--prefix", default="sim-", help="agent ids are PREFIX0 .. PREFIX{N-1}")
    sim.add_argument("--log-json", action="store_true")
    return parser


def _with_memory_flag(config: EdgeConfig, args: argparse.Namespace) -> EdgeConfig:
    return dataclasses.replace(config, memory=MemoryConfig.low()) if getattr(args, "low_memory", False) else config


def load_config(args: argparse.Namespace) -> EdgeConfig:
    config = _with_memory_flag(EdgeConfig.from_dict(read_toml(args.config), base_dir=Path(args.config).resolve().parent), args)
    overrides = {
        "broker_url": args.broker,
        "agent_id": args.agent_id,
        "state_dir": args.state_dir,
        "log_json": True if args.log_json else None,
        "progress": False if args.no_progress else None,
        "backend": args.backend,
        "metrics_address": getattr(args, "metrics", None),
    }
    data_overrides = {"root": args.data_root, "download": True if args.download else None}
    data = dataclasses.replace(config.data, **{k: v for k, v in data_overrides.items() if v is not None})
    return dataclasses.replace(config, data=data, **{k: v for k, v in overrides.items() if v is not None})


def cmd_simulate(args: argparse.Namespace) -> int:
    from .simulate import SimulationConfig, run_simulation

    try:
        base = _with_memory_flag(EdgeConfig.from_dict(read_toml(args.config)), args)
        if args.broker:
            base = dataclasses.replace(base, broker_url=args.broker)
        sim = SimulationConfig(base, args.agents, prefix=args.prefix)
    except (ValueError, FileNotFoundError) as exc:
        print(f"edge-agent: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(args.log_json, name="sim ")
    apply_process_memory(base.memory)  # before the first big allocation; see edge_agent.memory
    codes = run_simulation(sim)
    return max(codes) if codes else 0


def cmd_check(args: argparse.Namespace) -> int:
    try:
        EdgeConfig.from_dict(read_toml(args.config), base_dir=Path(args.config).resolve().parent)
    except (ValueError, OSError) as exc:
        print(f"edge-agent: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        return cmd_check(args)
    if args.command == "simulate":
        return cmd_simulate(args)
    if args.command == "doctor":
        from .doctor import DoctorOptions
        from .doctor import main as doctor_main

        return doctor_main(DoctorOptions(args.config, args.backend, args.timeout, load_data=not args.no_load_data,
                                         data_root=args.data_root, state_dir=args.state_dir))
    try:
        config = load_config(args)
    except (ValueError, FileNotFoundError, PermissionError) as exc:
        print(f"edge-agent: error: {exc}\n  -> fix {args.config} (edge-agent doctor --config {args.config} checks it; "
              f"keys in docs/configuration.md)", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(config.log_json, name=f"{config.agent_id} ")
    pinned = apply_process_memory(config.memory)  # before the first big allocation; see edge_agent.memory
    if config.memory.micro_batch_samples or pinned or config.memory.checkpoint_blocks:
        log.info("memory: micro-batches of %s samples, malloc threshold %s, checkpointed blocks %s",
                 config.memory.micro_batch_samples or "all", "pinned" if pinned else "as glibc sets it", config.memory.checkpoint_blocks)
    if not sys.stderr.isatty():
        config = dataclasses.replace(config, progress=False)
    from .agent import EdgeAgent
    from .doctor.data import data_fix

    try:
        agent = EdgeAgent(config)
    except TransportError as exc:  # before any connection: the TLS files (ca_file, cert_file, key_file)
        log.error("%s", exc)
        log.error("  -> fix ca_file / cert_file / key_file in [agent] of %s (a relative path is relative to that file); "
                  "edge-agent doctor --config %s checks them", args.config, args.config)
        return EXIT_CONFIG
    except (ValueError, OSError) as exc:  # OSError: FileNotFoundError, PermissionError, unreadable files
        log.error("cannot load this device's data ([data] in %s): %s", args.config, exc)
        log.error("  -> %s; edge-agent doctor --config %s checks the data", data_fix(exc), args.config)
        return EXIT_CONFIG
    agent.config_path = args.config
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    from shared_protocol.metrics_endpoint import MetricsEndpointError

    try:
        return agent.run()
    except TransportError as exc:
        return explain_connect_failure(config, args.config, exc)
    except MetricsEndpointError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    finally:
        agent.close_metrics()


def explain_connect_failure(config: EdgeConfig, config_path: str, exc: TransportError) -> int:
    """Log why the broker connection failed and what to change, as doctor would say it, and
    return the exit code: a configuration error (TLS, CA, password) is not retried by the
    systemd unit; an unreachable broker is (it may come back)."""
    from .doctor import connection_checks

    log.error("%s", exc)
    failed = [c for c in connection_checks(config) if c.failed]
    for check in failed:
        log.error("%s: %s", check.name, check.detail)
        if check.fix:
            log.error("  -> %s (in %s; edge-agent doctor --config %s checks it)", check.fix, config_path, config_path)
    if any(c.name in ("tls", "login") for c in failed):
        return EXIT_CONFIG
    if not failed:
        log.error("  -> the broker answers now: a passing failure; start the agent again")
    return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
