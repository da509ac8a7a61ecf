"""The FedGKT server step: against a bare PyTorch loop, eagerly against ``torch.compile``, and
its cost per map by batch size.

``test_training_loop``: the server step (``FedGktServer._train`` through the shared step of
``cloud_server/server_step.py`` in its ``auto`` mode) and a bare loop train the same server model
from the same initial weights (batch, optimizer, CE + KD loss) over the same maps. The bare loop
iterates over ready float32 batches; the server step gathers staged float16 maps by shuffled index
and records logits by sample id.

``test_compile``: the shared server step (ResNet-55 on 16x32x32 maps, batch 64, FedGKT's loss)
eagerly and through ``torch.compile`` from an empty inductor cache, seconds per step after the
warm-up; the warm-up's time (the compilation) and the first step's loss in ``extra_info``.
Whether compiling helps here, and whether ``server_step = "auto"`` (``AUTO_STEP["cpu"]``)
follows, is :func:`micro_docs.compile_verdict` of the two.

``test_step_by_batch``: one server step (ResNet-55, Adam, fp32, CE) at batch 32, 64 and 256: why
FedGKT's CPU defaults take batch 64 where the paper's Table 10 says 256.

    make bench-micro MICRO=server_loop     # or: pytest bench/micro/test_server_loop.py [--quick]
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cloud_server.feature_store import ArrayStaging, StagedBatch, gather_batches
from cloud_server.methods import ServerContext
from cloud_server.methods.fedgkt import FedGktServer
from cloud_server.server_step import AUTO_CPU_COMPILE_MIN_STEPS, AUTO_STEP, RowBank, TrainStep
from models import build_model
from models.losses import kd_loss
from models.training import make_optimizer
from shared_protocol.methods.fedgkt import GktFeatures

MODEL = "resnet55_server"
BATCH = 64
TEMPERATURE = 3.0
#: (staged samples, agents, timed repeats), full and --quick.
LOOP_SIZES = {False: (1024, 4, 5), True: (128, 2, 1)}
#: (timed steps per round, warm-up steps, rounds), full and --quick.
COMPILE_SIZES = {False: (4, 2, 6), True: (1, 1, 1)}
STEM_CHANNELS = 16  # ResNet-8's stem: the maps FedGKT's default edge uploads


def gkt_loss(logits: torch.Tensor, labels: torch.Tensor, edge_logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels) + kd_loss(logits, edge_logits, TEMPERATURE)


@pytest.fixture(scope="module")
def staged(quick: bool) -> dict[str, tuple]:
    """Each agent's maps staged as the server stages them within its memory bound."""
    samples, agents, _ = LOOP_SIZES[quick]
    rng, per, staging, data = np.random.default_rng(0), samples // agents, ArrayStaging(1 << 40), {}
    for a in range(agents):
        msg = GktFeatures(
            run="b", round=1, sender=f"a{a}", split="train", seq=0, instance="i",
            features=np.maximum(rng.normal(size=(per, 16, 32, 32)), 0).astype(np.float32),
            logits=rng.normal(size=(per, 10)).astype(np.float32), labels=rng.integers(0, 10, per).astype(np.int64),
            sample_ids=np.arange(a * per, (a + 1) * per, dtype=np.int64))
        data[f"a{a}"] = gather_batches([StagedBatch(staging.stage(msg.features), msg.logits, msg.labels, msg.sample_ids)], staging)
    return data


@pytest.mark.parametrize("loop", ["server_step", "bare_loop"])
def test_training_loop(benchmark: Any, staged: dict[str, tuple], quick: bool, loop: str) -> None:
    samples, agents, repeats = LOOP_SIZES[quick]
    torch.manual_seed(0)
    ctx = ServerContext(run_id="bench", num_classes=10, in_channels=1, device="cpu", seed=0)
    server = FedGktServer(ctx, {"server_model": MODEL, "server_batch_size": BATCH, "server_epochs": 1, "lr_schedule": "none"})
    initial = copy.deepcopy(server.model.state_dict())
    features = torch.cat([d[0][:].float() for d in staged.values()])  # (N, 16, 32, 32), ready in float32
    edge_logits, labels = torch.cat([d[1] for d in staged.values()]), torch.cat([d[2] for d in staged.values()])
    benchmark.extra_info.update(server_model=MODEL, samples=samples, agents=agents, batch_size=BATCH)

    def fresh() -> tuple[tuple, dict]:
        server.model.load_state_dict(initial)
        server.optimizer = server._make_optimizer()
        return (), {}

    def bare() -> None:
        model, optimizer = server.model.train(), server.optimizer
        for i in range(0, len(labels), BATCH):
            logits = model(features[i : i + BATCH])
            loss = gkt_loss(logits, labels[i : i + BATCH], edge_logits[i : i + BATCH])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    target = (lambda: server._train(staged, round_=1)) if loop == "server_step" else bare
    benchmark.pedantic(target, setup=fresh, warmup_rounds=1, rounds=repeats)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_compile(benchmark: Any, quick: bool, mode: str) -> None:
    steps, warmup, rounds = COMPILE_SIZES[quick]
    # A cold compilation, as the first run on a machine pays it: an empty inductor cache.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="edgesplit-inductor-")
    n, g = BATCH * 8, torch.Generator().manual_seed(0)
    bank = RowBank(torch.relu(torch.randn(n, 16, 32, 32, generator=g)).half(), torch.device("cpu"))  # staged as float16
    labels, edge_logits = torch.randint(0, 10, (n,), generator=g), torch.randn(n, 10, generator=g)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = build_model(MODEL, 10).train()
    step = TrainStep(model, make_optimizer("adam", model.parameters(), lr=1e-3, weight_decay=5e-4), gkt_loss, mode,
                     name=f"bench {mode}")
    position = [0]

    def one_step() -> float:
        if position[0] + BATCH > n:
            position[0] = 0
        idx = order[position[0] : position[0] + BATCH]
        position[0] += BATCH
        return float(step(bank.gather(idx, torch.float32), labels[idx], edge_logits[idx]).loss)

    started = time.perf_counter()
    first_loss = one_step()
    for _ in range(warmup - 1):
        one_step()
    benchmark.extra_info.update(
        server_model=MODEL, batch_size=BATCH, loss="CE + KD (T=3)", optimizer="adam (amsgrad)", warmup_steps=warmup,
        warmup_s=time.perf_counter() - started, first_step_loss=first_loss, ran=step.mode,
        fallback_reason=step.fallback_reason, auto_cpu_step=AUTO_STEP["cpu"], auto_cpu_compile_min_steps=AUTO_CPU_COMPILE_MIN_STEPS)
    benchmark.pedantic(one_step, rounds=rounds, iterations=steps)  # seconds per step


@pytest.mark.parametrize("batch", [32, 64, 256])
def test_step_by_batch(benchmark: Any, quick: bool, batch: int) -> None:
    if quick and batch > 64:
        pytest.skip("not at this size (--quick)")
    torch.manual_seed(0)
    model = build_model(MODEL, 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4, amsgrad=True)
    x, y = torch.randn(batch, STEM_CHANNELS, 32, 32), torch.randint(0, 10, (batch,))

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    benchmark.extra_info.update(server_model=MODEL, maps=batch, torch_threads=torch.get_num_threads())
    benchmark.pedantic(step, warmup_rounds=1, rounds=1 if quick else 3)
