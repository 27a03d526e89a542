"""Paper defaults of the trl-prime configs: constant learning rates, the LoRA learning-rate warning, the refused
``multi_objective_aggregation``, PROF's step-count penalty (PROF Eq. (1)), and the documented temperatures."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny_kwargs
from tiny import contains_reward, tiny_prompt_dataset

from trl_prime import (
    ImplicitPRMConfig,
    PrimeGRPOConfig,
    PrimeRLOOConfig,
    PrimeRLOOTrainer,
    PRLConfig,
    PRLGRPOTrainer,
    ProfGRPOConfig,
)
from trl_prime import functional as F
from trl_prime.prime.trainer import LORA_RECIPE_LEARNING_RATES, PrimeMixin, warn_full_finetuning_rates


ROOT = Path(__file__).resolve().parents[2]
COMMON = dict(bf16=False, use_cpu=True, report_to=[])
RL_CONFIGS = [PrimeRLOOConfig, PrimeGRPOConfig, PRLConfig, ProfGRPOConfig]


def _rl_kwargs(tmp_path, **overrides):
    return tiny_kwargs(tmp_path, drop=("learning_rate",), **{"max_steps": 3, **overrides})  # the configs' own rates


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


# ----------------------------------------------------------------------------------------------------------------
# Item: constant learning rates
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", RL_CONFIGS + [ImplicitPRMConfig])
def test_every_config_defaults_to_a_constant_learning_rate(tmp_path, cls):
    cfg = cls(output_dir=str(tmp_path), **COMMON)
    assert cfg.lr_scheduler_type == "constant"
    assert cfg.warmup_steps == 0
    if cls in (PrimeRLOOConfig, PrimeGRPOConfig):
        assert cfg.prm_lr_scheduler == "constant"  # the policy now follows the PRM's schedule


@pytest.mark.parametrize("cls", RL_CONFIGS + [ImplicitPRMConfig])
def test_explicit_schedules_are_kept_and_an_ignored_warmup_is_refused(tmp_path, cls):
    assert cls(output_dir=str(tmp_path), lr_scheduler_type="linear", **COMMON).lr_scheduler_type == "linear"
    cfg = cls(output_dir=str(tmp_path), lr_scheduler_type="constant_with_warmup", warmup_steps=5, **COMMON)
    assert (cfg.lr_scheduler_type, cfg.warmup_steps) == ("constant_with_warmup", 5)
    # "constant" takes no warmup (transformers.get_scheduler): a warmup it would silently drop is refused
    with pytest.raises(
        ValueError,
        match=r"`warmup_steps`=0.1 is ignored by `lr_scheduler_type`='constant'.*"
        r"constant_with_warmup",
    ):
        cls(output_dir=str(tmp_path), warmup_steps=0.1, **COMMON)


def test_prm_warmup_with_a_constant_prm_schedule_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"`prm_warmup_steps`=3 is ignored by `prm_lr_scheduler`='constant'"):
        PrimeRLOOConfig(output_dir=str(tmp_path), prm_warmup_steps=3, **COMMON)
    cfg = PrimeRLOOConfig(
        output_dir=str(tmp_path), prm_warmup_steps=3, prm_lr_scheduler="constant_with_warmup", **COMMON
    )
    assert cfg.prm_warmup_steps == 3


def test_recipes_keep_their_explicit_schedules():
    """The recipes that set a schedule keep it; the one that does not (prof_prime) now gets the constant default."""
    found = {}
    for path in sorted((ROOT / "recipes" / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        if "lr_scheduler_type" in data:
            found[path.stem] = data["lr_scheduler_type"]
    assert found == dict.fromkeys(
        ("demo", "implicit_prm", "prime_lora", "prime_qwen7b", "prl_grpo", "prof_grpo"), "constant"
    )


def test_three_step_prime_run_keeps_the_policy_learning_rate_constant(tiny_model_path, tmp_path):
    lr = 1e-3
    cfg = PrimeRLOOConfig(**_rl_kwargs(tmp_path, learning_rate=lr, prm_learning_rate=1e-2))
    tr = PrimeRLOOTrainer(
        model=tiny_model_path, reward_funcs=contains_reward("e"), args=cfg, train_dataset=tiny_prompt_dataset(12)
    )
    tr.train()
    logged = [h["learning_rate"] for h in tr.state.log_history if "learning_rate" in h]
    assert logged == [lr, lr, lr]  # TRL's "linear" default logged 6.7e-4, 3.3e-4, 0.0
    assert set(tr.lr_scheduler.get_last_lr()) == {lr}  # every param group
    assert tr.prm_lr_scheduler.get_last_lr() == [1e-2]


# ----------------------------------------------------------------------------------------------------------------
# Item: LoRA with the full fine-tuning rates
# ----------------------------------------------------------------------------------------------------------------
def test_lora_recipe_rates_match_the_warning():
    data = yaml.safe_load((ROOT / "recipes" / "configs" / "prime_lora.yaml").read_text())
    assert {k: float(data[k]) for k in LORA_RECIPE_LEARNING_RATES} == LORA_RECIPE_LEARNING_RATES


@pytest.mark.parametrize("cls", [PrimeRLOOConfig, PrimeGRPOConfig])
def test_warning_names_both_fields_and_the_lora_recipe_rates(tmp_path, cls):
    cfg = cls(output_dir=str(tmp_path), **COMMON)
    with pytest.warns(UserWarning, match="full fine-tuning") as rec:
        warn_full_finetuning_rates(cfg, prm_is_adapter=True)
    (msg,) = [str(w.message) for w in rec if "full fine-tuning" in str(w.message)]
    assert "`learning_rate`=5e-07, `prm_learning_rate`=1e-06" in msg
    assert "learning_rate=5e-06 and prm_learning_rate=1e-05" in msg and "recipes/configs/prime_lora.yaml" in msg
    # only the policy's rate kept: still warned, both fields named
    cfg = cls(output_dir=str(tmp_path), prm_learning_rate=1e-5, **COMMON)
    with pytest.warns(UserWarning, match=r"rate\(s\) `learning_rate`=5e-07: .*`prm_learning_rate`=1e-06"):
        warn_full_finetuning_rates(cfg, prm_is_adapter=True)
    # a separate (fully fine-tuned) PRM keeps its full-model rate: only the policy's is checked
    cfg = cls(output_dir=str(tmp_path), learning_rate=5e-6, **COMMON)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_full_finetuning_rates(cfg, prm_is_adapter=False)
    with pytest.warns(UserWarning, match=r"rate\(s\) `prm_learning_rate`=1e-06"):
        warn_full_finetuning_rates(cfg, prm_is_adapter=True)


def test_prime_trainer_warns_at_init_for_lora_with_the_default_rates(tiny_model_path, tmp_path):
    def build(**rates):
        cfg = PrimeRLOOConfig(**_rl_kwargs(tmp_path, max_steps=1, **rates))
        return PrimeRLOOTrainer(
            model=tiny_model_path,
            reward_funcs=contains_reward("e"),
            args=cfg,
            train_dataset=tiny_prompt_dataset(8),
            peft_config=_lora(),
        )

    with pytest.warns(
        UserWarning,
        match=r"PEFT run with PRIME's full fine-tuning learning rate\(s\) "
        r"`learning_rate`=5e-07, `prm_learning_rate`=1e-06",
    ):
        build()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        build(**LORA_RECIPE_LEARNING_RATES)
    assert not [w for w in rec if "full fine-tuning" in str(w.message)]
    # without PEFT the paper's rates are the right ones: no warning
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        PrimeRLOOTrainer(
            model=tiny_model_path,
            reward_funcs=contains_reward("e"),
            args=PrimeRLOOConfig(**_rl_kwargs(tmp_path, max_steps=1)),
            train_dataset=tiny_prompt_dataset(8),
        )
    assert not [w for w in rec if "full fine-tuning" in str(w.message)]


# ----------------------------------------------------------------------------------------------------------------
# Item: multi_objective_aggregation
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [PrimeGRPOConfig, PRLConfig, ProfGRPOConfig])
def test_normalize_then_sum_is_refused_naming_the_field(tmp_path, cls):
    with pytest.raises(
        ValueError,
        match=r"`multi_objective_aggregation`='normalize_then_sum': .*weighted sum.*"
        r"use 'sum_then_normalize'",
    ):
        cls(output_dir=str(tmp_path), multi_objective_aggregation="normalize_then_sum", **COMMON)
    assert cls(output_dir=str(tmp_path), **COMMON).multi_objective_aggregation == "sum_then_normalize"


# ----------------------------------------------------------------------------------------------------------------
# Item: PROF step-count penalty (PROF Eq. (1))
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("position", ["paper", "reference"])
def test_prof_penalised_incorrect_completion_is_dropped_before_a_consistent_one(position):
    """One prompt: 2 correct rows, 3 incorrect ones. Row 2 is incorrect with 1 step (penalised, H < 2), row 3 is a
    consistent incorrect row (low mean step score 0.3), row 4 an inconsistent one (0.9).

    critic = sign*c - 10*pen: row 2 = -0.2 - 10 = -10.2, row 3 = -0.3, row 4 = -0.9. Removing one incorrect row drops
    row 2; removing two drops rows 2 and 4. (The v1 form sign*(c - 10*pen) gave row 2 a critic of +9.8 and kept it.)
    """
    gid = torch.zeros(5, dtype=torch.long)
    c = torch.tensor([0.9, 0.8, 0.2, 0.3, 0.9])
    H = torch.tensor([5, 5, 1, 5, 5])
    o = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0])
    kw = dict(penalty=10.0, min_steps=2, max_steps=30, penalty_position=position)
    assert F.prof_select(gid, c, H, o, num_remove=1, **kw).tolist() == [0, 1, 3, 4]
    assert F.prof_select(gid, c, H, o, num_remove=2, **kw).tolist() == [0, 1, 3]
    # too many steps (H > 30) as well
    H_long = torch.tensor([5, 5, 31, 5, 5])
    assert F.prof_select(gid, c, H_long, o, num_remove=1, **kw).tolist() == [0, 1, 3, 4]


def test_prof_paper_position_reproduces_the_released_filter():
    """PROF Eq. (1) (v2) and the released filter_trajectories select the same rows on the conformance vectors."""
    data = json.loads((ROOT / "tests" / "data" / "conformance" / "prof_filter_both.json").read_text())
    assert any(1 in case["inputs"]["len_segs"] for case in data["cases"])  # the vectors hold penalised rows
    for case in data["cases"]:
        inp = case["inputs"]
        r = torch.tensor(inp["seq_reward"], dtype=torch.float64)
        c = torch.tensor(inp["scores_ic"], dtype=torch.float64) * (2 * r - 1)  # unsigned consistency
        kept = F.prof_select(
            inp["uid"],
            c,
            torch.tensor(inp["len_segs"]),
            r,
            num_remove=inp["n_remove_per_group"],
            penalty=inp["len_step_reward_coef"],
            mode="both",
            penalty_position="paper",
        )
        assert kept.tolist() == sorted(case["outputs"]["kept_indices"]), case["name"]


# ----------------------------------------------------------------------------------------------------------------
# Item: temperatures (PRL at the sampling temperature, PRIME's PRM at 1), as documented
# ----------------------------------------------------------------------------------------------------------------
def test_temperature_choices_are_documented():
    for doc in (PRLConfig.__doc__, PRLGRPOTrainer.__doc__):
        assert "sampling ``temperature``" in doc and "PRL section 3.1" in doc
    assert "temperature 1" in PrimeMixin.__doc__ and "PRIME Eq. 3" in PrimeMixin.__doc__
    page = (ROOT / "docs" / "methods" / "prl.md").read_text()
    assert "PRL computes its KL-to-go `S_t` from the rollout-policy and reference log-probs at the sampling" in page


def test_prl_kl_to_go_uses_the_sampling_temperature(tiny_model_path, tmp_path):
    """PRL's reference log-probs are computed at the sampling temperature: its own reference copy carries TRL's fused
    LM head at ``temperature`` (so a reference equal to the policy gives k_t = 0 at any temperature)."""
    cfg = PRLConfig(**_rl_kwargs(tmp_path, max_steps=1, temperature=0.5))
    tr = PRLGRPOTrainer(
        model=tiny_model_path, reward_funcs=contains_reward("e"), args=cfg, train_dataset=tiny_prompt_dataset(8)
    )
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    mask = torch.ones_like(ids)
    ref = tr._get_per_token_logps_and_entropies(tr.prl_ref_model, ids, mask, 3)[0]
    with torch.no_grad():
        logits = tr.prl_ref_model(input_ids=ids, attention_mask=mask).logits
    at = {t: (logits[:, -4:-1].float() / t).log_softmax(-1).gather(-1, ids[:, -3:, None])[..., 0] for t in (0.5, 1.0)}
    torch.testing.assert_close(ref, at[0.5], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, at[1.0], atol=1e-3)
