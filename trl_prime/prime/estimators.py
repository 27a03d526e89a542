"""PRIME's advantage estimators (PRIME arXiv 2502.01456 Eq. 5, Appendix B.3, Table 4): one registry.

Each estimator is one :class:`AdvantageEstimator` entry, PEFT's ``register_peft_method`` style: its name (the value of
``PrimeOptions.prime_estimator`` and of :func:`prime_advantages`' ``estimator``), its function, the options
:func:`prime_advantages` forwards to it, the :class:`~trl_prime.prime.config.PrimeOptions` fields the trainers read
into those options, and what the trainer must provide (a value model's values for GAE). Adding an estimator is one
function and one :func:`register_advantage_estimator` call; the configs, the trainers and :func:`prime_advantages`
look it up with :func:`get_advantage_estimator`, and nothing else compares estimator names.

Built in: ``"rloo"`` (PRIME Eq. 5, :func:`~trl_prime.prime.functional.rloo_advantages`), ``"grpo"`` (Appendix B.3,
Eq. 8, below), ``"reinforce"`` (Appendix B.3, Eq. 7: no baseline) and ``"ppo"`` (Table 4: GAE against a value model,
or the implicit PRM as value, section 5.4).

**The "grpo" estimator** (PRIME Appendix B.3, Eq. 8): group-normalised process and outcome terms. With ``rbar^j``
the mean token reward of completion j over its mask of ``L_j`` tokens, and ``mean_g`` / ``std_g`` the group mean /
unbiased std over the group's K scorable rows, the outcome term is ``(r_o^i - mean_g r_o) / (std_g r_o + eps)`` at
the last token and the process term, for token t, is chosen by ``grpo_process_form``:

- ``"token"`` (default): the printed Eq. 8, ``sum_{s>=t} gamma^(s-t) (r_s^i - mean_g rbar) / D``, each token
  reward centred on the group mean of the completions' mean token rewards, summed as Eq. 5 sums it. With the
  default divisor ``D = std_g r_o + eps`` (below) the process term keeps Eq. 5's size relative to the outcome
  term: both are the RLOO-style sums of Eq. 5, centred on the group and divided by one common scale. Worked
  example (K=8, one right completion, L=24 tokens each, a PRM that ranks correctly: +0.03 per token on the
  right completion, -0.03/7 on the others): on a wrong row the process part of ``A_0`` is 0.82 of the outcome
  part, as with the RLOO estimator (Eq. 5).
- ``"response"``: ``(1/L_i) sum_{s>=t} gamma^(s-t) (r_s^i - mean_g rbar) / D``, the reward-to-go measured in
  whole responses. At ``t=0`` (``gamma=1``) it is ``(rbar^i - mean_g rbar) / D``: with ``D = std_g rbar + eps``
  exactly the group z-score of the completion's mean token reward, so ``|A_0| <= (K-1)/sqrt(K)`` (Samuelson's
  bound for the unbiased std) whatever the completion length. It is ``1/L_i`` of the ``"token"`` form, so next
  to the outcome term (divided by the same ``D``) the process term of a ``L``-token completion weighs ``1/L`` of
  Eq. 5's: in the worked example above, 0.034 of the outcome part instead of 0.82 -- with the outcome's std as
  divisor it makes PRIME-GRPO nearly plain GRPO. Kept as an option for the ``"process_std"`` divisor.

``grpo_process_scale`` chooses the divisor of the process term (with ``scale_rewards=True``):

- ``"outcome_std"`` (default): ``std_g r_o + eps``, the outcome's group std, so both terms share one scale:
  PRIME's total reward (process + outcome) is normalised by the group statistics of the outcome, and the
  process term keeps its size relative to the outcome (as in Eq. 5). A group whose scorable outcomes are all
  equal gets process term 0 as well (no scale to measure it in); so does one whose outcome std is at most
  ``1e-4 * max(1, |mean_g r_o|)`` (outcomes equal up to rounding, e.g. a float32 weighted sum of rewards). The
  process term at token ``t`` is bounded by ``2 (L_i - t) max|r_s| / (std_g r_o + eps)``: the size of Eq. 5's
  process return, and an untrained PRM (rewards ~0) adds ~0.
- ``"process_std"``: ``std_g rbar + eps``, the process rewards' own group std (PRIME Appendix B.3 normalises
  them by their own group statistics; Eq. 8 as printed). Invariant to the reward scale (``beta``, the PRM's
  sharpness), but it divides by a statistic of whole responses only, which fails in two cases the default
  avoids:

  1. an untrained PRM (rewards of pure noise, around 1e-5) becomes a unit-size z-score per token, summed over
     ``L`` tokens (up to ``L (K-1)/sqrt(K)`` with the ``"token"`` form: about 1,500 at L=1024, K=4), so the
     policy follows PRM noise; with ``"outcome_std"`` such noise stays near 0;
  2. completions whose mean token rewards nearly agree but whose rewards vary inside them (a PRM rewarding
     early tokens and penalising late ones) have a tiny ``std_g rbar``, and the reward-to-go at ``t > 0``
     divided by it explodes (max |A| about 6,600 at L=512 for a +-0.02 two-half profile with 1e-5 noise, RLOO
     about 6 on the same batch).

  With ``"process_std"`` use ``grpo_process_form="response"``, whose ``t=0`` value is bounded by
  ``(K-1)/sqrt(K)``.

The learning benchmark (``benchmarks/learning.py``) runs ``prime_grpo`` (the defaults) and
``prime_grpo_process_std``; ``benchmarks/RESULTS.md`` reports what it measured.

``scale_rewards`` (TRL's, :data:`SCALE_REWARDS`; ``True`` = ``"group"``, ``False`` = ``"none"``): ``"group"``
(default) divides by the group statistics above; ``"batch"`` keeps the centring on the group means but takes
every divisor over the batch's scorable rows (TRL's ``scale_rewards="batch"``): the outcome term is
``(r_o^i - mean_g r_o) / (std_B r_o + eps)``, the process term is divided by ``std_B r_o + eps``
(``"outcome_std"``; process term 0 when every scorable outcome of the batch is equal) or ``std_B rbar + eps``
(``"process_std"``), with ``std_B`` the unbiased std over all scorable rows passed (the trainers pass the rows
the policy trains on: the kept groups); a group whose outcomes are all equal keeps its process term.
``"none"`` only centres (no divisor). Every divisor adds ``eps`` (default ``1e-6``; TRL 1.16 adds ``1e-4``);
with fewer than two scorable rows in the batch ``std_B`` is taken as 1 (TRL's is 0), and those rows, alone
in their groups, get advantage 0.

Extra options: ``scale_rewards``, ``eps``, ``grpo_process_form``, ``grpo_process_scale``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from trl_prime.ops import GroupIds
from trl_prime.options import check_choice
from trl_prime.prime.functional import _grpo_estimator, _ppo_estimator, _reinforce_estimator, _rloo_estimator


__all__ = [
    "AdvantageEstimator",
    "register_advantage_estimator",
    "get_advantage_estimator",
    "advantage_estimator_names",
    "estimator_options",
    "prime_advantages",
    "ESTIMATORS",
]

#: a config field an estimator option is read from: the field's name, or a function of the config
ConfigField = str | Callable[[Any], Any]


@dataclass(frozen=True)
class AdvantageEstimator:
    """One advantage estimator of PRIME.

    Attributes:
        name: The value of ``prime_estimator`` / ``estimator`` that selects it.
        function: ``function(process_rewards, outcome_rewards, mask, group_ids, **options)``: the ``(B, T)``
            advantages (0 outside the mask).
        options: The options :func:`prime_advantages` accepts for it (any other is refused).
        config_fields: Option -> the :class:`~trl_prime.prime.config.PrimeOptions` field it is read from (a name,
            or a function of the config), for the trainers (:func:`estimator_options`).
        needs_values: GAE against values ``V(y_<t)``: the trainer provides the ``values`` option (a learned value
            model, or the implicit PRM as value), and the value-model fields of the config act.
        group_std: The outcome is divided by a group (or batch) std, so TRL's ``scale_rewards`` acts.
    """

    name: str
    function: Callable[..., torch.Tensor]
    options: frozenset[str]
    config_fields: Mapping[str, ConfigField] = field(default_factory=dict)
    needs_values: bool = False
    group_std: bool = False


_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(estimator: AdvantageEstimator, *, overwrite: bool = False) -> AdvantageEstimator:
    """Register ``estimator`` under its name (refused when taken, unless ``overwrite``); returns it.

    Raises:
        ValueError: the name is registered already and ``overwrite`` is False.
    """
    if estimator.name in _ESTIMATORS and not overwrite:
        raise ValueError(
            f"an advantage estimator named {estimator.name!r} is registered already; pass overwrite=True to replace it."
        )
    _ESTIMATORS[estimator.name] = estimator
    return estimator


def get_advantage_estimator(name: Any, field: str = "estimator") -> AdvantageEstimator:
    """The estimator registered as ``name``.

    Raises:
        ValueError: ``name`` is no registered estimator; the message names ``field`` and the valid choices.
    """
    check_choice(name, advantage_estimator_names(), field)
    return _ESTIMATORS[name]


def advantage_estimator_names() -> tuple[str, ...]:
    """The registered estimators' names, in registration order."""
    return tuple(_ESTIMATORS)


