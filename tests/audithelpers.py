"""What the leakage audit's tests share: small Fashion-MNIST sets (private images, an agent's,
and public ones, the server's test split) as pixels in [0, 1], the agents' normalisation,
the models attacked, and an agent's local training as the agents run it."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cloud_server.audit import LocalSchedule, PixelSpace
from fldata import seeded_subset
from models.optimizers import make_optimizer
from models.registry import build_model

#: The normalisation every Fashion-MNIST loader applies (fldata.stats).
FASHION = PixelSpace.of_dataset("fashion-mnist", 1)
IMAGE_SHAPE = (1, 32, 32)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """The attacks' tests on one torch thread (the machine's other core is someone else's), and
    the process's setting back afterwards. Imported by each audit test module, which makes it
    apply there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=2)
def _subset(train_samples: int, test_samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    train, test = seeded_subset("fashion-mnist", train_samples=train_samples, test_samples=test_samples, seed=0)
    private = torch.from_numpy(train.images.astype("float32") / 255.0)  # (N, 1, 32, 32)
    public = torch.from_numpy(test.images.astype("float32") / 255.0)  # (M, 1, 32, 32)
    return private, torch.from_numpy(train.labels.copy()), public


def fashion_sets(private: int, public: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(private images, their labels, public images)``: the first ``private`` images of a seeded
    100-image training subset and a seeded ``public``-image test subset."""
    images, labels, public_images = _subset(100, public)
    return images[:private].clone(), labels[:private].clone(), public_images.clone()


def stem(seed: int) -> torch.nn.Module:
    """FedGKT's extractor for Fashion-MNIST (ResNet-8's conv stem) as drawn from ``seed``, in eval mode."""
    return build_model("resnet8", 10, 1, generator=torch.Generator().manual_seed(seed)).extractor.eval()


def lenet(seed: int) -> nn.Module:
    """DLG's small model (Zhu et al.): strided 5 x 5 convolutions with sigmoids, one linear layer."""
    with torch.random.fork_rng():  # the layers draw from the global generator; leave it as it was
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, 12, 5, padding=2, stride=2), nn.Sigmoid(),  # (N, 12, 16, 16)
            nn.Conv2d(12, 12, 5, padding=2, stride=2), nn.Sigmoid(),  # (N, 12, 8, 8)
            nn.Conv2d(12, 12, 5, padding=2, stride=1), nn.Sigmoid(),
            nn.Flatten(), nn.Linear(12 * 8 * 8, 10),
        )


def agent_update(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, schedule: LocalSchedule) -> dict[str, torch.Tensor]:
    """What an agent uploads minus the global model: ``schedule`` run with the agents' optimisers."""
    trained = _trained(model, images, labels, schedule)
    start = dict(model.named_parameters())
    return {name: (p - start[name]).detach() for name, p in trained.named_parameters()}


def agent_update_buffers(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, schedule: LocalSchedule) -> dict[str, torch.Tensor]:
    """The change of the float buffers (BatchNorm's running statistics) in the same training."""
    trained = _trained(model, images, labels, schedule)
    start = dict(model.named_buffers())
    return {name: (b - start[name]).detach() for name, b in trained.named_buffers() if b.dtype.is_floating_point}


def _trained(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, schedule: LocalSchedule) -> nn.Module:
    trained = copy.deepcopy(model).train()
    optimizer = make_optimizer(schedule.optimizer, trained.parameters(), schedule.lr, momentum=schedule.momentum,
                               weight_decay=schedule.weight_decay)
    for step in range(schedule.local_steps):
        index = torch.arange(step * schedule.batch_size, (step + 1) * schedule.batch_size) % images.shape[0]
        output = trained(FASHION.to_model(images[index]))
        logits = output[0] if isinstance(output, tuple) else output
        optimizer.zero_grad()
        F.cross_entropy(logits, labels[index]).backward()
        optimizer.step()
    return trained
