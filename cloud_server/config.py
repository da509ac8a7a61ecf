"""Server configuration: frozen dataclasses validated on construction.

TOML and CLI flags are parsed in :mod:`cloud_server.cli`; the method's own
table (``[<method>]``) is kept as a dict here and parsed by the method into
its own config dataclass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from shared_protocol.configs import unknown_keys_error
from shared_protocol.metrics_endpoint import MetricsEndpointConfig
from shared_protocol.registry import DEFAULT_METHOD
from shared_protocol.secagg_params import SUMMING_METHODS, SecAggParams
from shared_protocol.tomlio import read_secret
from shared_protocol.topics import check_name
from shared_protocol.transport import BrokerAddress, TransportConfig, redact_url

from .device_target import DEFAULT_LINK_MBIT, DeviceTarget

if TYPE_CHECKING:
    from .evaluation import EvalSetSpec
    from .methods.base import ServerContext
    from .privacy import PrivacyConfig
    from .robust import RobustnessConfig
    from .robust.validation import DefenceConfig

# The modes of cloud_server/server_step.py (kept here so that reading a config never imports torch).
SERVER_STEPS = ("auto", "eager", "compiled", "graph")

IN_CHANNELS_BY_DATASET = {"fashion-mnist": 1, "mnist": 1}
# (height, width) of the inputs of the datasets whose size is known (28x28 is padded to 32x32).
IMAGE_SIZE_BY_DATASET = {"fashion-mnist": (32, 32), "mnist": (32, 32), "cifar10": (32, 32), "cifar100": (32, 32), "cinic10": (32, 32)}


@dataclass(frozen=True)
class ServerConfig:
    run_id: str = "default"
    method: str = DEFAULT_METHOD
    broker_url: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    # Blob bytes per PUBLISH; unset: 512 KiB, or what the broker's Maximum Packet Size allows.
    chunk_size_bytes: int | None = None
    out_dir: str = "runs/default"
    expected_agents: int = 1  # round 1 starts when this many have joined (or at registration_timeout_s)
    allow_list: tuple[str, ...] = ()  # empty: any agent id may join
    rounds: int = 10
    round_deadline_s: float = 600.0
    offline_grace_s: float = 30.0  # a participant offline this long misses its round (before the deadline)
    min_agents: int = 1  # quorum: at least this many completed uploads ...
    min_fraction: float = 0.0  # ... and at least this fraction of the round's participants
    max_failed_rounds: int = 3  # consecutive rounds without quorum before the run is aborted
    target_accuracy: float | None = None
    eval_every: int = 1
    registration_timeout_s: float = 300.0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # How the server's training step runs (cloud_server/server_step.py): auto | eager | compiled | graph.
    server_step: str = "auto"
    seed: int = 0
    dataset: str = "fashion-mnist"
    # The global test set every method of a run is scored on (cloud_server/evaluation.py): a
    # seeded, stratified subset of eval_dataset's test split ("": the run's dataset; "none":
    # no global set, only the agents' own shards), eval_samples images (0: the whole split),
    # drawn with eval_seed as fldata.subsets.seeded_subset draws the agents' test shares.
    eval_dataset: str = ""
    eval_samples: int = 0
    eval_seed: int = 0
    eval_root: str | None = None  # where the dataset lies (None: the loader's default place)
    eval_download: bool = False
    num_classes: int = 10
    in_channels: int = 0  # 0: from the dataset name
    # The agents' input images, [height, width] as the model sees them (28x28 folders are
    # padded to 32x32). Empty: the first agent to join fixes it (the log says so); an agent
    # whose input_shape differs from the run's is refused at join (Hello.input_shape).
    image_size: tuple[int, ...] = ()
    max_rejections_per_agent: int = 50
    # What the server does when no agent is left to start a round with: "wait" up to
    # registration_timeout_s for one to (re)join, then end the run; "end" ends it at once.
    no_agents_policy: str = "wait"
    # Reassembly limits for senders the server has not accepted (yet): one transfer (a hello
    # is a few KiB) and all of them together.
    unexpected_sender_max_bytes: int = 1024 * 1024
    unexpected_senders_total_bytes: int = 16 * 1024 * 1024
    # Client sampling (the fraction C of federated averaging): each sync round takes this fraction of the online
    # agents (at least min_agents), drawn with a generator seeded by (seed, round).
    client_fraction: float = 1.0
    # Robustness to a bad device (cloud_server/robust/, docs/configuration.md): the
    # weight-sharing methods' aggregation rule, update clipping, plausibility checks,
    # the server's training guard and quarantine.
    aggregation: str = "mean"  # mean | trimmed_mean | median | krum | multi_krum
    aggregation_tolerate: float = 0  # bad agents tolerated: a count (>= 1) or a fraction (< 0.5)
    clip_update_norm: float = 0.0  # 0: off
    plausibility_checks: bool = True
    plausible_global_ratio: float = 10.0
    plausible_peer_ratio: float = 50.0
    plausible_mad: float = 6.0
    plausible_min_cosine: float = -1.0  # -1: off; RobustnessConfig's default (cloud_server/robust/), kept equal by a test
    feature_abs_limit: float = 1.0e4
    logit_abs_limit: float = 1.0e4
    quarantine_after: int = 3  # 0: no quarantine
    quarantine_release: str = "plausible"  # plausible | never
    quarantine_release_after: int = 1  # plausible: consecutive judged clean rounds that release
    server_grad_clip_norm: float = 0.0  # 0: off
    server_loss_skip_factor: float = 0.0  # 0: off
    # The checks that need the server's judgement (cloud_server/robust/validation.py): a labelled
    # validation set that judges weight updates (validation_samples 0: none), and the server-side
    # label-agreement check of feature-map uploads (plausible_min_label_agreement 0: off). Defaults: DefenceConfig's.
    validation_samples: int = 0
    validation_dataset: str = ""  # "": the run's dataset
    validation_split: str = "train-holdout"  # train-holdout | train | valid
    validation_agent_train_samples: int = 0  # train-holdout: the agents' data.train_samples
    validation_agent_data_seed: int | None = None  # train-holdout: the agents' data.seed (None: seed)
    validation_loss_margin: float = 0.5  # DefenceConfig's default (cloud_server/robust/validation.py), kept equal by a test
    validation_step: str = "update"  # update | share: what an update is scored by
    plausible_min_label_agreement: float = 0.0  # 0: off
    # Differential privacy (cloud_server/privacy.py, docs/privacy.md): DP-FedAvg at client level
    # (off | central | client_clipping | local) and DP-SGD on the agents (Opacus); off by default.
    dp_fedavg: str = "off"
    dp_clip_norm: float = 0.0
    dp_noise_multiplier: float = 0.0
    dp_delta: float = 1e-5
    dp_accountant: str = "rdp"  # rdp | prv (Opacus's accountants)
    dpsgd: bool = False
    dpsgd_noise_multiplier: float = 0.0
    dpsgd_max_grad_norm: float = 1.0
    # Secure aggregation (shared_protocol/secagg.py, docs/privacy.md): the summing methods' updates
    # reach the server masked by pairwise masks, and it learns only their weighted sum. Off by
    # default; the masked vectors live in the ring of secagg_ring_bits bits with secagg_fraction_bits
    # of fixed-point fraction; t = floor(secagg_threshold * roster) + 1 shares rebuild a seed.
    secure_aggregation: bool = False
    secagg_ring_bits: int = 32  # 32 | 64
    secagg_fraction_bits: int = 20
    secagg_threshold: float = 0.5
    secagg_stage_timeout_s: float = 60.0
    log_json: bool = False
    progress: bool = True
    # A console line every this many seconds while the server works on a round longer than that
    # (cloud_server/phase_ticker.py); 0: none.
    progress_interval_s: float = 30.0
    # The live view (cloud_server/metrics.py): Prometheus /metrics and the status page at /,
    # served on HOST:PORT (None: off, nothing of it imported). Any address but loopback needs
    # basic auth (metrics_password_file, user metrics_username) and TLS (metrics_cert_file,
    # metrics_key_file); metrics_linger_s keeps serving the final figures after the run.
    metrics_address: str | None = None
    metrics_username: str = "edgesplit"
    metrics_password_file: str | None = None
    metrics_cert_file: str | None = None
    metrics_key_file: str | None = None
    metrics_linger_s: float = 0.0
    # The device the per-device figures are read against (cloud_server/device_target.py): its
    # link in Mbit/s, and its memory ("2GiB"; "": each agent's own).
    link_mbit: float = DEFAULT_LINK_MBIT
    device_memory: str = ""
    # The leakage audit (`edgesplit audit RUN_DIR`, cloud_server/audit_keeper.py): keep what the
    # audit reads under RUN_DIR/audit: per agent at most audit_samples_per_agent uploaded maps (and
    # one round's labels), or one weight update and the global model it started from.
    audit: bool = False
    audit_samples_per_agent: int = 8
    method_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name("run id", self.run_id)
        BrokerAddress.parse(self.broker_url)
        for agent in self.allow_list:
            check_name("allow_list entry", agent)
        positive = {
            "expected_agents": self.expected_agents, "rounds": self.rounds, "min_agents": self.min_agents,
            "eval_every": self.eval_every, "num_classes": self.num_classes, "max_failed_rounds": self.max_failed_rounds,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"server.{name} must be an integer >= 1, got {value!r}")
        if self.round_deadline_s <= 0 or self.registration_timeout_s <= 0 or self.offline_grace_s < 0:
            raise ValueError("round_deadline_s and registration_timeout_s must be positive")
        if not 0.0 < self.client_fraction <= 1.0:
            raise ValueError(f"client_fraction must be in (0, 1], got {self.client_fraction}")
        if not 0.0 <= self.min_fraction <= 1.0:
            raise ValueError(f"min_fraction must be in [0, 1], got {self.min_fraction}")
        if self.target_accuracy is not None and not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.min_agents > self.expected_agents:
            raise ValueError(f"min_agents ({self.min_agents}) cannot exceed expected_agents ({self.expected_agents})")
        if self.in_channels < 0:
            raise ValueError("in_channels must be >= 0")
        if self.image_size and (len(self.image_size) != 2 or not all(isinstance(d, int) and d >= 1 for d in self.image_size)):
            raise ValueError(f"server.image_size must be [height, width] in pixels (e.g. [32, 32]), or left out; got {list(self.image_size)!r}")
        if self.eval_samples < 0:
            raise ValueError(f"server.eval_samples must be >= 0 (0: the whole test split), got {self.eval_samples}")
        if not self.progress_interval_s >= 0:
            raise ValueError(f"server.progress_interval_s must be >= 0 seconds (0: no progress lines), got {self.progress_interval_s}")
        if self.server_step not in SERVER_STEPS:
            raise ValueError(f"server.server_step must be one of {SERVER_STEPS}, got {self.server_step!r}")
        if self.no_agents_policy not in ("wait", "end"):
            raise ValueError(f"no_agents_policy must be 'wait' or 'end', got {self.no_agents_policy!r}")
        if not 0 < self.unexpected_sender_max_bytes <= self.unexpected_senders_total_bytes:
            raise ValueError(
                f"need 0 < unexpected_sender_max_bytes ({self.unexpected_sender_max_bytes}) <= "
                f"unexpected_senders_total_bytes ({self.unexpected_senders_total_bytes})"
            )
        if not isinstance(self.audit_samples_per_agent, int) or self.audit_samples_per_agent < 1:
            raise ValueError(f"server.audit_samples_per_agent must be an integer >= 1, got {self.audit_samples_per_agent!r}")
        if self.metrics_linger_s < 0:
            raise ValueError(f"server.metrics_linger_s must be >= 0, got {self.metrics_linger_s}")
        try:
            DeviceTarget(link_mbit=self.link_mbit, device_memory=self.device_memory)
        except ValueError as exc:
            raise ValueError(f"server.{exc}") from None
        self.transport_config()  # chunk size, credentials in the URL
        self.metrics_endpoint()  # a non-loopback address without credentials is refused here
        self.secagg_params()  # first: a conflict with secure aggregation says what to drop
        self.robustness_config()  # the rule's bound against expected_agents, the thresholds
        self.defence_config()
        self.privacy_config()

    def privacy_config(self) -> "PrivacyConfig":
        from .privacy import PrivacyConfig

        return PrivacyConfig(
            dp_fedavg=self.dp_fedavg, dp_clip_norm=self.dp_clip_norm, dp_noise_multiplier=self.dp_noise_multiplier,
            dp_delta=float(self.dp_delta), dp_accountant=self.dp_accountant, dpsgd=self.dpsgd,
            dpsgd_noise_multiplier=self.dpsgd_noise_multiplier, dpsgd_max_grad_norm=self.dpsgd_max_grad_norm,
            client_fraction=self.client_fraction, secure_aggregation=self.secure_aggregation,
        )

    def metrics_endpoint(self) -> MetricsEndpointConfig | None:
        """Where the metrics and the status page are served (None: metrics off)."""
        return MetricsEndpointConfig.of("server", self.metrics_address, self.metrics_username, self.metrics_password_file,
                                        self.metrics_cert_file, self.metrics_key_file)

    def robustness_config(self) -> "RobustnessConfig":
        from .robust import RobustnessConfig

        return RobustnessConfig(
            aggregation=self.aggregation, aggregation_tolerate=self.aggregation_tolerate,
            clip_update_norm=self.clip_update_norm, plausibility_checks=self.plausibility_checks,
            plausible_global_ratio=self.plausible_global_ratio, plausible_peer_ratio=self.plausible_peer_ratio,
            plausible_mad=self.plausible_mad, plausible_min_cosine=self.plausible_min_cosine, feature_abs_limit=self.feature_abs_limit,
            logit_abs_limit=self.logit_abs_limit, quarantine_after=self.quarantine_after,
            quarantine_release=self.quarantine_release, quarantine_release_after=self.quarantine_release_after,
            server_grad_clip_norm=self.server_grad_clip_norm,
            server_loss_skip_factor=self.server_loss_skip_factor, expected_agents=self.expected_agents,
        )

    def defence_config(self) -> "DefenceConfig":
        from .robust.validation import DefenceConfig

        return DefenceConfig(
            validation_samples=self.validation_samples, validation_dataset=self.validation_dataset or self.dataset,
            validation_split=self.validation_split, validation_agent_train_samples=self.validation_agent_train_samples,
            validation_agent_data_seed=self.validation_agent_data_seed, validation_root=self.eval_root,
            validation_download=self.eval_download, validation_loss_margin=self.validation_loss_margin,
            validation_step=self.validation_step,
            plausible_min_label_agreement=self.plausible_min_label_agreement, plausible_mad=self.plausible_mad, seed=self.seed,
        )

    def secagg_params(self) -> "SecAggParams | None":
        """Secure aggregation's parameters (None: off); a setting that needs the individual
        updates the server no longer sees is refused here, naming both keys."""
        if not self.secure_aggregation:
            return None
        if self.method not in SUMMING_METHODS:
            raise ValueError(f"server.secure_aggregation sums the agents' models; method {self.method!r} does not average "
                             f"them (it works on each one): use one of {SUMMING_METHODS} or leave secure_aggregation off")
        conflicts = {
            "aggregation": (self.aggregation != "mean", f"{self.aggregation!r} (a robust rule needs each update; use 'mean')"),
            "clip_update_norm": (self.clip_update_norm != 0, f"{self.clip_update_norm!r} (server-side clipping needs each update; "
                                                            "clip on the agents, before masking, or set 0)"),
            "validation_samples": (self.validation_samples != 0, f"{self.validation_samples!r} (the validation screen scores "
                                                                "each update; set 0)"),
            "plausible_min_cosine": (self.plausible_min_cosine > -1, f"{self.plausible_min_cosine!r} (the direction check "
                                                                    "compares each update with the others; set -1)"),
            "dp_fedavg": (self.dp_fedavg == "central", f"{self.dp_fedavg!r} (central DP-FedAvg has the server clip each "
                                                      "update; use 'client_clipping': the agents clip before masking and the "
                                                      "server adds the noise to the sum)"),
        }
        for key, (conflict, detail) in conflicts.items():
            if conflict:
                raise ValueError(f"server.secure_aggregation = true conflicts with server.{key} = {detail}: "
                                 "the server sees only the sum of the updates")
        params = SecAggParams(ring_bits=self.secagg_ring_bits, fraction_bits=self.secagg_fraction_bits,
                              threshold=self.secagg_threshold, stage_timeout_s=self.secagg_stage_timeout_s)
        if (self.dp_fedavg in ("client_clipping", "local") and isinstance(self.dp_clip_norm, (int, float))
                and isinstance(self.dp_noise_multiplier, (int, float)) and self.dp_clip_norm > 0):
            # A clipped update's entries are within C (local: plus the agent's noise, kept within six
            # standard deviations); beyond the fixed-point bound they would be clipped again, silently
            # changing the sum the noise was calibrated for.
            largest = self.dp_clip_norm * (1 + (6 * self.dp_noise_multiplier if self.dp_fedavg == "local" else 0))
            bound = params.bound(self.expected_agents) / 2.0 ** params.fraction_bits
            if largest > bound:
                raise ValueError(f"server.secure_aggregation = true with server.dp_fedavg = {self.dp_fedavg!r}: an entry of a "
                                 f"privatised update may reach {largest:.4g}, beyond the fixed-point bound {bound:.4g} per agent "
                                 f"at expected_agents = {self.expected_agents} (secagg_ring_bits = {self.secagg_ring_bits}, "
                                 f"secagg_fraction_bits = {self.secagg_fraction_bits}): lower server.dp_clip_norm, or set "
                                 "server.secagg_ring_bits = 64 or fewer server.secagg_fraction_bits")
        return params

    @property
    def resolved_in_channels(self) -> int:
        return self.in_channels or IN_CHANNELS_BY_DATASET.get(self.dataset, 3)

    @property
    def known_image_size(self) -> tuple[tuple[int, int], str] | None:
        """The run's input (height, width) and where it comes from, when the config fixes it:
        [server] image_size, else the size of a named dataset; None: the first agent fixes it."""
        if self.image_size:
            return (int(self.image_size[0]), int(self.image_size[1])), "[server] image_size"
        if self.dataset in IMAGE_SIZE_BY_DATASET:
            return IMAGE_SIZE_BY_DATASET[self.dataset], f"[server] dataset = {self.dataset!r}; set [server] image_size for other images"
        return None

    @property
    def in_channels_source(self) -> str:
        """Where :attr:`resolved_in_channels` comes from, for the log and refusals."""
        if self.in_channels:
            return "[server] in_channels"
        if self.dataset in IN_CHANNELS_BY_DATASET:
            return f"[server] dataset = {self.dataset!r}"
        return f"the default for [server] dataset = {self.dataset!r}; set [server] in_channels"

    def eval_set_spec(self) -> "EvalSetSpec":
        from .evaluation import EvalSetSpec

        return EvalSetSpec(dataset=self.eval_dataset or self.dataset, samples=self.eval_samples, seed=self.eval_seed,
                           root=self.eval_root, download=self.eval_download)

    def transport_config(self) -> TransportConfig:
        return TransportConfig(
            broker_url=self.broker_url,
            client_id=f"edgesplit-{self.run_id}-server",
            username=self.username,
            password=self.password,
            ca_file=self.ca_file,
            cert_file=self.cert_file,
            key_file=self.key_file,
            chunk_size_bytes=self.chunk_size_bytes,
            max_unexpected_transfer_bytes=self.unexpected_sender_max_bytes,
            max_unexpected_total_bytes=self.unexpected_senders_total_bytes,
        )

    def method_context(self, device: str, progress: bool = False) -> "ServerContext":
        """What the method's server step gets to know about the run."""
        from .methods.base import ServerContext

        return ServerContext(run_id=self.run_id, num_classes=self.num_classes, in_channels=self.resolved_in_channels,
                             device=device, seed=self.seed, progress=progress, rounds=self.rounds,
                             out_dir=self.out_dir, server_step=self.server_step, robustness=self.robustness_config(),
                             defence=self.defence_config(), secagg=self.secagg_params())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["allow_list"] = list(self.allow_list)
        out["image_size"] = list(self.image_size)
        if out.get("password"):
            out["password"] = "***"
        out["broker_url"] = redact_url(self.broker_url)
        return out

    @classmethod
    def table_keys(cls) -> tuple[str, ...]:
        """The keys ``[server]`` may hold (``password_file`` for ``password``; the method's
        table is its own)."""
        return tuple(f for f in cls.__dataclass_fields__ if f != "method_config") + ("password_file",)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ServerConfig":
        """From a parsed TOML document: ``[server]`` plus a table named after the method."""
        server = dict(raw.get("server", {}))
        unknown = set(server) - set(cls.table_keys())
        if unknown:
            raise unknown_keys_error("server", unknown, cls.table_keys())
        password_file = server.pop("password_file", None)
        if password_file:
            server["password"] = read_secret(password_file)
        if "allow_list" in server:
            server["allow_list"] = tuple(server["allow_list"])
        if "image_size" in server:
            size = server["image_size"]
            server["image_size"] = (size, size) if isinstance(size, int) else tuple(size)
        method = server.get("method", DEFAULT_METHOD)
        server.setdefault("method_config", dict(raw.get(method, {})))
        return cls(**server)
