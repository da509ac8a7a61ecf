"""MQTT topic layout. The protocol version is part of every topic so that an
ACL can confine each agent to its own up/down topics, and a v2 can coexist."""

from __future__ import annotations

import re
from dataclasses import dataclass

TOPIC_ROOT = "edgesplit/v1"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def check_name(kind: str, value: str) -> str:
    """Run and agent ids become topic levels: no wildcards, slashes or spaces."""
    if not isinstance(value, str) or not _NAME.match(value) or value == "all":
        raise ValueError(
            f"{kind} {value!r} is not valid: use 1-64 of [A-Za-z0-9_.-], starting alphanumeric, not 'all'"
        )
    return value


@dataclass(frozen=True)
class Topics:
    run: str

    def __post_init__(self) -> None:
        check_name("run id", self.run)

    @property
    def base(self) -> str:
        return f"{TOPIC_ROOT}/{self.run}"

    def down(self, agent: str) -> str:
        return f"{self.base}/down/{agent}"

    @property
    def down_all(self) -> str:
        return f"{self.base}/down/all"

    def up(self, agent: str) -> str:
        return f"{self.base}/up/{agent}"

    @property
    def up_any(self) -> str:
        return f"{self.base}/up/+"

    def status(self, agent: str) -> str:
        return f"{self.base}/status/{agent}"

    @property
    def status_any(self) -> str:
        return f"{self.base}/status/+"

    @property
    def everything(self) -> str:
        return f"{self.base}/#"

    def agent_of(self, topic: str) -> str | None:
        """The agent id in an up/ or status/ topic of this run, else None."""
        parts = topic.split("/")
        if len(parts) != 5 or "/".join(parts[:3]) != self.base or parts[3] not in ("up", "status", "down"):
            return None
        return parts[4]
