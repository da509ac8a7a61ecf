"""Which attacks the audit runs on which method, under which assumptions about the server."""

from __future__ import annotations

import dataclasses

import pytest

from cloud_server.audit import (ATTACKS, PAYLOADS, AttackSpec, MethodExposure, ServerKnowledge, UnknownAuditMethodError,
                                attacks_for, audited_methods, register_exposure)
from shared_protocol.registry import method_names


def test_every_registered_method_has_an_audit_entry() -> None:
    assert set(method_names()) <= set(audited_methods())


@pytest.mark.parametrize("method", sorted(method_names()))
def test_every_method_is_open_to_at_least_one_attack(method: str) -> None:
    plan = attacks_for(method)
    assert plan.method == method
    assert plan.attacks, f"{method}: no attack applies to what it uploads"
    assert set(plan.uploads) <= set(PAYLOADS)


def test_fedgkt_default_is_open_to_every_activation_attack() -> None:
    plan = attacks_for("fedgkt")
    assert plan.knowledge.extractor_weights and plan.knowledge.public_images
    assert plan.attack_names == ("white_box_inversion", "inverse_network", "architecture_only", "labels_in_the_clear",
                                 "logit_histogram")


def test_a_server_without_the_extractor_leaves_the_architecture_only_attack() -> None:
    plan = attacks_for("fedgkt", ServerKnowledge(extractor_weights=False))
    assert "white_box_inversion" not in plan.attack_names and "inverse_network" not in plan.attack_names
    assert "architecture_only" in plan.attack_names
    assert attacks_for("fedgkt").knowledge.extractor_weights  # the default entry is unchanged


@pytest.mark.parametrize("method", ["fedavg", "fedbe", "feddistill", "fedgkd", "fedkd"])
def test_weight_sharing_methods_face_update_inversion_and_bias_labels(method: str) -> None:
    plan = attacks_for(method)
    assert plan.knowledge.start_model and plan.knowledge.local_schedule
    assert plan.attack_names == ("update_inversion", "bias_update_labels")
    without_schedule = attacks_for(method, dataclasses.replace(plan.knowledge, local_schedule=False))
    assert without_schedule.attacks == ()


def test_split_learning_sends_labels_and_activations() -> None:
    plan = attacks_for("splitnn")
    assert set(plan.uploads) == {"activations", "labels"}
    assert "logit_histogram" not in plan.attack_names


def test_unknown_methods_and_duplicates_are_refused() -> None:
    with pytest.raises(UnknownAuditMethodError, match="fedgkt"):
        attacks_for("fedprox")
    with pytest.raises(ValueError, match="already"):
        register_exposure(MethodExposure("fedavg", ("weight_update",), ServerKnowledge()))


def test_specs_refuse_unknown_payloads_and_knowledge() -> None:
    with pytest.raises(ValueError, match="payloads"):
        MethodExposure("x", ("gradients",), ServerKnowledge())
    with pytest.raises(ValueError, match="knowledge"):
        AttackSpec("x", ("activations",), ("the_keys",), "images", "")
    with pytest.raises(ValueError, match="scores"):
        AttackSpec("x", ("activations",), (), "pixels", "")
    with pytest.raises(ValueError, match="knowledge item"):
        ServerKnowledge().holds("note")
    assert all(spec.name == name for name, spec in ATTACKS.items())
