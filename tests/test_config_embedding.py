"""Config declared once: a server config holds the agents' round config (no copied ``edge_``
fields), optimiser names are checked in one place, and upload codecs against the registry."""

from __future__ import annotations

import dataclasses

import pytest

from cloud_server.methods.fedavg import FedAvgConfig
from cloud_server.methods.fedbe import FedBEConfig
from cloud_server.methods.fedgkt import FedGktConfig
from cloud_server.methods.splitnn import SplitNNConfig
from shared_protocol.codecs import list_codecs
from shared_protocol.configs import OPTIMIZERS, check_codec, check_optimizer
from shared_protocol.errors import ValueRangeError
from shared_protocol.methods.fedavg import FedAvgRoundConfig
from shared_protocol.methods.fedgkt import GktFeatures, GktRoundConfig
from shared_protocol.methods.splitnn import SplitRoundConfig


def test_the_server_configs_hold_the_round_config_instead_of_copying_its_fields() -> None:
    pairs = ((FedGktConfig, GktRoundConfig), (SplitNNConfig, SplitRoundConfig), (FedAvgConfig, FedAvgRoundConfig),
             (FedBEConfig, FedAvgRoundConfig))  # FedBE stands for the FedAvg family, whose configs extend FedAvg's
    for server_config, round_config in pairs:
        fields = {f.name: f for f in dataclasses.fields(server_config)}
        assert fields["edge"].type in (round_config, round_config.__name__)
        copied = {f.name for f in dataclasses.fields(round_config)} & set(fields)
        assert not copied, f"{server_config.__name__} repeats {copied}"
        # The server's own choices about the agents' model (which model, its initial weights, where it is
        # scored) are not agent settings; any other edge_* key would be a round config field copied.
        assert not any(name.startswith("edge_") and name not in ("edge_model", "edge_init", "edge_scoring") for name in fields)


def test_the_flat_tables_keep_their_keys_and_read_back() -> None:
    """Existing [fedgkt] / [splitnn] tables (deploy/configs, the launcher) stay valid, and the
    resolved config in reports and checkpoints is the same flat table."""
    gkt = FedGktConfig.from_dict({"edge_lr": 0.01, "edge_batch_size": 32, "temperature": 2.0, "upload_codec": "u8-zstd",
                                  "server_lr": 0.002, "kd": "s2e"})
    assert (gkt.edge.edge_lr, gkt.edge.batch_size, gkt.edge.temperature, gkt.edge.upload_codec) == (0.01, 32, 2.0, "u8-zstd")
    assert gkt.round_config() is gkt.edge and gkt.edge.edge_kd  # S->E: the agents still distil
    assert FedGktConfig.from_dict({"kd": "none"}).edge.edge_kd is False
    table = gkt.to_table()
    assert table["edge_batch_size"] == 32 and "batch_size" not in table and "edge_kd" not in table and "edge" not in table
    assert FedGktConfig.from_dict(table) == gkt
    split = SplitNNConfig.from_dict({"edge_optimizer": "sgd", "edge_lr": 0.05, "batch_size": 16, "local_epochs": 2})
    assert (split.edge.optimizer, split.edge.lr, split.edge.batch_size, split.edge.local_epochs) == ("sgd", 0.05, 16, 2)
    assert SplitNNConfig.from_dict(split.to_table()) == split
    # A key the table never had is still refused by name.
    with pytest.raises(ValueError, match=r"unknown \[fedgkt\] keys: \['edge_kd'\]"):
        FedGktConfig.from_dict({"edge_kd": False})
    with pytest.raises(ValueError, match=r"unknown \[splitnn\] keys: \['lr'\]"):
        SplitNNConfig.from_dict({"lr": 0.1})
    fedavg = FedAvgConfig.from_dict({"lr": 0.01, "local_epochs": 3, "upload_codec": "raw", "download_codec": "fp16-zstd"})
    sent = fedavg.round_config(4, {"bn.num_batches_tracked": 7})
    assert (sent.lr, sent.local_epochs, sent.upload_codec, sent.model_version, sent.int_buffers) == (0.01, 3, "raw", 4, {"bn.num_batches_tracked": 7})
    assert FedAvgConfig.from_dict(fedavg.to_table()) == fedavg and "model_version" not in fedavg.to_table()
    with pytest.raises(ValueError, match=r"unknown \[fedavg\] keys: \['model_version'\]"):
        FedAvgConfig.from_dict({"model_version": 2})  # the server's, per round


def test_optimiser_names_are_checked_in_one_place() -> None:
    assert check_optimizer("sgd") == "sgd"
    for make in (lambda: GktRoundConfig(edge_optimizer="lamb"), lambda: SplitRoundConfig(optimizer="lamb"),
                 lambda: FedGktConfig(server_optimizer="lamb"), lambda: SplitNNConfig.from_dict({"edge_optimizer": "lamb"})):
        with pytest.raises(ValueError, match=rf"must be one of {OPTIMIZERS!r}".replace("(", r"\(").replace(")", r"\)")):
            make()


def test_the_upload_codec_has_one_default_checked_against_the_registry() -> None:
    assert GktRoundConfig().upload_codec == GktFeatures.DEFAULT_CODECS["features"] == FedGktConfig().edge.upload_codec
    with pytest.raises(ValueError, match="unknown codec 'fp8'; known codecs") as refused:
        FedGktConfig.from_dict({"upload_codec": "fp8"})
    assert all(name in str(refused.value) for name in list_codecs())
    with pytest.raises(ValueError, match="unknown codec"):
        check_codec("fp8")
    # Off the wire, the same refusal is a rejected message, not a crash.
    with pytest.raises(ValueRangeError, match="unknown codec 'fp8'"):
        GktRoundConfig.from_dict({"upload_codec": "fp8"})
    for name in list_codecs():
        assert GktRoundConfig(upload_codec=name).upload_codec == name
