"""Configs of the PRIME trainers (PRIME arXiv 2502.01456, Algorithm 1).

:class:`PrimeRLOOConfig` extends TRL's ``RLOOConfig`` and :class:`PrimeGRPOConfig` extends ``GRPOConfig`` with the
same PRIME options (one shared dataclass, :class:`PrimeOptions`). Every option is a named field with the paper's
default; invalid values and combinations fail in ``__post_init__`` with a message naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig, RLOOConfig

from trl_prime.functional import (
    BASELINES,
    ESTIMATORS,
    GRPO_PROCESS_FORMS,
    GRPO_PROCESS_SCALES,
    IMPLICIT_VALUE_SCALES,
    PRIME_VALUES,
    PRM_LABELS,
    PRM_LOSSES,
    PRM_REFERENCES,
    PRM_SCHEDULERS,
    PRM_UPDATES,
    PROCESS_REWARD_NORMS,
    check_choice,
)
from trl_prime.guards import GuardOptions, check_grpo_outcome_options, constant_lr_schedule
from trl_prime.prime.estimators import AdvantageEstimator, get_advantage_estimator
from trl_prime.prof.config import ProfOptions


#: the value-model fields of :class:`PrimeOptions` that only ``prime_estimator="ppo"`` reads (PRIME section 5.4)
PPO_ONLY_FIELDS = (
    "prime_value_scale",
    "lam",
    "vf_coef",
    "cliprange_value",
    "value_epochs",
    "value_learning_rate",
    "value_weight_decay",
    "value_max_grad_norm",
)

#: the string options of :class:`PrimeOptions` and their allowed values (:mod:`trl_prime.functional`)
PRIME_CHOICES = {
    "prm_loss": PRM_LOSSES,
    "prm_label": PRM_LABELS,
    "prm_update": PRM_UPDATES,
    "prm_reference": PRM_REFERENCES,
    "prime_estimator": ESTIMATORS,
    "prime_baseline": BASELINES,
    "process_reward_norm": PROCESS_REWARD_NORMS,
    "grpo_process_form": GRPO_PROCESS_FORMS,
    "grpo_process_scale": GRPO_PROCESS_SCALES,
    "prm_lr_scheduler": PRM_SCHEDULERS,
    "prime_value": PRIME_VALUES,
    "prime_value_scale": IMPLICIT_VALUE_SCALES,
}


@dataclass
class PrimeOptions(GuardOptions, ProfOptions):
    # + the PROF filter's `prof_*` fields (trl_prime/prof/config.py; prof_mode="off" by default) and the reliability
    # fields `max_nonfinite_skips`, `max_verifier_failure_rate` (trl_prime/guards.py)
    """The PRIME options shared by :class:`PrimeRLOOConfig` and :class:`PrimeGRPOConfig` (PRIME, arXiv 2502.01456).

    Defaults are the paper's (PRIME section 3 and Table 5): implicit PRM beta 0.05 trained online with cross-entropy
    on the outcome labels, its own AdamW at lr 1e-6, single forward, a frozen copy of the initial (SFT) policy as
    reference, Eq. 5 RLOO advantages with process and outcome coefficients 1, gamma 1, the online prompt filter
    0.2 <= accuracy <= 0.8, and no KL penalty (TRL's ``beta`` = 0). The released code differs (double forward,
    ``batch_norm``, coefficients 5/5, whitening, last token excluded); set those options to reproduce it.
    ``prime_estimator="ppo"`` adds a value model (``prime_value``, ``value_*``, ``vf_coef``, ``cliprange_value``,
    ``lam``; PRIME section 5.4, Table 4), on both trainers: their losses take ``(B, T)`` advantages. The value model
    has its own AdamW, so ``vf_coef`` only rescales its loss relative to ``value_max_grad_norm`` (and Adam's eps);
    ``cliprange_value`` acts from ``value_epochs >= 2``. The value-model fields set without ``"ppo"`` are refused.
    """

    # --- TRL defaults PRIME changes (PRIME Table 5), in both configs ---------------------------------------------
    num_generations: int | None = field(
        default=4, metadata={"help": "Completions per prompt K (PRIME: 4). Must be >= 2."}
    )
    learning_rate: float = field(
        default=5e-7, metadata={"help": "Policy learning rate (PRIME: 5e-7; TRL's default is 1e-6)."}
    )
    lr_scheduler_type: str = constant_lr_schedule("PRIME: 'constant', section 4.1")
    # --- Implicit PRM -------------------------------------------------------------------------------------------
    prm_beta: float = field(
        default=0.05,
        metadata={
            "help": "Implicit PRM reward scale beta: r_t = beta * (log pi_phi - log pi_ref) (PRIME Eq. 3). > 0."
        },
    )
    prm_learning_rate: float = field(
        default=1e-6, metadata={"help": "Learning rate of the PRM's own AdamW optimizer (paper: 1e-6)."}
    )
    prm_loss: str = field(
        default="ce",
        metadata={
            "help": "PRM loss on the outcome labels: 'ce' (BCE(sigmoid(r(y)), label), the paper's), 'dpo', 'kto' or "
            "'nca' (Implicit PRM, arXiv 2412.01981, section 3). They see the global batch: 'dpo'/'nca' pair the "
            "completions of each prompt's group (also a group split across processes) and 'kto' takes its "
            "reference points over all rows; each process gathers the others' sequence rewards detached, so "
            "gradients flow through its own rows only."
        },
    )
    prm_class_balance: bool = field(
        default=False,
        metadata={
            "help": "prm_loss='ce': weight the rows so that positive and negative labels carry equal total weight "
            "over the global batch (trl_prime.functional.class_balanced_weights). Plain CE on groups of mostly 1 right "
            "in K first learns the base rate. Not in PRIME (paper: off); a lever measured in benchmarks/RESULTS.md."
        },
    )
    prm_epochs: int = field(
        default=1,
        metadata={
            "help": "PRM updates (optimizer steps) per generation round on its kept rows (PRIME Algorithm 1 line 8: "
            "1). The token rewards come from the first update's forward (prm_update='single') or a forward after the "
            "last (prm_update='double'); the later updates train the PRM for the next round. Each update is guarded "
            "like the first, and a skipped policy step drops them all. >= 1."
        },
    )
    prm_replay_rounds: int = field(
        default=0,
        metadata={
            "help": "prm_loss='ce': each PRM update also trains on the labelled rows of the last N generation rounds "
            "(token ids, PRM labels and reference log-probs kept on each process; the PRM's log-probs recomputed), one "
            "mean over all of them. A round joins once its PRM step is taken; checkpoints keep the window. Not in "
            "PRIME (paper: 0, the current round only); a lever measured in benchmarks/RESULTS.md. >= 0."
        },
    )
    prm_label: str = field(
        default="identity",
        metadata={
            "help": "The PRM's training label l in [0, 1] derived from the outcome reward r (the advantages keep r "
            "itself): 'identity' (l = r, PRIME's; a reward outside [0, 1] raises), 'threshold' (l = 1 at r >= "
            "prm_label_threshold, else 0), 'sigmoid' (l = sigmoid(r / prm_label_temperature), e.g. a reward "
            "model's logit) or 'group_rank' (1 above the mean of the prompt's group, 0 below; a tie to the mean "
            "gets no label). The online prompt filter's accuracy and the prm/*_accuracy metrics read the labels "
            "(trl_prime.functional.prm_labels)."
        },
    )
    prm_label_threshold: float = field(
        default=0.5, metadata={"help": "prm_label='threshold': label 1 at outcome reward >= this, else 0."}
    )
    prm_label_temperature: float = field(
        default=1.0, metadata={"help": "prm_label='sigmoid': label sigmoid(outcome reward / this); > 0."}
    )
    prm_label_min_spread: float = field(
        default=1e-3,
        metadata={
            "help": "prm_label='group_rank': a group whose scorable outcome rewards span less than this (max - min, "
            "in reward units) gives its rows no PRM label (excluded from the PRM loss, the online filter and the "
            "PRM metrics), with a UserWarning once per run: a rank inside so small a spread is noise, yet would "
            "become a confident 0/1 label. Default 1e-3: above float32 rounding of a weighted reward sum (~1e-7) "
            "and below the smallest step of the usual rewards (1/n for a fraction of n <= 1000 tests passed; 0/1 "
            "verifiers); for a Bradley-Terry reward model's scores a difference of 1e-3 is a preference of "
            "sigmoid(1e-3) = 0.50025, a coin flip. Raise it to your reward's noise level; 0 labels every group "
            "whose rewards are not all equal. >= 0."
        },
    )
    prm_update: str = field(
        default="single",
        metadata={
            "help": "'single': one PRM forward per step gives both the token rewards (before the PRM step) and the "
            "loss; 'double': update the PRM first, then a second no-grad forward gives the rewards (released code)."
        },
    )
    prm_reference: str = field(
        default="sft",
        metadata={
            "help": "Reference pi_ref of the implicit PRM: 'sft' = a frozen copy of the initial checkpoint (the PEFT "
            "base with adapters disabled under LoRA), 'policy' = the rollout policy's log-probs (no extra forward; "
            "PRIME Appendix B.1)."
        },
    )
    prm_model: str | None = field(
        default=None,
        metadata={
            "help": "Path or Hub id of the PRM's initial checkpoint. Default: a copy of the policy's initial "
            "checkpoint (under PEFT: a second adapter 'prm' on the policy's base)."
        },
    )
    prm_ref_model: str | None = field(
        default=None,
        metadata={"help": "Path of the PRM reference's checkpoint (prm_reference='sft'). Default: prm_model's."},
    )
    prm_max_grad_norm: float | None = field(
        default=1.0, metadata={"help": "Gradient clipping (max global L2 norm) of PRM updates; None disables it."}
    )
    prm_max_abs_token_reward: float | None = field(
        default=100.0,
        metadata={
            "help": "Largest sane |token reward| r_t = prm_beta * log(pi_phi(y_t)/pi_ref(y_t)) (PRIME Eq. 3). A row "
            "beyond it (a diverged or overflowing PRM, e.g. r_t ~ 1e36) is treated like a non-finite one: the PRM "
            "step (checked before it runs) and the policy step of its generation batch are skipped, the rows logged, "
            "and the skip counts toward `max_nonfinite_skips`. A healthy PRM's |r_t| stays far below: at "
            "prm_beta=0.05, 100 is a per-token log-ratio of 2,000 nats. None disables the bound; > 0."
        },
    )
    prm_weight_decay: float = field(default=0.0, metadata={"help": "Weight decay of the PRM's AdamW."})
    prm_lr_scheduler: str = field(
        default="constant",
        metadata={
            "help": f"Learning-rate schedule of the PRM optimizer (transformers.get_scheduler name): {PRM_SCHEDULERS}."
        },
    )
    prm_warmup_steps: int = field(default=0, metadata={"help": "Warmup steps (PRM updates) of the PRM scheduler."})
    prm_micro_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Rows per PRM / reference forward pass (and per PRM backward with the 'ce' loss), and, with "
            "prime_estimator='ppo', per value-model forward and backward. Default: per_device_train_batch_size."
        },
    )
    prm_score_filtered_rows: bool = field(
        default=True,
        metadata={
            "help": "Compute reference and PRM log-probs (token rewards) for the rows of prompts the online filter "
            "removed, for the logs and callbacks only (one no-grad PRM forward and the reference forward). False "
            "skips both for those rows, as the paper filters before the PRM: cheaper when many prompts are filtered; "
            "their token rewards are then NaN in callbacks (null in TokenRewardLogger's JSONL) and left out of the "
            "prm/token_reward_* metrics. Applies "
            "in training with prm_loss='ce' without DeepSpeed (elsewhere every row is scored)."
        },
    )
    prm_save_reference: bool = field(
        default=True,
        metadata={
            "help": "Write the frozen PRM reference into each checkpoint's prm/reference/ (so the saved PRM reloads "
            "on its own). False saves disk: the reference is then reloaded from the path it came from."
        },
    )
    # --- Advantages ---------------------------------------------------------------------------------------------
    process_coef: float = field(default=1.0, metadata={"help": "Weight of the process (implicit PRM) term of Eq. 5."})
    outcome_coef: float = field(default=1.0, metadata={"help": "Weight of the outcome (verifier) term of Eq. 5."})
    prime_gamma: float = field(
        default=1.0, metadata={"help": "Discount of the process return sum_{s>=t} gamma^(s-t) r_s (Eq. 5), in [0, 1]."}
    )
    prime_baseline: str = field(
        default="paper",
        metadata={
            "help": "Process-reward baseline: 'paper' (Eq. 5, leave-one-out mean of the other completions' mean token "
            "reward) or 'reference' (the released code's per-token x*K/(K-1) - sum_j rbar^j/(K-1))."
        },
    )
    whiten_advantages: bool = field(
        default=False, metadata={"help": "Masked whitening of the advantages over the batch's tokens (released code)."}
    )
    process_reward_norm: str = field(
        default="none",
        metadata={
            "help": "Process-reward normalisation: 'none' or 'batch_norm' (divide by the batch's max |reverse "
            "cumulative sum|, released code)."
        },
    )
    include_last_token: bool = field(
        default=True,
        metadata={"help": "Keep the last token's process reward (False = the released code, which drops it)."},
    )
    grpo_process_form: str = field(
        default="token",
        metadata={
            "help": "Process term of the 'grpo' estimator (PRIME App. B.3, Eq. 8): 'token' (default: the printed "
            "Eq. 8, each token reward centred on the group mean of the mean token rewards and summed to the end, "
            "so with grpo_process_scale='outcome_std' it keeps Eq. 5's size next to the outcome term) or 'response' "
            "(that sum divided by the completion length L_i: at t=0 the group z-score of the completion's mean "
            "token reward with 'process_std', but 1/L_i of Eq. 5's weight with 'outcome_std'). Other estimators "
            "ignore it."
        },
    )
    grpo_process_scale: str = field(
        default="outcome_std",
        metadata={
            "help": "Divisor of the 'grpo' estimator's process term: 'outcome_std' (default: the outcome's group "
            "std: both terms share one scale, as in Eq. 5, so an untrained PRM's near-zero rewards stay near 0 "
            "instead of weighing as much as the outcome; groups with equal outcomes get process term 0) or "
            "'process_std' (the group std of the completions' mean token rewards, a z-score at t=0 with "
            "grpo_process_form='response' whatever the reward scale, but unbounded at t>0 when the mean token "
            "rewards nearly agree, and L times a z-score with 'token'). Applies with scale_rewards='group' (with 'batch': the batch std of the outcome or of the mean "
            "token rewards); other estimators ignore it."
        },
    )
    # --- Online prompt filter -----------------------------------------------------------------------------------
    filter_lower: float = field(
        default=0.2,
        metadata={
            "help": "Keep a group iff filter_lower <= accuracy <= filter_upper (inclusive); the accuracy is the "
            "group's mean PRM label (prm_label; with 'identity' the mean outcome reward)."
        },
    )
    filter_upper: float = field(default=0.8, metadata={"help": "Upper bound of the online prompt filter (inclusive)."})
    filter_truncated: bool = field(
        default=False,
        metadata={
            "help": "Also drop groups holding a truncated completion (one that ends without EOS, as TRL's "
            "completions/clipped_ratio counts it)."
        },
    )
    oversample_factor: float = field(
        default=1.0,
        metadata={
            "help": "Generate oversample_factor x the generation batch's prompts, judge them all with the online "
            "filter and train on the first generation_batch_size / num_generations groups that pass (in the "
            "sampler's order), as PRIME's released recipe does (data.oversample_factor=4): every step then trains a "
            "full batch unless too few groups pass (then the rows that passed, logged as filter/kept_groups). The "
            "extra prompts cost generation and scoring time (set prm_score_filtered_rows=False so that the rows not "
            "selected get no PRM / reference forward). Finite, >= 1; 1 = no oversampling. Not with an "
            "IterableDataset or multimodal inputs."
        },
    )
    # --- PPO: a learned value model (prime_estimator="ppo"; PRIME section 5.4, Table 4) -------------------------
    prime_value: str = field(
        default="critic",
        metadata={
            "help": "Baseline of prime_estimator='ppo': 'critic' (a learned value model V(y_<t), trained by a clipped "
            "value loss on GAE returns of the token rewards r_t = process_coef * r_phi(y_t) + outcome_coef * r_o on "
            "the last token; process_coef=0 is plain PPO) or 'implicit_prm' (PRIME section 5.4's ablation, no "
            "critic: the implicit PRM's prefix value V(y_<t) = sum_{s<t} r_phi(y_s) is the baseline of the outcome "
            "reward, which is the only reward, on the last token; with gamma=lam=1, A_t = outcome_coef * r_o - "
            "sum_{s<t} r_phi(y_s)). Only with prime_estimator='ppo'."
        },
    )
    prime_value_scale: str = field(
        default="logit",
        metadata={
            "help": "Scale of the implicit PRM's prefix value with prime_value='implicit_prm': 'logit' (V(y_<t) = "
            "sum_{s<t} r_phi(y_s), PRIME section 5.4 as written: the PRM's CE makes the prefix sum a logit, 0 "
            "at the first token) or 'prob' (V(y_<t) = outcome_coef * sigmoid(sum_{s<t} r_phi(y_s)), the PRM's "
            "probability of label 1 given the prefix, on the outcome's scale when the outcome is the PRM's label: "
            "prm_label='identity', rewards in [0, 1]; 0.5 * outcome_coef at the first token, so A_0 = "
            "outcome_coef * (r_o - 0.5)). trl_prime.functional.implicit_prm_values."
        },
    )
    value_model: str | None = field(
        default=None,
        metadata={
            "help": "Path of the value model's initial checkpoint (a causal LM; a saved `value/` folder also brings "
            "its scalar head). Default: a copy of the policy's initial checkpoint plus a new scalar head (under "
            "PEFT: a third adapter 'value' on the policy's base plus the head). prime_value='critic' only."
        },
    )
    value_learning_rate: float = field(
        default=1e-5,
        metadata={
            "help": "Learning rate of the value model's own AdamW (veRL's critic default, PRIME's code base). Its "
            "micro-batch is `prm_micro_batch_size`."
        },
    )
    value_weight_decay: float = field(default=0.0, metadata={"help": "Weight decay of the value model's AdamW."})
    value_max_grad_norm: float | None = field(
        default=1.0, metadata={"help": "Gradient clipping (max global L2 norm) of value updates; None disables it."}
    )
    vf_coef: float = field(
        default=0.1,
        metadata={
            "help": "Factor on the clipped value loss (TRL's last PPOConfig: 0.1). The value model has its own AdamW "
            "(in TRL's old PPO the policy and value shared one optimizer, where vf_coef weighed the two losses); "
            "Adam being nearly scale-invariant, vf_coef here only rescales the value loss relative to "
            "`value_max_grad_norm` (and Adam's eps). > 0."
        },
    )
    cliprange_value: float = field(
        default=0.2,
        metadata={
            "help": "Clip range of the value loss around the values of the round's first value forward (TRL's last "
            "PPOConfig: 0.2). It acts only from value_epochs >= 2: epoch 1's forward is the clip centre itself (one "
            "value forward per micro-batch, no separate no-grad forward for the old values as in veRL), so with "
            "value_epochs=1 value/clipfrac is 0. > 0."
        },
    )
    lam: float = field(
        default=1.0,
        metadata={
            "help": "GAE lambda of prime_estimator='ppo', in [0, 1] (veRL's default 1: the return minus the value; "
            "0 is the one-step TD error). The discount is `prime_gamma`."
        },
    )
    value_epochs: int = field(
        default=1,
        metadata={
            "help": "Value-model epochs per generation round, each one pass over the rows (a fresh forward) and one "
            "optimizer step; the returns and the clip centre are those of the first epoch. >= 1."
        },
    )

    def __post_init__(self):
        self._validate_prime()  # first, so PRIME's messages win over TRL's
        super().__post_init__()  # TRL's RLOOConfig / GRPOConfig

    def advantage_estimator(self) -> AdvantageEstimator:
        """The registered estimator ``prime_estimator`` names (:mod:`trl_prime.prime.estimators`).

        Raises:
            ValueError: ``prime_estimator`` is no registered estimator (the message lists the choices).
        """
        return get_advantage_estimator(self.prime_estimator, "prime_estimator")

    def _validate_prime(self) -> None:
        """Check the PRIME options, then the PROF and guard ones.

        Raises:
            ValueError: an invalid value or combination; the message names the field and the fix.
        """
        for name, choices in PRIME_CHOICES.items():
            if name == "prime_estimator":  # the registry: the built-in estimators and any registered one
                self.advantage_estimator()
            else:
                check_choice(getattr(self, name), choices, name)
        if self.num_generations is None or self.num_generations < 2:
            raise ValueError(
                f"`num_generations`={self.num_generations}: PRIME needs at least 2 completions per prompt (the "
                "leave-one-out baseline and the prompt filter are per group). Set num_generations >= 2 (paper: 4)."
            )
        if not self.prm_beta > 0:
            raise ValueError(f"`prm_beta`={self.prm_beta} must be > 0 (paper: 0.05).")
        self._validate_prm_label()
        if self.prm_learning_rate < 0:
            raise ValueError(f"`prm_learning_rate`={self.prm_learning_rate} must be >= 0 (paper: 1e-6).")
        self._validate_filter()
        if not 0.0 <= self.prime_gamma <= 1.0:
            raise ValueError(f"`prime_gamma`={self.prime_gamma} must lie in [0, 1] (paper: 1.0).")
        if self.prm_micro_batch_size is not None and self.prm_micro_batch_size < 1:
            raise ValueError(f"`prm_micro_batch_size`={self.prm_micro_batch_size} must be >= 1 (or None).")
        if self.prm_max_grad_norm is not None and self.prm_max_grad_norm <= 0:
            raise ValueError(f"`prm_max_grad_norm`={self.prm_max_grad_norm} must be > 0, or None to disable clipping.")
        self._validate_prm_levers()
        if self.prm_warmup_steps < 0:
            raise ValueError(f"`prm_warmup_steps`={self.prm_warmup_steps} must be >= 0.")
        if self.prm_ref_model is not None and self.prm_reference == "policy":
            raise ValueError(
                "`prm_ref_model` is set but `prm_reference`='policy' uses the rollout policy's log-probs as reference. "
                "Unset prm_ref_model, or set prm_reference='sft'."
            )
        if self.prm_reference == "policy" and getattr(self, "temperature", 1.0) != 1.0:
            warnings.warn(
                f"`prm_reference`='policy' uses the rollout log-probs, computed at the sampling `temperature`="
                f"{self.temperature}, as reference, while the PRM's log-probs are at temperature 1 (as the released "
                "PRIME code does). Use prm_reference='sft' for a temperature-free reference.",
                stacklevel=4,
            )
        for name in ("process_coef", "outcome_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"`{name}`={value} must be a finite number >= 0 (paper: 1.0; 0 drops that term).")
        if self.process_coef == 0 and self.outcome_coef == 0:
            raise ValueError("`process_coef` and `outcome_coef` are both 0: every advantage would be 0. Set one > 0.")
        self._validate_ppo()
        self._validate_prof()
        self._validate_guards()

    def _validate_prm_levers(self) -> None:
        """The online PRM's levers that are not in PRIME: several updates, a replay, class-balanced CE."""
        if self.prm_epochs < 1:
            raise ValueError(f"`prm_epochs`={self.prm_epochs} must be >= 1 (PRM updates per round; paper: 1).")
        if self.prm_replay_rounds < 0:
            raise ValueError(f"`prm_replay_rounds`={self.prm_replay_rounds} must be >= 0 (0: no replay, the paper's).")
        if self.prm_replay_rounds and self.prm_reference == "policy":
            raise ValueError(
                f"`prm_replay_rounds`={self.prm_replay_rounds} replays rows with their stored reference log-probs, but "
                "`prm_reference`='policy' takes the reference from each round's rollout policy, which moves: replayed "
                "rewards would mix references. Set prm_reference='sft', or prm_replay_rounds=0."
            )
        if self.prm_replay_rounds and self.prm_loss != "ce":
            raise ValueError(
                f"`prm_replay_rounds`={self.prm_replay_rounds} replays rows into the cross-entropy update, but "
                f"`prm_loss`={self.prm_loss!r} pairs the current batch's groups. Set prm_loss='ce', or "
                "prm_replay_rounds=0."
            )
        if self.prm_class_balance and self.prm_loss != "ce":
            raise ValueError(
                f"`prm_class_balance`=True weights the cross-entropy rows, but `prm_loss`={self.prm_loss!r}. Set "
                "prm_loss='ce', or prm_class_balance=False (the pairwise losses are balanced by construction)."
            )

    def _validate_ppo(self) -> None:
        """The value-model options of ``prime_estimator="ppo"`` (PRIME section 5.4, Table 4)."""
        self._validate_ppo_ignored()
        ppo = self.advantage_estimator().needs_values
        if not ppo and (self.prime_value != "critic" or self.value_model is not None):
            name = "prime_value" if self.prime_value != "critic" else "value_model"
            raise ValueError(
                f"`{name}` is set but `prime_estimator`={self.prime_estimator!r} has no value model. Set "
                "prime_estimator='ppo', or leave prime_value='critic' and value_model=None."
            )
        if self.prime_value_scale != "logit" and self.prime_value != "implicit_prm":
            raise ValueError(
                f"`prime_value_scale`={self.prime_value_scale!r} scales the implicit PRM's prefix value, but "
                f"`prime_value`={self.prime_value!r} learns a critic. Set prime_value='implicit_prm', or leave "
                "prime_value_scale='logit'."
            )
        if self.value_model is not None and self.prime_value == "implicit_prm":
            raise ValueError(
                "`value_model` is set but `prime_value`='implicit_prm' uses the implicit PRM as the value (no learned "
                "critic). Unset value_model, or set prime_value='critic'."
            )
        if ppo and (self.process_reward_norm != "none" or not self.include_last_token):
            raise ValueError(
                "`process_reward_norm` and `include_last_token` shape the returns of the 'rloo' estimator (the "
                "released code); prime_estimator='ppo' sums the raw token rewards by GAE. Keep process_reward_norm="
                "'none' and include_last_token=True."
            )
        for name in ("value_learning_rate", "value_weight_decay"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"`{name}`={getattr(self, name)} must be >= 0.")
        for name in ("vf_coef", "cliprange_value"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"`{name}`={getattr(self, name)} must be > 0 (TRL's PPO: vf_coef 0.1, cliprange_value 0.2)."
                )
        if self.value_max_grad_norm is not None and self.value_max_grad_norm <= 0:
            raise ValueError(f"`value_max_grad_norm`={self.value_max_grad_norm} must be > 0, or None to disable it.")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"`lam`={self.lam} must lie in [0, 1] (veRL: 1.0).")
        if self.value_epochs < 1:
            raise ValueError(f"`value_epochs`={self.value_epochs} must be >= 1.")

    def _validate_ppo_ignored(self) -> None:
        """Refuse the options a run would silently ignore: the value-model fields (:data:`PPO_ONLY_FIELDS`) changed
        from their defaults without ``prime_estimator="ppo"``; ``prime_baseline="reference"`` (an ``"rloo"``
        baseline) under ``"ppo"``; and, with ``prime_value="implicit_prm"`` (the outcome is the only reward),
        ``process_coef != 1`` (unused) or ``outcome_coef == 0`` (every reward 0).

        Raises:
            ValueError: the message names the field and the fix.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in PPO_ONLY_FIELDS}
        if not self.advantage_estimator().needs_values:
            for name, default in defaults.items():
                if getattr(self, name) != default:
                    raise ValueError(
                        f"`{name}`={getattr(self, name)!r} only acts with prime_estimator='ppo' (the value model); "
                        f"`prime_estimator`={self.prime_estimator!r} ignores it. Set prime_estimator='ppo', or "
                        f"leave {name}={default!r}."
                    )
            return
        if self.prime_baseline != "paper":
            raise ValueError(
                f"`prime_baseline`={self.prime_baseline!r} is a baseline of prime_estimator='rloo'; 'ppo' subtracts "
                "the value model's values (GAE) and ignores it. Leave prime_baseline='paper'."
            )
        if self.prime_value == "implicit_prm" and self.process_coef != 1.0:
            raise ValueError(
                f"`process_coef`={self.process_coef} is unused with prime_value='implicit_prm': the outcome is the "
                "only reward (the implicit PRM is the value, not a reward). Leave process_coef=1.0, or set "
                "prime_value='critic' to add process rewards."
            )
        if self.prime_value == "implicit_prm" and self.outcome_coef == 0:
            raise ValueError(
                "`outcome_coef`=0 with prime_value='implicit_prm': the outcome is the only reward, so every reward "
                "would be 0. Set outcome_coef > 0 (paper: 1.0)."
            )

    def _validate_filter(self) -> None:
        """The online prompt filter's bounds and ``oversample_factor``.

        Raises:
            ValueError: a bound outside [0, 1], lower > upper, or a factor that is not a finite number >= 1.
        """
        if not (0.0 <= self.filter_lower <= 1.0 and 0.0 <= self.filter_upper <= 1.0):
            raise ValueError(
                f"`filter_lower`={self.filter_lower} and `filter_upper`={self.filter_upper} are accuracies: both must "
                "lie in [0, 1] (0 and 1 switch the filter off)."
            )
        if self.filter_lower > self.filter_upper:
            raise ValueError(
                f"`filter_lower`={self.filter_lower} > `filter_upper`={self.filter_upper}: no group could be kept. "
                "Swap them (paper: 0.2 and 0.8)."
            )
        f = self.oversample_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 1.0:
            raise ValueError(
                f"`oversample_factor`={f!r} must be a finite number >= 1 (1 = no oversampling; PRIME's released "
                "recipe: 4)."
            )

    def _validate_prm_label(self) -> None:
        """``prm_label_threshold`` finite, ``prm_label_temperature`` finite and > 0, ``prm_label_min_spread`` finite
        and >= 0 (``prm_label`` is checked with the other choices; :func:`trl_prime.functional.prm_labels`)."""
        if not math.isfinite(self.prm_label_threshold):
            raise ValueError(f"`prm_label_threshold`={self.prm_label_threshold} must be a finite number.")
        if not (math.isfinite(self.prm_label_temperature) and self.prm_label_temperature > 0):
            raise ValueError(f"`prm_label_temperature`={self.prm_label_temperature} must be a finite number > 0.")
        if not (math.isfinite(self.prm_label_min_spread) and self.prm_label_min_spread >= 0):
            raise ValueError(
                f"`prm_label_min_spread`={self.prm_label_min_spread} must be a finite number >= 0 (0: label every "
                "group whose rewards are not all equal)."
            )


@dataclass
class PrimeRLOOConfig(PrimeOptions, RLOOConfig):
    """Configuration of :class:`~trl_prime.PrimeRLOOTrainer`: TRL's ``RLOOConfig`` plus the PRIME options.

    PRIME overrides of TRL's ``RLOOConfig`` defaults (PRIME Table 5):

    - ``beta`` (KL coefficient) 0.0 (TRL: 0.05): the paper uses no KL; TRL then loads no reference model, the PRIME
      trainer owns the implicit PRM's reference;
    - ``num_generations`` 4 (TRL: 2): the paper's K;
    - ``learning_rate`` 5e-7 (TRL: 1e-6): the paper's policy learning rate (the PRM's is ``prm_learning_rate``
      1e-6);
    - ``lr_scheduler_type`` ``"constant"`` (TRL: ``"linear"``, a decay to 0 over ``max_steps``): the paper trains the
      policy at a constant rate (PRIME section 4.1), as the PRM (``prm_lr_scheduler``).

    Under PEFT (``peft_config``) these full fine-tuning rates barely move a LoRA adapter: the trainer warns when
    ``learning_rate`` or ``prm_learning_rate`` keeps its default (``recipes/configs/prime_lora.yaml``: 5e-6, 1e-5).

    TRL defaults PRIME keeps: ``epsilon`` 0.2 (the PPO clip), ``num_iterations`` 1 (one PPO epoch), ``temperature``
    1.0, ``normalize_advantages`` False (it must stay False: use ``whiten_advantages``). The advantage estimator is
    ``prime_estimator`` ``"rloo"`` (Eq. 5). The policy loss is token-level PPO-clip on ``(B, T)`` advantages,
    averaged over the kept tokens of the batch.

    Raises:
        ValueError: an invalid PRIME option (see the message: it names the field and the fix).
    """

    prime_estimator: str = field(
        default="rloo",
        metadata={
            "help": "Advantage estimator: 'rloo' (Eq. 5, default), 'grpo', 'reinforce' (PRIME App. B.3) or 'ppo' (GAE "
            "with a value model, `prime_value`; PRIME section 5.4)."
        },
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "KL coefficient (TRL). PRIME uses 0.0: no KL penalty and no TRL reference model."},
    )

    def __post_init__(self):
        super().__post_init__()  # PrimeOptions: the PRIME options first, then TRL's RLOOConfig
        if self.normalize_advantages:
            raise ValueError(
                "`normalize_advantages`=True standardises TRL's (B,) outcome-only RLOO advantages over the batch, "
                "which PRIME replaces by (B, T) process + outcome advantages (Eq. 5): a per-sequence statistic does "
                "not fit them. Set normalize_advantages=False; the token-level counterpart is `whiten_advantages`="
                "True (the released PRIME code's masked whitening over the batch's tokens)."
            )


@dataclass
class PrimeGRPOConfig(PrimeOptions, GRPOConfig):
    """Configuration of :class:`~trl_prime.PrimeGRPOTrainer`: TRL's ``GRPOConfig`` plus the PRIME options.

    PRIME overrides of TRL's ``GRPOConfig`` defaults (PRIME Table 5):

    - ``num_generations`` 4 (TRL: 8): the paper's K;
    - ``learning_rate`` 5e-7 (TRL: 1e-6): the paper's policy learning rate (the PRM's is ``prm_learning_rate``
      1e-6);
    - ``lr_scheduler_type`` ``"constant"`` (TRL: ``"linear"``, a decay to 0 over ``max_steps``): the paper trains the
      policy at a constant rate (PRIME section 4.1), as the PRM (``prm_lr_scheduler``);
    - ``loss_type`` ``"dapo"``, pinned (TRL 1.16's default too): the token mean over the kept tokens of the batch,
      PRIME's aggregation. ``"grpo"``, ``"sapo"``, ``"bnpo"`` and ``"dr_grpo"`` normalise per sequence, per
      micro-batch or by a fixed size, so with the prompt filter (or PROF) on they scale each update by the kept
      fraction: a ``UserWarning`` says so at config time.

    Under PEFT (``peft_config``) these full fine-tuning rates barely move a LoRA adapter: the trainer warns when
    ``learning_rate`` or ``prm_learning_rate`` keeps its default (``recipes/configs/prime_lora.yaml``: 5e-6, 1e-5).
    TRL's ``multi_objective_aggregation`` must stay ``"sum_then_normalize"``: the outcome ``r_o`` is the weighted sum
    of the reward functions.

    TRL defaults PRIME keeps: ``beta`` 0.0 (no KL), ``epsilon`` 0.2 (the PPO clip), ``num_iterations`` 1 (one PPO
    epoch), ``temperature`` 1.0. The advantage estimator is ``prime_estimator`` ``"grpo"`` (PRIME App. B.3: the
    process term group-normalises the completions' mean process rewards, the outcome term is GRPO's); TRL's
    ``scale_rewards`` chooses its divisors: ``"group"`` (the group std), ``"batch"`` (the std over the batch's kept
    scorable rows, the centring staying per group, as TRL's ``"batch"``) or ``"none"`` (no divisor); the ``"rloo"``
    and ``"reinforce"`` estimators ignore it. Its process term is the
    printed Eq. 8 by default (``grpo_process_form="token"``: each token reward centred on its group's mean of the
    completions' mean token rewards, summed to the end of the completion as Eq. 5 sums it); ``"response"`` divides
    that sum by the completion length. Both terms are divided by the outcome's group std by default
    (``grpo_process_scale="outcome_std"``), so the process term keeps Eq. 5's size next to the outcome term and an
    untrained PRM's noise stays near 0; ``"process_std"`` divides the process term by its own group std (a z-score
    at t=0 with the ``"response"`` form) (see :func:`trl_prime.functional.prime_advantages`). The
    policy loss is TRL's GRPO loss on ``(B, T)`` advantages (token-level ratio).

    Raises:
        ValueError: an invalid PRIME option (see the message: it names the field and the fix).
    """

    prime_estimator: str = field(
        default="grpo",
        metadata={
            "help": "Advantage estimator: 'grpo' (default here), 'rloo' (Eq. 5), 'reinforce' or 'ppo' (GAE with a "
            "value model, `prime_value`)."
        },
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "TRL's policy-loss aggregation. PRIME: 'dapo' (token mean over the kept tokens of the batch). "
            "'grpo', 'sapo', 'bnpo' and 'dr_grpo' scale the update by the kept fraction when prompts are filtered."
        },
    )

    def __post_init__(self):
        super().__post_init__()  # PrimeOptions: the PRIME options first, then TRL's GRPOConfig
        check_grpo_outcome_options(
            self,
            grouped=None,  # every TRL scale_rewards: "group", "batch" (batch std; PRIME-GRPO estimator) or "none"
            summed="PRIME's outcome r_o (Eq. 5, and the PRM's labels) is the weighted sum of the reward functions, "
            "so TRL's per-function normalisation would be ignored",
            token_level="PRIME feeds token-level (B, T) advantages",
            no_group_std=None
            if self.advantage_estimator().group_std
            else f"`prime_estimator`={self.prime_estimator!r} does not normalise the outcome by a group std "
            "('rloo': the leave-one-out mean only, PRIME Eq. 5; 'reinforce': the raw returns; 'ppo': GAE with a "
            "value model)",
        )
        # prof_mode != "off" allows only PROF_LOSS_TYPES ("dapo", "cispo"): refused in ProfOptions before this point
        filtering = self.filter_lower > 0.0 or self.filter_upper < 1.0 or self.filter_truncated
        if filtering and self.loss_type in ("grpo", "sapo", "bnpo", "dr_grpo"):
            how = {
                "grpo": "averages per-sequence means over all rows, filtered ones included with weight 0, so each "
                "policy update is scaled by the fraction of rows kept",
                "sapo": "averages per-sequence means over all rows, filtered ones included with weight 0, so each "
                "policy update is scaled by the fraction of rows kept",
                "bnpo": "normalises each micro-batch by its own kept tokens, so each policy update is scaled by the "
                "fraction of micro-batches holding a kept row (and tokens are weighted unevenly across them)",
                "dr_grpo": "divides by all rows times max_completion_length, filtered ones included, so each policy "
                "update is scaled by the fraction of rows kept",
            }[self.loss_type]
            warnings.warn(
                f"`loss_type`={self.loss_type!r} {how}; with the prompt filter on (filter_lower/filter_upper/"
                "filter_truncated) that fraction varies from step to step. Use loss_type='dapo' (PRIME's "
                "token mean over the kept tokens of the batch), or switch filtering off (filter_lower=0, "
                "filter_upper=1).",
                UserWarning,
                stacklevel=3,
            )
