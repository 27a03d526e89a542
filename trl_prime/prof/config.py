"""PROF's configuration (PROF arXiv 2509.03403): the ``prof_*`` fields (:class:`ProfOptions`) and
:class:`ProfGRPOConfig`.

Imports no trainer: the PRIME configs mix :class:`ProfOptions` in.
"""

from __future__ import annotations

import codecs
import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from trl_prime.functional import (
    PROF_CENTERS,
    PROF_LOSS_TYPES,
    PROF_MODES,
    PROF_PENALTY_POSITIONS,
    PROF_ROUNDINGS,
    check_choice,
)
from trl_prime.guards import GuardOptions, check_grpo_outcome_options, constant_lr_schedule
from trl_prime.models import looks_local


#: the string options of :class:`ProfOptions` and their allowed values (:mod:`trl_prime.functional`)
PROF_CHOICES = {
    "prof_mode": PROF_MODES,
    "prof_penalty_position": PROF_PENALTY_POSITIONS,
    "prof_rounding": PROF_ROUNDINGS,
    "prof_center": PROF_CENTERS,
}


#: system message of Qwen2.5-Math-PRM-7B's model card (the released PROF code sends "...\\boxed{{}}." verbatim)
QWEN_PRM_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


#: steps scored per completion by an external PRM (the released code's max_steps)
PRM_MAX_SCORED_STEPS = 100


#: string options whose escape sequences are decoded (``--prof_step_delimiter '\\n\\n'`` on a command line)
PROF_ESCAPED_FIELDS = ("prof_step_delimiter", "prof_prm_separator")


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
def decode_escapes(value):
    """Decode backslash escape sequences (``'\\n'`` -> newline, ``'\\t'``, ``'\\u2029'``...) of a string holding a
    backslash; other strings (and non-strings) are returned unchanged. Non-ASCII characters survive."""
    if not isinstance(value, str) or "\\" not in value:
        return value
    try:
        return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{value!r}: invalid escape sequence ({e.reason}); write a literal backslash as '\\\\'."
        ) from e


def check_prof_prm_path(prof_prm) -> None:
    """Raise a ValueError naming ``prof_prm`` when it is a local path that does not exist (checked before any model is
    loaded; a Hub id such as ``Qwen/Qwen2.5-Math-PRM-7B`` is not checked here)."""
    if not isinstance(prof_prm, str) or prof_prm == "implicit" or not looks_local(prof_prm):
        return
    if not os.path.exists(os.path.expanduser(prof_prm)):
        raise ValueError(
            f"`prof_prm`={prof_prm!r} looks like a local path but does not exist: give an existing folder (a "
            "token-classification step PRM, or one saved by ImplicitPRM.save_pretrained), a Hub id such as "
            "'Qwen/Qwen2.5-Math-PRM-7B', or 'implicit' (PRIME trainers)."
        )


