"""The controlled task of the learning benchmark (issue 14): multi-operand addition written step by step.

A problem adds ``operands`` numbers of ``digits`` digits each. The gold solution writes one running sum per step,
steps separated by a blank line (the ``"\\n\\n"`` step delimiter of PROF and PRL), and ends with the answer in
``\\boxed{}``::

    prompt:      "Add: 7 + 8 + 6 + 9\\n"
    completion:  "7 + 8 = 15\\n\\n15 + 6 = 21\\n\\n21 + 9 = 30\\n\\n\\\\boxed{30}"

Every step depends on the previous one, so an early wrong running sum decides the outcome (credit assignment
matters). Answers are checked by :func:`trl_prime.rewards.math_reward`.

This module also builds the tiny real model of the benchmark and the learning test: a character-level tokenizer
trained with ``tokenizers`` over the task's alphabet (wrapped in ``PreTrainedTokenizerFast`` with pad/eos/bos tokens
and a chat template), a Llama-architecture causal LM of 1.06M parameters (hidden 128, 4 layers), warm-started with
TRL's ``SFTTrainer`` (600 steps of 32 examples, about 3 minutes on one core) on the solutions of a teacher whose
running sums are one too large in 30% of the steps. The warm start then solves 4x1 problems 92% of the time greedily and
about 40% sampled at temperature 1: its mistakes are early slips that decide the outcome, which RL can remove. It is
cached under ``~/.cache/trl_prime/learning/<hash of the recipe>/`` (``TRL_PRIME_CACHE`` overrides the root). The
module also holds the held-out evaluation (greedy and sampled accuracy) shared by the benchmark and the test, and the
oracle process reward of the benchmark's ``prime_rloo_oracle`` row (:func:`oracle_step_rewards`). Longer chains
(``TaskSpec(8, 1)``, the harder difficulty) use the same recipe; the SFT sequence length, the model's context and the
generation budget grow with them (:func:`sft_max_length`, :func:`max_completion_tokens`).

Everything is offline. Used by ``benchmarks/learning.py`` and ``tests/bench/test_learning.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONTROL_TOKENS = ["<|pad|>", "<|im_end|>", "<|im_start|>", "<|bos|>"]
# every character the task, its prompts and the chat template can produce (one token each)
ALPHABET = sorted(set("0123456789 +=:\n\\{}") | set("Addboxe") | set("usertmanicyst"))


@dataclass(frozen=True)
class TaskSpec:
    """The addition task: ``operands`` numbers of ``digits`` digits (the ``--difficulty``, written ``"3x2"``)."""

    operands: int = 4
    digits: int = 1

    @classmethod
    def parse(cls, text: str) -> TaskSpec:
        """``"3x2"`` -> 3 operands of 2 digits. Raises ``ValueError`` on anything else."""
        try:
            o, d = (int(x) for x in text.lower().split("x"))
        except ValueError as e:
            raise ValueError(f"--difficulty {text!r}: write OPERANDSxDIGITS, e.g. 3x2 (3 numbers of 2 digits)") from e
        if o < 2 or d < 1:
            raise ValueError(f"--difficulty {text!r}: needs at least 2 operands of at least 1 digit")
        return cls(o, d)

    def __str__(self) -> str:
        return f"{self.operands}x{self.digits}"


def make_problem(rng: random.Random, spec: TaskSpec, slip: float = 0.0) -> dict:
    """One problem: ``{"prompt", "completion", "solution" (the true answer), "key" (the operands)}``.

    ``completion`` is the step-by-step solution; with ``slip > 0`` each running sum is one too large with
    probability ``slip`` and the following steps continue from the written (wrong) sum, as a teacher that slips
    would write them (slips always go up, so they never cancel: the answer is right iff no step slipped). The warm start imitates such a teacher (see :class:`WarmStartRecipe`); ``solution`` is always
    the true sum.
    """
    lo = 10 ** (spec.digits - 1) if spec.digits > 1 else 0
    nums = [rng.randint(lo, 10**spec.digits - 1) for _ in range(spec.operands)]
    steps, written = [], nums[0]
    for n in nums[1:]:
        value = written + n
        if slip > 0 and rng.random() < slip:
            value += 1  # always up: two slips never cancel, so a right answer means no slipped step
        steps.append(f"{written} + {n} = {value}")
        written = value
    prompt = "Add: " + " + ".join(map(str, nums)) + "\n"
    completion = "\n\n".join(steps) + f"\n\n\\boxed{{{written}}}"
    return {"prompt": prompt, "completion": completion, "solution": str(sum(nums)), "key": tuple(nums)}


def make_splits(
    spec: TaskSpec, n_train: int, n_heldout: int, seed: int = 1234, slip: float = 0.0
) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out problems (no operand tuple in both), deterministic in ``seed``.

    ``slip`` applies to the train completions only (the SFT data); held-out completions are always correct.
    """
    rng = random.Random(seed)
    heldout, seen = [], set()
    while len(heldout) < n_heldout:
        p = make_problem(rng, spec)
        if p["key"] not in seen:
            seen.add(p["key"])
            heldout.append(p)
    train = []
    while len(train) < n_train:
        p = make_problem(rng, spec, slip)
        if p["key"] not in seen:
            train.append(p)
    return train, heldout


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and model
# ----------------------------------------------------------------------------------------------------------------
def build_tokenizer():
    """A character-level tokenizer over :data:`ALPHABET` (``tokenizers`` WordLevel, one token per character),
    wrapped as a left-padding ``PreTrainedTokenizerFast`` with pad/eos/bos tokens and a ChatML chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=CONTROL_TOKENS, min_frequency=1, show_progress=False)
    tok.train_from_iterator(["".join(ALPHABET)] * 2, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token="<|bos|>",
        padding_side="left",
        truncation_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass(frozen=True)
class WarmStartRecipe:
    """Everything that decides the warm-started model; its hash names the cache folder."""

    task: TaskSpec = TaskSpec()
    hidden_size: int = 128
    num_layers: int = 4
    intermediate_size: int = 512
    num_heads: int = 4
    slip: float = 0.3  # the SFT teacher's running sums are off by one with this probability per step
    sft_examples: int = 19200
    sft_steps: int = 600
    sft_batch: int = 32
    sft_lr: float = 3e-3
    seed: int = 0
    data_seed: int = 1234
    n_heldout: int = 256
    version: int = 2  # bump when this file changes the recipe's meaning

    def digest(self) -> str:
        fields = {**asdict(self), "task": asdict(self.task), "alphabet": ALPHABET}
        if sft_max_length(self.task) != SFT_MAX_LENGTH:
            # longer chains (e.g. 8x1) train on their whole solutions; before, SFT truncated them at 128 tokens, so
            # they get a new hash. A task that fits 128 tokens (4x1, 3x2) keeps its hash and its cached warm start.
            fields["sft_max_length"] = sft_max_length(self.task)
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# SFT sequence budget (prompt + completion tokens) and model context of the recipes whose solutions fit in them
SFT_MAX_LENGTH = 128
MAX_POSITIONS = 256


def longest_prompt_tokens(spec: TaskSpec) -> int:
    """Tokens (= characters) of the longest prompt of ``spec``: every operand ``10**digits - 1``."""
    return len("Add: " + " + ".join([str(10**spec.digits - 1)] * spec.operands) + "\n")


def sft_max_length(spec: TaskSpec) -> int:
    """SFT's ``max_length`` for ``spec``: 128, or the longest prompt plus :func:`max_completion_tokens` where that is
    longer (8x1: 35 + 108 = 143), so that no SFT example loses the end of its solution (its boxed answer)."""
    return max(SFT_MAX_LENGTH, longest_prompt_tokens(spec) + max_completion_tokens(spec))


def cache_root() -> Path:
    return Path(os.environ.get("TRL_PRIME_CACHE", Path.home() / ".cache" / "trl_prime")) / "learning"


def build_random_model(path: str | os.PathLike, recipe: WarmStartRecipe) -> str:
    """``save_pretrained`` the tokenizer and a random-init Llama causal LM of the recipe's size into ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=max(MAX_POSITIONS, sft_max_length(recipe.task)),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def warm_start(recipe: WarmStartRecipe = WarmStartRecipe(), *, log=print) -> str:
    """The warm-started model's folder: built once with TRL's ``SFTTrainer`` and cached by the recipe's hash.

    The build (a few CPU minutes on one thread) writes into a temporary folder and renames it, so concurrent callers
    never see a half-written model; ``info.json`` records the recipe, the SFT time and the sampled accuracy.
    """
    folder = cache_root() / recipe.digest()
    if (folder / "info.json").is_file():
        return str(folder)
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tmp = folder.parent / f"{folder.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    init = build_random_model(tmp / "init", recipe)
    train, heldout = make_splits(recipe.task, recipe.sft_examples, recipe.n_heldout, recipe.data_seed, recipe.slip)
    ds = Dataset.from_list([{"prompt": p["prompt"], "completion": p["completion"]} for p in train])
    args = SFTConfig(
        output_dir=str(tmp / "sft"),
        max_steps=recipe.sft_steps,
        per_device_train_batch_size=recipe.sft_batch,
        learning_rate=recipe.sft_lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, recipe.sft_steps // 20),
        weight_decay=0.0,
        seed=recipe.seed,
        data_seed=recipe.seed,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        logging_steps=max(1, recipe.sft_steps // 10),
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_length=sft_max_length(recipe.task),
        completion_only_loss=True,
    )
    trainer = SFTTrainer(model=init, args=args, train_dataset=ds)
    trainer.train()
    out = tmp / "model"
    trainer.model.save_pretrained(out)
    trainer.processing_class.save_pretrained(out)
    sft_seconds = time.time() - t0
    acc = evaluate(trainer.model, trainer.processing_class, heldout, greedy=True, samples=1, seed=0, spec=recipe.task)
    info = {
        "recipe": {**asdict(recipe), "task": asdict(recipe.task)},
        "sft_seconds": round(sft_seconds, 1),
        "heldout_accuracy": acc,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "torch_threads": torch.get_num_threads(),
    }
    (out / "info.json").write_text(json.dumps(info, indent=2))
    # publish: model files at the folder's top level
    try:
        os.rename(out, folder)
    except OSError:
        if not (folder / "info.json").is_file():
            raise
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"warm start {folder}: {sft_seconds:.0f} s SFT, held-out accuracy {acc}")
    return str(folder)


