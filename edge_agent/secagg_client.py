"""The agent's side of secure aggregation (shared_protocol/secagg.py): advertise keys and
share seeds before training, upload the masked update after it, then answer the unmasking.

Every exchange goes through the method's context (``EdgeContext.request`` / ``send``), so its
bytes and waits are metered as the round's. A share that does not decrypt, comes from an agent
outside the roster or twice from one is logged, counted and left out; the agent goes on (the
server needs only ``t`` shares of each seed). What would reveal an update is refused: an
unmasking request that names an agent both surviving and dropped, or fewer survivors than
``t``, fails the round without sending a share.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from shared_protocol.errors import SecAggError, SecAggShareError
from shared_protocol.secagg import (
    AgentKeys,
    SecAggParams,
    open_shares,
    pair_seed,
    pair_sign,
    prg,
    public_bytes,
    quantise,
    seal_shares,
    self_seed,
    share_context,
    split_seed,
)
from shared_protocol.secagg_messages import (
    SecAggAdvertise,
    SecAggMaskedInput,
    SecAggRoster,
    SecAggShareKeys,
    SecAggShares,
    SecAggUnmask,
    SecAggUnmaskShares,
)

from .costs import RoundMeter

log = logging.getLogger("edge_agent.secagg")


def wire_view(ring: np.ndarray) -> np.ndarray:
    """The ring elements' bits as the signed type the wire carries."""
    return ring.view(np.int32 if ring.dtype == np.uint32 else np.int64)


