"""The server's side of secure aggregation (shared_protocol/secagg.py): one round's stages,
the relay of encrypted shares between agents, and the unmasking that leaves only the sum.

A :class:`SecAggRound` takes the agents' secure-aggregation uploads (:meth:`receive`), and
:meth:`due` says what to send now: a stage closes when every agent it waits for has sent
its part (an agent the coordinator drops is no longer waited for) or ``stage_timeout_s``
after it opened (the masked-input stage: after the first masked input came, since it waits
for local training). The server never sees an individual update: what it can rebuild is the
survivors' self masks and the dropped agents' pairwise masks, never both for one agent.

This is the honest-but-curious protocol (Bonawitz et al., Fig. 4, without the signatures and
consistency check that guard against a server sending agents different survivor lists).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared_protocol.errors import SecAggError, SecAggReplayError, SecAggShareError, ShapeMismatchError, UnknownSenderError
from shared_protocol.message_base import Message, encode_message
from shared_protocol.secagg import SecAggParams, combine_seed, dequantise, mask_key_of, pair_seed, pair_sign, prg, self_seed
from shared_protocol.secagg_messages import (
    KEY_BYTES,
    SecAggAdvertise,
    SecAggMaskedInput,
    SecAggRoster,
    SecAggShareKeys,
    SecAggShares,
    SecAggUnmask,
    SecAggUnmaskShares,
)

log = logging.getLogger("cloud_server.secagg")

STAGES = ("advertise", "share", "masked", "unmask", "done", "failed")
_STAGE_OF = {SecAggAdvertise: "advertise", SecAggShareKeys: "share", SecAggMaskedInput: "masked", SecAggUnmaskShares: "unmask"}


@dataclass
class SecureSum:
    """What unmasking gives: the summed weighted update (float64, the model's floats in the
    agreed order), the summed weight, the survivors and the agents recovered after dropping."""

    update_sum: np.ndarray
    weight_sum: float
    survivors: list[str]
    dropped: list[str]
    int_buffers: dict[str, dict[str, int]]  # survivor -> its BatchNorm counters
    num_samples: dict[str, int]  # survivor -> its advertised sample count
    sampled: int = 0  # the agents given the round (fixed before any update): DP-FedAvg's denominator


@dataclass
class SecAggRound:
    run_id: str
    round: int
    params: SecAggParams
    length: int  # entries of a masked vector: the model's floats and the weight
    clock: Callable[[], float] = time.monotonic
    expected: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)
    stage: str = "advertise"
    stage_opened_at: float = 0.0
    adverts: dict[str, SecAggAdvertise] = field(default_factory=dict)
    roster: list[str] = field(default_factory=list)
    shared: dict[str, SecAggShareKeys] = field(default_factory=dict)
    masked: dict[str, SecAggMaskedInput] = field(default_factory=dict)
    first_masked_at: float | None = None
    unmasking: dict[str, SecAggUnmaskShares] = field(default_factory=dict)
    survivors: list[str] = field(default_factory=list)
    result: SecureSum | None = None
    failure: str = ""
    outbox: list[tuple[str, Message]] = field(default_factory=list)
    answers: dict[tuple[str, str], Message] = field(default_factory=dict)  # (agent, request msg_id) -> answer
    stats: dict[str, Any] = field(default_factory=lambda: {"messages_up": 0, "messages_down": 0, "bytes_up": 0,
                                                           "bytes_down": 0, "unmask_s": 0.0, "stage_s": {}})

    def __post_init__(self) -> None:
        self.stage_opened_at = self.clock()

    # -- who takes part --------------------------------------------------------------- #

    def expect(self, agent: str) -> None:
        """``agent`` was given the round (a RoundStart)."""
        self.expected.add(agent)
        self.dropped.discard(agent)

    def drop(self, agent: str) -> None:
        """The coordinator gave up on ``agent`` this round (failed, offline, restarted)."""
        if self.stage == "advertise":
            self.adverts.pop(agent, None)
        self.dropped.add(agent)

    def _waiting_for(self) -> set[str]:
        if self.stage == "advertise":
            group, arrived = self.expected, self.adverts
        elif self.stage == "share":
            group, arrived = set(self.roster), self.shared
        elif self.stage == "masked":
            group, arrived = set(self.shared), self.masked
        elif self.stage == "unmask":
            group, arrived = set(self.survivors), self.unmasking
        else:
            return set()
        return group - set(arrived) - self.dropped

    # -- uploads ------------------------------------------------------------------------ #

    def receive(self, agent: str, msg: Message) -> None:
        """Take one upload; a ProtocolError subclass when it cannot be used (nothing changes)."""
        stage = _STAGE_OF.get(type(msg))
        if stage is None:
            raise SecAggError(f"{msg.TYPE} is not a secure-aggregation upload")
        held = {"advertise": self.adverts, "share": self.shared, "masked": self.masked, "unmask": self.unmasking}[stage]
        if agent in held:
            if held[agent].msg_id == msg.msg_id:  # the agent asked again: the answer may have been lost
                if (agent, msg.msg_id) in self.answers:
                    self._send(agent, self.answers[(agent, msg.msg_id)], cache_for=None)
                return
            raise SecAggReplayError(f"{agent} already sent its {msg.TYPE} for round {self.round} (message {held[agent].msg_id}); "
                                    f"a second one ({msg.msg_id}) is refused")
        if stage != self.stage:
            if stage == "advertise" and self.stage in STAGES[1:]:
                # Too late to join: say so at once rather than let the agent wait out its requests.
                self._send(agent, self._roster_message(f"the roster of round {self.round} closed before {agent} advertised"),
                           cache_for=msg.msg_id)
                return
            raise SecAggError(f"{msg.TYPE} from {agent} for round {self.round} arrived in stage {self.stage!r}")
        group = {"advertise": self.expected, "share": set(self.roster), "masked": set(self.shared),
                 "unmask": set(self.survivors)}[stage]
        if agent not in group or agent in self.dropped:
            raise UnknownSenderError(f"{msg.TYPE} from {agent}, who is not among round {self.round}'s {stage} stage: {sorted(group)}")
        self._check(agent, msg)
        held[agent] = msg
        self.stats["messages_up"] += 1
        self.stats["bytes_up"] += len(encode_message(msg))
        if isinstance(msg, SecAggMaskedInput) and self.first_masked_at is None:
            self.first_masked_at = self.clock()

    def _check(self, agent: str, msg: Message) -> None:
        if isinstance(msg, SecAggShareKeys):
            expected = sorted(set(self.roster) - {agent})
            if sorted(msg.recipients) != expected:
                raise SecAggShareError(f"{agent}'s shares are for {sorted(msg.recipients)}; the roster's others are {expected}")
        elif isinstance(msg, SecAggMaskedInput):
            wire = np.int32 if self.params.ring_bits == 32 else np.int64
            if msg.masked.dtype != wire or msg.masked.shape != (self.length,):
                raise ShapeMismatchError(f"masked input of {agent}: expected {self.length} {np.dtype(wire).name}, "
                                         f"got {msg.masked.shape} {msg.masked.dtype}")
        elif isinstance(msg, SecAggUnmaskShares):
            wanted = {u: "b" for u in self.survivors} | {u: "s" for u in set(self.shared) - set(self.survivors)}
            for owner, kind in zip(msg.owners, msg.kinds):
                if wanted.get(owner) != kind:
                    raise SecAggShareError(f"{agent} sent a {kind!r} share of {owner!r}; this round asks for "
                                           f"{wanted.get(owner, 'nothing')!r} of it")

    # -- the stages ----------------------------------------------------------------------- #

    def due(self) -> list[tuple[str, Message]]:
        """Close the stage if it is complete or timed out; what to send now."""
        if self.stage in ("advertise", "share", "masked", "unmask"):
            opened = self.first_masked_at if self.stage == "masked" else self.stage_opened_at
            timed_out = opened is not None and self.clock() - opened >= self.params.stage_timeout_s
            if not self._waiting_for() or timed_out:
                if timed_out and self._waiting_for():
                    log.warning("round %d: secure aggregation's %s stage closes without %s", self.round, self.stage,
                                ", ".join(sorted(self._waiting_for())))
                getattr(self, f"_close_{self.stage}")()
        out, self.outbox = self.outbox, []
        return out

    def _next(self, stage: str) -> None:
        now = self.clock()
        self.stats["stage_s"][self.stage] = round(now - self.stage_opened_at, 6)
        self.stage, self.stage_opened_at = stage, now

    def _fail(self, reason: str, tell: list[str], message: Callable[[str], Message]) -> None:
        log.error("round %d: secure aggregation abandoned: %s", self.round, reason)
        self.failure = reason
        for agent in tell:
            self._send(agent, message(reason), cache_for=None)
        self._next("failed")

    def _send(self, agent: str, msg: Message, cache_for: str | None) -> None:
        if cache_for is not None:
            self.answers[(agent, cache_for)] = msg
        self.outbox.append((agent, msg))
        self.stats["messages_down"] += 1
        self.stats["bytes_down"] += len(encode_message(msg))

    def _roster_message(self, reason: str = "") -> SecAggRoster:
        rows = [self.adverts[a] for a in self.roster] if not reason else []
        keys = lambda name: np.stack([getattr(m, name) for m in rows]) if rows else np.zeros((0, KEY_BYTES), np.uint8)  # noqa: E731
        return SecAggRoster(run=self.run_id, round=self.round, sender="server", agents=list(self.roster) if not reason else [],
                            threshold=self.params.shares_needed(len(self.roster)) if not reason else 0,
                            weight_scale=max((m.num_samples for m in rows), default=1), reason=reason,
                            c_public=keys("c_public"), s_public=keys("s_public"))

    def _close_advertise(self) -> None:
        self.roster = sorted(a for a in self.adverts if a not in self.dropped)
        if len(self.roster) < 2:
            self._fail(f"{len(self.roster)} agent(s) advertised keys; secure aggregation needs at least 2", list(self.roster),
                       self._roster_message)
            return
        roster = self._roster_message()
        for agent in self.roster:
            self._send(agent, roster, cache_for=self.adverts[agent].msg_id)
        self._next("share")

    def _shares_message(self, agent: str, senders: list[str], reason: str = "") -> SecAggShares:
        rows = [self.shared[s].ciphertexts[self.shared[s].recipients.index(agent)] for s in senders]
        return SecAggShares(run=self.run_id, round=self.round, sender="server", senders=senders, reason=reason,
                            ciphertexts=np.stack(rows) if rows else np.zeros((0, 60), np.uint8))

    def _close_share(self) -> None:
        sharers = sorted(a for a in self.shared if a not in self.dropped)
        self.shared = {a: self.shared[a] for a in sharers}
        needed = self.params.shares_needed(len(self.roster))
        if len(sharers) < needed:
            self._fail(f"{len(sharers)} agent(s) shared keys, {needed} are needed", sharers,
                       lambda reason: SecAggShares(run=self.run_id, round=self.round, sender="server", reason=reason,
                                                   ciphertexts=np.zeros((0, 60), np.uint8)))
            return
        for agent in sharers:
            self._send(agent, self._shares_message(agent, [s for s in sharers if s != agent]), cache_for=self.shared[agent].msg_id)
        self._next("masked")

    def _close_masked(self) -> None:
        self.survivors = sorted(a for a in self.masked if a not in self.dropped)
        lost = sorted(set(self.shared) - set(self.survivors))
        needed = self.params.shares_needed(len(self.roster))
        unmask = lambda reason="": SecAggUnmask(run=self.run_id, round=self.round, sender="server",  # noqa: E731
                                                 survivors=self.survivors if not reason else [], dropped=lost if not reason else [],
                                                 reason=reason)
        if len(self.survivors) < needed:
            self._fail(f"{len(self.survivors)} masked input(s) arrived, {needed} are needed to unmask", self.survivors, unmask)
            return
        for agent in self.survivors:
            self._send(agent, unmask(), cache_for=self.masked[agent].msg_id)
        self._next("unmask")

    def _close_unmask(self) -> None:
        started = time.perf_counter()
        try:
            self.result = self._unmask()
        except SecAggError as exc:
            self.failure = str(exc)
            log.error("round %d: secure aggregation could not unmask: %s", self.round, exc)
            self._next("failed")
            return
        finally:
            self.stats["unmask_s"] = round(time.perf_counter() - started, 6)
        self._next("done")

    def _unmask(self) -> SecureSum:
        needed = self.params.shares_needed(len(self.roster))
        index = {a: k + 1 for k, a in enumerate(self.roster)}
        context = f"{self.run_id}|{self.round}"
        shares: dict[str, list[tuple[int, bytes]]] = {}
        for holder, msg in self.unmasking.items():
            for owner, row in zip(msg.owners, msg.shares):
                shares.setdefault(owner, []).append((index[holder], bytes(row)))
        dtype = self.params.dtype
        total = np.zeros(self.length, dtype=dtype)
        for agent in self.survivors:
            total += self.masked[agent].masked.view(dtype)
        for agent in self.survivors:
            b_seed = combine_seed(shares.get(agent, []), needed)
            total -= prg(self_seed(b_seed, context), self.length, dtype)
        lost = sorted(set(self.shared) - set(self.survivors))
        for agent in lost:
            s_key = mask_key_of(combine_seed(shares.get(agent, []), needed))
            for survivor in self.survivors:
                mask = prg(pair_seed(s_key, self.adverts[survivor].s_public, context), self.length, dtype)
                # The survivor added its pair's mask with its own sign; take it back out.
                if pair_sign(survivor, agent) > 0:
                    total -= mask
                else:
                    total += mask
        values = dequantise(total, self.params)
        weight = float(values[-1])
        if not weight > 0:
            raise SecAggError(f"the unmasked weights sum to {weight}; a share or a masked input was wrong")
        return SecureSum(update_sum=values[:-1], weight_sum=weight, survivors=list(self.survivors), dropped=lost,
                         int_buffers={a: dict(self.masked[a].int_buffers) for a in self.survivors},
                         num_samples={a: self.adverts[a].num_samples for a in self.survivors},
                         sampled=len(self.expected))

    def report(self) -> dict[str, Any]:
        """The round's secure-aggregation figures for the run report."""
        return {"stage": self.stage, "roster": len(self.roster), "survivors": list(self.survivors),
                "recovered_dropped": sorted(set(self.shared) - set(self.survivors)) if self.stage == "done" else [],
                "threshold": self.params.shares_needed(len(self.roster)) if self.roster else None,
                "failure": self.failure or None, **self.stats}