# ----------------------------------------------------------------------------------------------------------------
# Held-out evaluation
# ----------------------------------------------------------------------------------------------------------------
def max_completion_tokens(spec: TaskSpec) -> int:
    """Tokens (= characters) of the longest gold solution of ``spec`` plus 8: the RL and eval generation budget."""
    worst = make_problem(random.Random(0), TaskSpec(spec.operands, spec.digits))
    nums = [10**spec.digits - 1] * spec.operands
    steps, total = [], nums[0]
    for n in nums[1:]:
        steps.append(f"{total} + {n} = {total + n}")
        total += n
    longest = "\n\n".join(steps) + f"\n\n\\boxed{{{total}}}"
    return max(len(longest), len(worst["completion"])) + 8


def evaluate(
    model,
    tokenizer,
    problems: list[dict],
    *,
    greedy: bool = True,
    samples: int = 1,
    seed: int = 0,
    batch_size: int = 256,
    max_new_tokens: int | None = None,
    spec: TaskSpec | None = None,
) -> dict:
    """Held-out accuracy of ``model``: ``{"greedy": acc, "sampled": acc}`` (keys present as requested).

    Greedy decoding scores each problem once; sampling (temperature 1, no top-k/top-p) draws ``samples`` completions
    per problem with ``torch`` seeded by ``seed``. Answers are checked by ``trl_prime.rewards.math_reward``; a row it
    cannot score (``None``: gold unparseable or verifier error) is excluded from the mean, and counted.
    """
    import torch

    from trl_prime.rewards import math_reward

    spec = spec or TaskSpec()
    max_new_tokens = max_new_tokens or max_completion_tokens(spec)
    was_training = model.training
    model.eval()
    out = {}
    modes = (["greedy"] if greedy else []) + (["sampled"] if samples > 0 else [])
    try:
        for mode in modes:
            reps = 1 if mode == "greedy" else samples
            prompts = [p["prompt"] for p in problems for _ in range(reps)]
            golds = [p["solution"] for p in problems for _ in range(reps)]
            texts = []
            gen = torch.Generator().manual_seed(seed)
            for s in range(0, len(prompts), batch_size):
                enc = tokenizer(prompts[s : s + batch_size], return_tensors="pt", padding=True)
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
                with torch.no_grad():
                    ids = model.generate(
                        **enc.to(model.device),
                        max_new_tokens=max_new_tokens,
                        do_sample=mode == "sampled",
                        temperature=1.0 if mode == "sampled" else None,
                        top_k=0 if mode == "sampled" else None,
                        top_p=1.0 if mode == "sampled" else None,
                        pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id,
                    )
                texts += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            rewards = math_reward(texts, solution=golds)
            scored = [r for r in rewards if r is not None]
            out[mode] = sum(scored) / max(1, len(scored))
            if len(scored) < len(rewards):
                out[f"{mode}_unscored"] = len(rewards) - len(scored)
    finally:
        model.train(was_training)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The oracle process reward (issue 26, item 8): exact per-step correctness in place of the implicit PRM
