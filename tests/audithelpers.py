"""Small Fashion-MNIST sets for the leakage audit's tests: private images (an agent's) and
public ones (the server's test split), as pixels in [0, 1], and the agents' normalisation."""

from __future__ import annotations

import functools

import torch

from cloud_server.audit import PixelSpace
from fldata import seeded_subset

#: The normalisation every Fashion-MNIST loader applies (fldata.stats).
FASHION = PixelSpace.of_dataset("fashion-mnist", 1)
IMAGE_SHAPE = (1, 32, 32)


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
    from models.registry import build_model

    return build_model("resnet8", 10, 1, generator=torch.Generator().manual_seed(seed)).extractor.eval()
