"""FedGKT's settings: the paper's presets (Table 10) and the agents' shared initialisation."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict

import numpy as np
import pytest
import torch

from cloud_server.methods import ServerContext
from cloud_server.methods.fedgkt import PAPER_PRESETS, FedGktConfig, FedGktServer
from edge_agent.costs import RoundMeter
from edge_agent.methods.base import EdgeContext
from edge_agent.methods.fedgkt import FedGktEdge
from fldata import make_synthetic
from shared_protocol.messages import EvalReport, RoundEnd, RoundStart

CTX = ServerContext(run_id="u", num_classes=10, in_channels=1, device="cpu", seed=5)


def test_paper_presets_are_table_10() -> None:
    """Table 10 (CIFAR-10; Tables 11-12 repeat it): FedGKT I.I.D. Adam lr 0.001 wd 0.0001,
    non-I.I.D. SGD lr 0.005 momentum 0.9; batch 256; 1 edge epoch; 20 / 40 server epochs."""
    iid = FedGktConfig.from_dict({"preset": "paper-iid"})
    assert (iid.server_optimizer, iid.server_lr, iid.server_weight_decay) == ("adam", 0.001, 1e-4)
    assert (iid.edge.edge_optimizer, iid.edge.edge_lr, iid.edge.edge_weight_decay) == ("adam", 0.001, 1e-4)
    assert (iid.server_batch_size, iid.edge.batch_size, iid.edge.edge_epochs, iid.server_epochs) == (256, 256, 1, 20)
    noniid = FedGktConfig.from_dict({"preset": "paper-noniid"})
    assert (noniid.server_optimizer, noniid.server_lr, noniid.server_momentum) == ("sgd", 0.005, 0.9)
    assert (noniid.edge.edge_optimizer, noniid.edge.edge_lr, noniid.edge.edge_momentum) == ("sgd", 0.005, 0.9)
    assert (noniid.server_batch_size, noniid.edge.batch_size, noniid.edge.edge_epochs, noniid.server_epochs) == (256, 256, 1, 40)
    for config in (iid, noniid):
        assert (config.kd, config.mode, config.edge.temperature, config.edge.alpha) == ("bidirectional", "sync", 3.0, 1.0)
        # Algorithm 1: agent-by-agent server batches, the whole ResNet-8 trains (line 22), the
        # server model evaluated with its running BatchNorm statistics.
        assert (config.server_order, config.edge.train_extractor) == ("per_agent", True)


def test_the_defaults_depart_from_algorithm_1_for_non_iid_agents() -> None:
    """docs/methods/fedgkt.md ("Non-IID agents and the balanced test set"): batches from all
    agents' maps, the extractors frozen at the shared initialisation, global BatchNorm statistics;
    the KD direction stays the paper's."""
    config = FedGktConfig()
    assert (config.server_order, config.edge.train_extractor) == ("mixed", False)
    assert (config.kd, config.edge_init) == ("bidirectional", "shared")
    assert asdict(config.round_config())["train_extractor"] is False  # what the agents receive


def test_a_preset_fills_only_what_the_table_leaves_out() -> None:
    config = FedGktConfig.from_dict({"preset": "paper-iid", "server_epochs": 3})
    assert config.server_epochs == 3 and config.server_batch_size == 256
    assert asdict(config)["preset"] == "paper-iid"  # the resolved config names the preset
    with pytest.raises(ValueError, match="Table 10 has two columns"):
        FedGktConfig.from_dict({"preset": "paper"})
    with pytest.raises(ValueError, match="preset"):
        FedGktConfig(preset="fast")
    assert set(PAPER_PRESETS) == {"paper-iid", "paper-noniid"}