class SecAggClient:
    """One round of secure aggregation for one agent."""

    def __init__(self, ctx: Any, params: SecAggParams, round_: int, deadline_at: float) -> None:
        self.ctx, self.params, self.round, self.deadline_at = ctx, params, round_, deadline_at
        self.me: str = ctx.agent_id
        self.context = f"{ctx.run_id}|{round_}"
        self.keys = AgentKeys.generate()
        self.roster: list[str] = []
        self.threshold = 0
        self.weight_scale = 1
        self.s_public: dict[str, np.ndarray] = {}
        self.held: dict[str, tuple[bytes, bytes]] = {}  # agent -> my shares of its (b seed, s seed)
        # The others the server says shared keys: my pairwise masks are with them, whether or not
        # their ciphertext to me opened (their masks with me count on mine to cancel).
        self.sharers: list[str] = []
        self.problems: dict[str, int] = {"bad_shares": 0, "unknown_senders": 0, "replayed_shares": 0}
        self.compute_s = 0.0  # this agent's own secure-aggregation work (not the waits)
        self.clipped = 0

    def _base(self) -> dict[str, Any]:
        return {"run": self.ctx.run_id, "round": self.round, "sender": self.me}

    def _request(self, msg: Any, meter: RoundMeter, answer: type, timeout_s: float, attempts: int = 3) -> Any:
        reply = self.ctx.request(msg, meter, lambda m: isinstance(m, answer) and m.round == self.round, timeout_s,
                                 attempts=attempts)
        if reply.reason:
            raise SecAggError(f"the server abandoned round {self.round}'s secure aggregation: {reply.reason}")
        return reply

    # -- before training: keys and shares ---------------------------------------------- #

    def setup(self, meter: RoundMeter, num_samples: int) -> None:
        started = time.perf_counter()
        advert = SecAggAdvertise(**self._base(), num_samples=num_samples, c_public=public_bytes(self.keys.c_key),
                                 s_public=public_bytes(self.keys.s_key))
        self.compute_s += time.perf_counter() - started
        # The server answers once every participant advertised or the stage's time is up.
        roster: SecAggRoster = self._request(advert, meter, SecAggRoster, self.params.stage_timeout_s * 1.5)
        self.take_roster(roster)
        shares = self._request(self.share_keys(), meter, SecAggShares, self.params.stage_timeout_s * 1.5)
        self.take_shares(shares)

    def take_roster(self, roster: SecAggRoster) -> None:
        if self.me not in roster.agents:
            raise SecAggError(f"round {self.round}'s roster {roster.agents} leaves out this agent ({self.me})")
        self.roster, self.threshold, self.weight_scale = list(roster.agents), roster.threshold, roster.weight_scale
        self.c_public = {a: roster.c_public[k] for k, a in enumerate(roster.agents)}
        self.s_public = {a: roster.s_public[k] for k, a in enumerate(roster.agents)}

    def share_keys(self) -> SecAggShareKeys:
        started = time.perf_counter()
        n = len(self.roster)
        b_shares = split_seed(self.keys.b_seed, self.threshold, n)
        s_shares = split_seed(self.keys.s_seed, self.threshold, n)
        others = [a for a in self.roster if a != self.me]
        rows = []
        for agent in others:
            k = self.roster.index(agent)
            rows.append(seal_shares(self.keys.c_key, self.c_public[agent], b_shares[k], s_shares[k],
                                    share_context(self.ctx.run_id, self.round, self.me, agent)))
        mine = self.roster.index(self.me)
        self.held[self.me] = (b_shares[mine], s_shares[mine])
        self.compute_s += time.perf_counter() - started
        return SecAggShareKeys(**self._base(), recipients=others, ciphertexts=np.stack(rows))

    def take_shares(self, shares: SecAggShares) -> None:
        """Open the shares relayed to me; one that cannot be used is counted and left out."""
        started = time.perf_counter()
        for sender, row in zip(shares.senders, shares.ciphertexts):
            if sender not in self.roster or sender == self.me:
                self.problems["unknown_senders"] += 1
                log.error("round %d: a share from %r, who is not in the roster %s: left out", self.round, sender, self.roster)
                continue
            if sender in self.sharers:
                self.problems["replayed_shares"] += 1
                log.error("round %d: a second share from %s: left out", self.round, sender)
                continue
            self.sharers.append(sender)
            try:
                self.held[sender] = open_shares(self.keys.c_key, self.c_public[sender], row,
                                                share_context(self.ctx.run_id, self.round, sender, self.me))
            except SecAggShareError as exc:
                self.problems["bad_shares"] += 1
                log.error("round %d: the share from %s is unusable (%s): left out", self.round, sender, exc)
        self.compute_s += time.perf_counter() - started

    # -- after training: the masked update and the unmasking ------------------------------- #

    def mask(self, update: np.ndarray, num_samples: int, uniform: bool = False) -> np.ndarray:
        """``update`` (the model's floats minus the global's, flattened, float64) weighted, in
        fixed point, followed by the weight, plus the self mask and the pairwise masks. The weight
        is ``num_samples / weight_scale``, or 1 with ``uniform`` (DP-FedAvg: a public weight, so
        that the agent's share of the sum is its clipped update whatever its data size)."""
        started = time.perf_counter()
        unit = 2.0 ** -self.params.fraction_bits
        weight = 1.0 if uniform else max(unit, round(num_samples / self.weight_scale / unit) * unit)  # exact in fixed point
        ring, self.clipped = quantise(np.append(update * weight, weight), self.params, len(self.roster))
        if self.clipped:
            log.warning("round %d: %d update entries beyond the fixed-point bound were clipped (raise "
                        "secagg_ring_bits or lower secagg_fraction_bits)", self.round, self.clipped)
        dtype = self.params.dtype
        ring = ring + prg(self_seed(self.keys.b_seed, self.context), ring.size, dtype)
        s_key = self.keys.s_key
        for other in self.sharers:
            mask = prg(pair_seed(s_key, self.s_public[other], self.context), ring.size, dtype)
            ring = ring + mask if pair_sign(self.me, other) > 0 else ring - mask
        self.compute_s += time.perf_counter() - started
        return ring

    def upload(self, meter: RoundMeter, masked: np.ndarray, model_version: int, int_buffers: dict[str, int]) -> None:
        msg = SecAggMaskedInput(**self._base(), model_version=model_version, int_buffers=int_buffers, masked=wire_view(masked))
        # The answer waits for the slowest agent's training: as long as the round has left.
        wait_s = max(self.params.stage_timeout_s, self.deadline_at - time.monotonic())
        unmask: SecAggUnmask = self._request(msg, meter, SecAggUnmask, wait_s, attempts=1)
        self.ctx.send(self.unmask_shares(unmask), meter)

    def unmask_shares(self, unmask: SecAggUnmask) -> SecAggUnmaskShares:
        known = set(self.sharers) | {self.me}
        named = set(unmask.survivors) | set(unmask.dropped)
        if self.me not in unmask.survivors or not named <= set(self.roster) or len(unmask.survivors) < self.threshold:
            raise SecAggError(f"round {self.round}'s unmasking names survivors {unmask.survivors} and dropped {unmask.dropped}; "
                              f"this agent ({self.me}, threshold {self.threshold}) answers only a list that holds it, stays "
                              f"within the roster and has at least the threshold of survivors")
        owners, kinds, rows = [], [], []
        for owner, kind in [(a, "b") for a in unmask.survivors] + [(a, "s") for a in unmask.dropped]:
            if owner in known and owner in self.held:
                owners.append(owner)
                kinds.append(kind)
                rows.append(np.frombuffer(self.held[owner][0 if kind == "b" else 1], dtype=np.uint8))
        return SecAggUnmaskShares(**self._base(), owners=owners, kinds=kinds,
                                  shares=np.stack(rows) if rows else np.zeros((0, 16), np.uint8))

    def metrics(self) -> dict[str, Any]:
        """What the round's RoundEnd reports of this agent's secure aggregation."""
        return {"secagg_s": round(self.compute_s, 6), "secagg_clipped": self.clipped,
                **{f"secagg_{k}": v for k, v in self.problems.items()}}
