"""The server's registry of agents: who joined and what it said about itself, whether it
is online, which round it was given, what it last said it was doing, and when it is
dropped for misbehaving. The registry decides nothing about rounds; the round scheduler
asks it who can take part, and the coordinator tells it what each message said."""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from shared_protocol.mqtt.chunking import SenderLimits
from shared_protocol.errors import UnknownSenderError
from shared_protocol.frame import FrameLimits
from shared_protocol.messages import Hello, Status
from shared_protocol.topics import Topics
from shared_protocol.transport import Transport

from .config import ServerConfig
from .methods import ServerMethod, StreamedUploads
from .records import AgentInfo

log = logging.getLogger("cloud_server")


class RunAborted(RuntimeError):
    """The run cannot go on (too few agents, too many failed rounds)."""


@dataclass
class AgentState:
    agent_id: str
    hello: Hello
    online: bool = True
    rejections: int = 0
    dropped: bool = False
    round: int = 0  # round currently assigned (0: none)
    assigned_at: float = 0.0
    offline_since: float | None = None
    instance: str = ""
    status: str = ""  # its last status message ("training", "idle", ...)
    status_at: float = 0.0
    last_heard_at: float = 0.0  # any accepted message from it
    nudged_at: float = 0.0  # last time the server asked it to announce itself again
    # (instance, connection) of the hello the agent's current round_start answered: a later hello
    # with the same pair is the same session repeating itself, which still holds that round_start.
    round_session: tuple[str, int] | None = None

    def same_session(self, hello: Hello) -> bool:
        """``hello`` comes from the process and broker connection this agent's round was started on."""
        return bool(hello.instance) and hello.connection > 0 and self.round_session == (hello.instance, hello.connection)

    @property
    def active(self) -> bool:
        return self.online and not self.dropped


