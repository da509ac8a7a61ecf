"""Metering no method can forget.

The shared training loop counts samples, FLOPs and compute time from what a method
declares it trains (``edge_agent/trainer.py``), forward passes outside training go
through ``RoundMeter.forward``, both from one FLOP count (``models.cost``); the
coordinator times every call to a method's server hooks. A throw-away method that
trains a model and counts nothing itself still reports its FLOPs, samples and compute
time, and its server hooks' seconds.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

import pytest

import edge_agent.costs as costs_module
from cloud_server.rounds import HookClock
from edge_agent.costs import RoundMeter
from edge_agent.trainer import Trains, train_epochs
from models import (
    build_model,
    cached_flops_per_sample,
    cached_forward_flops_per_sample,
    clear_flops_cache,
    flops_per_sample,
    layer_flops_per_sample,
)

from fedhelpers import ROOT, agent_config, in_memory_federation, method_server_config

# --------------------------------------------------------------------------- #
# The edge meter and the one FLOP count
# --------------------------------------------------------------------------- #


def test_a_nested_phase_counts_only_once(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: now[0])
    meter = RoundMeter()
    with meter.phase("compute"):
        now[0] += 1.0
        with meter.phase("network"):  # an upload sent from inside training
            now[0] += 2.0
            with meter.phase("encode"):
                now[0] += 4.0
            now[0] += 8.0
        with meter.phase("compute"):  # the same phase again: counted once
            now[0] += 16.0
        now[0] += 32.0
    assert meter.seconds == {"compute": 49.0, "network": 10.0, "encode": 4.0, "idle": 0.0}
    assert sum(meter.seconds.values()) == now[0]


def test_the_meter_counts_training_and_forward_passes_from_the_declared_figures() -> None:
    meter = RoundMeter()
    model = build_model("resnet8", 10, 1)
    flops = cached_flops_per_sample(model, (1, 28, 28))
    meter.trained(30, flops.training)
    meter.forward(flops, 7)
    assert meter.samples_trained == 30 and meter.train_flops == 30 * flops.training + 7 * flops.forward


def test_one_cache_for_every_model_of_an_architecture() -> None:
    clear_flops_cache()
    a, b = build_model("resnet8", 10, 3), build_model("resnet8", 10, 3)
    first = cached_flops_per_sample(a, (3, 32, 32))
    assert first == flops_per_sample(a, (3, 32, 32)) and first.training > first.forward > 0
    assert cached_flops_per_sample(b, (3, 32, 32)) is first  # counted once, for every model built alike
    assert cached_flops_per_sample(a, (3, 16, 16)).training < first.training  # the shape is part of the key
    assert cached_flops_per_sample(a, (3, 32, 32), loss="sum") is not first
    # A frozen teacher has no training figure; its forward comes from the same count.
    b.requires_grad_(False)
    assert cached_forward_flops_per_sample(b, (3, 32, 32)) == first.forward
    assert cached_forward_flops_per_sample(build_model("resnet8", 10, 1), (1, 32, 32)) != first.forward


def test_a_declaration_sums_trained_models_teachers_and_extra_work() -> None:
    mentor, mentee = build_model("resnet20", 10, 1), build_model("resnet8", 10, 1)
    teacher = build_model("resnet8", 10, 1).requires_grad_(False)
    shape = (1, 32, 32)
    trains = Trains.of((mentor, mentee), shape, teachers=(teacher, teacher), extra_flops_per_sample=5)
    expected = (layer_flops_per_sample(mentor, shape).training + layer_flops_per_sample(mentee, shape).training
                + 2 * layer_flops_per_sample(mentee, shape).forward + 5)
    assert trains.flops_per_sample == expected


def test_training_needs_the_round_meter() -> None:
    meter = inspect.signature(train_epochs).parameters["meter"]
    assert meter.kind is inspect.Parameter.KEYWORD_ONLY and meter.default is inspect.Parameter.empty


#: Where edge methods live: none of them may count samples or FLOPs by hand.
EDGE_METHOD_SOURCES = ("edge_agent/methods", "edge_agent/fedgkt_edge.py", "edge_agent/backends")
HAND_METERING = re.compile(r"\.(train_flops|samples_trained)\s*\+?=")


def test_no_edge_method_meters_by_hand() -> None:
    files = [p for s in EDGE_METHOD_SOURCES for p in ([ROOT / s] if s.endswith(".py") else sorted((ROOT / s).glob("*.py")))]
    assert len(files) > 8
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
             if HAND_METERING.search(line)]
    assert found == [], "count through the training loop (train_epochs) and meter.forward, not by hand"
    assert HAND_METERING.search("meter.train_flops += 3 * n") and not HAND_METERING.search("meter.trained(n, f)")


def test_hook_clock_counts_every_call_by_round_and_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    import cloud_server.rounds as rounds_module

    now = [0.0]
    monkeypatch.setattr(rounds_module.time, "perf_counter", lambda: now[0])
    clock = HookClock()
    for round_, hook, seconds in ((1, "on_upload", 1.0), (1, "on_upload", 2.0), (1, "complete", 4.0), (2, "complete", 8.0)):
        with clock.timing(round_, hook):
            now[0] += seconds
    with pytest.raises(ValueError), clock.timing(2, "on_upload"):  # a refused upload still took the server's time
        now[0] += 16.0
        raise ValueError("implausible")
    assert clock.take(1) == {"on_upload": 3.0, "complete": 4.0}
    assert clock.take(1) == {} and clock.take(2) == {"complete": 8.0, "on_upload": 16.0}


# --------------------------------------------------------------------------- #
# A throw-away method that meters nothing itself, end to end
# --------------------------------------------------------------------------- #

EPOCHS = 2
FORGETFUL_FILES = {
    "forgetful/__init__.py": '''
        """The registry entry of a throw-away method that trains and counts nothing itself."""

        from shared_protocol.registry import MethodSpec, register_method

        register_method(MethodSpec(name="forgetful", summary="trains a ResNet-8 locally, meters nothing by hand",
                                   server="forgetful.server", edge="forgetful.edge", config="forgetful.server:ForgetfulConfig",
                                   messages=("forgetful.messages",)))
    ''',
    "forgetful/messages.py": '''
        from __future__ import annotations  # the message registry reads field annotations as text

        from dataclasses import dataclass
        from typing import ClassVar

        from shared_protocol.messages import Message, register_message


        @register_message
        @dataclass(kw_only=True)
        class ForgetfulDone(Message):
            TYPE: ClassVar[str] = "forgetful.done"
            num_samples: int
    ''',
    "forgetful/edge.py": f'''
        import torch
        import torch.nn.functional as F

        from edge_agent.methods.base import EdgeMethod, EvalAnswer, RoundResult, register_edge_method
        from edge_agent.trainer import train_epochs
        from fldata.torch_data import make_loader
        from models import build_model
        from models.training import logits_of

        from .messages import ForgetfulDone


        @register_edge_method
        class ForgetfulEdge(EdgeMethod):
            name = "forgetful"

            def __init__(self, ctx):
                super().__init__(ctx)
                self.model = build_model("resnet8", int(ctx.settings["num_classes"]), ctx.train.in_channels)

            def run_round(self, start, meter):
                loader = make_loader(self.ctx.train, 32, shuffle=True, seed=start.round)
                optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
                # No declaration, no count: the loop meters the model it trains.
                train_epochs(self.model, loader, optimizer, lambda out, y, ids: F.cross_entropy(logits_of(out), y),
                             {EPOCHS}, meter=meter)
                self.ctx.send(ForgetfulDone(run=self.ctx.run_id, round=start.round, sender=self.ctx.agent_id,
                                            num_samples=len(self.ctx.train)), meter)
                return RoundResult(num_samples=len(self.ctx.train))

            def evaluate(self, request, meter):
                return EvalAnswer()
    ''',
    "forgetful/server.py": '''
        from dataclasses import dataclass

        import torch

        from cloud_server.evaluation import HEADLINE, EvalModel, Evaluation, local_results
        from cloud_server.methods.base import RoundOutcome, ServerMethod, register_server_method
        from shared_protocol.configs import config_from_table

        from .messages import ForgetfulDone


        @dataclass(frozen=True)
        class ForgetfulConfig:
            pass


        @register_server_method
        class ForgetfulServer(ServerMethod):
            name = "forgetful"
            upload_types = (ForgetfulDone,)

            def __init__(self, ctx, method_config):
                super().__init__(ctx, method_config)
                self.config = config_from_table(ForgetfulConfig, method_config, "forgetful")
                self.staged = {}

            def welcome_settings(self):
                return {"num_classes": self.ctx.num_classes}

            def round_config(self, round_, agent, evaluate):
                return {}, {}

            def on_upload(self, agent, msg):
                self.staged[agent] = msg

            def discard(self, agent):
                self.staged.pop(agent, None)

            def complete(self, round_, ends, evaluate):  # times nothing itself
                used = {a: self.staged.pop(a) for a in sorted(ends) if a in self.staged}
                return RoundOutcome(used_agents=list(used), samples=sum(m.num_samples for m in used.values()))

            def evaluation(self, round_, reports):
                def forward(images):  # (B, C, H, W) -> (B, K): class 0, whatever the image
                    return torch.zeros(images.shape[0], self.ctx.num_classes, device=images.device)

                return Evaluation(global_models={HEADLINE: {Evaluation.GLOBAL: EvalModel(forward)}},
                                  local=local_results(reports), labels={HEADLINE: "class 0"})

            def model_info(self):
                return {"edge": None, "server": None}
    ''',
}
#: The registries the throw-away method joins: restored after the test.
_REGISTRIES = (
    ("shared_protocol.registry", "_METHODS"), ("shared_protocol.registry", "_IMPORTED"),
    ("shared_protocol.message_base", "_MESSAGE_TYPES"), ("cloud_server.methods.base", "_SERVER_METHODS"),
    ("edge_agent.methods.base", "_EDGE_METHODS"),
)


@pytest.fixture
def forgetful(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for module, attr in _REGISTRIES:
        held = getattr(importlib.import_module(module), attr)
        monkeypatch.setattr(importlib.import_module(module), attr, type(held)(held))
    packages = tmp_path / "plugins"
    for name, text in FORGETFUL_FILES.items():
        path = packages / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setenv("EDGESPLIT_METHODS", "forgetful")
    yield
    for name in [m for m in sys.modules if m == "forgetful" or m.startswith("forgetful.")]:
        del sys.modules[name]


def test_a_method_that_counts_nothing_still_reports_its_training_and_server_time(forgetful: None, tmp_path: Path) -> None:
    config = method_server_config(tmp_path, "forgetful", {}, run_id="forgetful", agents=2, rounds=2)
    report = in_memory_federation(config, [agent_config("forgetful", i, 2) for i in range(2)]).start().join(timeout_s=600)
    assert report["status"] == "finished" and [r["status"] for r in report["rounds"]] == ["ok", "ok"]
    per_sample = layer_flops_per_sample(build_model("resnet8", 10, 3), (3, 32, 32)).training  # the synthetic set's images
    assert per_sample > 0
    for record in report["rounds"]:
        for agent, costs in record["per_agent"].items():
            assert costs["samples"] == 80 * EPOCHS, agent  # 160 training images over 2 agents
            assert costs["train_flops"] == per_sample * costs["samples"], agent
            assert costs["compute_s"] > 0, agent
        # The server step timed nothing; the coordinator timed its hooks.
        assert record["time_s"]["server_train"] == 0
        hooks = record["server_hooks_s"]
        assert {"round_config", "on_upload", "complete", "end_round"} <= set(hooks), hooks
        assert all(seconds > 0 for seconds in hooks.values()), hooks
    assert "evaluation" in report["rounds"][-1]["server_hooks_s"]  # the last round is evaluated


def test_every_registered_edge_step_trains_in_the_loop_that_meters() -> None:
    from edge_agent.methods import available_methods, get_edge_method

    for name in available_methods():
        classes = [c for c in get_edge_method(name).__mro__ if c.__module__.startswith("edge_agent.")]
        assert any("train_epochs(" in inspect.getsource(c) for c in classes), f"{name}: trains outside the shared loop"
