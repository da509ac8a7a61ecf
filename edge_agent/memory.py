"""Keep the agent's resident memory close to what it uses.

glibc's malloc serves a request above its mmap threshold with a fresh mapping
and gives it back to the system on ``free``; below it, memory comes from the
heap, which only shrinks from the top. The threshold starts at 128 KiB but
rises to the size of every mapped block freed (up to 32 MiB), so after the first
training step the multi-megabyte activation tensors of a ResNet-8 batch (torch,
and onnxruntime without its arena) all land on the heap, fragment it, and the
process keeps the high-water mark of every round, plus the fragmentation, as
RSS. A fixed threshold stops that adjustment: bench/micro/test_footprint.py's agent runs
(bench/results/footprint.json) show the RSS between rounds and the peaks of
both backends falling with it, and the ort agent's peak no longer growing from
round to round.

It is not free: every large activation is then a fresh mapping whose pages the
kernel must fault in and zero at every step, so a training step is slower with
the threshold pinned (bench/results/step_memory.json, ``test_torch_step``'s
``step_ms_median``, malloc against pinned). So the agent pins it only when asked (``[memory]
pin_malloc``, part of ``edge-agent run --low-memory``): for a device where
memory, not time, is what runs out.

What ``--low-memory`` takes (:meth:`edge_agent.config.MemoryConfig.low`) and why:

* micro-batches of 16 samples for every forward pass (training accumulates their
  gradients into the round's batch; extraction and evaluation run in slices;
  uploads carry at most 64 samples). A ResNet-8 training step keeps about 2 MB
  of activations per sample for its backward pass, so the step's share of the
  peak falls with the micro-batch, not the batch. BatchNorm then normalises
  each micro-batch with its own statistics (its running statistics are updated
  once per micro-batch with a momentum that keeps their time constant in
  samples): the one change to the computation, whose accuracy cost
  bench/experiments/low_memory.toml measures;
* the pinned malloc threshold above.

Between rounds the agent gives the free pages inside malloc's heaps back
(:func:`trim_malloc`, after each round and each evaluation): whatever the
threshold, what a round freed would otherwise stay resident, and a heap that
fragments a little differently every round kept a little more every round
(the long runs of bench/results/footprint.json, before the trim, held a heap of
free pages between rounds).

``[memory] checkpoint_blocks`` (not in the preset) makes the torch backend's
edge model recompute each bottleneck block's activations in the backward pass
instead (:func:`models.memory.checkpoint_bottlenecks`: same losses, gradients
and BN statistics; more training FLOPs and a slower step, as
bench/results/step_memory.json records): exact where micro-batches are not, but
it saves less.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import MemoryConfig

__all__ = ["MEASURED_PEAK_MB", "MMAP_THRESHOLD_BYTES", "PEAK_FROM_LONG_RUN", "apply_process_memory", "fix_malloc_mmap_threshold", "lighten_model", "memory_mode",
           "trim_malloc"]

#: Allocations from this size up are mapped and returned to the system when freed.
MMAP_THRESHOLD_BYTES = 1024 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


#: The agent's measured peak RSS in MB (FedGKT, ResNet-8, batch 64, x86_64, CPU-only torch),
#: by (backend, memory mode): the most any round held in bench/results/footprint.json's long
#: runs (``test_long_run``: 30 rounds over MQTT, every shard size; the short runs' figure for a mode
#: without a long run: ``test_first_rounds``), rounded up: the long-run plateau, not the first rounds'
#: (tests/test_memory_doctor.py keeps the two equal). ``edge-agent doctor`` compares them with
#: the device's memory.
MEASURED_PEAK_MB = {('torch', 'default'): 619, ('torch', 'low-memory'): 328, ('ort', 'default'): 272, ('ort', 'low-memory'): 134}
#: The (backend, memory mode) pairs of :data:`MEASURED_PEAK_MB` taken from the long runs (the others
#: from the first rounds: two rounds at 1,000 samples, one at 16,000).
PEAK_FROM_LONG_RUN = frozenset({("torch", "default"), ("torch", "low-memory"), ("ort", "low-memory")})


def memory_mode(memory: "MemoryConfig") -> str:
    """``"low-memory"`` for ``--low-memory``'s settings, ``"default"`` for none, ``"custom"`` otherwise."""
    from .config import MemoryConfig

    if memory == MemoryConfig.low():
        return "low-memory"
    return "default" if memory == MemoryConfig() else "custom"


def apply_process_memory(memory: "MemoryConfig") -> bool:
    """The process-wide part of ``memory`` (the malloc threshold); True if it was pinned.

    Call it before the first big allocation (the CLI does, right after parsing).
    """
    return fix_malloc_mmap_threshold() if memory.pin_malloc else False


def lighten_model(model, memory: "MemoryConfig"):  # type: ignore[no-untyped-def]
    """``model`` with checkpointed bottleneck blocks if ``memory.checkpoint_blocks``; ``model`` unchanged otherwise.

    A model without bottleneck blocks is returned as it is (there is nothing
    big to recompute in it). Imports torch only when it does something, so the
    ort agent never pulls it in.
    """
    if not memory.checkpoint_blocks:
        return model
    from models.memory import checkpoint_bottlenecks, has_bottlenecks

    return checkpoint_bottlenecks(model) if has_bottlenecks(model) else model


def _glibc():  # type: ignore[no-untyped-def]
    """The C library where it is glibc on Linux (None elsewhere: macOS, musl manage memory their own way)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


def trim_malloc() -> bool:
    """Give the free pages inside every malloc arena back to the system (glibc's ``malloc_trim(0)``);
    True if it released any, False where there was nothing to release or the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim.restype = ctypes.c_int
    return bool(libc.malloc_trim(0))


def fix_malloc_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``threshold_bytes``; True if it was set.

    A no-op (False) where the C library is not glibc (macOS, musl): they manage
    large blocks their own way.
    """
    if threshold_bytes < 1:
        raise ValueError(f"threshold_bytes must be >= 1, got {threshold_bytes}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
