"""One tokenisation and one step splitter everywhere.

- Offline ids (``tokenize_prompt_completion``: ``ImplicitPRM.score``, best-of-N, ``ImplicitPRMTrainer``, the rollout
  sampler) equal the ids TRL 1.16's ``GRPOTrainer`` / ``RLOOTrainer`` put in a batch, on a tokenizer whose
  post-processor adds BOS, for plain-string and conversational prompts: a PRM trained online (PRIME) is scored
  offline on the ids it was trained on.
- Best-of-N scoring (``ImplicitPRM.step_rewards`` / ``score`` / ``score_candidates``), PRL and PROF split a
  completion into the same steps (``F.step_end_mask``): runs of delimiters collapse, leading delimiters and a
  trailing delimiter before EOS make no step, so ``min`` aggregation never scores an empty step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_kwargs

from trl_prime import ImplicitPRM
from trl_prime import functional as F
from trl_prime.implicit_prm.model import tokenize_prompt_completion


PLAIN = ["What is 2 + 3?", "Let x be 4."]
CONVERSATIONAL = [
    [{"role": "user", "content": "Compute 7 * 6."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
]
COMPLETIONS = ["The answer is 5.", "x + 4 = 9"]


# ----------------------------------------------------------------------------------------------------------------
# Item 12: tokenisation
# ----------------------------------------------------------------------------------------------------------------
def build_bos_tokenizer():
    """The tiny BPE tokenizer of ``tests/tiny.py`` plus a BOS token ``<|bos|>`` that its post-processor prepends
    (``add_special_tokens=True``, like Llama's) and that its chat template writes itself (``{{ bos_token }}``)."""
    from tiny import CHAT_TEMPLATE, build_tokenizer
    from tokenizers.processors import TemplateProcessing

    tok = build_tokenizer()
    tok.add_special_tokens({"bos_token": "<|bos|>"})
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def bos_model_path(tmp_path_factory):
    """A tiny Qwen2 causal LM saved with the BOS tokenizer (vocabulary covering ``<|bos|>``)."""
    from tiny import tiny_qwen2_config
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny_bos")
    tok = build_bos_tokenizer()
    cfg = tiny_qwen2_config(
        tok, small=True, max_position_embeddings=256, bos_token_id=tok.bos_token_id, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _trl_kwargs(tmp_path, **overrides):
    trl = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=4)
    return tiny_kwargs(tmp_path, drop=("logging_steps", "learning_rate"), **{**trl, "beta": 0.0, **overrides})


@pytest.fixture(scope="module")
def trl_trainers(bos_model_path, tmp_path_factory):
    """TRL's own trainers (not trl-prime's) on the BOS tokenizer: ``{"grpo": GRPOTrainer, "rloo": RLOOTrainer}``."""
    from tiny import contains_reward, tiny_prompt_dataset
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    out = {}
    for name, trainer_cls, cfg_cls in (("grpo", GRPOTrainer, GRPOConfig), ("rloo", RLOOTrainer, RLOOConfig)):
        out[name] = trainer_cls(
            model=bos_model_path,
            reward_funcs=contains_reward("e"),
            args=cfg_cls(**_trl_kwargs(tmp_path_factory.mktemp(name))),
            train_dataset=tiny_prompt_dataset(4),
            processing_class=build_bos_tokenizer(),
        )
    return out


def test_bos_tokenizer_adds_bos_once():
    tok = build_bos_tokenizer()
    bos = tok.bos_token_id
    assert tok("Let x be 4.")["input_ids"][0] == bos
    assert tok("Let x be 4.", add_special_tokens=False)["input_ids"][0] != bos
    conv = tok.apply_chat_template(CONVERSATIONAL[0], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert conv["input_ids"][0] == bos and conv["input_ids"].count(bos) == 1


@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
@pytest.mark.parametrize("kind", ["plain", "conversational"])
def test_offline_ids_equal_trl_trainer_ids(trl_trainers, trainer_name, kind):
    """TRL's ``_tokenize_prompts`` (the prompt ids of every GRPO/RLOO batch) vs the offline tokenisation."""
    from trl_prime.implicit_prm.data import _render_prompt

    trainer = trl_trainers[trainer_name]
    tok = trainer.processing_class
    prompts = PLAIN if kind == "plain" else CONVERSATIONAL
    trl_ids, _, _ = trainer._tokenize_prompts(prompts)
    iprm = ImplicitPRM(trainer.model, None, tokenizer=tok)  # external reference: encode only
    enc = iprm.encode(prompts, COMPLETIONS)
    for i, (prompt, completion) in enumerate(zip(prompts, COMPLETIONS)):
        want_prompt = list(trl_ids[i])
        assert want_prompt[0] == tok.bos_token_id and want_prompt.count(tok.bos_token_id) == 1
        row = tokenize_prompt_completion(prompt, completion, tok)
        assert row["prompt_ids"] == want_prompt
        assert _render_prompt(prompt, tok) == want_prompt  # the prompt the offline rollout sampler continues
        # the completion as the policy generates it: no special token added, EOS at the end
        want_completion = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert row["completion_ids"] == want_completion
        # ImplicitPRM.encode / score: the unpadded row is TRL's prompt ids followed by the completion ids
        ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
        assert ids == want_prompt + want_completion


@pytest.mark.parametrize("kind", ["plain", "conversational"])
def test_offline_prompt_ids_equal_a_trl_grpo_step(bos_model_path, tmp_path, kind):
    """The prompt ids of a real GRPOTrainer step (what PRIME's online PRM is trained on) equal the offline ids."""
    from datasets import Dataset
    from tiny import contains_reward
    from trl import GRPOConfig, GRPOTrainer

    captured = []

    class Capture(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            captured.append(([x["prompt"] for x in inputs], out["prompt_ids"], out["prompt_mask"]))
            return out

    prompts = (PLAIN if kind == "plain" else CONVERSATIONAL) * 2
    tok = build_bos_tokenizer()
    Capture(
        model=bos_model_path,
        reward_funcs=contains_reward("e"),
        args=GRPOConfig(**_trl_kwargs(tmp_path)),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
    ).train()
    rows, ids, mask = captured[0]
    assert len(rows) == 4
    for prompt, row_ids, row_mask in zip(rows, ids, mask):
        trl_row = row_ids[row_mask.bool()].tolist()
        assert trl_row[0] == tok.bos_token_id
        assert tokenize_prompt_completion(prompt, "ok", tok)["prompt_ids"] == trl_row


def test_implicit_prm_trainer_dataset_uses_trl_ids(trl_trainers, tmp_path):
    """``ImplicitPRMTrainer`` trains on the same prompt ids (its dataset goes through the shared tokenisation)."""
    from datasets import Dataset

    from trl_prime import ImplicitPRMConfig, ImplicitPRMTrainer

    trainer = trl_trainers["grpo"]
    tok = trainer.processing_class
    args = ImplicitPRMConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for prompts in (PLAIN, CONVERSATIONAL):
        ds = Dataset.from_dict({"prompt": prompts, "completion": COMPLETIONS, "label": [1.0, 0.0]})
        prepared = ImplicitPRMTrainer._prepare_dataset(ds, tok, args, "train")
        want = trainer._tokenize_prompts(prompts)[0]
        assert [r["prompt_ids"] for r in prepared] == [list(w) for w in want]
        assert all(r["prompt_ids"][0] == tok.bos_token_id for r in prepared)


# ----------------------------------------------------------------------------------------------------------------
# Item 13: one step splitter
# ----------------------------------------------------------------------------------------------------------------
# Texts with runs of delimiters, a leading delimiter, a whitespace-only gap and a trailing delimiter (before EOS).
STEP_TEXTS = [
    "a\n\n\n\nb\n\n",
    "\n\nFirst, add.\n\n\n\nThen, divide.\n\n",
    "x = 5.\n\n \n\nThe answer is 5.",
    "one step",
]
# Hand-derived step ends, as character offsets in the text (the step ends on the token holding that character; the
# last step ends at the appended EOS):
#   "a\n\n\n\nb\n\n": "\n\n\n\n" is one run: step "a\n\n\n\n" ends at char 4, step "b\n\n" + EOS at EOS
#   "\n\nFirst, add.\n\n\n\nThen, divide.\n\n": the leading "\n\n" is no step; "First, add." is chars 2-12, its
#       run of delimiters chars 13-16, so step 1 ends at char 16; step 2 ("Then, divide.\n\n" + EOS) at EOS
#   "x = 5.\n\n \n\nThe answer is 5.": "\n\n \n\n" (chars 6-10) is one run: step 1 ends at char 10, step 2 at EOS
#   "one step": one step, ending at EOS
EXPECTED_CHAR_ENDS = [[4], [16], [10], []]


def _batch(tok, prompt="What is 2 + 3?"):
    rows = [tokenize_prompt_completion(prompt, t, tok)["completion_ids"] for t in STEP_TEXTS]
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tok.pad_token_id)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    expected = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        assert r[-1] == tok.eos_token_id and tok.decode(r[:-1]) == STEP_TEXTS[i]
        ends_at = 0  # exclusive end offset of each token's text
        for t, piece in enumerate(tok.decode([j]) for j in r[:-1]):
            ends_at += len(piece)
            expected[i, t] = any(ends_at - len(piece) <= c < ends_at for c in EXPECTED_CHAR_ENDS[i])
        expected[i, len(r) - 1] = True
    return ids, mask, expected


@pytest.fixture(scope="module")
def step_prm(tiny_model_path):
    """An ImplicitPRM with a perturbed PRM and the original as reference (non-zero token rewards)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prm = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in prm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return ImplicitPRM(prm, ref, beta=0.05, tokenizer=AutoTokenizer.from_pretrained(tiny_model_path))


def test_step_ends_are_hand_derived_and_no_step_is_empty(step_prm):
    tok = step_prm.tokenizer
    ids, mask, expected = _batch(tok)
    assert expected.sum(-1).tolist() == [2, 2, 2, 1]
    ends = F.step_end_mask(ids, mask, tok, delimiter="\n\n")
    assert ends.tolist() == expected.tolist()
    for i, text in enumerate(STEP_TEXTS):
        e = ends[i].nonzero().flatten().tolist()
        steps = [tok.decode(ids[i, a + 1 : b + 1], skip_special_tokens=True) for a, b in zip([-1] + e[:-1], e)]
        assert "".join(steps) == text
        assert all(s.strip() for s in steps)  # no empty or whitespace-only step, also not a leading "\n\n"
        assert [s.strip() for s in steps] == F.split_steps(text)


def test_best_of_n_prl_and_prof_split_alike(step_prm):
    from trl_prime import PRLGRPOTrainer
    from trl_prime.implicit_prm.best_of_n import score_candidates
    from trl_prime.prof.step_prm import ImplicitStepPRM, StepBatch

    tok = step_prm.tokenizer
    prompt = "What is 2 + 3?"
    ids, mask, expected = _batch(tok, prompt)
    enc = step_prm.encode([prompt] * len(STEP_TEXTS), STEP_TEXTS)
    assert torch.equal(enc["completion_ids"], ids) and torch.equal(enc["completion_mask"], mask)
    rewards = step_prm.token_rewards(enc["input_ids"], enc["attention_mask"], mask, include_last_token=True)
    want_values, want_smask = F.step_rewards(rewards, expected)
    assert want_smask.sum(-1).tolist() == [2, 2, 2, 1]

    # best-of-N: ImplicitPRM.step_rewards / score, and score_candidates (its batched twin)
    values, smask = step_prm.step_rewards(enc["input_ids"], enc["attention_mask"], mask)
    assert torch.equal(smask, want_smask)
    torch.testing.assert_close(values, want_values)
    want_min = [float(want_values[i][want_smask[i]].min()) for i in range(len(STEP_TEXTS))]
    assert step_prm.score([prompt] * len(STEP_TEXTS), STEP_TEXTS) == pytest.approx(want_min, abs=1e-6)
    assert score_candidates(step_prm, prompt, STEP_TEXTS, aggregations=("min",))["min"] == pytest.approx(
        want_min, abs=1e-6
    )

    # PRL segmentation
    fake = SimpleNamespace(
        args=SimpleNamespace(prl_order="advantage_first", prl_step_split="double_newline", prl_step_len=256),
        _tokenizer=tok,
    )
    assert PRLGRPOTrainer._prl_step_ends(fake, ids, mask).tolist() == expected.tolist()

    # PROF with the implicit PRM as step PRM: the same steps, scored sigmoid(step reward)
    batch = StepBatch(
        prompts=[prompt] * 4, completions=STEP_TEXTS, completion_ids=ids, completion_mask=mask, token_rewards=rewards
    )
    scores, prof_smask = ImplicitStepPRM(tok, delimiter="\n\n").step_scores(batch)
    assert torch.equal(prof_smask, want_smask)
    torch.testing.assert_close(scores, F.prof_step_scores_from_implicit(want_values, want_smask))


def test_special_tokens_hold_no_step_text():
    """A special token (EOS, BOS) after a trailing delimiter ends that step instead of forming a step of its own;
    a test double without ``all_special_ids`` keeps its decoded text (the conformance tokenizers)."""

    class Pieces:
        def __init__(self, special):
            self.pieces = {0: "A", 1: "\n\n", 2: "B", 3: "<eos>", 4: "<bos>"}
            if special:
                self.all_special_ids = [3, 4]

        def batch_decode(self, seqs):
            return ["".join(self.pieces[i] for i in s) for s in seqs]

    ids = torch.tensor([[0, 1, 2, 1, 3], [4, 1, 0, 1, 2]])
    mask = torch.ones(2, 5)
    assert F.step_end_mask(ids, mask, Pieces(True)).tolist() == [
        [False, True, False, False, True],  # "A\n\n", "B\n\n<eos>"
        [False, False, False, True, True],  # "<bos>\n\nA\n\n", "B": the leading delimiter is no step
    ]
    assert F.step_end_mask(ids, mask, Pieces(False)).tolist() == [
        [False, True, False, True, True],
        [False, True, False, True, True],
    ]