# ----------------------------------------------------------------------------------------------------------------
# The oracle's reward at the first wrong step. Chosen as the outcome reward's own gap (math_reward: 1 right, 0
# wrong), so that with Eq. 5's process_coef = outcome_coef = 1 the oracle's sequence rewards (0 for a solution with
# every step right, -1 otherwise) separate solutions as much as the outcome does: the scale of an implicit PRM that
# ranks perfectly (a PRM with +0.03 per token on a right completion of 24 tokens and -0.03/7 on 7 wrong ones separates them by 0.82,
# issue 26 item 1), and far above the ~0.01 of an untrained one.
ORACLE_STEP_PENALTY = 1.0


def gold_steps(operands: list[int]) -> list[str]:
    """The right solution's steps of ``operands``: ``"a + b = c"`` per running sum, then ``"\\\\boxed{sum}"``.

    ``gold_steps([7, 8, 6])`` is ``["7 + 8 = 15", "15 + 6 = 21", "\\\\boxed{21}"]`` (the completion format of
    :func:`make_problem`, blank-line separated)."""
    steps, total = [], operands[0]
    for n in operands[1:]:
        steps.append(f"{total} + {n} = {total + n}")
        total += n
    return [*steps, f"\\boxed{{{total}}}"]


def parse_operands(prompt: str) -> list[int]:
    """The operands of a task prompt (``"Add: 7 + 8 + 6\\n"`` -> ``[7, 8, 6]``). Raises ``ValueError`` otherwise."""
    m = re.search(r"Add: (\d+(?: \+ \d+)+)", prompt)
    if m is None:
        raise ValueError(f"not a prompt of the addition task: {prompt!r}")
    return [int(x) for x in m.group(1).split(" + ")]


