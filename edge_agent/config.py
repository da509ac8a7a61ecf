"""Agent configuration: frozen dataclasses validated on construction.

TOML and CLI flags are parsed in :mod:`edge_agent.cli` only; everything below
receives typed objects. Method hyperparameters are not here: the server sends
them with every round, so one federation cannot run with mismatched settings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shared_protocol.tomlio import read_secret
from shared_protocol.topics import check_name
from shared_protocol.transport import BrokerAddress, TransportConfig, redact_url


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

    def __post_init__(self) -> None:
        if self.num_agents < 1:
            raise ValueError(f"data.num_agents must be >= 1, got {self.num_agents}")
        if not 0 <= self.agent_index < self.num_agents:
            raise ValueError(f"data.agent_index must be in [0, {self.num_agents}), got {self.agent_index}")
        if self.train_samples < 0 or self.test_samples < 0:
            raise ValueError("data.train_samples and data.test_samples must be >= 0")


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
    state_dir: str | None = None  # local checkpoint (edge model, server logits); None = no persistence
    backend: str = "torch"
    threads: int = 1
    device: str = "cpu"
    progress: bool = True
    log_json: bool = False
    exit_on_shutdown: bool = True

    def __post_init__(self) -> None:
        check_name("agent id", self.agent_id)
        check_name("run id", self.run_id)
        BrokerAddress.parse(self.broker_url)
        if self.backend not in ("torch", "ort"):
            raise ValueError(f"backend must be 'torch' or 'ort' (onnxruntime-training, no torch), got {self.backend!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self.transport_config()  # chunk size, credentials in the URL

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
        )

    def to_dict(self) -> dict[str, Any]:
        """Resolved config for logs and reports, with secrets masked."""
        out = asdict(self)
        if out.get("password"):
            out["password"] = "***"
        out["broker_url"] = redact_url(self.broker_url)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "EdgeConfig":
        """From a parsed TOML document (``[agent]`` and ``[data]`` tables)."""
        agent = dict(raw.get("agent", {}))
        data = DataConfig(**raw.get("data", {}))
        password_file = agent.pop("password_file", None)
        unknown = set(agent) - {f for f in cls.__dataclass_fields__ if f != "data"}
        if unknown:
            raise ValueError(f"unknown [agent] keys: {sorted(unknown)}")
        if password_file:
            agent["password"] = read_secret(password_file)
        return cls(data=data, **agent)
