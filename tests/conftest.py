"""Shared pytest fixtures: tiny offline models built once per session (see ``tests/tiny.py``)."""

from __future__ import annotations

import os
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
for p in (ROOT, TESTS):  # `import trl_prime` and `import tiny` without an installed package
    if p not in sys.path:
        sys.path.insert(0, p)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
# DeepSpeed JIT-compiles its CPU shared-memory op (~2 min on 2 cores) into TORCH_EXTENSIONS_DIR; torch names the build
# by its flags, which hold the venv's path, so venvs sharing ~/.cache rebuild it in turn (and a build killed by a test
# timeout leaves a lock every later launch waits on forever): one folder per venv
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A tiny Qwen2 causal LM (hidden 64, 2 layers) and its tokenizer, saved with ``save_pretrained``."""
    from tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A tiny Llama causal LM with attention dropout 0.1 (checks eval-mode scoring), seed 1."""
    from tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=1, dropout=0.1)
