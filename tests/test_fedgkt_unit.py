"""FedGKT pieces: KD loss, sample-id keyed teacher logits, the server step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cloud_server.methods import ServerContext
from cloud_server.methods.fedgkt import FedGktConfig, FedGktServer
from edge_agent.teacher import TeacherLogits
from fldata import make_synthetic
from fldata.torch_data import make_loader
from models.losses import kd_loss
from shared_protocol.errors import ShapeMismatchError, ValueRangeError
from shared_protocol.messages import RoundEnd, decode_message, encode_message
from shared_protocol.methods.fedgkt import GktFeatures, GktRoundConfig, GktServerLogits


def test_kd_loss_matches_hand_computation() -> None:
    student = torch.tensor([[1.0, 0.0, -1.0]])
    teacher = torch.tensor([[0.0, 2.0, 0.0]])
    t = 2.0
    p_t = np.exp(np.array([0.0, 1.0, 0.0]))
    p_t /= p_t.sum()
    p_s = np.exp(np.array([0.5, 0.0, -0.5]))
    p_s /= p_s.sum()
    expected = t * t * float(np.sum(p_t * (np.log(p_t) - np.log(p_s))))
    assert kd_loss(student, teacher, t).item() == pytest.approx(expected, rel=1e-6)
    assert kd_loss(teacher, teacher, t).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError):
        kd_loss(student, teacher, 0.0)


def test_teacher_logits_follow_sample_ids_through_a_shuffled_loader() -> None:
    """The teacher row used for an image is the row computed for that very image."""
    ds = make_synthetic(100, num_classes=10, in_channels=1, seed=3)

    def server_logits_of(images: np.ndarray) -> np.ndarray:  # any per-image function
        flat = images.reshape(len(images), -1).astype(np.float32)
        return np.stack([flat[:, i * 7 : i * 7 + 7].mean(1) for i in range(10)], 1)

    teacher = TeacherLogits(10)
    # Logits arrive in an order unrelated to the dataset (as batches from the server would).
    perm = np.random.default_rng(0).permutation(len(ds))
    teacher.update(ds.sample_ids[perm], server_logits_of(ds.images[perm]))
    index_of = {int(i): k for k, i in enumerate(ds.sample_ids)}
    seen = 0
    for _images, _labels, ids in make_loader(ds, 16, shuffle=True, seed=7):
        rows, found = teacher.lookup(ids.numpy())
        assert found.all()
        positions = [index_of[int(i)] for i in ids]
        np.testing.assert_array_equal(rows, server_logits_of(ds.images[positions]))
        seen += len(ids)
    assert seen == 100
    rows, found = teacher.lookup(np.array([10_000_000_5, int(ds.sample_ids[0])]))
    assert found.tolist() == [False, True]
    # Updating some ids replaces exactly those rows.
    teacher.update(ds.sample_ids[:3], np.zeros((3, 10), np.float32))
    np.testing.assert_array_equal(teacher.lookup(ds.sample_ids[:3])[0], 0)
    assert len(teacher) == 100


def _features(agent_seed: int, n: int, ids: np.ndarray, round_: int = 1, instance: str = "i1", seq: int = 0) -> GktFeatures:
    rng = np.random.default_rng(agent_seed)
    return GktFeatures(
        run="u", round=round_, sender="a", split="train", seq=seq, instance=instance,
        features=np.maximum(rng.normal(size=(n, 16, 32, 32)), 0).astype(np.float32),
        logits=rng.normal(size=(n, 10)).astype(np.float32),
        labels=rng.integers(0, 10, n).astype(np.int64),
        sample_ids=ids.astype(np.int64),
    )


def _end(batches: list[GktFeatures], instance: str = "i1", round_: int = 1) -> RoundEnd:
    return RoundEnd(run="u", round=round_, sender="a", num_samples=sum(len(b.labels) for b in batches), instance=instance,
                    uploads={"train": {"batches": len(batches), "samples": sum(len(b.labels) for b in batches)}})


def test_server_logits_are_keyed_by_sample_id() -> None:
    """Algorithm 1 line 12: z_s[id] = f_s(H_id). Batch size 1 and a negligible lr make the
    last-epoch logits reproducible by a separate forward pass of each sample."""
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)
    server = FedGktServer(ctx, {"server_batch_size": 1, "server_lr": 1e-12, "server_optimizer": "sgd", "lr_schedule": "none"})
    ids = np.array([50, 7, 31, 12], np.int64)
    upload = _features(1, 4, ids)
    server.on_upload("a", upload)
    outcome = server.complete(1, {"a": _end([upload])}, evaluate=False)
    (agent, msg), = outcome.downloads
    assert agent == "a" and isinstance(msg, GktServerLogits)
    server.model.train()
    with torch.no_grad():
        for i, sid in enumerate(msg.sample_ids):
            k = int(np.where(ids == sid)[0][0])
            expected = server.model(torch.from_numpy(upload.features[k : k + 1].astype(np.float16).astype(np.float32)))
            np.testing.assert_allclose(msg.logits[i], expected[0].numpy(), rtol=1e-4, atol=1e-4)


def test_server_excludes_incomplete_or_foreign_uploads() -> None:
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)
    server = FedGktServer(ctx, {"server_batch_size": 8})
    a = _features(1, 8, np.arange(8), seq=0)
    b = _features(2, 8, np.arange(8, 16), seq=1)
    server.on_upload("a", a)
    # The agent says it sent two batches; only one arrived.
    outcome = server.complete(1, {"a": _end([a, b])}, evaluate=False)
    assert "a" in outcome.excluded and outcome.downloads == [] and outcome.used_agents == []
    # A restarted process (new instance) voids what the old one staged.
    server.on_upload("a", a)
    server.on_upload("a", _features(3, 8, np.arange(8), instance="i2"))
    outcome = server.complete(1, {"a": _end([a], instance="i2")}, evaluate=False)
    assert outcome.used_agents == ["a"] and outcome.samples == 8


def test_server_rejects_bad_uploads_without_state_change() -> None:
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)
    server = FedGktServer(ctx, {})
    bad_labels = _features(1, 4, np.arange(4))
    bad_labels.labels[0] = 10
    with pytest.raises(ValueRangeError):
        server.on_upload("a", bad_labels)
    wrong_channels = _features(1, 4, np.arange(4))
    wrong_channels.features = wrong_channels.features[:, :8]
    with pytest.raises(ShapeMismatchError):
        server.on_upload("a", wrong_channels)
    assert server.staged == {}


def test_features_message_round_trip_and_validation() -> None:
    msg = _features(1, 5, np.arange(5))
    back = decode_message(encode_message(msg))
    assert isinstance(back, GktFeatures)
    np.testing.assert_allclose(back.features, msg.features, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(back.sample_ids, msg.sample_ids)
    dup = _features(1, 3, np.array([1, 1, 2]))
    with pytest.raises(ValueRangeError):
        encode_message(dup)
    short = _features(1, 3, np.arange(3))
    short.labels = short.labels[:2]
    with pytest.raises(ShapeMismatchError):
        encode_message(short)


def test_configs_validate() -> None:
    with pytest.raises(ValueError):
        FedGktConfig(mode="sometimes")
    with pytest.raises(ValueError):
        FedGktConfig(kd="maybe")
    with pytest.raises(ValueRangeError):
        GktRoundConfig.from_dict({"edge_epochs": 1, "bogus": 2})
    assert FedGktConfig(kd="none").round_config().edge_kd is False
    assert math.isclose(FedGktConfig().round_config().temperature, 3.0)


def test_lost_batches_are_requested_again_and_replaced_by_seq() -> None:
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)
    server = FedGktServer(ctx, {"server_batch_size": 8})
    a = _features(1, 8, np.arange(8), seq=0)
    b = _features(2, 8, np.arange(8, 16), seq=1)
    end = _end([a, b])
    server.on_upload("a", a)
    (request,) = server.missing_uploads("a", end)
    assert request.split == "train" and request.seqs == [1]
    server.on_upload("a", b)
    server.on_upload("a", b)  # a duplicate resend replaces, never double counts
    assert server.missing_uploads("a", end) == []
    outcome = server.complete(1, {"a": end}, evaluate=False)
    assert outcome.used_agents == ["a"] and outcome.samples == 16
    # Uploads of another process are not completed by asking: they are void.
    server.on_upload("a", _features(3, 8, np.arange(8), instance="i2"))
    assert server.missing_uploads("a", _end([a, b], instance="i1")) == []


def test_the_lr_schedule_steps_once_per_round_with_the_rounds_loss_also_in_async_mode(monkeypatch) -> None:
    """Async calls complete() once per arrival, each on one agent's maps. The plateau schedule
    (patience 2) steps once per closed round with the round's sample-weighted loss: two agents
    whose losses differ (1.0 and 0.1, the same every round) give a flat round loss (0.55), so
    three rounds halve nothing; stepped per arrival, the easy agent's 0.1 would count the other
    agent's arrivals as bad epochs and halve the rate within three rounds."""
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)
    server = FedGktServer(ctx, {"mode": "async", "lr_schedule": "plateau", "server_lr": 0.001})
    loss_of = {"a": 1.0, "b": 0.1}
    trained: list[str] = []

    def fake_train(data, round_, fresh=None):
        (agent,) = data if fresh is None else fresh  # async: one agent's new maps per call (others replayed)
        trained.append(agent)
        return {}, loss_of[agent]

    monkeypatch.setattr(server, "_train", fake_train)
    for round_ in (1, 2, 3):
        for seed, agent in enumerate(("a", "b")):
            up = _features(seed, 4, np.arange(4) + 10 * seed, round_=round_)
            server.on_upload(agent, up)
            server.complete(round_, {agent: _end([up], round_=round_)}, evaluate=False)
        assert server.scheduler.last_epoch == round_ - 1  # not stepped by the arrivals
        server.end_round(round_)
        assert server.scheduler.last_epoch == round_
    assert trained == ["a", "b"] * 3
    assert server.optimizer.param_groups[0]["lr"] == pytest.approx(0.001)
    # The same losses stepped per arrival (what async did before) halve the rate by then.
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.001),
                                                           mode="min", factor=0.5, patience=2)
    for _ in range(3):
        for agent in ("a", "b"):
            reference.step(loss_of[agent])
    assert reference.optimizer.param_groups[0]["lr"] < 0.001
    # A round's pending losses survive a checkpoint.
    server.round_losses = {4: [(0.5, 4)]}
    other = FedGktServer(ctx, {"mode": "async"})
    other.load_state(server.state())
    assert other.round_losses == {4: [(0.5, 4)]}