def estimator_options(config: Any) -> dict:
    """The options of :func:`prime_advantages` for a config's ``prime_estimator``: ``estimator`` and each option
    of its :attr:`AdvantageEstimator.config_fields`, read from ``config``."""
    estimator = get_advantage_estimator(config.prime_estimator, "prime_estimator")
    options = {"estimator": estimator.name}
    for option, source in estimator.config_fields.items():
        options[option] = source(config) if callable(source) else getattr(config, source)
    return options


def prime_advantages(
    process_rewards: torch.Tensor,
    outcome_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: GroupIds | None,
    *,
    estimator: str = "rloo",
    **options: Any,
) -> torch.Tensor:
    """PRIME advantages with a choice of estimator (PRIME Eq. 5 and Appendix B.3).

    * ``"rloo"`` (default): :func:`rloo_advantages` (PRIME Eq. 5); options ``process_coef``,
      ``outcome_coef``, ``gamma``, ``outcome_gamma``, ``baseline``, ``whiten``, ``process_reward_norm``,
      ``include_last_token``, ``whiten_eps``.
    * ``"grpo"`` (PRIME Appendix B.3, Eq. 8): group-normalised process and outcome terms; options as ``"rloo"``
      without ``baseline``, plus ``scale_rewards``, ``eps``, ``grpo_process_form`` (``"token"``: the printed Eq. 8;
      ``"response"``) and ``grpo_process_scale`` (``"outcome_std"``; ``"process_std"``). Formulas, bounds and why
      the defaults: :mod:`trl_prime.prime.estimators`.
    * ``"reinforce"``: no baseline, ``sum_{s>=t} gamma^(s-t) r_s^i + r_o^i``.
    * ``"ppo"`` (PRIME Table 4): GAE (:func:`gae_advantages`, options ``gamma``, ``lam``, ``whiten``, ``whiten_eps``)
      over the rewards of :func:`ppo_token_rewards` (``process_coef``, ``outcome_coef``) with the ``(B, T)``
      ``values`` option (required): a value model's, or :func:`implicit_prm_values` for the implicit PRM as value.
      No group baseline (``group_ids`` is ignored and may be ``None``); ``outcome_gamma``, ``baseline``,
      ``process_reward_norm`` and ``include_last_token`` do not apply.

    All estimators share the coefficients, discounts, whitening, process-reward normalisation and the NaN
    rule (unscorable rows: excluded, advantage 0). A group with fewer than two scorable rows has no baseline:
    its row gets advantage 0 with ``"rloo"`` and ``"grpo"`` (:func:`single_row_group_mask`). ``"reinforce"`` has
    no baseline for any group by definition and is unchanged: each row keeps its own returns whatever its
    group's size. ``group_ids`` may be ``None`` when ``num_generations`` is passed as an option.

    Args:
        process_rewards: ``(B, T)`` token process rewards.
        outcome_rewards: ``(B,)`` outcome rewards (NaN = unscorable).
        mask: ``(B, T)`` completion mask.
        group_ids: ``(B,)`` prompt ids.
        estimator: ``"rloo"`` | ``"grpo"`` | ``"reinforce"`` | ``"ppo"``.
        **options: Forwarded estimator options (listed above).

    Returns:
        ``(B, T)`` advantages, 0 outside the mask.

    Raises:
        ValueError: on an unknown estimator, an option the estimator does not take or an unknown option value
            (``grpo_process_form`` not in ``("response", "token")``, ``grpo_process_scale`` not in
            ``("process_std", "outcome_std")``), plus the errors of :func:`rloo_advantages`.

    Source: PRIME Eq. 5; PRIME Appendix B.3 (Eqs. 7-8: REINFORCE and GRPO with implicit process rewards).
    """
    entry = get_advantage_estimator(estimator)
    unknown = set(options) - entry.options
    if unknown:
        raise ValueError(
            f"prime_advantages(estimator={estimator!r}) got unknown option(s) {sorted(unknown)}; "
            f"valid options: {sorted(entry.options)}."
        )
    return entry.function(process_rewards, outcome_rewards, mask, group_ids, **options)


