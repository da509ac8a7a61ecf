"""Edge compute of FedGKT's ResNet-8 against the full ResNet-56 / ResNet-110 (the FedGKT paper's
Fig. 4): one training batch timed (forward + cross-entropy + backward, no optimiser step), with
parameters and FLOPs per image in ``extra_info``. FLOPs are counted by ``FlopCounterMode``
(2 x MACs, conv and matmul only) on a small batch: per image they do not depend on the batch.

    make bench-micro MICRO=edge_cost     # or: pytest bench/micro/test_edge_cost.py [--quick]
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from models import build_model, count_parameters, forward_flops_per_sample, training_flops_per_sample

INPUT_SHAPE = (3, 32, 32)  # a CIFAR-10 image (C, H, W)
NUM_CLASSES = 10
FLOP_BATCH_SIZE = 2
#: (batch, warm-up steps, timed steps), full and --quick.
SIZES = {False: (64, 3, 7), True: (4, 1, 2)}
#: The FedGKT paper's ratios to ResNet-8 (He et al., NeurIPS 2020).
PAPER_FLOPS_RATIO = {"resnet8": 1.0, "resnet56": 9.0, "resnet110": 17.0}
PAPER_PARAMS_RATIO = {"resnet8": 1.0, "resnet56": 54.0, "resnet110": 105.0}


@pytest.mark.parametrize("model", ["resnet8", "resnet56", "resnet110"])
def test_training_batch(benchmark: Any, quick: bool, model: str) -> None:
    batch, warmup, rounds = SIZES[quick]
    net = build_model(model, num_classes=NUM_CLASSES, in_channels=INPUT_SHAPE[0]).train()
    benchmark.extra_info.update(
        params=count_parameters(net), batch_size=batch,
        training_flops_per_sample=training_flops_per_sample(net, INPUT_SHAPE, batch_size=FLOP_BATCH_SIZE, loss="ce"),
        forward_flops_per_sample=forward_flops_per_sample(net, INPUT_SHAPE, batch_size=FLOP_BATCH_SIZE),
        paper_flops_ratio_vs_resnet8=PAPER_FLOPS_RATIO[model], paper_params_ratio_vs_resnet8=PAPER_PARAMS_RATIO[model])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *INPUT_SHAPE, generator=generator)  # (B, 3, 32, 32)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)  # (B,)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        output = net(x)
        F.cross_entropy(output[0] if isinstance(output, tuple) else output, y).backward()  # ResNet8Edge: (logits, features)

    benchmark.pedantic(step, warmup_rounds=warmup, rounds=rounds, iterations=1)