class AgentRegistry:
    STATUS_LIMITS = SenderLimits(64 * 1024, 256 * 1024, 4)  # status frames are a few hundred bytes
    REJECTIONS_LOG_EVERY_S = 60.0  # further rejections from one sender are summarised this often

    def __init__(self, config: ServerConfig, method: ServerMethod, transport: Transport, limits: FrameLimits,
                 count_rejection: Callable[[str], None]) -> None:
        self.config = config
        self.method = method
        self.transport = transport
        self.limits = limits
        self.count_rejection = count_rejection  # the run's record counts rejected messages by reason
        self.topics = Topics(config.run_id)
        self.agents: dict[str, AgentState] = {}
        # The run's data contract: one input as the model sees it (channels, height, width).
        # Channels are what the server's models are built for; height and width come from
        # [server] image_size, or the first agent that tells them fixes them.
        known = config.known_image_size
        self.input_hw: tuple[int, int] | None = known[0] if known else None
        self.input_hw_source = known[1] if known else ""
        # Agents refused at join, in order: what the report lists (agent, code, reason).
        self.refused: list[dict[str, str]] = []
        self._rejections_unlogged: dict[str, Counter[str]] = {}  # per sender, since the last summary
        self._rejections_logged_at = time.monotonic()

    # -- joining ------------------------------------------------------------------ #

    def refusal(self, agent: str, hello: Hello) -> tuple[str, str] | None:
        """Why ``agent`` may not join, as (code, reason); None: it may."""
        if self.config.allow_list and agent not in self.config.allow_list:
            self.count_rejection(UnknownSenderError.code)
            log.warning("refusing agent %s: not in the allow-list", agent)
            return self._refuse(agent, "not_allowed", "agent id not in the server's allow-list")
        if self.method.name not in hello.methods:
            return self._refuse(agent, "method", f"agent does not implement {self.method.name}")
        mismatch = self.data_mismatch(agent, hello)
        if mismatch is not None:
            return self._refuse(agent, "data_mismatch", mismatch)
        return None

    def _refuse(self, agent: str, code: str, reason: str) -> tuple[str, str]:
        entry = {"agent": agent, "code": code, "reason": reason}
        if entry not in self.refused:  # an agent that says hello again is listed once
            self.refused.append(entry)
            if code == "data_mismatch":
                log.error("refusing agent %s: %s", agent, reason)
        return code, reason

    def contract_state(self) -> dict[str, Any]:
        """What the checkpoint keeps of the data contract: the image size once fixed, and by what."""
        return {} if self.input_hw is None else {"input_hw": list(self.input_hw), "input_hw_source": self.input_hw_source}

    def load_contract_state(self, state: dict[str, Any]) -> None:
        """A resumed run keeps the image size its first agent fixed (a size from the config is
        the config's: it was checked against the agents then)."""
        if self.input_hw is None and state.get("input_hw"):
            height, width = (int(d) for d in state["input_hw"])
            self.input_hw = (height, width)
            self.input_hw_source = str(state.get("input_hw_source") or "the checkpoint")

    def run_input_shape(self) -> tuple[int, int, int] | None:
        """The run's (channels, height, width), once the height and width are known."""
        return None if self.input_hw is None else (self.config.resolved_in_channels, *self.input_hw)

    def data_mismatch(self, agent: str, hello: Hello) -> str | None:
        """How the agent's data breaks the run's contract, naming both sides and the setting
        to change; None when it fits (or the agent does not say: an older agent)."""
        run_classes = self.config.num_classes
        if hello.num_classes and hello.num_classes != run_classes:
            return (f"this agent's data has {hello.num_classes} classes, the run has {run_classes} ([server] num_classes): "
                    f"every device needs the same {run_classes} class folders (an empty folder for a class it has no images of), "
                    f"or set [server] num_classes = {hello.num_classes} on the server if the run really has {hello.num_classes} classes")
        if not hello.input_shape:
            return None
        channels, height, width = (int(d) for d in hello.input_shape)
        run_channels = self.config.resolved_in_channels
        shown = f"(channels, height, width) = ({channels}, {height}, {width})"
        if channels != run_channels:
            run = self.run_input_shape()
            run_shown = f"({run_channels}, {run[1]}, {run[2]})" if run else f"({run_channels}, *, *)"
            return (f"this agent's images are {shown}, the run's are {run_shown} ({run_channels} channels from "
                    f"{self.config.in_channels_source}): convert this device's images to {run_channels} channel(s) "
                    f"({'RGB' if run_channels == 3 else 'grayscale'}), or set [server] in_channels = {channels} on the server")
        if self.input_hw is None:
            self.input_hw = (height, width)
            self.input_hw_source = f"agent {agent}, the first to join"
            log.info("input images of this run: (channels, height, width) = (%d, %d, %d), fixed by agent %s (the first to "
                     "join; set [server] image_size = [%d, %d] to fix it in the config); agents with other sizes are refused",
                     run_channels, height, width, agent, height, width)
            return None
        if (height, width) != self.input_hw:
            h, w = self.input_hw
            return (f"this agent's images are {shown}, the run's are ({run_channels}, {h}, {w}) (from {self.input_hw_source}): "
                    f"resize this device's images to {w}x{h} (width x height; 28x28 is padded to 32x32), or, if "
                    f"{width}x{height} is right for the whole run, set [server] image_size = [{height}, {width}] on the server "
                    f"and resize the other devices' images")
        return None

    def join(self, agent: str, hello: Hello) -> AgentState:
        """Register ``agent`` or take its new hello (a restarted agent says hello again); a
        dropped agent stays dropped."""
        state = self.agents.get(agent)
        if state is None:
            state = self.agents[agent] = AgentState(agent, hello, last_heard_at=time.monotonic())
            log.info("agent %s joined: %s, %d cores, %d samples", agent, hello.cpu_model, hello.cores, hello.num_samples)
        else:
            state.hello, state.online, state.offline_since = hello, True, None
        if not state.dropped:
            self.expect_from(agent)
        return state

    def expect_from(self, agent: str) -> None:
        """Tell the transport what this agent may send: its largest upload, as the method
        knows it now, bounds what a transfer on its topic may declare."""
        largest = self.method.max_upload_bytes(agent) if isinstance(self.method, StreamedUploads) else None
        if largest is None:  # the method cannot say: the largest frame the server decodes
            largest = self.limits.max_body_bytes + self.limits.max_header_bytes + 64
            limits = SenderLimits(largest, largest, 16)
        else:
            largest = max(largest, 1024 * 1024)  # round_end, errors and requests are small
            # An agent streams its uploads one after another: two transfers open at once, plus resends.
            limits = SenderLimits(largest, 2 * largest + 1024 * 1024, 8)
        self.transport.expect_sender(self.topics.up(agent), limits)
        self.transport.expect_sender(self.topics.status(agent), self.STATUS_LIMITS)

    def refused_devices(self) -> list[str]:
        """The run's devices refused at join (their data or their methods do not fit) that
        have not joined since: none of them is still to come. An agent id outside the
        allow-list is not one of the run's devices and counts for nothing."""
        active = set(self.active())
        return sorted({r["agent"] for r in self.refused if r["code"] != "not_allowed" and r["agent"] not in active})

    def wait_for_agents(self, pump: Callable[[float], None]) -> None:
        """Before the first round: pump until every expected agent has joined or been refused
        (one refused at join does not hold the run up) or the registration timeout; fewer than
        ``min_agents`` joined then ends the run."""
        deadline = time.monotonic() + self.config.registration_timeout_s
        last_count = -1
        while time.monotonic() < deadline and len(self.active()) + len(self.refused_devices()) < self.config.expected_agents:
            count = len(self.active())
            if count != last_count:
                log.info("waiting for agents: %d of %d joined", count, self.config.expected_agents)
                last_count = count
            pump(min(1.0, deadline - time.monotonic()))
        joined, refused = len(self.active()), self.refused_devices()
        if joined < self.config.min_agents:
            raise RunAborted(
                f"only {joined} agents joined within {self.config.registration_timeout_s}s; need at least {self.config.min_agents}"
                + (f" ({len(refused)} refused at join: {', '.join(refused)}; see the server's log)" if refused else "")
            )
        if joined < self.config.expected_agents:
            log.warning("starting with %d of %d expected agents%s", joined, self.config.expected_agents,
                        f" ({len(refused)} refused at join: {', '.join(refused)})" if refused else "")

    # -- liveness ---------------------------------------------------------------- #

    def on_status(self, state: AgentState, msg: Status) -> None:
        state.status, state.status_at = msg.state, time.monotonic()
        was_online, state.online = state.online, msg.state != "offline"
        if was_online and not state.online:
            log.warning("agent %s went offline", state.agent_id)
            state.offline_since = time.monotonic()
        elif state.online:
            state.offline_since = None

    def infos(self) -> dict[str, AgentInfo]:
        """Every agent that joined, as the report's ``agents`` describes it."""
        return {a.agent_id: AgentInfo.from_hello(a.hello) for a in sorted(self.agents.values(), key=lambda a: a.agent_id)}

    def active(self) -> list[str]:
        return sorted(a for a, s in self.agents.items() if s.active)

    def sample(self, round_: int, agents: list[str]) -> list[str]:
        """Client sampling: ``max(min_agents, ceil(C * K))`` of the ``K`` online agents,
        drawn without replacement by a generator seeded with (run seed, round), so a
        resumed run draws the same agents for the same round."""
        fraction = self.config.client_fraction
        if fraction >= 1.0 or not agents:
            return agents
        count = min(len(agents), max(self.config.min_agents, math.ceil(fraction * len(agents))))
        rng = random.Random(f"{self.config.seed}/{round_}")
        return sorted(rng.sample(agents, count))

    def assign(self, agent: str, round_: int) -> None:
        state = self.agents[agent]
        state.round, state.assigned_at = round_, time.monotonic()

    def absent(self) -> list[str]:
        """Agents with a round that have been offline for longer than the grace period (a
        quick restart, e.g. by systemd, rejoins within it and redoes its round instead)."""
        now = time.monotonic()
        return [a for a, s in self.agents.items()
                if s.round and s.offline_since is not None and now - s.offline_since >= self.config.offline_grace_s]

    def overdue(self, deadline_s: float) -> list[str]:
        """Agents whose round was given to them more than ``deadline_s`` ago."""
        now = time.monotonic()
        return [a for a, s in self.agents.items() if s.round and now - s.assigned_at > deadline_s]

    def to_nudge(self, agent: str, quiet_for_s: float) -> bool:
        """Whether ``agent`` said it finished its round (idle) yet has been quiet for
        ``quiet_for_s`` with no upload arriving: its round_end was lost or refused on the way,
        and it is to be asked to announce itself again (its hello restarts its round)."""
        state, now = self.agents[agent], time.monotonic()
        finished = state.online and state.status == "idle" and state.status_at > state.assigned_at
        quiet = min(now - state.status_at, now - state.last_heard_at, now - state.nudged_at)
        if finished and quiet >= quiet_for_s and not self.transport.inbound_progress(self.topics.up(agent))[0]:
            state.nudged_at = now
            return True
        return False

    def why_waiting(self, agent: str, resend_requests: int) -> str:
        """What the server knows about a participant it still waits for."""
        now = time.monotonic()
        state = self.agents[agent]
        if state.dropped:
            return "dropped"
        parts = []
        if not state.online:
            since = now - (state.offline_since or now)
            parts.append(f"offline for {since:.0f} s (misses the round after {self.config.offline_grace_s:.0f} s)")
        elif state.status and state.status_at >= state.assigned_at:
            parts.append(f"said '{state.status}' {now - state.status_at:.0f} s ago")
        else:
            parts.append("no status since its round started")
        parts.append(f"last message {now - state.last_heard_at:.0f} s ago")
        transfers, held = self.transport.inbound_progress(self.topics.up(agent))
        if transfers:
            parts.append(f"{transfers} upload(s) arriving, {held / 1e6:.1f} MB so far")
        if resend_requests:
            parts.append(f"asked {resend_requests} time(s) to resend uploads that never arrived")
        if state.nudged_at > state.assigned_at:
            parts.append(f"asked {now - state.nudged_at:.0f} s ago to announce itself again (its round_end never came)")
        return ", ".join(parts)

    # -- rejections and dropping ---------------------------------------------------- #

    def reject(self, agent: str | None, reason: str, detail: str, names_sender: bool = True) -> bool:
        """Count a rejected message by reason; True when this drops ``agent`` (too many
        rejections). ``names_sender`` is False for a blob that did not decode: it names no
        sender, and on a broker without ACLs anyone may publish on an agent's topic, so it
        does not count toward dropping the agent (a message that decoded does)."""
        self.count_rejection(reason)
        sender = agent or "?"
        if sender not in self._rejections_unlogged and len(self._rejections_unlogged) >= 256:
            sender = "other senders"  # a flood from ever new topic names is summarised, not logged per name
        unlogged = self._rejections_unlogged.get(sender)
        if unlogged is None:
            self._rejections_unlogged[sender] = Counter()
            log.warning("rejected message from %s (%s): %s; further rejections from %s are summarised once a minute",
                        sender, reason, detail, sender)
        else:
            unlogged[reason] += 1
        self.log_rejections()
        state = self.agents.get(agent or "")
        if state is None or not names_sender:
            return False
        state.rejections += 1
        if state.rejections < self.config.max_rejections_per_agent or state.dropped:
            return False
        state.dropped = True
        log.error("dropping agent %s after %d rejected messages; what it sends from now on is ignored", agent, state.rejections)
        self.transport.block_sender(self.topics.up(agent or ""), "dropped by the server")
        return True

    def log_rejections(self) -> None:
        """Summarise the rejections not logged yet, at most once per ``REJECTIONS_LOG_EVERY_S``."""
        if time.monotonic() - self._rejections_logged_at < self.REJECTIONS_LOG_EVERY_S:
            return
        for sender, counts in self._rejections_unlogged.items():
            if counts:
                log.warning("rejected %d more messages from %s in the last %.0f s (%s)", sum(counts.values()), sender,
                            time.monotonic() - self._rejections_logged_at,
                            ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
                counts.clear()
        self._rejections_logged_at = time.monotonic()