def _arrive(server: FedGktServer, agent: str, seed: int, ids: np.ndarray, round_: int):
    up = _features(seed, len(ids), ids, round_=round_)
    server.on_upload(agent, up)
    return up, server.complete(round_, {agent: _end([up], round_=round_)}, evaluate=False)


def test_async_replay_trains_each_arrival_on_the_union_and_answers_the_arriving_agent(monkeypatch) -> None:
    """Async: agent b's arrival trains on batches drawn from b's new maps and a's latest maps
    (kept by the server), as many samples an epoch as b sent; only b gets logits, those of the
    trained model with its running BatchNorm averages; a's newer upload replaces its older
    maps in the staging. Without replay, b's arrival trains on b's maps alone."""
    ctx = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=0)
    server = FedGktServer(ctx, {"mode": "async", "server_batch_size": 4, "server_epochs": 2, "lr_schedule": "none"})
    drawn: list[list[tuple[str, int]]] = []
    batches = server._batches

    def spy(data, generator):
        plans = batches(data, generator)
        names = list(data)
        drawn.append([(names[k], int(r)) for plan in plans for k, rows in plan for r in rows])
        return plans

    monkeypatch.setattr(server, "_batches", spy)
    _, first = _arrive(server, "a", 1, np.arange(16), 1)
    assert [a for a, _ in first.downloads] == ["a"] and len(drawn) == 2  # alone: 2 epochs over a's 16 maps
    assert sorted(r for a, r in drawn[0]) == list(range(16))
    held = server.staging.in_memory_bytes
    drawn.clear()
    up_b, second = _arrive(server, "b", 2, np.arange(100, 108), 1)
    (agent, msg), = second.downloads
    assert agent == "b" and sorted(msg.sample_ids) == list(range(100, 108)) and second.samples == 8
    # Each epoch's plan covers a's and b's 24 maps; the epoch trains on its first 2 batches (8 samples).
    assert len(drawn) == 2 and all({a for a, _ in d} == {"a", "b"} and len(d) == 24 for d in drawn)
    server.model.eval()
    with torch.no_grad():
        expected = server.model(torch.from_numpy(up_b.features.astype(np.float16).astype(np.float32)))
    order = np.argsort(msg.sample_ids)
    np.testing.assert_allclose(msg.logits[order], expected.numpy()[np.argsort(up_b.sample_ids)], rtol=1e-4, atol=1e-4)
    assert set(server.replay) == {"a", "b"}
    # a's next upload replaces its held maps: the staging holds one upload per agent.
    _arrive(server, "a", 3, np.arange(16), 2)
    assert server.staging.in_memory_bytes == held + 8 * 16 * 32 * 32 * 2

    plain = FedGktServer(ctx, {"mode": "async", "async_replay": False, "server_batch_size": 4, "server_epochs": 1})
    seen: list[set[str]] = []
    monkeypatch.setattr(plain, "_batches", lambda data, g: (seen.append(set(data)), FedGktServer._batches(plain, data, g))[1])
    _arrive(plain, "a", 1, np.arange(16), 1)
    _arrive(plain, "b", 2, np.arange(100, 108), 1)
    assert seen == [{"a"}, {"b"}] and plain.replay == {} and plain.staging.in_memory_bytes == 0


def test_async_replay_refuses_the_per_agent_walk() -> None:
    with pytest.raises(ValueError, match="async_replay"):
        FedGktConfig.from_dict({"mode": "async", "server_order": "per_agent"})
    FedGktConfig.from_dict({"mode": "async", "server_order": "per_agent", "async_replay": False})
    assert FedGktConfig.from_dict({"preset": "paper-noniid", "mode": "async"}).async_replay is False