# ----------------------------------------------------------------------------------------------------------- built in

#: the options every estimator but "ppo" takes, and the config fields the trainers read them from
_RETURN_OPTIONS = {
    "process_coef": "process_coef",
    "outcome_coef": "outcome_coef",
    "gamma": "prime_gamma",
    "whiten": "whiten_advantages",
    "process_reward_norm": "process_reward_norm",
    "include_last_token": "include_last_token",
}
_SHARED = frozenset({*_RETURN_OPTIONS, "outcome_gamma", "whiten_eps", "num_generations"})

register_advantage_estimator(
    AdvantageEstimator(
        "rloo",
        _rloo_estimator,
        options=_SHARED | {"baseline"},
        config_fields={**_RETURN_OPTIONS, "baseline": "prime_baseline"},
    )
)
register_advantage_estimator(
    AdvantageEstimator(
        "grpo",
        _grpo_estimator,
        options=_SHARED | {"scale_rewards", "eps", "grpo_process_form", "grpo_process_scale"},
        config_fields={
            **_RETURN_OPTIONS,
            "scale_rewards": lambda config: getattr(config, "scale_rewards", "group"),  # TRL's: group, batch, none
            "grpo_process_form": "grpo_process_form",
            "grpo_process_scale": "grpo_process_scale",
        },
        group_std=True,
    )
)
register_advantage_estimator(
    AdvantageEstimator("reinforce", _reinforce_estimator, options=_SHARED, config_fields=_RETURN_OPTIONS)
)
register_advantage_estimator(
    AdvantageEstimator(
        "ppo",
        _ppo_estimator,
        options=frozenset(
            {"values", "process_coef", "outcome_coef", "gamma", "lam", "whiten", "whiten_eps", "num_generations"}
        ),
        config_fields={
            # the implicit PRM as the value: the outcome is the only reward
            "process_coef": lambda config: config.process_coef if config.prime_value == "critic" else 0.0,
            "outcome_coef": "outcome_coef",
            "gamma": "prime_gamma",
            "lam": "lam",
            "whiten": "whiten_advantages",
        },
        needs_values=True,
    )
)

#: the built-in estimators (PRIME Eq. 5, Appendix B.3 and Table 4): ``PrimeOptions.prime_estimator``,
#: :func:`prime_advantages` ``estimator``; :func:`advantage_estimator_names` also lists registered ones
ESTIMATORS = advantage_estimator_names()
