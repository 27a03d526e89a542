"""PRIME: process reinforcement through implicit rewards (arXiv 2502.01456), on TRL's RLOO and GRPO trainers.

- :mod:`~trl_prime.prime.config`: :class:`PrimeOptions` (every paper hyperparameter) and the RLOO / GRPO configs.
- :mod:`~trl_prime.prime.trainer`: :class:`PrimeRLOOTrainer`, :class:`PrimeGRPOTrainer` (Algorithm 1).
"""

from trl_prime._lazy import attach


__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "PrimeOptions": "config",
        "PrimeRLOOConfig": "config",
        "PrimeGRPOConfig": "config",
        "PrimeRLOOTrainer": "trainer",
        "PrimeGRPOTrainer": "trainer",
    },
)
