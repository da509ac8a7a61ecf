"""Secure aggregation's steps without a broker: the sum, dropout recovery, and what a bad
share, an unknown sender or a replay does (a clear error; the receiver goes on)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cloud_server.config import ServerConfig
from cloud_server.methods.base import registered_server_methods
from secagghelpers import RUN, Federation, through_wire, weighted_update_mean
from shared_protocol.errors import SecAggError, SecAggReplayError, SecAggShareError, UnknownSenderError, ValueRangeError
from shared_protocol.messages import decode_message, encode_message
from shared_protocol.secagg import SUMMING_METHODS, AgentKeys, SecAggParams, open_shares, public_bytes, seal_shares, share_context
from shared_protocol.secagg_messages import SecAggAdvertise, SecAggShares, SecAggUnmask

AGENTS = ["a0", "a1", "a2", "a3"]
SAMPLES = {"a0": 10, "a1": 30, "a2": 20, "a3": 40}
PARAMS = SecAggParams(stage_timeout_s=5.0)
LENGTH = 200


def _updates(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {a: rng.normal(scale=0.05, size=LENGTH) for a in AGENTS}


def _tolerance(agents: int) -> float:
    return 4 * agents * 2.0 ** -PARAMS.fraction_bits


def _mean(fed: Federation) -> np.ndarray:
    assert fed.server.result is not None, fed.server.failure
    return fed.server.result.update_sum / fed.server.result.weight_sum


@pytest.mark.parametrize("ring_bits", [32, 64])
def test_the_unmasked_sum_is_the_weighted_mean(ring_bits: int) -> None:
    fed = Federation(AGENTS, replace(PARAMS, ring_bits=ring_bits), LENGTH)
    fed.advertise(SAMPLES)
    fed.share()
    fed.take_shares()
    updates = _updates()
    masked = fed.masked_inputs(updates, SAMPLES)
    fed.unmask(AGENTS)
    assert fed.server.stage == "done" and fed.server.result.survivors == AGENTS
    exact = weighted_update_mean(updates, SAMPLES)
    assert np.abs(_mean(fed) - exact).max() < _tolerance(4)
    # Positive control: one masked input alone does not unmask to its update.
    alone = masked["a0"].view(np.int32 if ring_bits == 32 else np.int64).astype(np.float64) / 2 ** PARAMS.fraction_bits
    assert np.abs(alone[:-1] - updates["a0"] * SAMPLES["a0"] / 40).max() > 1.0


def test_an_agent_dropped_after_sharing_is_recovered_and_its_update_left_out() -> None:
    fed = Federation(AGENTS, PARAMS, LENGTH)
    fed.advertise(SAMPLES)
    fed.share()
    fed.take_shares()
    updates = _updates(1)
    fed.masked_inputs({a: updates[a] for a in AGENTS[:3]}, SAMPLES)
    fed.server.drop("a3")
    fed.unmask(AGENTS[:3])
    result = fed.server.result
    assert result is not None and result.dropped == ["a3"] and result.survivors == AGENTS[:3]
    assert np.abs(_mean(fed) - weighted_update_mean({a: updates[a] for a in AGENTS[:3]}, SAMPLES)).max() < _tolerance(3)
    # Each survivor revealed the dropped agent's mask-key share and the survivors' self-mask shares, never both.
    for holder, msg in fed.server.unmasking.items():
        assert dict(zip(msg.owners, msg.kinds)) == {"a0": "b", "a1": "b", "a2": "b", "a3": "s"}


def test_a_stage_closes_at_its_timeout_without_the_missing_agent() -> None:
    now = [0.0]
    fed = Federation(AGENTS, PARAMS, LENGTH)
    fed.server.clock = lambda: now[0]
    fed.server.stage_opened_at = 0.0
    for agent in AGENTS[:3]:
        client = fed.clients[agent]
        fed.server.receive(agent, SecAggAdvertise(run=RUN, round=1, sender=agent, num_samples=SAMPLES[agent],
                                                  c_public=public_bytes(client.keys.c_key), s_public=public_bytes(client.keys.s_key)))
    assert fed.server.due() == [] and fed.server.stage == "advertise"  # still waiting for a3
    now[0] = PARAMS.stage_timeout_s + 1
    sent = fed.server.due()
    assert fed.server.stage == "share" and sorted(a for a, _ in sent) == AGENTS[:3]
    assert sent[0][1].agents == AGENTS[:3]


def test_a_bad_share_is_refused_and_the_receiver_goes_on() -> None:
    fed = Federation(AGENTS, PARAMS, LENGTH)
    fed.advertise(SAMPLES)
    fed.share()
    relayed = fed.answers["a0"]
    assert isinstance(relayed, SecAggShares)
    tampered = relayed.ciphertexts.copy()
    tampered[0, -1] ^= 0x01  # one bit of a1's ciphertext to a0
    fed.answers["a0"] = replace(relayed, ciphertexts=tampered)
    fed.take_shares()
    assert fed.clients["a0"].problems["bad_shares"] == 1
    assert relayed.senders[0] not in fed.clients["a0"].held and len(fed.clients["a0"].held) == 3
    # a0 lacks one share, the others still hold t: the round ends with the right sum.
    updates = _updates(2)
    fed.masked_inputs(updates, SAMPLES)
    fed.unmask(AGENTS)
    assert np.abs(_mean(fed) - weighted_update_mean(updates, SAMPLES)).max() < _tolerance(4)
    # The server refuses an unmasking share the round does not ask for, and keeps the round.
    with pytest.raises(SecAggReplayError):
        fed.server.receive("a1", through_wire(fed.clients["a1"].unmask_shares(fed.answers["a1"])))


def test_a_ciphertext_opens_only_for_its_round_and_pair() -> None:
    alice, bob = AgentKeys.generate(), AgentKeys.generate()
    sealed = seal_shares(alice.c_key, public_bytes(bob.c_key), b"b" * 16, b"s" * 16, share_context(RUN, 1, "alice", "bob"))
    assert open_shares(bob.c_key, public_bytes(alice.c_key), sealed, share_context(RUN, 1, "alice", "bob")) == (b"b" * 16, b"s" * 16)
    for context in (share_context(RUN, 2, "alice", "bob"), share_context(RUN, 1, "carol", "bob"), share_context("other", 1, "alice", "bob")):
        with pytest.raises(SecAggShareError, match="does not authenticate"):
            open_shares(bob.c_key, public_bytes(alice.c_key), sealed, context)


def test_shares_from_an_unknown_or_repeated_sender_are_left_out() -> None:
    fed = Federation(AGENTS, PARAMS, LENGTH)
    fed.advertise(SAMPLES)
    fed.share()
    relayed = fed.answers["a0"]
    rows = np.concatenate([relayed.ciphertexts, relayed.ciphertexts[:1]])
    # The relay names an agent outside the roster: decoding refuses a duplicate, so rename it.
    fed.answers["a0"] = replace(relayed, senders=[*relayed.senders, "mallory"], ciphertexts=rows)
    fed.take_shares()
    client = fed.clients["a0"]
    assert client.problems["unknown_senders"] == 1 and client.problems["bad_shares"] == 0
    assert sorted(client.sharers) == ["a1", "a2", "a3"]
    client.take_shares(replace(relayed, senders=relayed.senders[:1], ciphertexts=relayed.ciphertexts[:1]))
    assert client.problems["replayed_shares"] == 1 and sorted(client.sharers) == ["a1", "a2", "a3"]


def test_the_server_refuses_unknown_senders_and_replays_and_keeps_the_round() -> None:
    fed = Federation(AGENTS[:3], PARAMS, LENGTH)
    stranger = AgentKeys.generate()
    advert = SecAggAdvertise(run=RUN, round=1, sender="mallory", num_samples=5, c_public=public_bytes(stranger.c_key),
                             s_public=public_bytes(stranger.s_key))
    with pytest.raises(UnknownSenderError, match="mallory"):
        fed.server.receive("mallory", advert)
    samples = {a: SAMPLES[a] for a in AGENTS[:3]}
    fed.advertise(samples)
    shares = fed.clients["a0"].share_keys()
    fed.server.receive("a0", through_wire(shares))
    fed.server.receive("a0", shares)  # the same message again (a lost answer): accepted, answered when due
    with pytest.raises(SecAggReplayError, match="already sent"):
        fed.server.receive("a0", fed.clients["a0"].share_keys())  # a different one: refused
    # A late advertisement is answered with the reason at once, not left to time out.
    fed.server.receive("a1", through_wire(fed.clients["a1"].share_keys()))
    fed.server.receive("a2", through_wire(fed.clients["a2"].share_keys()))
    sent = fed.deliver()
    assert fed.server.stage == "masked" and sorted(a for a, _ in sent) == AGENTS[:3]
    fed.server.expect("late")
    fed.server.receive("late", replace(advert, sender="late"))
    (who, answer), = fed.deliver()
    assert who == "late" and "closed" in answer.reason


def test_an_unmasking_request_that_would_reveal_an_update_is_refused() -> None:
    fed = Federation(AGENTS, PARAMS, LENGTH)
    fed.advertise(SAMPLES)
    fed.share()
    fed.take_shares()
    client = fed.clients["a0"]
    with pytest.raises(SecAggError, match="threshold"):
        client.unmask_shares(SecAggUnmask(run=RUN, round=1, sender="server", survivors=["a0", "a1"], dropped=["a2", "a3"]))
    with pytest.raises(SecAggError):
        client.unmask_shares(SecAggUnmask(run=RUN, round=1, sender="server", survivors=["a1", "a2", "a3"], dropped=["a0"]))
    # Both kinds of one agent's shares in one request cannot even be decoded.
    both = SecAggUnmask(run=RUN, round=1, sender="server", survivors=["a0", "a1", "a2"], dropped=["a2"])
    with pytest.raises(ValueRangeError, match="both surviving and dropped"):
        decode_message(encode_message(both))


def test_config_refuses_what_needs_individual_updates() -> None:
    base = ServerConfig(method="fedavg", secure_aggregation=True)
    assert base.secagg_params() == SecAggParams()
    for key, value in (("aggregation", "median"), ("clip_update_norm", 1.0), ("validation_samples", 100),
                       ("plausible_min_cosine", 0.0)):
        with pytest.raises(ValueError, match=f"secure_aggregation = true conflicts with server.{key}"):
            replace(base, **{key: value})
    with pytest.raises(ValueError, match="'fedkd'"):
        replace(base, method="fedkd")
    with pytest.raises(ValueError, match="secagg_ring_bits"):
        replace(base, secagg_ring_bits=16)
    assert ServerConfig(method="fedkd").secagg_params() is None  # off by default


def test_the_summing_methods_are_the_ones_that_declare_it() -> None:
    from cloud_server.methods import available_methods, get_server_method

    for name in available_methods():
        get_server_method(name)
    declared = sorted(name for name, cls in registered_server_methods().items() if cls.sums_updates)
    # FedBE inherits FedAvg's server and does not sum (it samples models around the clients'):
    # it must say so, and the list the config reads must match the classes.
    assert declared == sorted(SUMMING_METHODS)


def test_every_summing_method_takes_the_secure_uploads() -> None:
    from cloud_server.methods import get_server_method
    from shared_protocol.secagg_messages import SECAGG_UPLOADS

    for name in SUMMING_METHODS:
        assert set(SECAGG_UPLOADS) <= set(get_server_method(name).upload_types), name


@pytest.mark.parametrize("method", ["fedgkd", "feddistill"])
def test_the_fedavg_family_aggregates_securely_in_memory(tmp_path, method: str) -> None:  # type: ignore[no-untyped-def]
    from fedhelpers import agent_config, in_memory_federation, method_server_config

    cfg = replace(method_server_config(tmp_path, method, {"model": "resnet8", "batch_size": 32}, run_id="sa-fam", agents=3,
                                       rounds=1, eval_samples=40), secure_aggregation=True, secagg_stage_timeout_s=20.0)
    report = in_memory_federation(cfg, [agent_config(cfg.run_id, i, 3, train_samples=96, test_samples=16) for i in range(3)]).start().join()
    record = report["rounds"][0]
    assert record["status"] == "ok" and record["method"]["secagg"]["stage"] == "done"
    assert record["method"]["secagg"]["survivors"] == ["agent-0", "agent-1", "agent-2"]
