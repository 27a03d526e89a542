# Copyright 2025 The trl-prime developers. Licensed under the Apache License, Version 2.0.
"""The allowed values of every string option of trl-prime, and their one check.

Each tuple is the one source of the choices a config field and a function of :mod:`trl_prime.functional` accept
(configs validate against the same objects, through :func:`check_choice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


__all__ = [
    "PRM_LOSSES",
    "PAIRWISE_PRM_LOSSES",
    "PRM_UPDATES",
    "PRM_REFERENCES",
    "PRM_SCHEDULERS",
    "PRIME_VALUES",
    "BASELINES",
    "PROCESS_REWARD_NORMS",
    "GRPO_PROCESS_FORMS",
    "GRPO_PROCESS_SCALES",
    "GROUP_SCALE_REWARDS",
    "SCALE_REWARDS",
    "PRM_LABELS",
    "IMPLICIT_VALUE_SCALES",
    "SEQUENCE_LEVEL_LOSS_TYPES",
    "STEP_AGGREGATIONS",
    "PRL_STEP_SPLITS",
    "PRL_ORDERS",
    "PROF_SELECT_MODES",
    "PROF_MODES",
    "PROF_PENALTY_POSITIONS",
    "PROF_ROUNDINGS",
    "PROF_CENTERS",
    "PROF_LOSS_TYPES",
    "PAIR_ACCURACY_TIES",
    "check_choice",
]

#: implicit PRM losses (Implicit PRM arXiv 2412.01981 Sec. 3; PRIME arXiv 2502.01456 Eq. 4 is "ce"):
#: ``PrimeOptions.prm_loss``, ``ImplicitPRMConfig.loss_type``, :func:`implicit_prm_loss`
PRM_LOSSES = ("ce", "dpo", "kto", "nca")


#: the implicit PRM losses that pair the completions of one prompt (Implicit PRM Sec. 3: DPO, NCA)
PAIRWISE_PRM_LOSSES = ("dpo", "nca")


#: PRIME's PRM update order (PRIME Algorithm 1 vs the released code): ``PrimeOptions.prm_update``
PRM_UPDATES = ("single", "double")


#: reference of the implicit PRM (PRIME Appendix B.1): ``PrimeOptions.prm_reference``
PRM_REFERENCES = ("sft", "policy")


#: ``transformers.get_scheduler`` names offered for the PRM optimizer: ``PrimeOptions.prm_lr_scheduler``
PRM_SCHEDULERS = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)


#: what PPO's values come from (PRIME Table 4: a learned value model, or the implicit PRM as value, section 5.4):
#: ``PrimeOptions.prime_value``
PRIME_VALUES = ("critic", "implicit_prm")


#: process-reward baselines (PRIME Eq. 5 vs the released code): ``PrimeOptions.prime_baseline``, ``baseline``
BASELINES = ("paper", "reference")


#: process-reward normalisations (released PRIME code): ``process_reward_norm``
PROCESS_REWARD_NORMS = ("none", "batch_norm")


#: process term of the "grpo" estimator (PRIME Appendix B.3, Eq. 8): ``grpo_process_form``
GRPO_PROCESS_FORMS = ("response", "token")


#: divisor of the "grpo" estimator's process term: ``grpo_process_scale``
GRPO_PROCESS_SCALES = ("process_std", "outcome_std")


#: TRL's ``scale_rewards`` values a group-normalised outcome accepts (GRPO, DeepSeekMath arXiv 2402.03300 Sec. 4.1)
GROUP_SCALE_REWARDS = ("group", "none")


#: every TRL ``scale_rewards`` value (TRL 1.16 ``GRPOConfig``): the divisor of the group-centred outcome is the group
#: std, the std over the batch's scorable rows, or none: :func:`grpo_advantages`, :func:`prime_advantages` ("grpo"),
#: :func:`prl_advantages`, ``PrimeGRPOConfig`` / ``PRLConfig`` ``scale_rewards``
SCALE_REWARDS = ("group", "batch", "none")


#: how the implicit PRM's training label is derived from the outcome reward (PRIME arXiv 2502.01456 Eq. 4 trains
#: on labels in [0, 1]): ``PrimeOptions.prm_label``, :func:`prm_labels` ``mode``
PRM_LABELS = ("identity", "threshold", "sigmoid", "group_rank")


#: scales of the implicit PRM's prefix value as PPO's baseline (PRIME section 5.4): the prefix sum of token rewards
#: (a logit of the PRM's CE) or its sigmoid (a probability of the label): ``PrimeOptions.prime_value_scale``,
#: :func:`implicit_prm_values` ``scale``
IMPLICIT_VALUE_SCALES = ("logit", "prob")


#: TRL ``loss_type`` values that take one advantage per sequence: none of the token-level (B, T) advantages of PRIME
#: (Eq. 5) or PRL (Algorithm 1) fits them
SEQUENCE_LEVEL_LOSS_TYPES = ("luspo", "vespo")


#: aggregations of step rewards into one value (Implicit PRM arXiv 2412.01981 Sec. 4): :func:`aggregate_step_rewards`
STEP_AGGREGATIONS = ("min", "mean", "sum", "last")


#: step segmentations (PRL arXiv 2601.10201 Sec. 4: "length", every 256 tokens): ``PRLConfig.prl_step_split``,
#: :func:`step_end_mask` ``split``
PRL_STEP_SPLITS = ("length", "newline", "double_newline", "token")


#: PRL orders (PRL Algorithm 1 vs the released code's ``prm_adv='prm'``): ``PRLConfig.prl_order``,
#: :func:`prl_advantages` ``order``
PRL_ORDERS = ("advantage_first", "process_first")


#: PROF selection modes (PROF arXiv 2509.03403 Sec. 3: PROF-BOTH, PROF-POS): :func:`prof_select` ``mode``
PROF_SELECT_MODES = ("both", "correct")


#: ``prof_mode`` of the configs: a selection mode, or "off" (no filter)
PROF_MODES = (*PROF_SELECT_MODES, "off")


#: where PROF's step-count penalty enters the critic (PROF Eq. 1): ``prof_penalty_position``, ``penalty_position``
PROF_PENALTY_POSITIONS = ("reference", "paper")


#: rounding of the correct rows removed per prompt (PROF Alg. 1): ``prof_rounding``, ``rounding``
PROF_ROUNDINGS = ("half_even", "half_up", "half_down")


#: PROF consistency centring (paper: "none"; released code: "batch"): ``prof_center``, ``center``
PROF_CENTERS = ("none", "batch")


#: TRL ``loss_type`` values normalised by the kept tokens of the whole generation batch (``num_items_in_batch``), the
#: only ones under which the rows PROF drops do not scale the update: TRL's "grpo", "sapo" and "dr_grpo" count the
#: dropped rows, "bnpo" normalises each micro-batch by its own kept tokens
PROF_LOSS_TYPES = ("dapo", "cispo")


#: tie handling of :func:`prm_pair_accuracy`
PAIR_ACCURACY_TIES = ("reference", "half")


def check_choice(value: Any, choices: Sequence[str], name: str) -> None:
    """Check that option ``name`` holds one of ``choices`` (one of the option tuples above).

    Args:
        value: the option's value.
        choices: the allowed values.
        name: the option's name (a config field or a function argument), named in the message.

    Raises:
        ValueError: ``value`` is not in ``choices``; the message names the field, the value and the allowed choices,
            e.g. ``prime_baseline='loo' is not supported; choose one of 'paper', 'reference'.``
    """
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}.")
