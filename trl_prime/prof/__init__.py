"""PROF: process-consistency filtering of rollouts with a step PRM (arXiv 2509.03403).

- :mod:`~trl_prime.prof.config`: the ``prof_*`` fields and :class:`ProfGRPOConfig` (imports no trainer).
- :mod:`~trl_prime.prof.step_prm`: step PRMs behind one interface.
- :mod:`~trl_prime.prof.filter`: :class:`ProfFilter`, composed by any trainer.
- :mod:`~trl_prime.prof.trainer`: :class:`ProfGRPOTrainer`.
"""

from trl_prime._lazy import attach


__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "ProfOptions": "config",
        "ProfGRPOConfig": "config",
        "StepBatch": "step_prm",
        "StepPRM": "step_prm",
        "TokenClassificationStepPRM": "step_prm",
        "ImplicitStepPRM": "step_prm",
        "load_step_prm": "step_prm",
        "ProfFilter": "filter",
        "ProfGRPOTrainer": "trainer",
    },
)
