"""PRLGRPOTrainer / PRLConfig on a tiny offline model (single process, CPU). PRL arXiv 2601.10201, section 3 and Algorithm 1."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_config, tiny_kwargs
from tiny import contains_reward, tiny_prompt_dataset
from tiny_prm import llama_style_tokenizer, qwen_style_tokenizer

from trl_prime import PRLConfig, PRLGRPOTrainer
from trl_prime import functional as F
from trl_prime.modeling import unwrap


K = 4


def _config(tmp_path, **overrides):
    prl = dict(max_completion_length=10, max_steps=2, learning_rate=1e-2, prl_eta=2.0, prl_step_split="length")
    return tiny_config(PRLConfig, tmp_path, **{**prl, "prl_step_len": 3, **overrides})


class Spy(PRLGRPOTrainer):
    """Records each generation round's PRL inputs/outputs and every batch that reaches the loss."""

    def __init__(self, *a, **kw):
        self.rounds, self.loss_inputs = [], []
        super().__init__(*a, **kw)

    def _algorithm_step(self, output, cap):
        out = super()._algorithm_step(output, cap)
        self.rounds.append(
            dict(
                self._prl_last,
                completion_ids=output["completion_ids"].clone(),
                prompt_ids=output["prompt_ids"].clone(),
                prompt_mask=output["prompt_mask"].clone(),
                local_advantages=out["advantages"].clone(),
            )
        )
        return out

    def _compute_loss(self, model, inputs):
        self.loss_inputs.append(dict(inputs))
        return super()._compute_loss(model, inputs)


def _run(path, tmp_path, reward=None, cls=Spy, n_prompts=8, **overrides):
    tr = cls(
        model=path,
        reward_funcs=reward or contains_reward("e"),
        args=_config(tmp_path, **overrides),
        train_dataset=tiny_prompt_dataset(n_prompts),
    )
    tr.train()
    return tr


