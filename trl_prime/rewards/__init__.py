"""Outcome verifiers as TRL reward functions.

- :func:`math_reward`: final answers checked with ``math-verify`` in worker processes with hard timeouts.
- :func:`code_reward`: programs run against test cases in a sandboxed subprocess.

Both return one float per completion (``None`` when the completion cannot be scored, which TRL turns
into NaN and excludes from every mean and baseline), and report how many results had each reason.
"""

from trl_prime.rewards.code_verifier import CodeResult, code_reward, verify_code  # noqa: F401
from trl_prime.rewards.math_verifier import MathResult, make_math_reward, math_reward, verify_math  # noqa: F401


__all__ = ["math_reward", "make_math_reward", "verify_math", "MathResult", "code_reward", "verify_code", "CodeResult"]
