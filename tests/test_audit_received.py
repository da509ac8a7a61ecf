"""The attacks on what the server holds: messages encoded with the run's codecs and decoded
as the server decodes them, turned into the attacks' tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from audithelpers import FASHION, IMAGE_SHAPE, agent_update, fashion_sets, lenet, stem
from audithelpers import one_torch_thread  # noqa: F401 (a fixture: importing it applies it here)
from cloud_server.audit import (AttackInputError, LocalSchedule, WhiteBoxConfig, activations_from_messages,
                                invert_features_white_box, score_images, update_from_fedavg, update_from_fedkd)
from shared_protocol.message_base import decode_message, encode_message
from shared_protocol.methods.fedavg import FedAvgUpdate
from shared_protocol.methods.fedgkt import GktFeatures
from shared_protocol.methods.fedkd import FedKdUpdate, factor_state
from shared_protocol.methods.splitnn import SplitActivations


def over_the_wire(msg, codecs=None):  # type: ignore[no-untyped-def]
    return decode_message(encode_message(msg, codecs))


def gkt_batches(images: torch.Tensor, labels: torch.Tensor, codec: str) -> list[GktFeatures]:
    """An agent's training uploads, 4 images a batch, through ``codec`` and back."""
    with torch.no_grad():
        features = stem(0)(FASHION.to_model(images)).numpy()  # (N, 16, 32, 32)
    batches = []
    for seq, start in enumerate(range(0, len(labels), 4)):
        rows = slice(start, start + 4)
        msg = GktFeatures(run="r", round=1, sender="agent-0", split="train", seq=seq, instance="i",
                          features=features[rows], logits=np.zeros((len(labels[rows]), 10), np.float32),
                          labels=labels[rows].numpy(), sample_ids=np.arange(len(labels))[rows])
        batches.append(over_the_wire(msg, {"features": codec}))
    return batches


@pytest.mark.parametrize("codec", ["fp16-zstd", "u8-zstd"])
def test_the_white_box_attack_on_decoded_fedgkt_uploads(codec: str) -> None:
    private, labels, _ = fashion_sets(8, 50)
    received = activations_from_messages(gkt_batches(private, labels, codec))
    assert len(received) == 8 and received.labels.tolist() == labels.tolist()
    assert received.sample_ids is not None and received.sample_ids.tolist() == list(range(8))
    reconstructed = invert_features_white_box(stem(0), received.features, FASHION, IMAGE_SHAPE, WhiteBoxConfig(steps=200))
    scores = score_images(reconstructed, private)
    # u8-zstd keeps 8 bits a value, fp16-zstd 11: both leave the images recoverable.
    assert scores.psnr_db > (60.0 if codec == "fp16-zstd" else 45.0)
    assert scores.ssim > 0.999


def test_split_learning_activations_and_mixed_uploads() -> None:
    private, labels, _ = fashion_sets(4, 50)
    with torch.no_grad():
        maps = stem(0)(FASHION.to_model(private)).numpy()
    split = over_the_wire(SplitActivations(run="r", round=1, sender="agent-0", split="train", seq=0, instance="i",
                                           activations=maps, labels=labels.numpy()))
    received = activations_from_messages([split])
    assert received.logits is None and received.sample_ids is None
    torch.testing.assert_close(received.features, torch.from_numpy(maps))
    with pytest.raises(AttackInputError, match="one agent's uploads of one kind"):
        activations_from_messages([split, *gkt_batches(private, labels, "fp16-zstd")])
    with pytest.raises(AttackInputError, match="no 'test'"):
        activations_from_messages([split], split="test")


def test_a_fedavg_upload_minus_the_global_model_is_the_agents_update() -> None:
    private, labels, _ = fashion_sets(1, 50)
    model, schedule = lenet(0), LocalSchedule(lr=0.01)
    update = agent_update(model, private, labels, schedule)
    start = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
    uploaded = {name: start[name] + update[name].numpy() for name in start}
    msg = over_the_wire(FedAvgUpdate(run="r", round=1, sender="agent-0", instance="i", num_samples=1, model_version=0,
                                     weights=uploaded))
    received = update_from_fedavg(msg, start)
    for name, delta in update.items():
        torch.testing.assert_close(received[name], delta, rtol=1e-4, atol=1e-7)
    with pytest.raises(AttackInputError, match="has no"):
        update_from_fedavg(msg, {})


def test_a_fedkd_upload_rebuilt_from_its_factors() -> None:
    private, labels, _ = fashion_sets(1, 50)
    update = agent_update(lenet(0), private, labels, LocalSchedule(lr=0.01))
    layout, factors, _ = factor_state({k: v.numpy() for k, v in update.items()}, threshold=1.0)
    common = dict(run="r", round=1, sender="agent-0", instance="i", num_samples=1, base_version=0, threshold=1.0,
                  layout=layout, factors=factors)
    rebuilt = update_from_fedkd(over_the_wire(FedKdUpdate(payload="update", **common)))
    for name, delta in update.items():
        torch.testing.assert_close(rebuilt[name], delta, rtol=1e-3, atol=1e-6)
    as_gradient = update_from_fedkd(over_the_wire(FedKdUpdate(payload="gradient", **common)), learning_rate=0.5)
    torch.testing.assert_close(as_gradient["4.weight"], -0.5 * rebuilt["4.weight"])