def test_edgesplit_local_leaves_a_preset_its_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`edgesplit local --set fedgkt.preset=paper-iid` runs Table 10's 20 server epochs: the
    launcher writes only the flags given (it wrote their defaults, so the GPU run of session
    13 trained 1 server epoch a round under the paper preset); a flag given still wins."""
    from cloud_server.config import ServerConfig
    from cloud_server.launcher import build_parser, write_configs
    from shared_protocol.tomlio import read_toml

    def resolved(*flags: str) -> FedGktConfig:
        args = build_parser().parse_args(["local", "--method", "fedgkt", "--agents", "1", "--dataset", "synthetic", *flags])
        path, _ = write_configs(args, "p", tmp_path / str(len(flags)), "mqtt://127.0.0.1:1883")
        return FedGktConfig.from_dict(ServerConfig.from_dict(read_toml(path)).method_config)

    assert resolved("--set", "fedgkt.preset=paper-iid").server_epochs == 20
    noniid = resolved("--set", "fedgkt.preset=paper-noniid", "--kd", "s2e")
    assert (noniid.server_epochs, noniid.server_optimizer, noniid.kd) == (40, "sgd", "s2e")
    given = resolved("--set", "fedgkt.preset=paper-iid", "--server-epochs", "1", "--edge-epochs", "2", "--codec", "raw")
    assert (given.server_epochs, given.edge.edge_epochs, given.edge.upload_codec) == (1, 2, "raw")
    # Without a preset, leaving a flag out gives what its help calls the default: the flags'
    # declared defaults are FedGktConfig's.
    from shared_protocol.registry import get_method

    plain = resolved()
    for flag in get_method("fedgkt").flags:
        if flag.default is not None:
            field = {"edge_epochs": None}.get(flag.dest, flag.dest)
            value = plain.edge.edge_epochs if field is None else getattr(plain, field)
            assert value == flag.default, flag.name


def test_the_paper_configs_match_the_presets() -> None:
    """deploy/configs/paper/ writes the same values as the presets (one source of truth checked)."""
    from cloud_server.config import ServerConfig
    from pathlib import Path
    from shared_protocol.tomlio import read_toml

    root = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "paper"
    for split in ("iid", "noniid"):
        table = ServerConfig.from_dict(read_toml(root / f"cifar10-fedgkt-resnet56-{split}.toml")).method_config
        preset = PAPER_PRESETS[f"paper-{split}"]
        assert {k: table[k] for k in preset} == preset


def _edge(seed: int) -> FedGktEdge:
    data = make_synthetic(48, num_classes=10, in_channels=1, seed=1)
    ctx = EdgeContext(agent_id=f"agent-{seed}", run_id="u", instance=f"i{seed}", train=data, test=data,
                      settings={"num_classes": 10, "edge_model": "resnet8"}, send=lambda *a, **k: None, seed=seed)
    torch.manual_seed(seed)  # as the agent seeds its own models: each draws its own initialisation
    return FedGktEdge(ctx)


def _start(round_: int, weights: dict[str, np.ndarray], lr: float) -> RoundStart:
    config = asdict(FedGktConfig.from_dict({"edge_optimizer": "sgd", "edge_lr": lr, "edge_momentum": 0.0, "edge_weight_decay": 0.0,
                                            "edge_batch_size": 16, "upload_batch_samples": 16}).round_config())
    return RoundStart(run="u", round=round_, sender="server", method="fedgkt", config=config, deadline_s=60.0, weights=weights)


def _convs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith("weight") and v.dim() == 4}


def test_shared_init_starts_every_agent_from_the_servers_weights() -> None:
    server = FedGktServer(CTX, {})
    _, first = server.round_config(1, "agent-0", evaluate=False)
    _, other = server.round_config(1, "agent-1", evaluate=False)
    assert first and first.keys() == other.keys()
    assert all(np.array_equal(first[k], other[k]) for k in first)
    a, b = _edge(1), _edge(2)
    assert any(not torch.equal(x, y) for x, y in zip(_convs(a.model).values(), _convs(b.model).values()))
    for edge in (a, b):
        edge.run_round(_start(1, first, lr=1e-12), RoundMeter())  # a step of ~0: the weights stay the initial ones
    for name, value in _convs(a.model).items():
        torch.testing.assert_close(value, _convs(b.model)[name])
        torch.testing.assert_close(value, torch.from_numpy(first[name]))
    # A model that has trained keeps its weights: a later RoundStart's init is not loaded again.
    before = _convs(a.model)
    a.run_round(_start(2, {k: np.zeros_like(v) for k, v in first.items()}, lr=1e-12), RoundMeter())
    assert all(torch.allclose(v, before[k]) for k, v in _convs(a.model).items())


def test_the_init_goes_out_until_the_agent_has_finished_a_round() -> None:
    server = FedGktServer(CTX, {"server_batch_size": 8})
    assert server.round_config(1, "agent-0", evaluate=False)[1]
    server.initialised_agents.add("agent-0")  # what complete() records for the agents it used
    assert server.round_config(2, "agent-0", evaluate=False)[1] == {}
    assert server.round_config(2, "agent-9", evaluate=False)[1]  # a newcomer still gets it
    assert server.state()["initialised_agents"] == ["agent-0"]
    restored = FedGktServer(CTX, {"server_batch_size": 8})
    restored.load_state(server.state())
    assert restored.round_config(3, "agent-0", evaluate=False)[1] == {}


def test_per_agent_init_sends_no_weights() -> None:
    server = FedGktServer(CTX, {"edge_init": "per_agent"})
    assert server.round_config(1, "agent-0", evaluate=False)[1] == {}
    with pytest.raises(ValueError, match="edge_init"):
        FedGktConfig(edge_init="random")


def test_the_shared_init_is_the_torch_free_agents_init() -> None:
    """The ort backend's artifacts start from the edge model drawn from the run's seed: so does the shared init."""
    from models import build_model, state_dict_to_arrays

    server = FedGktServer(CTX, {})
    with torch.random.fork_rng():
        torch.manual_seed(CTX.seed)
        expected = state_dict_to_arrays(build_model("resnet8", 10, 1))
    _, weights = server.round_config(1, "a", evaluate=False)
    assert all(np.array_equal(weights[k], expected[k]) for k in expected)



def _upload(agent_seed: int, n: int, split: str, scale: float, shift: float) -> "GktFeatures":
    from shared_protocol.methods.fedgkt import GktFeatures

    rng = np.random.default_rng(agent_seed)
    return GktFeatures(
        run="u", round=1, sender="x", split=split, seq=0, instance="i1",
        features=(np.maximum(rng.normal(size=(n, 16, 8, 8)), 0) * scale + shift).astype(np.float32),
        logits=rng.normal(size=(n, 10)).astype(np.float32), labels=rng.integers(0, 10, n).astype(np.int64),
        sample_ids=np.arange(n, dtype=np.int64) + (0 if split == "train" else 1000),
    )


def _round_end(train: int) -> RoundEnd:
    return RoundEnd(run="u", round=1, sender="x", num_samples=train, instance="i1", uploads={"train": {"batches": 1, "samples": train}})


def _report(agent: str) -> EvalReport:
    return EvalReport(run="u", round=1, sender=agent, instance="i1", uploads={"test": {"batches": 1, "samples": 12}})


def test_each_agent_is_evaluated_with_the_servers_and_its_own_batchnorm_statistics() -> None:
    """Two agents whose extractors speak different "feature languages" (maps of different scale):
    the headline scores each agent's test maps with the server's running statistics; the
    personalised figure with the statistics of that agent's own training maps."""
    server = FedGktServer(CTX, {"server_batch_size": 8, "eval_diagnostics": True, "personalised_eval": "every"})
    looks = {"a": (1.0, 0.0), "b": (6.0, 3.0)}
    uploads = {agent: (_upload(k, 24, "train", *looks[agent]), _upload(10 + k, 12, "test", *looks[agent])) for k, agent in enumerate(looks)}
    for agent, (train, _test) in uploads.items():
        server.on_upload(agent, train)
    first = server.norms[0]
    server.complete(1, {agent: _round_end(24) for agent in looks}, evaluate=True)
    assert set(server.agent_bn) == {"a", "b"}
    for agent, (_train, test) in uploads.items():
        server.on_upload(agent, test)  # the evaluation's upload, after the round's step
    seen: list[torch.Tensor] = []
    handle = first.register_forward_pre_hook(lambda m, _x: seen.append(m.running_mean.clone()) if not m.training else None)
    try:
        ev = server.evaluation(1, {agent: _report(agent) for agent in looks})
    finally:
        handle.remove()
    assert ev.local["model"] == {"a": (ev.local["model"]["a"][0], 12), "b": (ev.local["model"]["b"][0], 12)}
    assert set(ev.local["personalised_bn"]) == {"a", "b"} and server.eval_staged == {}
    # The statistics are each agent's own: an independent cumulative average over its training maps.
    for agent, (train, _test) in uploads.items():
        reference = FedGktServer(CTX, {"server_batch_size": 8})
        reference.model.load_state_dict(server.model.state_dict())
        for m in reference.norms:
            m.reset_running_stats()
            m.momentum = None
        reference.model.train()
        with torch.no_grad():
            reference.model(torch.from_numpy(train.features.astype(np.float16)).float())
        for (mean, var), m in zip(server.agent_bn[agent], reference.norms):
            torch.testing.assert_close(mean, m.running_mean, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(var, m.running_var, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(server.agent_bn["a"][0][0], server.agent_bn["b"][0][0])
    # Evaluation passes, per agent: the server's running statistics, then the agent's own.
    assert len(seen) == 4
    torch.testing.assert_close(seen[0], first.running_mean)
    torch.testing.assert_close(seen[1], server.agent_bn["a"][0][0])
    torch.testing.assert_close(seen[2], first.running_mean)
    torch.testing.assert_close(seen[3], server.agent_bn["b"][0][0])
    assert "server_train_accuracy" in server.round_report(1)
    # They are kept in the checkpoint.
    restored = FedGktServer(CTX, {"server_batch_size": 8})
    restored.load_state(server.state())
    torch.testing.assert_close(restored.agent_bn["b"][3][1], server.agent_bn["b"][3][1])


def test_without_the_personalised_evaluation_nothing_is_calibrated() -> None:
    server = FedGktServer(CTX, {"server_batch_size": 8, "personalised_eval": "off"})
    server.on_upload("a", _upload(0, 16, "train", 1.0, 0.0))
    server.complete(1, {"a": _round_end(16)}, evaluate=True)
    server.on_upload("a", _upload(1, 8, "test", 1.0, 0.0))
    ev = server.evaluation(1, {"a": _report("a")})
    assert set(ev.local) == {"model"} and ev.local["model"]["a"][1] == 8 and server.agent_bn == {}
    final = FedGktServer(dataclasses.replace(CTX, rounds=3), {"personalised_eval": "final"})
    assert not final._personalised(2) and final._personalised(3)


# nothing calibrated without the diagnostics


def test_an_agents_next_round_keeps_its_test_maps_of_the_last() -> None:
    """Async: an agent streams its test maps of round 1, then starts round 2 and uploads its
    training maps before round 1's record closes; round 1's evaluation still has the maps."""
    server = FedGktServer(CTX, {"server_batch_size": 8, "personalised_eval": "off"})
    server.on_upload("a", _upload(0, 16, "train", 1.0, 0.0))
    server.complete(1, {"a": _round_end(16)}, evaluate=True)
    server.on_upload("a", _upload(1, 8, "test", 1.0, 0.0))
    next_round = _upload(2, 16, "train", 1.0, 0.0)
    next_round.round = 2
    server.on_upload("a", next_round)
    ev = server.evaluation(1, {"a": _report("a")})
    assert ev.local["model"]["a"][1] == 8
    assert set(server.staged) == {"a"} and server.staged["a"].round == 2  # round 2's maps are still staged
