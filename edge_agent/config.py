"""Agent configuration: frozen dataclasses validated on construction.

TOML and CLI flags are parsed in :mod:`edge_agent.cli` only; everything below
receives typed objects. Method hyperparameters are not here: the server sends
them with every round, so one federation cannot run with mismatched settings.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared_protocol.configs import unknown_keys_error
from shared_protocol.faults import FaultSpec
from shared_protocol.metrics_endpoint import MetricsEndpointConfig
from shared_protocol.tomlio import read_secret
from shared_protocol.topics import check_name
from shared_protocol.mqtt.config import BrokerAddress, TransportConfig, redact_url


#: [agent] keys naming files that a relative path finds next to the config file.
CREDENTIAL_PATH_KEYS = ("password_file", "ca_file", "cert_file", "key_file")


def resolve_credential_paths(agent: dict[str, Any], base_dir: str | Path | None) -> dict[str, Any]:
    """``agent`` with each relative credential path (``password_file``, ``ca_file``, ...)
    joined to ``base_dir``: a device bundle from ``edgesplit keys init`` says
    ``password_file = "agent.password"`` and works wherever its three files are installed
    together (``/etc/edgesplit``, or the bundle's own directory)."""
    if base_dir is None:
        return agent
    out = dict(agent)
    for key in CREDENTIAL_PATH_KEYS:
        value = out.get(key)
        if isinstance(value, str) and value and not Path(os.path.expanduser(value)).is_absolute():
            out[key] = str(Path(base_dir) / value)
    return out


@dataclass(frozen=True)
class DataConfig:
    """Where this agent's data comes from.

    In a real deployment ``dataset`` is a local folder (``imagefolder`` / ``npz``)
    with ``partition = "none"``. In a local simulation every agent loads the same
    dataset and takes its share by the seeded partition spec.
    """

    dataset: str = "fashion-mnist"
    root: str | None = None
    partition: str = "iid"  # iid | dirichlet:A | step:K | table:path.csv | none
    num_agents: int = 1
    agent_index: int = 0
    seed: int = 0
    train_samples: int = 0  # 0 = all; otherwise a seeded subset of the dataset before partitioning
    test_samples: int = 0
    download: bool = False
    augment: bool | None = None  # None: on for CIFAR/CINIC as in the paper, off otherwise
    # The run's data contract as its server states it ([server] in_channels, image_size, num_classes;
    # edgesplit keys init copies them into every device bundle): edge-agent doctor checks this
    # device's data against them before it ever joins. 0 / unset: not checked on the device. The
    # server checks every agent at join either way, and its settings are the ones that count.
    in_channels: int = 0
    image_size: Any = None  # [height, width] as the model sees it (28x28 counts as 32x32), or an int for a square
    num_classes: int = 0

    def __post_init__(self) -> None:
        if self.num_agents < 1:
            raise ValueError(f"data.num_agents must be >= 1, got {self.num_agents}")
        for key in ("in_channels", "num_classes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"data.{key} must be an int >= 0 (0: not checked), got {value!r}")
        if self.image_size is not None:
            size = self.image_size
            hw = [size, size] if isinstance(size, int) and not isinstance(size, bool) else size
            if (not isinstance(hw, (list, tuple)) or len(hw) != 2
                    or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in hw)):
                raise ValueError(f"data.image_size must be [height, width] or one int, got {size!r}")
            object.__setattr__(self, "image_size", [int(hw[0]), int(hw[1])])
        if not 0 <= self.agent_index < self.num_agents:
            raise ValueError(f"data.agent_index must be in [0, {self.num_agents}), got {self.agent_index}")
        if self.train_samples < 0 or self.test_samples < 0:
            raise ValueError("data.train_samples and data.test_samples must be >= 0")


#: ``--low-memory``'s resend cache: at 64 MiB (the transport's default) a Pi agent's cache alone
#: would be a fifth of its budget.
LOW_MEMORY_RESEND_CACHE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class MemoryConfig:
    """How this agent trades speed for resident memory (``[memory]``; ``--low-memory``
    takes :meth:`low`). Nothing here changes what the agent reports or sends, only
    how it computes it; see :mod:`edge_agent.memory` for what each costs.

    * ``micro_batch_samples``: the most samples any forward pass holds activations
      for. A training batch larger than this runs as micro-batches whose gradients
      are accumulated into one optimiser step on the round's batch (the same
      gradient, except that BatchNorm normalises each micro-batch with its own
      statistics: "ghost" batches); feature extraction and evaluation run in slices
      of this size, and uploads carry at most ``upload_batch_samples_cap`` samples.
      0: the round's batch as it is.
    * ``checkpoint_blocks``: the torch backend's ResNet blocks recompute their
      activations in the backward pass (exact, more FLOPs and a slower step:
      bench/results/step_memory.json, ``recompute_flops_ratio``).
    * ``pin_malloc``: pin glibc's mmap threshold so freed activations go back to
      the system (process-wide, set at start; training steps slower:
      bench/results/step_memory.json, ``test_torch_step``).
    * ``shard_on_disk``: the agent's images (train and test shard) live in an unnamed
      file under the data directory (``$EDGESPLIT_DATA_DIR`` or
      ``~/.cache/edgesplit/datasets``), memory-mapped, and each batch's rows are read
      from it and their pages given back (:mod:`fldata.mapped`): the shard no longer
      counts in the agent's RSS (16.4 MB at 16,000 32x32 images), for a page-cache read
      per batch. The directory must be on a disk, not a RAM-backed tmpfs.
    * ``resend_cache_bytes``: the most the MQTT transport keeps of the round's uploads
      for answering the server's requests for lost chunks (emptied at every round
      start). A lost chunk of an upload no longer kept is recovered by the method
      (FedGKT extracts the batch again, ``GktResendRequest``), at the cost of the
      extraction.
    """

    micro_batch_samples: int = 0
    checkpoint_blocks: bool = False
    pin_malloc: bool = False
    shard_on_disk: bool = False

    #: The largest upload message (samples) while micro-batching: the maps of a
    #: 256-sample upload are 16 MiB before encoding, 64 samples' 4 MiB.
    upload_batch_samples_cap: int = 64
    resend_cache_bytes: int = TransportConfig.resend_cache_bytes

    def __post_init__(self) -> None:
        if self.micro_batch_samples < 0 or self.micro_batch_samples == 1:
            raise ValueError(f"memory.micro_batch_samples must be 0 (off) or >= 2 (BatchNorm needs two samples), "
                             f"got {self.micro_batch_samples}")
        if self.upload_batch_samples_cap < 1:
            raise ValueError(f"memory.upload_batch_samples_cap must be >= 1, got {self.upload_batch_samples_cap}")
        if self.resend_cache_bytes < 0:
            raise ValueError(f"memory.resend_cache_bytes must be >= 0, got {self.resend_cache_bytes}")

    @classmethod
    def low(cls) -> "MemoryConfig":
        """``--low-memory``: micro-batches of 16 samples, the pinned malloc threshold, the
        shard kept on disk and a resend cache of 8 MiB (a few uploads of 64 samples), not
        64 (measured in bench/micro/test_footprint.py; accuracy cost: bench/experiments/low_memory.toml)."""
        return cls(micro_batch_samples=16, pin_malloc=True, shard_on_disk=True, resend_cache_bytes=LOW_MEMORY_RESEND_CACHE_BYTES)

    def upload_batch_samples(self, asked: int) -> int:
        """Samples per upload message when the server asks for ``asked``."""
        return min(asked, self.upload_batch_samples_cap) if self.micro_batch_samples else asked


@dataclass(frozen=True)
class EdgeConfig:
    agent_id: str
    run_id: str = "default"
    broker_url: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    chunk_size_bytes: int | None = None  # unset: 512 KiB, or what the broker's Maximum Packet Size allows
    data: DataConfig = field(default_factory=DataConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    state_dir: str | None = None  # local checkpoint (edge model, server logits); None = no persistence
    backend: str = "torch"
    threads: int = 1
    device: str = "cpu"
    progress: bool = True
    log_json: bool = False
    exit_on_shutdown: bool = True
    # Prometheus /metrics of this agent (edge_agent/metrics.py) on HOST:PORT (None: off, nothing
    # of it imported). Any address but loopback needs basic auth (metrics_password_file, user
    # metrics_username) and TLS (metrics_cert_file, metrics_key_file).
    metrics_address: str | None = None
    metrics_username: str = "edgesplit"
    metrics_password_file: str | None = None
    metrics_cert_file: str | None = None
    metrics_key_file: str | None = None
    # Seeds the agent's private key (edge_agent/activation_guard.py: its own initialisation under
    # edge_init = "per_agent", the noise on its maps); 0: drawn from os.urandom at start. The
    # server never sees it.
    private_seed: int = 0
    # A misbehaving device on purpose, for testing the server's defences (shared_protocol/faults.py:
    # sign_flip, scale, random_labels, nan); "": an honest agent. fault_scale: the factor of
    # sign_flip and scale (unset: the kind's default).
    fault: str = ""
    fault_scale: float | None = None

    def __post_init__(self) -> None:
        check_name("agent id", self.agent_id)
        if self.fault_scale is not None and not self.fault:
            raise ValueError(f"agent.fault_scale = {self.fault_scale!r} without agent.fault: set a fault "
                             "(e.g. fault = \"sign_flip\") or remove fault_scale")
        self.fault_spec()  # an unknown kind or a bad scale is refused here
        if not isinstance(self.private_seed, int) or isinstance(self.private_seed, bool) or self.private_seed < 0:
            raise ValueError(f"private_seed must be an integer >= 0 (0: drawn from os.urandom), got {self.private_seed!r}")
        check_name("run id", self.run_id)
        BrokerAddress.parse(self.broker_url)
        if self.backend not in ("torch", "ort"):
            raise ValueError(f"backend must be 'torch' or 'ort' (onnxruntime-training, no torch), got {self.backend!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self.transport_config()  # chunk size, credentials in the URL
        self.metrics_endpoint()  # a non-loopback address without credentials is refused here

    def fault_spec(self) -> FaultSpec | None:
        """The fault this agent commits on purpose (None: honest)."""
        return FaultSpec(self.fault, self.fault_scale, where="agent.fault") if self.fault else None

    def metrics_endpoint(self) -> MetricsEndpointConfig | None:
        """Where this agent's metrics are served (None: metrics off)."""
        return MetricsEndpointConfig.of("agent", self.metrics_address, self.metrics_username, self.metrics_password_file,
                                        self.metrics_cert_file, self.metrics_key_file)

    def transport_config(self) -> TransportConfig:
        return TransportConfig(
            broker_url=self.broker_url,
            client_id=f"edgesplit-{self.run_id}-{self.agent_id}",
            username=self.username,
            password=self.password,
            ca_file=self.ca_file,
            cert_file=self.cert_file,
            key_file=self.key_file,
            chunk_size_bytes=self.chunk_size_bytes,
            resend_cache_bytes=self.memory.resend_cache_bytes,
        )

    def to_dict(self) -> dict[str, Any]:
        """Resolved config for logs and reports, with secrets masked."""
        out = asdict(self)
        if out.get("password"):
            out["password"] = "***"
        out["broker_url"] = redact_url(self.broker_url)
        return out

    @classmethod
    def table_keys(cls) -> dict[str, tuple[str, ...]]:
        """The keys each table of an agent's config may hold: ``[agent]`` (``password_file``
        for ``password``), ``[data]`` and ``[memory]``."""
        return {
            "agent": tuple(f for f in cls.__dataclass_fields__ if f not in ("data", "memory")) + ("password_file",),
            "data": tuple(DataConfig.__dataclass_fields__),
            "memory": tuple(MemoryConfig.__dataclass_fields__),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any], base_dir: str | Path | None = None) -> "EdgeConfig":
        """From a parsed TOML document (``[agent]``, ``[data]`` and ``[memory]`` tables);
        relative credential paths are taken relative to ``base_dir`` (the config file's
        directory) when given: see :func:`resolve_credential_paths`."""
        keys = cls.table_keys()
        for table in keys:
            unknown = set(raw.get(table, {})) - set(keys[table])
            if unknown:
                raise unknown_keys_error(table, unknown, keys[table])
        agent = resolve_credential_paths(dict(raw.get("agent", {})), base_dir)
        data = DataConfig(**raw.get("data", {}))
        memory = MemoryConfig(**raw.get("memory", {}))
        password_file = agent.pop("password_file", None)
        if password_file:
            agent["password"] = read_secret(password_file)
        return cls(data=data, memory=memory, **agent)
