"""DeepSpeed over gloo on CPU for the two-process test scripts.

DeepSpeed's CPU backend JIT-compiles a shared-memory collective op (``deepspeed_shm_comm``, ~2 min of C++ on 2 cores)
at its first ``init_distributed`` in a venv, under a file lock with no timeout: a launch killed by a test's timeout
while it compiles leaves the lock behind and every later DeepSpeed launch waits on it forever (CI lost its ZeRO tests
and its time limit that way). The op only speeds up intra-node collectives; gloo gives the same results, so the test
scripts mark it unavailable, as DeepSpeed does on platforms without it."""

from __future__ import annotations


def gloo_state():
    """The process's ``PartialState`` over gloo (accelerate 1.15 sets no backend on CPU), without the shm op."""
    import deepspeed.ops
    from accelerate import PartialState

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return PartialState(backend="gloo")
