"""FedGKT's maps go up once: the server holds an agent's accepted maps across rounds, a batch
that reuses them carries logits and sample ids only, and a claim the server cannot serve
(another digest, unknown ids, maps it lost) is never trained on: the maps are asked for in
full. Server pieces directly, then whole federations over the in-memory transport."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cloud_server.methods import ServerContext
from cloud_server.methods.fedgkt import FedGktServer
from edge_agent.fedgkt_edge import maps_digest
from shared_protocol.errors import MapsNotHeldError, ValueRangeError
from shared_protocol.messages import Message, RoundEnd, decode_message, encode_message
from shared_protocol.methods.fedgkt import GktFeatures, GktMapsRequest, GktResendRequest, GktReusedMaps, GktRoundConfig

from fedhelpers import agent_config, in_memory_federation, server_config

D1 = "a" * 64
D2 = "b" * 64


def _ctx() -> ServerContext:
    return ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)


def _full(seq: int, ids: np.ndarray, round_: int = 1, digest: str = D1, salt: int = 0, split: str = "train") -> GktFeatures:
    rng = np.random.default_rng(100 + int(ids[0]))  # the same ids give the same maps and labels
    n = len(ids)
    logits = np.random.default_rng(1000 * round_ + seq + salt).normal(size=(n, 10)).astype(np.float32)
    return GktFeatures(run="u", round=round_, sender="a", split=split, seq=seq, instance="i1", maps_digest=digest,
                       features=np.maximum(rng.normal(size=(n, 16, 8, 8)), 0).astype(np.float32), logits=logits,
                       labels=rng.integers(0, 10, n).astype(np.int64), sample_ids=ids.astype(np.int64))


def _claim(full: GktFeatures, digest: str | None = None, ids: np.ndarray | None = None) -> GktReusedMaps:
    return GktReusedMaps(run="u", round=full.round, sender="a", split=full.split, seq=full.seq, instance=full.instance,
                         maps_digest=digest or full.maps_digest, logits=full.logits,
                         sample_ids=full.sample_ids if ids is None else ids.astype(np.int64))


def _end(batches: list[Any], round_: int) -> RoundEnd:
    n = sum(len(b.sample_ids) for b in batches)
    return RoundEnd(run="u", round=round_, sender="a", num_samples=n, instance="i1",
                    uploads={"train": {"batches": len(batches), "samples": n}})


IDS = [np.arange(0, 6), np.arange(6, 12)]


def _server(**config: Any) -> FedGktServer:
    torch.manual_seed(0)
    return FedGktServer(_ctx(), {"server_batch_size": 4, "lr_schedule": "none", **config})


def _round(server: FedGktServer, round_: int, reuse: bool) -> Any:
    batches = [_full(seq, ids, round_) for seq, ids in enumerate(IDS)]
    sent = [_claim(b) if reuse else b for b in batches]
    for msg in sent:
        server.on_upload("a", msg)
    assert server.missing_uploads("a", _end(sent, round_)) == []
    return server.complete(round_, {"a": _end(sent, round_)}, evaluate=False)


def test_reused_maps_train_exactly_as_the_maps_sent_again() -> None:
    """Round 1 sends maps with a digest; the server then names it in the agent's round config.
    Round 2's claims (logits and ids only) train the server to the same weights and logits as
    the same maps sent in full, without a copy of the held maps."""
    resent, reused = _server(), _server()
    for server in (resent, reused):
        _round(server, 1, reuse=False)
        assert server.round_config(2, "a", False)[0]["held_maps"] == {"train": D1}
    held = reused.held[("a", "train")].rows.staged
    want, got = _round(resent, 2, reuse=False), _round(reused, 2, reuse=True)
    assert reused.held[("a", "train")].rows.staged is held  # trained on the held maps as they are
    assert got.used_agents == ["a"] and got.samples == want.samples == 12
    assert got.server_loss == want.server_loss
    np.testing.assert_array_equal(got.downloads[0][1].logits, want.downloads[0][1].logits)
    for p, q in zip(resent.model.parameters(), reused.model.parameters()):
        assert torch.equal(p, q)
    figures = reused.round_report(2)
    assert figures["maps_reused_batches"] == 2 and figures["maps_reused_samples"] == 12
    assert figures["maps_reused_fp32_bytes"] == 12 * 16 * 8 * 8 * 4
    assert "maps_reused_batches" not in resent.round_report(2)


@pytest.mark.parametrize("bad", ["digest", "ids", "lost"])
def test_a_claim_the_server_cannot_serve_is_refused_and_the_maps_asked_for_in_full(bad: str) -> None:
    """Another digest, sample ids never received, or held maps dropped (as a restart would):
    the claim raises the specific error, is not staged, the round_end gets a maps request for
    exactly that batch, and the full maps sent in answer train the round as usual."""
    server = _server()
    _round(server, 1, reuse=False)
    batches = [_full(seq, ids, 2) for seq, ids in enumerate(IDS)]
    claims = [_claim(b) for b in batches]
    if bad == "digest":
        claims[1] = _claim(batches[1], digest=D2)
    elif bad == "ids":
        claims[1] = _claim(batches[1], ids=np.arange(6, 12) + 1000)
    else:
        server.drop_held_maps("a")
        assert server.round_config(2, "a", False)[0]["held_maps"] == {}
    with pytest.raises(MapsNotHeldError, match="digest" if bad == "digest" else "sample ids" if bad == "ids" else "no train maps"):
        server.reused_rows("a", claims[1])
    for msg in claims:
        server.on_upload("a", msg)  # the receiver carries on
    end = _end(claims, 2)
    (request,) = server.missing_uploads("a", end)
    assert isinstance(request, GktMapsRequest) and request.reason.startswith("maps_not_held")
    assert request.seqs == ([0, 1] if bad == "lost" else [1]) and request.split == "train"
    for seq in request.seqs:
        server.on_upload("a", batches[seq])
    assert server.missing_uploads("a", end) == []
    outcome = server.complete(2, {"a": end}, evaluate=False)
    assert outcome.used_agents == ["a"] and outcome.samples == 12
    assert server.round_report(2)["maps_requested_batches"] == len(request.seqs)


def test_maps_dropped_after_a_claim_arrived_are_never_trained_on() -> None:
    server = _server()
    _round(server, 1, reuse=False)
    claims = [_claim(_full(seq, ids, 2)) for seq, ids in enumerate(IDS)]
    for msg in claims:
        server.on_upload("a", msg)
    server.drop_held_maps()
    outcome = server.complete(2, {"a": _end(claims, 2)}, evaluate=False)
    assert outcome.used_agents == [] and outcome.excluded["a"].startswith("maps_not_held")
    assert server.staging.in_memory_bytes == 0


@pytest.mark.parametrize("config", [{"reuse_maps": False}, {"train_extractor": True}])
def test_nothing_is_held_with_reuse_off_or_a_trained_extractor(config: dict[str, Any]) -> None:
    server = _server(**config)
    _round(server, 1, reuse=False)
    assert server.held == {} and server.staging.in_memory_bytes == 0
    assert server.round_config(2, "a", False)[0]["held_maps"] == {}
    claim = _claim(_full(0, IDS[0], 2))
    with pytest.raises(MapsNotHeldError, match="does not hold maps"):
        server.reused_rows("a", claim)


def test_uploads_without_a_digest_are_not_held() -> None:
    server = _server()
    for seq, ids in enumerate(IDS):
        server.on_upload("a", _full(seq, ids, 1, digest=""))
    server.complete(1, {"a": _end([_full(s, i, 1) for s, i in enumerate(IDS)], 1)}, evaluate=False)
    assert server.held == {} and server.staging.in_memory_bytes == 0


def test_messages_validate_and_old_feature_frames_still_decode() -> None:
    full = _full(0, IDS[0], 1)
    claim = decode_message(encode_message(_claim(full)))
    assert isinstance(claim, GktReusedMaps) and claim.for_evaluation is False and claim.maps_digest == D1
    for broken in ({"maps_digest": ""}, {"maps_digest": "A" * 64}, {"sample_ids": np.array([1, 1, 2, 3, 4, 5])},
                   {"sample_ids": np.zeros(0, np.int64), "logits": np.zeros((0, 10), np.float32)}):
        with pytest.raises(ValueRangeError):
            encode_message(_claim(full).__class__(**{**_claim(full).__dict__, **broken}))
    with pytest.raises(ValueRangeError):
        encode_message(GktFeatures(**{**full.__dict__, "maps_digest": "not-a-digest"}))
    # A frame from an agent that predates the digest: the field is left out, and the default holds.
    old = GktFeatures(**{**full.__dict__, "maps_digest": ""})
    assert decode_message(encode_message(old)).maps_digest == ""
    request = decode_message(encode_message(GktMapsRequest(run="u", round=2, sender="server", split="test", seqs=[0, 3],
                                                           reason="maps_not_held: x")))
    assert isinstance(request, GktMapsRequest) and request.seqs == [0, 3]
    with pytest.raises(ValueRangeError):
        encode_message(GktMapsRequest(run="u", round=2, sender="server", split="train", seqs=[]))
    with pytest.raises(ValueRangeError):
        GktRoundConfig.from_dict({"held_maps": {"train": "nope"}})
    with pytest.raises(ValueRangeError):
        GktRoundConfig.from_dict({"held_maps": {"valid": D1}})
    assert GktRoundConfig.from_dict({"held_maps": {"train": D1}}).held_maps == {"train": D1}


def test_the_digest_covers_the_extractor_its_batchnorm_buffers_and_the_codec() -> None:
    from models import build_model, state_dict_to_arrays

    arrays = state_dict_to_arrays(build_model("resnet8", 10, 1, generator=torch.Generator().manual_seed(0)))
    base = maps_digest(arrays, "fp16-zstd")
    assert len(base) == 64 and base == maps_digest(dict(arrays), "fp16-zstd")
    assert maps_digest(arrays, "u8-zstd") != base
    classifier = next(k for k in arrays if k.startswith("classifier."))
    assert maps_digest({**arrays, classifier: arrays[classifier] + 1}, "fp16-zstd") == base  # the classifier trains
    for name in ("extractor.conv.weight", "extractor.bn.running_mean", "extractor.bn.num_batches_tracked"):
        assert maps_digest({**arrays, name: arrays[name] + 1}, "fp16-zstd") != base, name
    assert maps_digest({k: v for k, v in arrays.items() if not k.startswith("extractor.")}, "fp16-zstd") == ""


# -- whole federations over the in-memory transport ---------------------------------------------- #

def _federation(tmp: Path, method: dict[str, Any] | None = None, rounds: int = 3):  # type: ignore[no-untyped-def]
    cfg = server_config(tmp, run_id=f"reuse-{tmp.name}"[:40], rounds=rounds, method_config=method or {})
    return in_memory_federation(cfg, [agent_config(cfg.run_id, i, 2, train_samples=128, test_samples=64) for i in range(2)])


def _hook_send(agent: Any, rewrite: Any) -> list[Message]:
    """Rewrite every message ``agent`` sends just before it is encoded; the sent ones are listed."""
    honest, sent = agent.send, []

    def send(msg: Message, *args: Any, **kwargs: Any) -> Any:
        msg = rewrite(msg)
        sent.append(msg)
        return honest(msg, *args, **kwargs)

    agent.send = send
    return sent


def test_a_lying_claim_over_the_transport_is_refused_and_the_round_trains_on_the_full_maps(tmp_path: Path) -> None:
    """agent-1 claims round 2's first training batch and first test batch with another digest:
    the server holds no such maps, asks for the training batch in full (the agent re-extracts
    it), leaves that evaluation's local figure out for agent-1, and goes on; round 3 reuses."""
    fed = _federation(tmp_path)
    bad = fed.agents[1]

    def lie(msg: Message) -> Message:
        if isinstance(msg, GktReusedMaps) and msg.round == 2 and msg.seq == 0:
            return GktReusedMaps(**{**msg.__dict__, "maps_digest": D2})
        return msg

    sent = _hook_send(bad, lie)
    report = fed.start().join(300)
    assert report["status"] == "finished"
    rounds = report["rounds"]
    assert all(r["status"] == "ok" and r["completed"] == ["agent-0", "agent-1"] for r in rounds)
    assert all(not r.get("excluded") and r["samples"] == 128 for r in rounds)  # every agent's maps trained on
    full_round2 = [m for m in sent if isinstance(m, GktFeatures) and m.round == 2]
    assert [(m.split, m.seq) for m in full_round2] == [("train", 0)]  # the one batch asked for in full
    assert rounds[1]["method"]["maps_requested_batches"] == 1 and rounds[1]["method"]["test_maps_requested_batches"] == 1
    assert rounds[2]["method"]["maps_reused_batches"] == 2  # each agent's 64 samples in one batch of 64
    assert not any(isinstance(m, GktResendRequest) for m in sent)
    on_disk = json.loads((tmp_path / "run" / "report.json").read_text())
    assert on_disk["totals"]["rejected_by_reason"] == {} or "maps_not_held" not in on_disk["totals"]["rejected_by_reason"]
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "maps_reused_batches" in summary and "maps_reused_fp32_bytes" in summary