class SecAggRounds:
    """A summing method's secure aggregation across rounds: the open rounds' protocols, and the
    new global state from a finished one. ``names`` are the model's float entries in the order
    both sides flatten them (sorted by name)."""

    def __init__(self, run_id: str, params: SecAggParams, names: list[str], length: int) -> None:
        self.run_id, self.params, self.names, self.length = run_id, params, sorted(names), length + 1
        self.rounds: dict[int, SecAggRound] = {}
        self.agent_costs: dict[int, dict[str, float]] = {}

    def expect(self, round_: int, agent: str) -> None:
        for old in [r for r in self.rounds if r < round_ - 1]:
            del self.rounds[old]  # a round's figures are read when it closes
        rnd = self.rounds.get(round_)
        if rnd is None:
            rnd = self.rounds[round_] = SecAggRound(self.run_id, round_, self.params, self.length)
        rnd.expect(agent)

    def receive(self, agent: str, msg: Message) -> None:
        rnd = self.rounds.get(msg.round)
        if rnd is None:
            raise SecAggError(f"{msg.TYPE} from {agent} for round {msg.round}, which has no secure aggregation open")
        rnd.receive(agent, msg)

    def drop(self, agent: str) -> None:
        for rnd in self.rounds.values():
            if rnd.stage not in ("done", "failed"):
                rnd.drop(agent)

    def due(self) -> list[tuple[str, Message]]:
        return [out for rnd in self.rounds.values() for out in rnd.due()]

    def finish(self, round_: int, global_state: dict[str, np.ndarray],
               mean_of: Callable[[dict[str, np.ndarray], SecureSum], dict[str, np.ndarray]] | None = None,
               ) -> tuple[dict[str, np.ndarray], SecureSum] | None:
        """(the new global state: the global model plus the survivors' weighted mean update, and
        the sum it came from), or None when the round's secure aggregation did not finish. A round
        whose stage is still open (the round's deadline came first) is closed with what arrived.
        ``mean_of`` turns the summed update (by name) into the mean update instead of dividing by
        the summed weight (DP-FedAvg: noise on the sum, a fixed denominator)."""
        rnd = self.rounds.get(round_)
        if rnd is None:
            return None
        for _ in STAGES:
            if rnd.stage in ("done", "failed"):
                break
            rnd.stats.setdefault("closed_at_deadline", rnd.stage)
            getattr(rnd, f"_close_{rnd.stage}")()
        rnd.outbox.clear()
        if rnd.result is None:
            return None
        result = rnd.result
        update_sum: dict[str, np.ndarray] = {}
        offset = 0
        for name in self.names:
            base = global_state[name]
            update_sum[name] = result.update_sum[offset:offset + base.size].reshape(base.shape)
            offset += base.size
        mean = mean_of(update_sum, result) if mean_of is not None else {n: u / result.weight_sum for n, u in update_sum.items()}
        state = dict(global_state)
        for name in self.names:
            state[name] = (global_state[name].astype(np.float64) + mean[name]).astype(global_state[name].dtype)
        weights = [result.num_samples[a] for a in result.survivors]
        for name in {n for buffers in result.int_buffers.values() for n in buffers}:
            values = [result.int_buffers[a].get(name, int(global_state[name])) for a in result.survivors]
            state[name] = np.asarray(np.rint(np.average(values, weights=weights)), dtype=global_state[name].dtype)
        return state, result

    def report(self, round_: int) -> dict[str, Any]:
        rnd = self.rounds.get(round_)
        if rnd is None:
            return {}
        figures = {**rnd.report(), **self.params.to_dict()}
        costs = self.agent_costs.get(round_, {})
        if costs:
            figures["agent_secagg_s_mean"] = round(sum(costs.values()) / len(costs), 6)
            figures["agent_secagg_s_max"] = round(max(costs.values()), 6)
        return {"secagg": figures}