def _padded_logps(model, input_ids, attention_mask, T):
    """Independent log-probs as TRL scores them: padded rows, attention mask, default positions, full log-softmax."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -T - 1 : -1]
    return logits.log_softmax(-1).gather(-1, input_ids[:, -T:, None])[..., 0]


def _suffix_sum(k):
    return k.flip(-1).cumsum(-1).flip(-1)


def _key(prompt_ids, completion_ids):
    return tuple(prompt_ids.tolist()) + (-1,) + tuple(completion_ids.tolist())


# ----------------------------------------------------------------------------------------------------------------
def test_config_defaults_and_validation(tmp_path):
    d = PRLConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    assert (d.prl_eta, d.prl_step_split, d.prl_step_len, d.prl_order) == (200.0, "length", 256, "advantage_first")
    assert (d.zero_fill_compat, d.scale_rewards, d.beta, d.loss_type, d.prl_eps) == (False, "group", 0.0, "dapo", 1e-6)
    bad = [
        (dict(prl_eta=0.0), "prl_eta"),
        (dict(prl_eta=-1.0), "prl_eta"),
        (dict(prl_step_split="paragraph"), "prl_step_split"),
        (dict(prl_step_len=0), "prl_step_len"),
        (dict(prl_order="kl_first"), "prl_order"),
        (dict(scale_rewards="global"), "scale_rewards"),  # "batch" is supported (tests/core/test_prm_label.py)
        (dict(loss_type="luspo", importance_sampling_level="sequence"), "loss_type"),
        (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation"),
    ]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            _config(tmp_path, **kw)
    assert _config(tmp_path, scale_rewards=False).scale_rewards == "none"
    with pytest.raises(TypeError, match="PRLConfig"):
        from trl import GRPOConfig

        PRLGRPOTrainer(
            model="x", reward_funcs=contains_reward(), args=GRPOConfig(str(tmp_path), use_cpu=True, bf16=False)
        )


@pytest.mark.parametrize(
    "options",
    [
        dict(prl_step_split="length", prl_step_len=3),
        dict(prl_step_split="length", prl_step_len=3, scale_rewards="batch"),
        dict(prl_step_split="double_newline", zero_fill_compat=True, scale_rewards="none"),
        dict(prl_step_split="newline", prl_order="process_first"),
        dict(
            prl_step_split="token",
            num_iterations=2,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=4,
            max_steps=4,
        ),
    ],
    ids=["length", "length-batch", "double_newline-compat-noscale", "process_first", "token-old-logps-from-trl"],
)
def test_trainer_advantages_equal_functional(tiny_model_path, tmp_path, options):
    """Every input rebuilt independently (verifier, step ends, rollout-policy and reference log-probs from fresh
    copies with a full log-softmax): the (B, T) weights that reach TRL's loss are `functional.prl_advantages`."""
    from transformers import AutoModelForCausalLM

    tr = _run(tiny_model_path, tmp_path, **{"max_steps": 2, **options})
    a = tr.args
    assert tr.prl_reference == "model" and tr.beta == 0.0 and tr.ref_model is None
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    assert all(torch.equal(p, q) for p, q in zip(unwrap(tr.prl_ref_model).parameters(), ref_model.parameters()))
    assert not any(p.requires_grad for p in tr.prl_ref_model.parameters())
    reward = contains_reward("e")
    assert len(tr.rounds) == 2
    for step, r in enumerate(tr.rounds):
        ids = torch.cat([r["prompt_ids"], r["completion_ids"]], 1)
        mask = r["mask"]
        am = torch.cat([r["prompt_mask"], mask.long()], 1)
        T = mask.size(1)
        texts = tr.processing_class.batch_decode(r["completion_ids"], skip_special_tokens=True)
        torch.testing.assert_close(r["outcome_rewards"], torch.tensor(reward(texts)))
        ref_lp = _padded_logps(ref_model, ids, am, T)
        torch.testing.assert_close(r["ref_logps"][mask], ref_lp[mask], atol=2e-5, rtol=1e-4)
        if step == 0:  # the policy still equals the reference: k_t = 0 exactly
            assert torch.equal(r["old_logps"][mask], r["ref_logps"][mask])
        else:
            assert (r["old_logps"] - r["ref_logps"])[mask].abs().max() > 1e-4
        if a.prl_order == "process_first" or a.prl_step_split == "token":
            assert r["step_ends"] is None
            ends = mask
        else:
            ends = F.step_end_mask(
                r["completion_ids"],
                mask,
                tr.processing_class,
                split=a.prl_step_split,
                step_len=a.prl_step_len if a.prl_step_split == "length" else None,
            )
            assert torch.equal(r["step_ends"] & mask, ends)
        expected = F.prl_advantages(
            r["outcome_rewards"],
            r["old_logps"],
            r["ref_logps"],
            mask,
            torch.arange(mask.size(0)) // K,
            eta=a.prl_eta,
            step_ends=None if r["step_ends"] is None else ends,
            order=a.prl_order,
            scale_rewards=a.scale_rewards,
            eps=a.prl_eps,
            zero_fill_compat=a.zero_fill_compat,
        )
        torch.testing.assert_close(r["advantages"], expected, atol=1e-6, rtol=1e-6)
        # by hand: A - S_t/eta, held constant within each step (per-token when every token ends a step)
        o = r["outcome_rewards"].view(-1, K)
        if a.prl_order == "advantage_first":
            A = o - o.mean(1, keepdim=True)
            if a.scale_rewards == "group":
                A = A / (o.std(1, keepdim=True) + a.prl_eps)
            elif a.scale_rewards == "batch":  # TRL's: the std of every outcome of the generation batch
                A = A / (o.std() + a.prl_eps)
            A = A.reshape(-1)
        else:
            A = r["outcome_rewards"]
        rho = (A[:, None] - _suffix_sum((r["old_logps"] - r["ref_logps"]) * mask) / a.prl_eta) * mask
        if ends is mask:
            torch.testing.assert_close(r["advantages"], rho, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(r["advantages"][ends], rho[ends], atol=1e-5, rtol=1e-5)
    # what reached the loss: the same weights, matched by content (TRL shuffles the rows of a generation batch)
    want = {}
    for r in tr.rounds:
        for i in range(r["completion_ids"].size(0)):
            want[_key(r["prompt_ids"][i], r["completion_ids"][i])] = r["local_advantages"][i]
    assert len(tr.loss_inputs) >= 2
    for inputs in tr.loss_inputs:
        assert inputs["advantages"].shape == inputs["completion_ids"].shape
        for i in range(inputs["completion_ids"].size(0)):
            assert torch.equal(
                inputs["advantages"][i], want[_key(inputs["prompt_ids"][i], inputs["completion_ids"][i])]
            )
    if options.get("num_iterations") == 2:
        assert all("old_per_token_logps" in x for x in tr.loss_inputs)  # TRL's own rollout log-probs were reused


def test_eta_huge_is_grpo(tiny_model_path, tmp_path):
    """With eta huge (and GRPO's eps 1e-4) PRL's weights are GRPO's advantage at every token: the run reproduces TRL's
    GRPOTrainer (same rollouts, same losses); and on one batch the loss equals the GRPO loss of the same tensors,
    while a finite eta changes it."""
    from trl import GRPOConfig, GRPOTrainer

    prl = _run(tiny_model_path, tmp_path / "prl", prl_eta=1e12, prl_eps=1e-4, max_steps=2)
    grpo_logs = []

    class Vanilla(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            grpo_logs.append(out)
            return out

    cfg = GRPOConfig(
        **tiny_kwargs(
            tmp_path, output_dir=str(tmp_path / "grpo"), max_completion_length=10, max_steps=2, learning_rate=1e-2
        )
    )
    van = Vanilla(
        model=tiny_model_path, reward_funcs=contains_reward("e"), args=cfg, train_dataset=tiny_prompt_dataset(8)
    )
    van.train()
    for step in range(2):
        r, g = prl.rounds[step], grpo_logs[step]
        assert torch.equal(r["completion_ids"], g["completion_ids"])
        torch.testing.assert_close(
            r["local_advantages"], g["advantages"][:, None].expand_as(r["mask"]) * r["mask"], atol=1e-7, rtol=1e-6
        )
    assert prl.rounds[1]["old_logps"].sub(prl.rounds[1]["ref_logps"])[prl.rounds[1]["mask"]].abs().max() > 1e-4
    pl = [h["loss"] for h in prl.state.log_history if "loss" in h and "train_runtime" not in h]
    gl = [h["loss"] for h in van.state.log_history if "loss" in h and "train_runtime" not in h]
    assert pl == pytest.approx(gl, rel=1e-4, abs=1e-7)
    # one batch of the second round (policy != reference): PRL loss == GRPO loss on (B,) advantages; eta=2 differs
    inputs = dict(prl.loss_inputs[-1])
    model = prl.model
    loss_prl = prl._compute_loss(model, inputs).item()
    A = inputs["advantages"][:, 0]
    loss_grpo = prl._compute_loss(model, dict(inputs, advantages=A)).item()
    assert loss_prl == pytest.approx(loss_grpo, abs=1e-7)
    r = prl.rounds[-1]
    S = _suffix_sum((r["old_logps"] - r["ref_logps"]) * r["mask"])
    S_of = {_key(r["prompt_ids"][i], r["completion_ids"][i]): S[i] for i in range(S.size(0))}
    S_in = torch.stack([S_of[_key(p, c)] for p, c in zip(inputs["prompt_ids"], inputs["completion_ids"])])
    loss_eta2 = prl._compute_loss(model, dict(inputs, advantages=A[:, None] - S_in / 2.0)).item()
    assert abs(loss_eta2 - loss_grpo) > 1e-4


def test_equal_outcomes_give_pure_kl_to_go(tiny_model_path, tmp_path):
    """All outcomes equal: A = 0 and the weights are -S_t/eta at each step end, the metrics say no sign flip."""

    def always_one(completions, **kw):
        return [1.0] * len(completions)

    tr = Spy(
        model=tiny_model_path,
        reward_funcs=always_one,
        train_dataset=tiny_prompt_dataset(8),
        args=_config(tmp_path, prl_step_split="length", prl_step_len=4, prl_eta=3.0, max_steps=1),
    )
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy away from its reference copy (A = 0 alone would never move it)
        for p in tr.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    tr.train()
    r = tr.rounds[0]
    mask = r["mask"]
    S = _suffix_sum((r["old_logps"] - r["ref_logps"]) * mask)
    expected = F.fill_from_step_end(-S / 3.0, r["step_ends"] | F.last_token_mask(mask)) * mask
    torch.testing.assert_close(r["advantages"], expected, atol=1e-6, rtol=1e-6)
    assert r["advantages"][mask].abs().max() > 1e-5
    h = next(h for h in tr.state.log_history if "prl/kl_to_go_mean" in h)
    assert h["prl/sign_flip_fraction"] == 0.0
    assert h["prl/kl_to_go_mean"] == pytest.approx(S[mask].mean().item(), rel=1e-5)
    assert h["prl/kl_to_go_max"] == pytest.approx(S[mask].max().item(), rel=1e-5)
    assert h["prl/kl_to_go_min"] == pytest.approx(S[mask].min().item(), rel=1e-5)
    assert h["prl/steps_per_completion"] == pytest.approx(torch.ceil(mask.sum(-1) / 4).float().mean().item())


class ZeroStepSpy(Spy):
    """Controlled log-probs: k = 0.25 on the first two tokens of row 0 (so S_0 = 0.5, S_1 = 0.25, S_t = 0 after),
    k = 0 everywhere else."""

    def _prl_logps(self, output, input_ids, attention_mask, T, mode):
        B = input_ids.size(0)
        ref = torch.zeros(B, T)
        old = torch.zeros(B, T)
        old[0, :2] = 0.25  # S_0 = 0.5, S_1 = 0.25, S_t = 0 after
        return old, ref


@pytest.mark.parametrize("compat", [False, True])
def test_exact_zero_step_value_survives(tiny_model_path, tmp_path, compat):
    """Outcomes (1, 0, 1, 0) per group, no std scaling: A = +-0.5. With eta 0.5 and steps of 2 tokens, row 0's first
    step ends with rho_1 = 0.5 - 0.25 / 0.5 = 0 exactly. The explicit step-end mask keeps that 0 for the whole step; the
    released non-zero fill (zero_fill_compat) replaces it by the next step's value (0.5)."""

    def alternating(completions, **kw):
        return [float(i % 2 == 0) for i in range(len(completions))]

    tr = _run(
        tiny_model_path,
        tmp_path,
        cls=ZeroStepSpy,
        reward=alternating,
        max_steps=1,
        scale_rewards="none",
        prl_eta=0.5,
        prl_step_split="length",
        prl_step_len=2,
        zero_fill_compat=compat,
    )
    r = tr.rounds[0]
    assert r["outcome_rewards"][0] == 1.0 and int(r["mask"][0].sum()) >= 4
    adv = r["advantages"][0]
    assert adv[1].item() == 0.0 or compat
    if compat:
        assert adv[0].item() == adv[1].item() == adv[2].item() == 0.5  # filled from the next step (S = 0 there)
    else:
        assert adv[0].item() == adv[1].item() == 0.0 and adv[2].item() == adv[3].item() == 0.5


@pytest.mark.parametrize("style", ["llama", "qwen"])
@pytest.mark.parametrize("split", ["newline", "double_newline"])
def test_newline_split_from_decoded_text(style, split):
    """Step ends come from the decoded text: right with a BOS tokenizer (the released code's `encode('\\n')[0]` is
    the BOS id there) and with newlines merged into other tokens (the delimiter's own id never occurs)."""
    tok = llama_style_tokenizer() if style == "llama" else qwen_style_tokenizer()
    texts = ["Let x = 4.\n\nThen we get 7.\nSo the result is 9.\n\nThe answer is 9.", "One step only."]
    delim = "\n" if split == "newline" else "\n\n"
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    T = max(map(len, rows)) + 2
    ids = torch.full((2, T), tok.pad_token_id)
    mask = torch.zeros(2, T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    fake = SimpleNamespace(
        args=SimpleNamespace(prl_order="advantage_first", prl_step_split=split, prl_step_len=256), _tokenizer=tok
    )
    ends = PRLGRPOTrainer._prl_step_ends(fake, ids, mask)
    for i, text in enumerate(texts):
        n = len(rows[i])
        assert tok.decode(rows[i]) == text and not ends[i, n:].any()
        # the steps are split_steps' steps (runs of delimiters collapse), cut at the token holding the delimiter
        e = ends[i, :n].nonzero().flatten().tolist()
        assert e[-1] == n - 1 and len(e) == len(F.split_steps(text, delimiter=delim))
        pieces = [tok.decode(rows[i][a + 1 : b + 1]) for a, b in zip([-1] + e[:-1], e)]
        assert "".join(pieces) == text
        for j, p in zip(e[:-1], pieces[:-1]):
            assert "\n" in tok.decode([rows[i][j]]) and delim in p
    assert ends[0].sum() >= (3 if split == "double_newline" else 4)
    if style == "llama":
        assert tok.encode("\n")[0] == tok.bos_token_id  # what the released code would look for
    else:
        assert tok.encode(delim)[0] not in rows[0]  # the released code would find no step end at all
        assert any("\n\n" in tok.decode([j]) and tok.decode([j]).strip() for j in rows[0])  # merged tokens


def test_reference_options(tiny_model_path, tmp_path):
    """TRL's beta > 0: TRL's reference and log-probs are reused (no own copy). PEFT: the base with adapters disabled.
    A pre-trained PeftModel: a frozen copy 'ref' of its adapter. Each gives k_t = 0 exactly on the first step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    tr = _run(tiny_model_path, tmp_path / "beta", beta=0.05, max_steps=1)
    assert tr.prl_reference == "trl" and tr.prl_ref_model is None and tr.ref_model is not None
    assert "kl" in tr.state.log_history[0]

    tr = Spy(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        args=_config(tmp_path / "peft", max_steps=2),
        train_dataset=tiny_prompt_dataset(8),
        peft_config=LoraConfig(**lora),
    )
    assert tr.prl_reference == "adapters_disabled" and tr.prl_ref_model is None
    tr.train()
    r0, r1 = tr.rounds
    assert torch.equal(r0["old_logps"][r0["mask"]], r0["ref_logps"][r0["mask"]])
    assert (r1["old_logps"] - r1["ref_logps"])[r1["mask"]].abs().max() > 0

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    peft_model = get_peft_model(base, LoraConfig(**lora))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)  # a "trained" adapter: the base is no longer the initial policy
    tr = Spy(
        model=peft_model,
        reward_funcs=contains_reward("e"),
        args=_config(tmp_path / "adapter", max_steps=1),
        train_dataset=tiny_prompt_dataset(8),
    )
    assert tr.prl_reference == "adapter" and "ref" in tr.model.peft_config
    ref_before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if ".ref." in n}
    tr.train()
    r0 = tr.rounds[0]
    assert torch.equal(r0["old_logps"][r0["mask"]], r0["ref_logps"][r0["mask"]])
    after = dict(tr.model.named_parameters())
    assert ref_before and all(torch.equal(v, after[n]) for n, v in ref_before.items())
    assert not any(after[n].requires_grad for n in ref_before)


def test_ten_step_run_logs_prl_metrics(tiny_model_path, tmp_path):
    tr = _run(tiny_model_path, tmp_path, cls=PRLGRPOTrainer, max_steps=10, n_prompts=20, prl_eta=5.0)
    logs = [h for h in tr.state.log_history if "loss" in h and "train_runtime" not in h]
    assert [h["step"] for h in logs] == list(range(1, 11))
    for h in logs:
        for n in (
            "loss",
            "prl/kl_to_go_mean",
            "prl/kl_to_go_min",
            "prl/kl_to_go_max",
            "prl/sign_flip_fraction",
            "prl/steps_per_completion",
            "reward",
            "entropy",
        ):
            assert n in h and math.isfinite(h[n]), (h["step"], n)
        assert 0.0 <= h["prl/sign_flip_fraction"] <= 1.0
        assert h["prl/kl_to_go_min"] <= h["prl/kl_to_go_mean"] <= h["prl/kl_to_go_max"]
        assert 1.0 <= h["prl/steps_per_completion"] <= math.ceil(10 / 3)
    assert logs[0]["prl/kl_to_go_max"] == 0.0 and logs[-1]["prl/kl_to_go_max"] > logs[-1]["prl/kl_to_go_min"]
    assert all(not p.requires_grad for p in tr.prl_ref_model.parameters())
