# Copyright 2025 The trl-prime developers. Licensed under the Apache License, Version 2.0.
"""Pure tensor functions of PRIME, the Implicit PRM, PRL and PROF.

Everything here is a side-effect-free function of tensors: no trainer, no model, no global state (the
only randomness, PROF's ``mode="correct"``, goes through an explicit ``torch.Generator``). Functions work
on any device and floating dtype (half precision inputs are reduced in float32 internally and cast back),
keep the autograd graph of their inputs, and are vectorised over tokens.

Conventions:

* ``B`` completions, ``T`` padded completion length, completions right-padded. ``mask`` is ``(B, T)``
  bool or 0/1 and is 1 on real completion tokens (EOS included). Masks are never inferred from token
  values.
* Groups (completions of one prompt) are given either by ``group_ids`` ``(B,)`` (integer tensor, or any
  sequence of hashables; any order, any group size) or, for contiguous equal groups, by
  ``num_generations``.
* Outcome rewards ``(B,)`` may be ``NaN`` = unscorable: such rows are excluded from every mean, std and
  baseline, get advantage 0 and loss weight 0.
* Values at padded positions are unspecified by the papers; the advantage functions here return 0 there.

Sources: PRIME (arXiv 2502.01456), Implicit PRM (arXiv 2412.01981), PRL (arXiv 2601.10201), PROF
(arXiv 2509.03403). Where the authors' released code differs from the paper, the paper is the default
and the released behaviour is a named option.

Each method's equations live in its package (:mod:`trl_prime.prime.functional` and PRIME's advantage estimators,
:mod:`trl_prime.prime.estimators`; :mod:`trl_prime.prl.functional`, :mod:`trl_prime.prof.functional`,
:mod:`trl_prime.implicit_prm.functional`), the shared helpers in :mod:`trl_prime.ops` and the option tuples in
:mod:`trl_prime.options`; this module re-exports them, the one public namespace.
"""

from trl_prime.implicit_prm.functional import (
    aggregate_step_rewards,
    class_balanced_weights,
    implicit_prm_loss,
    implicit_token_rewards,
    join_steps,
    sequence_logps,
    split_steps,
    step_end_mask,
    step_rewards,
    token_logps,
)
from trl_prime.ops import (  # noqa: F401  (kept importable from here)
    GroupIds,
    discounted_cumsum,
    fill_from_step_end,
    grpo_advantages,
    last_token_mask,
    left_fill_by_next_nonzero,
    masked_mean,
    masked_whiten,
    process_reward_batch_norm,
    single_row_group_mask,
)
from trl_prime.options import (  # noqa: F401  (IMPLICIT_VALUE_SCALES: public, not in __all__)
    BASELINES,
    GROUP_SCALE_REWARDS,
    GRPO_PROCESS_FORMS,
    GRPO_PROCESS_SCALES,
    IMPLICIT_VALUE_SCALES,
    PAIR_ACCURACY_TIES,
    PAIRWISE_PRM_LOSSES,
    PRIME_VALUES,
    PRL_ORDERS,
    PRL_STEP_SPLITS,
    PRM_LABELS,
    PRM_LOSSES,
    PRM_REFERENCES,
    PRM_SCHEDULERS,
    PRM_UPDATES,
    PROCESS_REWARD_NORMS,
    PROF_CENTERS,
    PROF_LOSS_TYPES,
    PROF_MODES,
    PROF_PENALTY_POSITIONS,
    PROF_ROUNDINGS,
    PROF_SELECT_MODES,
    SCALE_REWARDS,
    SEQUENCE_LEVEL_LOSS_TYPES,
    STEP_AGGREGATIONS,
    check_choice,
)
from trl_prime.prime.estimators import ESTIMATORS, prime_advantages
from trl_prime.prime.functional import (  # noqa: F401  (kept importable from here)
    _LABEL_RANGE_ATOL,
    clipped_value_loss,
    explained_variance,
    gae_advantages,
    implicit_prm_values,
    ppo_token_rewards,
    prm_abs_accuracy,
    prm_label_warnings,
    prm_labels,
    prm_pair_accuracy,
    prompt_accuracy_mask,
    rloo_advantages,
    token_ppo_clip_loss,
)
from trl_prime.prl.functional import (
    prl_advantages,
)
from trl_prime.prof.functional import (  # noqa: F401  (kept importable from here)
    _rank_within_class,
    prof_consistency_scores,
    prof_select,
    prof_step_scores_from_implicit,
    prof_step_scores_from_logits,
)


__all__ = [
    "implicit_token_rewards",
    "token_logps",
    "sequence_logps",
    "implicit_prm_loss",
    "class_balanced_weights",
    "step_rewards",
    "aggregate_step_rewards",
    "split_steps",
    "join_steps",
    "step_end_mask",
    "masked_mean",
    "masked_whiten",
    "last_token_mask",
    "discounted_cumsum",
    "process_reward_batch_norm",
    "left_fill_by_next_nonzero",
    "fill_from_step_end",
    "rloo_advantages",
    "grpo_advantages",
    "prime_advantages",
    "single_row_group_mask",
    "ppo_token_rewards",
    "implicit_prm_values",
    "gae_advantages",
    "clipped_value_loss",
    "explained_variance",
    "token_ppo_clip_loss",
    "prompt_accuracy_mask",
    "prm_pair_accuracy",
    "prm_abs_accuracy",
    "prm_labels",
    "prm_label_warnings",
    "prl_advantages",
    "prof_step_scores_from_logits",
    "prof_step_scores_from_implicit",
    "prof_consistency_scores",
    "prof_select",
    "check_choice",
    "PRM_LOSSES",
    "PAIRWISE_PRM_LOSSES",
    "PRM_UPDATES",
    "PRM_REFERENCES",
    "PRM_SCHEDULERS",
    "ESTIMATORS",
    "PRIME_VALUES",
    "BASELINES",
    "PROCESS_REWARD_NORMS",
    "GRPO_PROCESS_FORMS",
    "GRPO_PROCESS_SCALES",
    "GROUP_SCALE_REWARDS",
    "SCALE_REWARDS",
    "PRM_LABELS",
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
]
