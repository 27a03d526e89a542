"""Tiny offline models for tests: a byte-level BPE tokenizer and a 2-layer causal LM, built from nothing.

No network and no Hugging Face Hub: the tokenizer is trained with ``tokenizers`` on a small corpus, wrapped in a
``PreTrainedTokenizerFast`` (pad/eos tokens, left padding, a ChatML-style chat template), and the model is a
``Qwen2Config`` (hidden 64, 2 layers) or ``LlamaConfig`` model. ``build_tiny_model(path)`` writes both with
``save_pretrained`` so that TRL can reload them from ``config._name_or_path``.

Used by ``tests/conftest.py`` (session-scoped fixtures) and by the multi-process scripts in ``tests/scripts/``.
"""

from __future__ import annotations

import os
from pathlib import Path


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONTROL_TOKENS = ["<|pad|>", "<|im_end|>", "<|im_start|>"]

CORPUS = [
    "What is 2 + 3? The answer is 5.",
    "Compute 7 * 6. Step one: 7 * 6 = 42.\n\nSo the answer is \\boxed{42}.",
    "First, add the numbers.\n\nThen, divide by two.\n\nThe result is \\boxed{3}.",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z 0 1 2 3 4 5 6 7 8 9",
    "Let x be the number of apples. Then x + 4 = 9, so x = 5.",
    "user assistant system\nhello world, the quick brown fox jumps over the lazy dog.",
]


def build_tokenizer(vocab_size: int = 320):
    """Train a byte-level BPE tokenizer offline and wrap it as a left-padding ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        padding_side="left",
        truncation_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


#: the tiny policy's size (hidden 64, 2 layers) and a smaller one (hidden 32, 1 layer: step PRMs, reward models,
#: a PRM smaller than the policy)
TINY_DIMS = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
SMALL_DIMS = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)


def tiny_config_kwargs(tokenizer, *, small: bool = False, **overrides) -> dict:
    """The keyword arguments of a tiny model config on ``tokenizer``'s vocabulary and pad/eos ids: :data:`TINY_DIMS`
    (or :data:`SMALL_DIMS`), 512 positions, with ``overrides``."""
    kw = dict(
        vocab_size=len(tokenizer),
        **(SMALL_DIMS if small else TINY_DIMS),
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    kw.update(overrides)
    return kw


def tiny_qwen2_config(tokenizer=None, *, small: bool = False, **overrides):
    """A tiny ``Qwen2Config`` (:func:`tiny_config_kwargs`) on ``tokenizer`` (the tiny BPE tokenizer by default)."""
    from transformers import Qwen2Config

    if tokenizer is None:
        tokenizer = build_tokenizer()
    return Qwen2Config(**tiny_config_kwargs(tokenizer, small=small, **overrides))


def build_tiny_model(path: str | os.PathLike, *, arch: str = "qwen2", seed: int = 0, dropout: float = 0.0):
    """Build and ``save_pretrained`` a tiny causal LM and its tokenizer into ``path``; return ``str(path)``.

    Args:
        path: output folder (created).
        arch: ``"qwen2"`` or ``"llama"``.
        seed: torch seed for the random initialisation (the same seed gives the same weights).
        dropout: attention dropout of the config (0.0 by default; tests of eval-mode scoring set it > 0).
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    common = tiny_config_kwargs(tokenizer, bos_token_id=None, tie_word_embeddings=False, attention_dropout=dropout)
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    return save_tiny_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer, path)


def save_tiny_model(model, processing_class, path: str | os.PathLike) -> str:
    """Seeded weights are already in ``model``; set its generation ids (pad and eos of the tokenizer of
    ``processing_class``, no BOS) and ``save_pretrained`` both into ``path``; return ``str(path)``."""
    tok = getattr(processing_class, "tokenizer", processing_class)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(path)
    processing_class.save_pretrained(path)
    return str(path)


def tiny_prompt_dataset(n: int = 8, conversational: bool = False):
    """A ``datasets.Dataset`` with a ``prompt`` column (and a ``solution`` column) of ``n`` short prompts."""
    from datasets import Dataset

    prompts, solutions = [], []
    for i in range(n):
        text = f"What is {i} + {i % 3}?"
        prompts.append([{"role": "user", "content": text}] if conversational else text)
        solutions.append(str(i + i % 3))
    return Dataset.from_dict({"prompt": prompts, "solution": solutions})


def contains_reward(char: str = "a"):
    """A deterministic outcome verifier: 1.0 if the completion text contains ``char``, else 0.0."""

    def reward_contains(completions, **kwargs):
        out = []
        for c in completions:
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(1.0 if char in text else 0.0)
        return out

    reward_contains.__name__ = f"contains_{char}"
    return reward_contains


def exit_launched_process(accelerator=None) -> None:
    """End an ``accelerate launch`` test script: wait for every rank, flush, then ``os._exit(0)``.

    Skips interpreter finalisation, where gloo's worker threads can still hold tensors whose release needs the GIL
    of an interpreter being torn down (an intermittent SIGABRT, "terminate called without an active exception", seen
    under load in CI after every output had been written). Call it only after all files are written and closed.
    """
    import sys

    if accelerator is not None:
        accelerator.wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # pragma: no cover - manual helper
    import sys

    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/trl_prime_tiny"))  # noqa: T201
