"""One way from a server config to a running server (cloud-server run, the launcher's
config check, the benches and these tests all use it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cloud_server.assemble import build_server, build_server_method, resolve_device
from cloud_server.coordinator import Coordinator
from cloud_server.methods.fedavg import FedAvgServer
from shared_protocol.transport import InMemoryBroker, InMemoryTransport

from fedhelpers import method_server_config

FEDAVG_SMALL = {"model": "resnet8", "batch_size": 32}


def test_build_server_wires_the_configs_method_to_the_transport(tmp_path: Path) -> None:
    config = method_server_config(tmp_path, "fedavg", FEDAVG_SMALL, agents=2, rounds=3, seed=4)
    transport = InMemoryTransport(InMemoryBroker(), "server")
    server = build_server(config, transport, device="cpu")
    assert isinstance(server, Coordinator) and isinstance(server.method, FedAvgServer)
    assert server.transport is transport
    ctx = server.method.ctx
    assert (ctx.device, ctx.rounds, ctx.seed, ctx.run_id) == ("cpu", 3, 4, config.run_id)
    assert server.method.config.model == "resnet8"


def test_the_methods_config_class_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    config = method_server_config(tmp_path, "fedavg", {**FEDAVG_SMALL, "modle": "resnet8"}, agents=2)
    with pytest.raises(ValueError, match=r"unknown \[fedavg\] keys: \['modle'\]"):
        build_server_method(config, device="cpu")
    with pytest.raises(ValueError, match="unknown method 'nosuch'"):
        build_server_method(replace(config, method="nosuch", method_config={}), device="cpu")


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")
