"""bench/kd_pilots.py: a pilot's changes are parsed into the scale's and the local training's
keys, and anything else is refused with the keys it takes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import kd_pilots  # noqa: E402


def test_a_pilot_is_a_name_and_its_changes() -> None:
    assert kd_pilots.parse_pilot("base:") == ("base", {})
    assert kd_pilots.parse_pilot("n20k-e5:train_samples=20000,local_epochs=5") == ("n20k-e5", {"train_samples": 20000.0, "local_epochs": 5.0})
    assert kd_pilots.parse_pilot("lr:lr=0.01") == ("lr", {"lr": 0.01})


@pytest.mark.parametrize("text", [":lr=0.1", "x:momentum=0.5", "x:lr"])
def test_a_malformed_pilot_is_refused_naming_the_keys(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        kd_pilots.parse_pilot(text)