@dataclass
class ProfOptions:
    """The PROF options (PROF, arXiv 2509.03403), shared by every trainer that can filter with PROF.

    ``prof_mode="off"`` (default here; :class:`ProfGRPOConfig` defaults to ``"both"``) leaves the trainer unchanged.
    Defaults otherwise are the paper's: keep ``m = n/2`` (``n=8, m=4``), penalty ``lambda=10`` outside 2..30 steps,
    steps split at ``"\\n\\n"``, consistency = the mean step score (not centred), ties broken by banker's rounding as
    the released code.
    """

    prof_mode: str = field(
        default="off",
        metadata={
            "help": "PROF filter: 'both' (keep the most consistent correct and the least consistent incorrect "
            "completions), 'correct' (PROF-POS: rank the correct ones, pick the incorrect ones at random) or 'off'."
        },
    )
    prof_num_keep: int | None = field(
        default=None,
        metadata={
            "help": "m, completions kept per prompt (2..num_generations: a single kept row has no GRPO "
            "baseline, so its advantage would be 0). Default: num_generations // 2."
        },
    )
    prof_num_remove: int | None = field(
        default=None,
        metadata={"help": "n - m, completions dropped per prompt (alternative to prof_num_keep; not both)."},
    )
    prof_penalty: float = field(
        default=10.0, metadata={"help": "lambda, subtracted from the consistency outside the allowed step range."}
    )
    prof_min_steps: int = field(default=2, metadata={"help": "Fewer steps than this are penalised (paper: 2)."})
    prof_max_steps: int = field(default=30, metadata={"help": "More steps than this are penalised (paper: 30)."})
    prof_penalty_position: str = field(
        default="reference",
        metadata={
            "help": "Where the step-count penalty enters the critic: 'reference' (released code) and 'paper' (PROF "
            "Eq. (1), arXiv v2) both give critic = sign*c - lambda*pen, so a completion with too few or too many "
            "steps is dropped first from its class, correct or incorrect (functional.prof_select). The v1 preprint's "
            "sign*(c - lambda*pen), which kept such incorrect completions first, is not offered."
        },
    )
    prof_rounding: str = field(
        default="half_even",
        metadata={
            "help": "Rounding of the number of correct rows removed per prompt, r+ = round((n+ - n- + r)/2) with "
            "r = n - m removed; it only matters when that is x.5 (odd m with both classes large enough: two equally "
            "balanced (k+, k-) splits). 'half_up' rounds x.5 up: one more correct row removed, i.e. k+ = floor(m/2) "
            "correct and ceil(m/2) incorrect kept. 'half_down' rounds x.5 down: k+ = ceil(m/2), one more correct row "
            "kept. 'half_even' (default, the released code's Python round) rounds x.5 to the even integer, so it "
            "matches half_up or half_down depending on the counts (e.g. n=8, m=3: 5 correct/3 incorrect -> 1 correct "
            "kept; 4/4 -> 2 correct kept)."
        },
    )
    prof_prm: str | None = field(
        default="implicit",
        metadata={
            "help": "Step PRM: 'implicit' (the PRIME trainers' online implicit PRM: no extra model), a folder saved by "
            "ImplicitPRM.save_pretrained (a frozen implicit PRM), or the path / Hub id of a token-classification step "
            "PRM such as Qwen/Qwen2.5-Math-PRM-7B (probability of label 1 at each step separator)."
        },
    )
    prof_center: str = field(
        default="none",
        metadata={
            "help": "Consistency: 'none' (paper: mean step score) or 'batch' (released: 2*(mean - batch mean))."
        },
    )
    prof_correct_threshold: float = field(
        default=1.0, metadata={"help": "A completion is correct when its outcome reward is >= this."}
    )
    prof_step_delimiter: str = field(
        default="\n\n",
        metadata={
            "help": "Delimiter of reasoning steps. Escape sequences are decoded, so '\\n\\n' typed on the "
            "command line means two newlines."
        },
    )
    prof_implicit_temperature: float = field(
        default=1.0,
        metadata={
            "help": "Implicit PRM step scores: sigmoid(step reward / temperature) (> 0; monotone, keeps ranks)."
        },
    )
    prof_prm_separator: str = field(
        default="<extra_0>",
        metadata={
            "help": "External PRM: the step-separator token placed after every step (escape sequences are decoded)."
        },
    )
    prof_prm_system_prompt: str | None = field(
        default=QWEN_PRM_SYSTEM_PROMPT,
        metadata={"help": "External PRM: system message (None: no system message); removed from the user text."},
    )
    prof_prm_max_length: int = field(
        default=4096,
        metadata={
            "help": "External PRM: max tokens per input. A completion whose trailing steps are cut off by right "
            "truncation still counts all its steps (H) but is unscored: its consistency is NaN, the "
            "least consistent of its class (logged as prof/prm_truncated_fraction)."
        },
    )
    prof_prm_micro_batch_size: int | None = field(
        default=None, metadata={"help": "External PRM: rows per forward. Default: per_device_train_batch_size."}
    )

    def prof_keep_count(self) -> int:
        """``m``, the number of completions kept per prompt."""
        K = self.num_generations
        if self.prof_num_keep is not None:
            return self.prof_num_keep
        if self.prof_num_remove is not None:
            return K - self.prof_num_remove
        return max(1, K // 2)

    def _validate_prof(self) -> None:
        """Decode the escaped string options and check the PROF options (PROF arXiv 2509.03403 Sec. 3).

        Raises:
            ValueError: an invalid value or combination; the message names the field and the fix.
        """
        for name in PROF_ESCAPED_FIELDS:  # '\\n\\n' from a command line -> two newlines
            setattr(self, name, decode_escapes(getattr(self, name)))
        for name, choices in PROF_CHOICES.items():
            check_choice(getattr(self, name), choices, name)
        if self.prof_num_keep is not None and self.prof_num_remove is not None:
            raise ValueError("Set `prof_num_keep` (m) or `prof_num_remove` (n - m), not both.")
        for name in ("prof_num_keep", "prof_num_remove", "prof_min_steps", "prof_max_steps"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"`{name}`={v!r} must be a non-negative int.")
        if self.prof_min_steps > self.prof_max_steps:
            raise ValueError(f"`prof_min_steps`={self.prof_min_steps} > `prof_max_steps`={self.prof_max_steps}.")
        if not self.prof_penalty >= 0:
            raise ValueError(f"`prof_penalty`={self.prof_penalty} must be >= 0 (paper: 10).")
        if not self.prof_implicit_temperature > 0:
            raise ValueError(f"`prof_implicit_temperature`={self.prof_implicit_temperature} must be > 0.")
        if not self.prof_step_delimiter:
            raise ValueError("`prof_step_delimiter` must be a non-empty string (paper: '\\n\\n').")
        if self.prof_prm_max_length < 1:
            raise ValueError(f"`prof_prm_max_length`={self.prof_prm_max_length} must be >= 1.")
        if self.prof_prm_micro_batch_size is not None and self.prof_prm_micro_batch_size < 1:
            raise ValueError(f"`prof_prm_micro_batch_size`={self.prof_prm_micro_batch_size} must be >= 1 (or None).")
        if self.prof_mode != "off":
            self._validate_prof_keep_count()
            self._validate_prof_prm_and_loss()

    def _validate_prof_keep_count(self) -> None:
        """``m`` (``prof_num_keep``, or ``n - prof_num_remove``) must leave every prompt two kept rows (a GRPO
        baseline needs two); the paper keeps ``m = 4`` of ``n = 8`` (PROF Sec. 4)."""
        K = self.num_generations
        if K is None:
            return
        if self.prof_num_keep is not None and not 1 <= self.prof_num_keep <= K:
            raise ValueError(
                f"`prof_num_keep`={self.prof_num_keep} must lie in [2, num_generations={K}] (paper: n=8, m=4; a "
                "group needs two kept rows for a baseline)."
            )
        if self.prof_num_remove is not None and not 0 <= self.prof_num_remove < K:
            raise ValueError(
                f"`prof_num_remove`={self.prof_num_remove} must lie in [0, num_generations={K}) (paper: n=8, remove 4)."
            )
        if self.prof_keep_count() >= 2:
            return
        if self.prof_num_keep is not None:
            why, fix = f"`prof_num_keep`={self.prof_num_keep}", "set prof_num_keep >= 2"
        elif self.prof_num_remove is not None:
            why, fix = (
                f"`prof_num_remove`={self.prof_num_remove} with num_generations={K}",
                f"set prof_num_remove <= {K - 2}",
            )
        else:
            why, fix = (
                f"the default m = num_generations // 2 with `num_generations`={K}",
                "set num_generations >= 4 (or prof_num_keep=2 with num_generations >= 2)",
            )
        raise ValueError(
            f"PROF would keep one completion per prompt ({why}): a group of one row has no GRPO baseline, so "
            f"every kept row would get advantage 0 and the policy would learn nothing. {fix[0].upper() + fix[1:]} "
            "(paper: n=8, m=4)."
        )

    def _validate_prof_prm_and_loss(self) -> None:
        """``prof_prm`` must name a step PRM, and TRL's ``loss_type`` (GRPO configs) must normalise by the kept tokens
        of the batch (:data:`trl_prime.functional.PROF_LOSS_TYPES`)."""
        if not self.prof_prm:
            raise ValueError(
                "`prof_prm` is empty: set it to 'implicit' (PRIME trainers), an ImplicitPRM folder, or a step PRM path "
                "such as 'Qwen/Qwen2.5-Math-PRM-7B'."
            )
        check_prof_prm_path(self.prof_prm)
        loss_type = getattr(self, "loss_type", None)
        if loss_type is not None and loss_type not in PROF_LOSS_TYPES:
            raise ValueError(
                f"`loss_type`={loss_type!r} does not normalise by the kept tokens of the batch (it averages per "
                "completion, per micro-batch or by a constant), so the rows PROF drops would still scale the update. "
                f"With PROF use {list(PROF_LOSS_TYPES)} ('dapo', the default, is the paper's token mean)."
            )


@dataclass
class ProfGRPOConfig(GuardOptions, ProfOptions, GRPOConfig):
    """Configuration of :class:`ProfGRPOTrainer`: TRL's ``GRPOConfig`` plus the PROF options.

    PROF defaults here: ``prof_mode="both"``, ``num_generations`` 8 with ``m = 4`` kept, the step PRM
    ``Qwen/Qwen2.5-Math-PRM-7B`` (``prof_prm``; a token-classification PRM path, or a saved ImplicitPRM folder), and a
    constant policy learning rate (``lr_scheduler_type`` ``"constant"``; TRL's default ``"linear"`` decays it to 0).
    The paper also uses KL 0.001 (``beta``), entropy 0.001 (``entropy_coef``), temperature 1.0 and lr 1e-6 (set them).

    Raises:
        ValueError: an invalid PROF option (the message names the field and the fix).
    """

    prof_mode: str = field(default="both", metadata={"help": "'both' (PROF-BOTH), 'correct' (PROF-POS) or 'off'."})
    prof_prm: str | None = field(
        default="Qwen/Qwen2.5-Math-PRM-7B",
        metadata={"help": "Step PRM: a token-classification PRM path / Hub id, or a folder saved by ImplicitPRM."},
    )
    num_generations: int | None = field(default=8, metadata={"help": "Completions per prompt n (PROF: 8)."})
    lr_scheduler_type: str = constant_lr_schedule("'constant': PROF Appendix A.1 states no schedule")

    def __post_init__(self):
        self._validate_prof()
        self._validate_guards()
        super().__post_init__()
        if self.prof_mode != "off" and self.prof_prm == "implicit":
            raise ValueError(
                "`prof_prm`='implicit' needs an online implicit PRM: use PrimeGRPOTrainer / PrimeRLOOTrainer, or give a "
                "folder saved by ImplicitPRM.save_pretrained (a frozen implicit PRM) or a token-classification PRM."
            )
        check_grpo_outcome_options(
            self,
            grouped=None,  # "group" / "none": within each prompt's kept rows; "batch": by the kept rows' batch std
            summed="PROF splits correct/incorrect on the weighted sum of the rewards",
        )
