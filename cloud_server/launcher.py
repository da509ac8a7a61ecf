"""``edgesplit local``: a whole federation on one machine.

Starts mosquitto on a free loopback port (unless ``--broker`` is given), then
the server and N agents as separate processes that talk only through the
broker, waits for the run, prints the summary and the report path, and cleans
up every process on exit or Ctrl-C. Each agent gets one torch thread: N
processes each spinning all cores would slow every one of them down.

``--method NAME`` runs any registered method (:mod:`shared_protocol.registry`),
configured by that method's own ``launcher_table`` from the flags its registry
entry declares (:mod:`cloud_server.local_run`), and ``--set TABLE.KEY=VALUE``
changes any key of the generated configs; the server's config is checked (its
method built) before any process starts. Training one model on the union of the
data (the reference rows) is its own command, ``edgesplit centralized``
(:mod:`cloud_server.centralized_cli`).
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared_protocol.local_broker import BrokerNotFoundError, BrokerStartError, LocalBroker
from shared_protocol.metrics_endpoint import DEFAULT_METRICS_PORT
from shared_protocol.registry import DEFAULT_METHOD, registered_methods
from shared_protocol.transport import redact_url
from shared_protocol.version import add_version_flag

from .device_target import add_target_flags
from .local_checks import (EXIT_CONFIG, PARTITION_FORMS, LaunchConfigError, check_generated_configs, check_local_args,
                           dataset_name, faulty_agent, float_in, int_at_least, method_name, partition_spec)
from .local_run import (broker_settings, check_server_config, clear_previous_run, launcher_flags, local_options, method_table, metrics_addresses,
                        metrics_banner, write_configs)

__all__ = ["broker_settings", "build_parser", "check_server_config", "clear_previous_run", "cmd_local", "local_options", "main",
           "method_table", "metrics_addresses", "metrics_banner", "write_configs"]


class LocalHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``edgesplit local --help``: every flag's default (unless its help already says it), and
    for a flag naming a model, the models registered for it (read from the models registry,
    and so torch, only when the help is printed)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == [] or action.default == argparse.SUPPRESS
        if action.option_strings and "default" not in text and not unset:
            text += " (default: %(default)s)"
        named = _model_flags().get(action.option_strings[0]) if action.option_strings else None
        if named is not None and not all(model in text for model in named[1]):
            text += f"; registered: {' | '.join(named[1])}"
        return text


def _model_flags() -> dict[str, tuple[str, list[str]]]:
    from .local_checks import model_flags

    return model_flags()


def dataset_names() -> list[str]:
    from fldata.registry import list_datasets

    import fldata  # noqa: F401  (its import registers the built-in datasets)

    return list(list_datasets())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgesplit", description="EdgeSplit tools.")
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    local = sub.add_parser("local", help="run a federation on this machine: broker + server + N agents",
                           formatter_class=LocalHelpFormatter,
                           description="Run a federation on this machine: a broker, the server and N agents as separate\n"
                           "processes. Every flag and --set is checked before anything starts; a configuration\n"
                           f"error exits with code {EXIT_CONFIG}.",
                           epilog="methods (--method):\n" + "\n".join(
                               f"  {name:<12} {spec.summary}" for name, spec in registered_methods().items()))
    local.add_argument("--method", type=method_name, default=DEFAULT_METHOD, help=" | ".join(registered_methods()))
    local.add_argument("--agents", type=int_at_least(1), default=4, help="agents, each its own process")
    local.add_argument("--rounds", type=int_at_least(1), default=8, help="rounds of the run")
    local.add_argument("--dataset", type=dataset_name, default="fashion-mnist",
                       help=f"the dataset the agents share out: {' | '.join(dataset_names())}")
    local.add_argument("--data-root", default=None, help="the directory holding the dataset (default: the loader's own place)")
    local.add_argument("--partition", type=partition_spec, default="dirichlet:0.5",
                       help=f"how the training set is shared out among the agents: {PARTITION_FORMS}")
    local.add_argument("--train-samples", type=int_at_least(0), default=4000, help="seeded subset of the training set (0 = all)")
    local.add_argument("--test-samples", type=int_at_least(0), default=1000, help="seeded subset of the test set (0 = all)")
    # The methods' own flags, as their registry entries declare them (MethodSpec.flags). Left
    # out, a flag is None here and LocalRunOptions.flag gives the method's declared default: a
    # method's launcher table can tell a flag given from one left at its default (a method's
    # preset fills only the keys its table leaves unset).
    for launch in launcher_flags():
        flag = launch.flag
        local.add_argument(flag.name, type=flag.parse, default=None, choices=flag.choices or None,
                           help=launch.help_text() + ("" if flag.default is None else f" (default {flag.default})"))
    local.add_argument("--deadline", type=float_in(0.0), default=900.0, help="round deadline in seconds")
    local.add_argument("--eval-every", type=int_at_least(1), default=1, help="evaluate every N rounds (and the last)")
    local.add_argument("--client-fraction", type=float_in(0.0, 1.0), default=1.0,
                       help="sync methods: fraction of the agents drawn each round")
    local.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the data subsets, the partition and the models")
    local.add_argument("--run-id", default=None, help="the run's name (default <method>-<date>-<time>)")
    local.add_argument("--out", default=None, help="run directory (default runs/<run id>)")
    local.add_argument("--broker", default=None, help="use this broker instead of starting one (mqtt[s]://[user[:password]@]host:port)")
    local.add_argument("--username", default=None, help="broker user name for the server and every agent")
    local.add_argument("--password-file", default=None, help="file holding the broker password (server and agents read it; never logged)")
    local.add_argument("--chunk-size", type=int, default=None, metavar="BYTES",
                       help="blob bytes per MQTT PUBLISH, server and agents (default: 512 KiB, or less if the broker's "
                       "Maximum Packet Size requires; an explicit size that does not fit fails at connect)")
    local.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                       help="set any key of the generated configs, e.g. server.round_deadline_s=60, data.download=true, "
                       "<method>.<key>=3 (repeatable; VALUE is read as TOML, a bare word as a string)")
    local.add_argument("--low-memory", action="store_true",
                       help="every agent in the low-memory mode a 2 GB Raspberry Pi uses (`edge-agent run --low-memory`: "
                       "micro-batches, a shard on disk, a small resend cache); the agents report it in their hello")
    local.add_argument("--backend", choices=("torch", "ort"), default=None,
                       help="every agent's training backend (ort: onnxruntime-training, no torch, as on a device without "
                       "it; only methods that implement it). Default: each agent config's, torch")
    local.add_argument("--audit", action="store_true",
                       help="keep what the leakage audit needs under RUN_DIR/audit ([server] audit; "
                       "server.audit_samples_per_agent bounds it) and audit it when the run ends, as `edgesplit audit "
                       "RUN_DIR` does: the leakage section of summary.md and report.json, leakage.png")
    local.add_argument("--audit-steps", type=int_at_least(1), default=None, metavar="N",
                       help="with --audit: optimisation steps of every optimising attack (default: each attack's own; "
                       "fewer is faster and weaker)")
    local.add_argument("--faulty-agent", type=faulty_agent, action="append", default=[], metavar="AGENT_INDEX:KIND[:SCALE]",
                       help="make agent AGENT_INDEX misbehave on purpose, to try the server's defences ([agent] fault): "
                       "sign_flip (its update negated and scaled, default x4), scale (its uploads' tensors x SCALE, "
                       "default x1000), random_labels (trains on shuffled labels), nan (NaN in its uploads); repeatable, "
                       "one fault per agent; the report names the faulty agents")
    add_target_flags(local)  # --link-mbit, --device-memory: the device the per-device figures are read against
    local.add_argument("--log-json", action="store_true", help="the server and the agents log JSON lines")
    local.add_argument("--metrics", nargs="?", const=f"127.0.0.1:{DEFAULT_METRICS_PORT}", default=None, metavar="HOST:PORT",
                       help="watch the run: the server serves Prometheus metrics and the status page on HOST:PORT (default "
                       f"127.0.0.1:{DEFAULT_METRICS_PORT}, or a free port if that one is taken) and every agent its metrics on "
                       "a free loopback port; the addresses are printed at start")
    from .centralized_cli import add_parser as add_centralized_parser
    from .experiments.cli import add_parser as add_bench_parser
    from .keys import add_parser as add_keys_parser

    add_centralized_parser(sub)
    add_bench_parser(sub)
    add_keys_parser(sub)
    _add_audit_parser(sub)
    return parser


def _add_audit_parser(sub: argparse._SubParsersAction) -> None:
    # Here rather than beside the audit: importing cloud_server.audit imports torch, which
    # `edgesplit local --help` should not wait for.
    audit = sub.add_parser("audit", help="the leakage audit of a run kept with --audit: what the server could reconstruct "
                           "from what it received; writes RUN_DIR/audit/leakage.json and leakage.png")
    audit.add_argument("run_dir", metavar="RUN_DIR")
    audit.add_argument("--steps", type=int, default=None, help="optimisation steps of every optimising attack "
                       "(default: each attack's own; fewer is faster and weaker)")
    audit.add_argument("--public-samples", type=int, default=500,
                       help="public images (the server's global test set) the inverse network trains on (0: all)")
    audit.add_argument("--max-update-images", type=int, default=16,
                       help="invert a weight update only when it covers at most this many images")
    audit.add_argument("--attacks", default="", help="comma-separated attack names (default: every one that applies)")
    audit.add_argument("--seed", type=int, default=0)
    audit.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def cmd_audit(args: argparse.Namespace) -> int:
    import torch

    from .audit import AuditError
    from .audit.audit_run import AuditOptions, run_audit

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        options = AuditOptions(steps=args.steps, public_samples=args.public_samples, max_update_images=args.max_update_images,
                               attacks=tuple(a for a in args.attacks.split(",") if a), seed=args.seed)
        run_audit(args.run_dir, options, progress=lambda line: print(line, flush=True))
    except AuditError as exc:
        print(f"edgesplit audit: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


#: Lines of an agent's log shown when it dies before the federation started.
LOG_TAIL_LINES = 20


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(could not read {path}: {exc})"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _watch(server: subprocess.Popen, agents: list[subprocess.Popen], logs: Path, poll_s: float = 0.2) -> int | None:
    """Relay the server's status lines until its stdout closes, watching the agents meanwhile.

    An agent that exits with an error before the server printed its first round
    line (a missing dataset, a bad config) would otherwise leave the server
    waiting out its registration timeout with no word to the user: the run is
    abandoned at once, with the tail of that agent's log, and the agent's exit
    code is returned. Later agent failures are reported and the run goes on
    (the server's deadlines and quorum deal with a missing agent). Returns None
    when the server's output ended normally.
    """
    assert server.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert server.stdout is not None
        for line in server.stdout:  # one status line per round, then the final line
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="server-stdout", daemon=True).start()
    started = False
    reported: set[int] = set()
    while True:
        try:
            line = lines.get(timeout=poll_s)
        except queue.Empty:
            line = ""
        if line is None:
            return None
        if line:
            print(line.rstrip(), flush=True)
            started = True
        for i, p in enumerate(agents):
            if i in reported or p.poll() in (None, 0):
                continue
            reported.add(i)
            log_path = logs / f"agent-{i}.log"
            print(f"edgesplit: agent-{i} exited with code {p.returncode}; see {log_path}", flush=True)
            if not started:
                print(f"edgesplit: agent-{i} failed before the federation started; the end of its log:", flush=True)
                print("    " + _log_tail(log_path).replace("\n", "\n    "), flush=True)
                print("edgesplit: stopping the run", flush=True)
                return p.returncode if p.returncode > 0 else 1


#: What an `edgesplit local` run writes in its directory (replaced when the directory is reused).
def cmd_local(args: argparse.Namespace) -> int:
    run_id = args.run_id or f"{args.method}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(args.out or f"runs/{run_id}").resolve()
    try:  # everything, before anything starts or is written
        if args.audit_steps is not None and not args.audit:
            raise LaunchConfigError("--audit-steps needs --audit")
        check_local_args(args)
        check_generated_configs(args, run_id, out, args.broker)
    except LaunchConfigError as exc:
        print(f"edgesplit local: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if clear_previous_run(out):
        print(f"edgesplit: {out} held a previous run; replaced", file=sys.stderr)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    local_broker: LocalBroker | None = None
    procs: list[subprocess.Popen] = []
    files = []
    try:
        if args.broker:
            broker = args.broker
        else:
            try:
                local_broker = LocalBroker(out / "broker").start()
            except (BrokerNotFoundError, BrokerStartError) as exc:
                raise SystemExit(f"edgesplit: {exc}") from None
            broker = local_broker.url
        print(f"edgesplit: broker {redact_url(broker)}; run {run_id}; {args.agents} agents x {args.rounds} rounds of {args.method} on {args.dataset} ({args.partition})", flush=True)
        try:  # as checked above, now with the broker's address
            server_cfg, agent_cfgs = write_configs(args, run_id, out, broker)
        except ValueError as exc:
            print(f"edgesplit local: error: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        banner = metrics_banner(server_cfg, agent_cfgs)
        if banner is not None:
            print(banner, flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        extra = ["--log-json"] if args.log_json else []
        server_log = open(logs / "server.log", "w")
        files.append(server_log)
        server = subprocess.Popen(
            [sys.executable, "-m", "cloud_server.cli", "run", "--config", str(server_cfg), "--no-progress", *extra],
            stdout=subprocess.PIPE, stderr=server_log, text=True, env=env,
        )
        procs.append(server)
        agent_env = dict(env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        for i, cfg in enumerate(agent_cfgs):
            f = open(logs / f"agent-{i}.log", "w")
            files.append(f)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "edge_agent.cli", "run", "--config", str(cfg), "--no-progress", *extra,
                 *(["--low-memory"] if args.low_memory else []), *(["--backend", args.backend] if args.backend else [])],
                stdout=f, stderr=subprocess.STDOUT, env=agent_env,
            ))
        assert server.stdout is not None
        failed = _watch(server, procs[1:], logs)
        if failed is not None:
            return failed
        code = server.wait()
        _stop(procs[1:], grace_s=30)
        if code != 0:
            print(f"edgesplit: server exited with code {code}; see {logs / 'server.log'}", flush=True)
            return code
        if args.audit:
            print(f"edgesplit: auditing what the server received (`edgesplit audit {out}`)", flush=True)
            steps = [] if args.audit_steps is None else ["--steps", str(args.audit_steps)]
            audited = cmd_audit(build_parser().parse_args(["audit", str(out), *steps]))
            if audited != 0:
                return audited
        summary = out / "summary.md"
        if summary.exists():
            print()
            print(summary.read_text())
        print(f"edgesplit: report in {out} (report.json, rounds.csv, summary.md, *.png); logs in {logs}")
        return 0
    except KeyboardInterrupt:
        print("\nedgesplit: interrupted; stopping processes", flush=True)
        return 130
    finally:
        _stop(procs)
        if local_broker is not None:
            local_broker.stop()
        for f in files:
            f.close()


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (kill, systemd, the bench runner's budget) takes the Ctrl-C path: the broker, server
        # and agents this process started are stopped, not orphaned. Ctrl-C itself may be ignored
        # when started in the background (`cmd &` in a script).
        signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    if args.command == "keys":
        from .keys import KeyToolError, cmd_keys

        try:
            return cmd_keys(args)
        except (ValueError, KeyToolError) as exc:
            print(f"edgesplit keys: error: {exc}", file=sys.stderr)
            return 2
    if args.command == "audit":
        return cmd_audit(args)
    if args.command == "bench":
        from .experiments.cli import cmd_bench

        return cmd_bench(args)
    if args.command == "centralized":
        from .centralized_cli import cmd_centralized

        return cmd_centralized(args)
    return cmd_local(args)


if __name__ == "__main__":
    sys.exit(main())