def oracle_step_rewards(pieces: list[str], operands: list[int], penalty: float = ORACLE_STEP_PENALTY) -> list[float]:
    """Exact per-step process rewards of one completion: ``-penalty`` at the end of its first wrong step, else 0.

    Args:
        pieces: the completion's tokens, each decoded to its text (special tokens such as EOS to ``""``), in order.
        operands: the problem's numbers (:func:`parse_operands` of its prompt).
        penalty: the reward's size (:data:`ORACLE_STEP_PENALTY`).

    Returns:
        One reward per token (``len(pieces)``): 0 everywhere except ``-penalty`` on one token when a step is wrong.

    The completion is split into steps at blank lines (``"\\n\\n"``) and compared with :func:`gold_steps` (each step
    stripped of surrounding whitespace). Step k is right iff it is the gold step k: its left operand is the true
    running sum, i.e. the previous written sum *and* every step before it was right, and its result is that sum plus
    the operand. The first step that is not (a slipped sum, a wrong operand, a malformed line, a wrong boxed answer)
    gets ``-penalty`` on the token holding its last non-blank character (on the completion's last token if the step
    is blank); a completion that stops before its boxed answer gets it on its last token (the EOS: stopping was
    the mistake; with the trainer's ``include_last_token=False`` the advantages drop that last-token reward, and
    such a row keeps the outcome term alone). Every later step gets 0, and so do steps after the boxed answer.

    Why this form: the implicit PRM's token rewards are differences of a value (the sum of the rewards up to token
    t estimates ``beta log E[exp(r_o / beta) | y_<=t]``, Implicit PRM arXiv 2412.01981); for a policy that computes
    its answer from its written steps that value drops once, at the first wrong step, and the steps after it
    cannot repair it. Under Eq. 5's reward-to-go (``gamma = 1``) the tokens up to and including the first wrong
    step then carry the penalty and the steps after it do not (the outcome term alone blames them). Rewarding each
    right step (+c) instead would make every sequence reward count its right steps and, through the reward-to-go,
    favour early tokens whatever they are.

    What it is not: the outcome's decomposition. The warm starts reach right answers through wrong written steps
    (a slipped sum compensated later, or a wrong operand copied while the running sums stay right): in 1,024
    samples at temperature 1, 73 of the 290 right answers of the ``4x1`` warm start and 121 of the 123 right
    answers of the ``8x1`` one had a wrong step. The oracle penalises those (process supervision: a right answer
    through a wrong step is a flawed solution), so its sequence reward is ``-penalty`` for every wrong answer and
    for those right ones, and 0 for the faithful right ones.
    """
    rewards = [0.0] * len(pieces)
    if not pieces:
        return rewards
    owner = [i for i, piece in enumerate(pieces) for _ in piece]  # the token of each character
    text = "".join(pieces)
    spans, start = [], 0
    while True:
        end = text.find("\n\n", start)
        spans.append((start, len(text) if end < 0 else end))
        if end < 0:
            break
        start = end + 2
    for k, gold in enumerate(gold_steps(list(operands))):
        if k >= len(spans):  # stopped before this step
            rewards[-1] = -penalty
            break
        a, b = spans[k]
        if text[a:b].strip() != gold:
            last = [j for j in range(a, b) if not text[j].isspace()]
            rewards[owner[last[-1]] if last else len(pieces) - 1] = -penalty
            break
    return rewards


