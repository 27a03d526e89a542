"""PRL's configuration (PRL arXiv 2601.10201 Sec. 4): :class:`PRLConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from trl_prime.functional import PRL_ORDERS, PRL_STEP_SPLITS, check_choice
from trl_prime.guards import GuardOptions, check_grpo_outcome_options, constant_lr_schedule


@dataclass
class PRLConfig(GuardOptions, GRPOConfig):
    """Configuration of :class:`~trl_prime.PRLGRPOTrainer`: TRL's ``GRPOConfig`` plus the options of PRL (2601.10201).

    Defaults are the paper's: ``eta`` 200 (range 100-300), segments of 256 tokens, the GRPO outcome advantage first
    (group mean and unbiased std, eps 1e-6), no KL loss term (TRL's ``beta`` 0: the KL regularisation is inside the
    weights, with coefficient ``1/eta``) and token-mean aggregation (TRL's ``loss_type="dapo"``). TRL's
    ``scale_rewards`` chooses the divisor of the group-centred outcome ``A``: ``"group"`` (the group std, PRL's),
    ``"batch"`` (the std of every scorable outcome of the generation batch, as TRL) or ``"none"`` (no divisor); it
    applies with ``prl_order="advantage_first"`` (``"process_first"`` uses the raw outcome, so ``"batch"`` is refused
    there). TRL's sequence-level ``loss_type`` ``"luspo"`` and ``"vespo"`` are
    refused (the message says why; docs/guides/trl_options.md). The paper uses
    ``num_generations`` 5 (set it with a generation batch size divisible by 5). Policy learning rate: TRL's 1e-6 (PRL
    Table 6), at a constant rate (``lr_scheduler_type`` ``"constant"``; TRL's default ``"linear"`` decays it to 0).

    Temperature: ``k_t = log pi_old(y_t) - log pi_ref(y_t)`` uses the rollout-policy and reference log-probs at the
    sampling ``temperature`` (TRL's ``_get_per_token_logps_and_entropies``, which also gives the PPO ratio its
    log-probs): the KL-to-go is that of the distribution the completions were drawn from, the policy whose
    KL-regularised objective PRL optimises (PRL section 3.1, Theorem 3.1; ``k_t`` of Algorithm 1, section 3.3), with
    the reference tempered alike (a reference equal to the policy gives ``k_t = 0`` exactly). PRIME's implicit PRM
    scores at temperature 1 instead: it is a reward model, not the sampling policy (see
    :class:`~trl_prime.PrimeRLOOTrainer`). At ``temperature`` 1 (PRL's released rollout setting) the two coincide.

    Raises:
        ValueError: an invalid PRL option (the message names the field and the fix).
    """

    prl_eta: float = field(
        default=200.0,
        metadata={
            "help": "eta > 0 of rho_t = A - S_t / eta: the KL coefficient is 1/eta (paper: 200, range 100-300)."
        },
    )
    prl_step_split: str = field(
        default="length",
        metadata={
            "help": "Segmentation of the KL-to-go: 'length' (every prl_step_len tokens, paper default), 'newline' or "
            "'double_newline' (at '\\n' / '\\n\\n' in the decoded text) or 'token' (every token its own step). Each "
            "token takes the value at its step's end; the last token always ends a step. Used with "
            "prl_order='advantage_first' ('process_first' is per token)."
        },
    )
    prl_step_len: int = field(
        default=256, metadata={"help": "Tokens per step with prl_step_split='length' (paper: 256)."}
    )
    prl_order: str = field(
        default="advantage_first",
        metadata={
            "help": "'advantage_first' (normalise the outcome within the group, then subtract the segmented KL-to-go) "
            "or 'process_first' (raw outcome minus the per-token KL-to-go, no normalisation; the released code's "
            "prm_adv='prm')."
        },
    )
    zero_fill_compat: bool = field(
        default=False,
        metadata={
            "help": "Reproduce the released code's fill of step values by the next NON-ZERO value (a step-end weight of "
            "exactly 0 is then overwritten by the next step's). Default False: an explicit step-end mask."
        },
    )
    prl_eps: float = field(default=1e-6, metadata={"help": "eps added to the group std of the outcome advantage."})
    lr_scheduler_type: str = constant_lr_schedule("PRL: 'constant', the single rate of Table 6")

    def __post_init__(self):
        self._validate_guards()
        check_choice(self.prl_step_split, PRL_STEP_SPLITS, "prl_step_split")
        check_choice(self.prl_order, PRL_ORDERS, "prl_order")
        if not self.prl_eta > 0:
            raise ValueError(
                f"`prl_eta`={self.prl_eta} must be > 0: the KL coefficient is 1/prl_eta (paper: 100-300; a very large "
                "prl_eta gives plain GRPO)."
            )
        if isinstance(self.prl_step_len, bool) or not isinstance(self.prl_step_len, int) or self.prl_step_len < 1:
            raise ValueError(f"`prl_step_len`={self.prl_step_len!r} must be a positive int (paper: 256).")
        if not self.prl_eps >= 0:
            raise ValueError(f"`prl_eps`={self.prl_eps} must be >= 0.")
        super().__post_init__()
        check_grpo_outcome_options(
            self,
            grouped=None,  # every TRL scale_rewards: "group", "batch" (the batch std) or "none"
            summed="PRL's outcome is the weighted sum of the reward functions",
            token_level="PRL feeds token-level (B, T) weights (PRL Algorithm 1)",
            no_group_std=None
            if self.prl_order == "advantage_first"
            else "`prl_order`='process_first' uses the raw outcome as A (no group mean, no std)",
        )
