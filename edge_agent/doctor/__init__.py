"""``edge-agent doctor``: check that this device can run an agent, and say what is wrong.

Each check returns a :class:`Check` with a status, what was found, and -- when
something is wrong -- what to do about it, in plain words. Checks run in order
and later ones are skipped when what they need failed (no broker check without a
readable config). Nothing here imports torch or onnxruntime at module level:
the doctor must run in an environment where they are missing, to say so.

Checks: Python version; the training backend (torch, or onnxruntime-training
for ``--backend ort``) and the agent's other dependencies; the config file;
credentials (password file, CA, client certificate); broker reachability (DNS,
TCP); TLS (handshake, certificate chain and host name, plain port mistaken for
TLS and the reverse); MQTT login (username/password); the data directory and
dataset; the state directory.

:mod:`.run` runs them in order (:func:`run_checks`); the checks themselves live in
:mod:`.device`, :mod:`.network` and :mod:`.data`, what a check says and how it prints
in :mod:`.report`. This package gathers their public names.
"""

from __future__ import annotations

from .data import check_data, contract_mismatch, data_fix
from .device import (
    MIN_PYTHON,
    check_backend,
    check_credentials,
    check_dependencies,
    check_memory,
    check_python,
    check_state_dir,
    meminfo_bytes,
)
from .network import check_login, check_reachable, check_tls
from .report import FAIL, OK, SKIP, WARN, Check, render
from .run import DEFAULT_CONFIG, DoctorOptions, connection_checks, main, run_checks

__all__ = [
    "DEFAULT_CONFIG", "FAIL", "MIN_PYTHON", "OK", "SKIP", "WARN", "Check", "DoctorOptions", "check_backend",
    "check_credentials", "check_data", "check_dependencies", "check_login", "check_memory", "check_python",
    "check_reachable", "check_state_dir", "check_tls", "connection_checks", "contract_mismatch", "data_fix", "main",
    "meminfo_bytes", "render", "run_checks",
]
