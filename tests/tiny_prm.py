"""Offline test doubles for PRL / PROF: a tiny token-classification step PRM and two tokenizer styles.

- :func:`build_tiny_step_prm`: a ``Qwen2ForTokenClassification`` (2 labels) with the tiny BPE tokenizer of
  ``tests/tiny.py`` plus the step separator ``<extra_0>``, saved with ``save_pretrained`` (Qwen2.5-Math-PRM-7B style).
- :func:`llama_style_tokenizer`: SentencePiece-like BPE (``▁`` word prefix, byte fallback so ``"\\n"`` is
  ``<0x0A>``, a BOS token added by the post-processor): ``tokenizer.encode("\\n")[0]`` is the BOS id.
- :func:`qwen_style_tokenizer`: byte-level BPE trained without pre-splitting, so newlines merge with the punctuation
  and words around them (``".\\n\\n"``-like tokens, as Qwen2's ``".ĊĊ"``): ``"\\n\\n"``'s own id may never occur.
"""

from __future__ import annotations

import os
from pathlib import Path


STEP_CORPUS = [
    "First, add the numbers.\n\nThen, divide by two.\n\nThe result is 3.",
    "Step one: x = 2.\n\nStep two: y = 3.\nSo x + y = 5.\n\nThe answer is 5.",
    "Let us compute.\n\nWe get 7.\n\nDone.",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , : = +",
]


def build_tiny_step_prm(path: str | os.PathLike, *, seed: int = 3, separator: str = "<extra_0>") -> str:
    """Save a tiny token-classification step PRM and its tokenizer into ``path``; return ``str(path)``."""
    import torch
    from tiny import build_tokenizer, tiny_qwen2_config
    from transformers import AutoModelForTokenClassification

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [separator]})
    cfg = tiny_qwen2_config(tok, small=True, num_labels=2, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def llama_style_tokenizer():
    """A Llama-2-style tokenizer: ``▁`` prefixes, byte fallback (``"\\n"`` -> ``<0x0A>``), BOS ``<s>`` prepended."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<unk>", "<s>", "</s>", *bytes_], show_progress=False
    )
    # no newline in the training text: "\n" has no token of its own and falls back to the byte <0x0A>
    tok.train_from_iterator([t.replace("\n", " ") for t in STEP_CORPUS] * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )


def qwen_style_tokenizer():
    """A byte-level BPE whose merges cross newlines (``".\\n\\n"`` and ``"\\n\\nThe"``-like tokens), no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(STEP_CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
