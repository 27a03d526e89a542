"""The implicit process reward model (Implicit PRM arXiv 2412.01981; PRIME arXiv 2502.01456 Eq. 3).

- :mod:`~trl_prime.implicit_prm.model`: :class:`ImplicitPRM` (token, step and sequence rewards).
- :mod:`~trl_prime.implicit_prm.config` / :mod:`~trl_prime.implicit_prm.trainer`: offline training on outcome labels
  (CE / DPO / KTO / NCA).
- :mod:`~trl_prime.implicit_prm.data`: training rows from a policy and a verifier.
- :mod:`~trl_prime.implicit_prm.best_of_n`: best-of-N reranking.
"""

from trl_prime._lazy import attach


__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "ImplicitPRM": "model",
        "ImplicitPRMConfig": "config",
        "ImplicitPRMTrainer": "trainer",
        "build_outcome_dataset": "data",
        "sample_completions": "data",
        "best_of_n": "best_of_n",
        "score_candidates": "best_of_n",
    },
)
