"""PRL: process reward learning from KL-regularised reward-to-go (arXiv 2601.10201), on TRL's GRPO trainer."""

from trl_prime._lazy import attach


__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "PRLConfig": "config",
        "PRLGRPOTrainer": "trainer",
    },
)
