"""Checkpointed bottlenecks (models.memory, the torch agent's --low-memory): same math, less saved."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models import build_model, state_dict_to_arrays
from models.memory import checkpoint_bottlenecks, has_bottlenecks, is_checkpointed, recompute_flops_ratio
from models.losses import kd_loss


def _pair(seed: int = 0, in_channels: int = 3) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    plain = build_model("resnet8", 10, in_channels)
    return plain, checkpoint_bottlenecks(copy.deepcopy(plain))


def _steps(model: torch.nn.Module, steps: int = 4) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Adam steps on fixed random batches (CE + KD, as the FedGKT edge trains); losses and grads per step."""
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4, amsgrad=True)
    model.train()
    losses, grads = [], []
    for _ in range(steps):
        x = torch.randn(16, 3, 32, 32, generator=gen)  # (B, C, H, W)
        y = torch.randint(0, 10, (16,), generator=gen)
        teacher = torch.randn(16, 10, generator=gen)
        opt.zero_grad()
        logits, _ = model(x)
        loss = F.cross_entropy(logits, y) + kd_loss(logits, teacher, 3.0)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, grads


def test_losses_gradients_and_bn_statistics_match_the_plain_model() -> None:
    plain, light = _pair()
    plain_losses, plain_grads = _steps(plain)
    light_losses, light_grads = _steps(light)
    assert light_losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)
    for step, (g_plain, g_light) in enumerate(zip(plain_grads, light_grads)):
        for name in g_plain:
            torch.testing.assert_close(g_light[name], g_plain[name], rtol=1e-4, atol=1e-6, msg=f"step {step} grad {name}")
    plain_state, light_state = plain.state_dict(), light.state_dict()
    assert list(light_state) == list(plain_state)  # no wrapper module: names unchanged
    for name, value in plain_state.items():
        if name.endswith("num_batches_tracked"):
            # counted once per step, not once more for the recomputation
            assert int(light_state[name]) == int(value) == 4, name
        else:
            torch.testing.assert_close(light_state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_running_statistics_of_the_recomputed_blocks_move_as_in_the_plain_model() -> None:
    """The BN layers inside the bottlenecks are the ones recomputed: their running stats must
    have moved (training happened) and by exactly one update per step."""
    plain, light = _pair()
    before = {n: v.clone() for n, v in plain.state_dict().items() if "stages" in n and n.endswith("running_mean")}
    assert before
    _steps(plain, 1)
    _steps(light, 1)
    for name, value in before.items():
        assert not torch.equal(plain.state_dict()[name], value), f"{name} did not move: the test would prove nothing"
        torch.testing.assert_close(light.state_dict()[name], plain.state_dict()[name], rtol=1e-5, atol=1e-6, msg=name)


def test_momentum_none_cumulative_average_is_kept_too() -> None:
    """momentum=None uses num_batches_tracked in the update: a recomputation that counted
    itself would change the average."""
    plain, light = _pair()
    for model in (plain, light):
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = None
    _steps(plain, 3)
    _steps(light, 3)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(light.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert all(m.momentum is None for m in light.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_recomputation_saves_less_for_the_backward_pass() -> None:
    plain, light = _pair()
    x = torch.randn(8, 3, 32, 32)

    def saved_bytes(model: torch.nn.Module) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.train()(x)[0].sum()
        return sum(storages.values())

    assert saved_bytes(light) < 0.3 * saved_bytes(plain)


def test_eval_and_no_grad_run_the_plain_forward() -> None:
    plain, light = _pair()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(light.eval()(x)[0], plain.eval()(x)[0])
        torch.testing.assert_close(light.train()(x)[1], plain.train()(x)[1])


def test_off_by_default_and_idempotent() -> None:
    model = build_model("resnet8", 10, 3)
    assert not is_checkpointed(model)
    assert checkpoint_bottlenecks(checkpoint_bottlenecks(model)) is model and is_checkpointed(model)
    arrays = state_dict_to_arrays(model)
    assert list(arrays) == list(state_dict_to_arrays(build_model("resnet8", 10, 3)))


def test_a_model_without_bottlenecks_is_refused() -> None:
    stem_only = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    assert not has_bottlenecks(stem_only)
    with pytest.raises(ValueError, match="no Bottleneck"):
        checkpoint_bottlenecks(stem_only)


def test_recompute_costs_forward_flops_of_the_bottlenecks() -> None:
    ratio = recompute_flops_ratio(build_model("resnet8", 10, 3), (3, 32, 32))
    # one more forward of the two bottlenecks: more than nothing, less than a whole extra forward (+1/3)
    assert 1.2 < ratio < 1.34


def test_the_agent_checkpoints_only_when_its_memory_config_asks() -> None:
    import edge_agent.memory as memory
    from edge_agent.config import MemoryConfig

    assert not is_checkpointed(memory.lighten_model(build_model("resnet8", 10, 3), MemoryConfig()))
    assert not is_checkpointed(memory.lighten_model(build_model("resnet8", 10, 3), MemoryConfig.low()))  # the preset micro-batches
    assert is_checkpointed(memory.lighten_model(build_model("resnet8", 10, 3), MemoryConfig(checkpoint_blocks=True)))
    stem_only = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    assert memory.lighten_model(stem_only, MemoryConfig(checkpoint_blocks=True)) is stem_only


def test_edge_agent_low_memory_flag_takes_the_preset_and_pins_malloc_before_the_agent_starts(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import edge_agent.agent as agent_module
    import edge_agent.cli as cli
    import edge_agent.memory as memory
    from edge_agent.config import MemoryConfig

    pinned: list[bool] = []
    monkeypatch.setattr(memory, "fix_malloc_mmap_threshold", lambda: pinned.append(True) or True)  # no process-wide change here
    seen: list[MemoryConfig] = []

    class Refused(agent_module.EdgeAgent):
        def __init__(self, config, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(config.memory)
            raise ValueError("stop here")

    monkeypatch.setattr(agent_module, "EdgeAgent", Refused)
    config = tmp_path / "agent.toml"
    config.write_text('[agent]\nagent_id = "a0"\n')
    assert cli.main(["run", "--config", str(config)]) == 2
    assert seen == [MemoryConfig()] and pinned == []
    assert cli.main(["run", "--low-memory", "--config", str(config)]) == 2
    assert seen[-1] == MemoryConfig.low() and pinned == [True]
    config.write_text('[agent]\nagent_id = "a0"\n[memory]\nmicro_batch_samples = 8\n')
    assert cli.main(["run", "--config", str(config)]) == 2
    assert seen[-1] == MemoryConfig(micro_batch_samples=8) and pinned == [True]
    config.write_text('[agent]\nagent_id = "a0"\n[memory]\nmicro_batch = 8\n')
    assert cli.main(["run", "--config", str(config)]) == 2  # unknown key: refused, naming the known ones


def test_fedgkt_edge_model_is_checkpointed_when_asked_and_reports_the_methods_flops() -> None:
    from edge_agent.config import MemoryConfig
    from edge_agent.methods.base import EdgeContext
    from edge_agent.methods.fedgkt import FedGktEdge
    from fldata import make_synthetic
    from models import clear_flops_cache

    data = make_synthetic(8, num_classes=10, in_channels=1, seed=0)

    def edge(memory_config: MemoryConfig) -> FedGktEdge:
        clear_flops_cache()  # counted afresh for each (the shared count caches per architecture and shape)
        ctx = EdgeContext(agent_id="a0", run_id="r", instance="i", train=data, test=data,
                          settings={"num_classes": 10, "edge_model": "resnet8"}, send=lambda *a, **k: None, memory=memory_config)
        return FedGktEdge(ctx)

    plain = edge(MemoryConfig())
    light = edge(MemoryConfig(checkpoint_blocks=True))
    assert not is_checkpointed(plain.model) and is_checkpointed(light.model)
    # the reported FLOPs are the method's (recomputation documented, not counted)
    assert light.flops == plain.flops and light.trains == plain.trains and plain.flops.training > 0
