"""Outcome verifiers as TRL reward functions.

- :func:`math_reward`: final answers checked with ``math-verify`` in worker processes with hard timeouts.
- :func:`code_reward`: programs run against test cases in a jail (see :mod:`trl_prime.rewards.sandbox`).
- :mod:`trl_prime.rewards.registry`: which verifier scores which rows (one entry per verifier).

Both return one float per completion (``None`` when the completion cannot be scored, which TRL turns
into NaN and excludes from every mean and baseline), and report how many results had each reason.
The verifiers are imported on first use, so reading the registry stays cheap.
"""

from importlib import import_module


# public name -> submodule that defines it
_LAZY = {
    "math_reward": "trl_prime.rewards.math_verifier",
    "make_math_reward": "trl_prime.rewards.math_verifier",
    "verify_math": "trl_prime.rewards.math_verifier",
    "MathResult": "trl_prime.rewards.math_verifier",
    "code_reward": "trl_prime.rewards.code_verifier",
    "make_code_reward": "trl_prime.rewards.code_verifier",
    "verify_code": "trl_prime.rewards.code_verifier",
    "CodeResult": "trl_prime.rewards.code_verifier",
    "Verifier": "trl_prime.rewards.registry",
    "register_verifier": "trl_prime.rewards.registry",
    "get_verifier": "trl_prime.rewards.registry",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_prime.rewards' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