def __getattr__(name: str):
    """``OracleRLOOTrainer``, built on first use (importing it imports torch and trl_prime)."""
    if name == "OracleRLOOTrainer":
        return _oracle_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ORACLE_CLASS = None


def _oracle_trainer_class():
    global _ORACLE_CLASS
    if _ORACLE_CLASS is not None:
        return _ORACLE_CLASS
    import torch
    from accelerate.utils import gather

    from trl_prime import PrimeRLOOTrainer

    class OracleRLOOTrainer(PrimeRLOOTrainer):
        """PRIME-RLOO (Eq. 5) whose process rewards are :func:`oracle_step_rewards` of each completion instead of
        the implicit PRM's Eq. 3 token rewards (the benchmark's ``prime_rloo_oracle``: ``prm_learning_rate=0``, the
        PRM is not used). ``prm/pair_accuracy`` then measures the oracle's sequence rewards against the outcomes:
        each (right, wrong) pair of a group scores 1, or 0.5 (a tie) when the right answer came through a wrong
        step; a group whose outcomes are all equal scores 0.5 (the metric's convention)."""

        oracle_penalty = ORACLE_STEP_PENALTY

        def _token_rewards(self, output, r):
            """``(B, T)`` oracle rewards on the policy's tokens (``r.actions``) and their ``(B_global,)`` row sums."""
            tok, mask = self._tokenizer, r.actions
            prompts = tok.batch_decode(output["prompt_ids"], skip_special_tokens=True)
            rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
            for i, ids in enumerate(output["completion_ids"].tolist()):
                pos = mask[i].nonzero(as_tuple=True)[0].tolist()
                pieces = [tok.decode([ids[p]], skip_special_tokens=True) for p in pos]
                values = oracle_step_rewards(pieces, parse_operands(prompts[i]), self.oracle_penalty)
                rewards[i, pos] = torch.tensor(values, dtype=torch.float32, device=mask.device)
            return rewards, gather(rewards.sum(-1))

    _ORACLE_CLASS = OracleRLOOTrainer
    return OracleRLOOTrainer
