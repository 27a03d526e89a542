"""PRIME on one GPU with LoRA: the policy and the implicit PRM are two LoRA adapters on one frozen base model.

- Policy = adapter ``"default"`` (TRL's PEFT model), implicit PRM = adapter ``"prm"`` on the same base with its own
  AdamW, PRM reference = the same base with adapters disabled (the SFT model, no extra copy). One set of base weights
  in memory instead of three (policy, PRM, reference).
- Optionally a 4-bit base (``--load_in_4bit true``: bitsandbytes NF4), which fits a 7B model and both adapters on a
  single 24 GB GPU. It also trains on a CPU (``--use_cpu true``, slowly: tests and debugging); 8-bit needs CUDA.
- Same data, verifiers and PRIME options as ``recipes/prime_qwen7b.py`` (Eurus-2-RL-Data routed to math_reward /
  code_reward, K=4, filter 0.2-0.8, the released code's advantage options), with LoRA learning rates and a smaller
  batch (see ``recipes/configs/prime_lora.yaml``).

Usage (every field of ``DataArguments``, :class:`trl_prime.PrimeRLOOConfig` and ``trl.ModelConfig`` is a flag or a key
of the YAML; flags override the YAML; without ``--config`` the script reads ``recipes/configs/prime_lora.yaml``)::

    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/prime_lora.py \\
        --config recipes/configs/prime_lora.yaml
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/prime_lora.py --load_in_4bit true
    python recipes/prime_lora.py --model_name_or_path /models/Eurus-2-7B-SFT --lora_r 64 --lora_alpha 128

The policy adapter is saved to ``output_dir`` and the PRM adapter (with ``implicit_prm_config.json``) to
``output_dir/prm``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _rl_common import DataArguments, build, parse  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "prime_lora.yaml")


def with_default_config(argv: list[str] | None = None, default: str = DEFAULT_CONFIG) -> list[str]:
    """``argv`` (default ``sys.argv[1:]``) with ``--config <default>`` put first when it names no ``--config``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", default, *argv]
    return argv


def check_args(training_args, model_args) -> None:
    """Fail early, naming the option and the fix: LoRA must be on, a quantized base needs bitsandbytes, and an 8-bit
    base CUDA (4-bit trains on a CPU too)."""
    if not model_args.use_peft:
        raise ValueError(
            "recipes/prime_lora.py trains the policy and the PRM as LoRA adapters: set `use_peft: true` (--use_peft "
            "true), or use recipes/prime_qwen7b.py for full fine-tuning."
        )
    if model_args.load_in_4bit or model_args.load_in_8bit:
        import importlib.util

        import torch

        flag = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit"
        if model_args.load_in_8bit and (not torch.cuda.is_available() or getattr(training_args, "use_cpu", False)):
            raise ValueError(
                "`load_in_8bit`=true quantizes the base with bitsandbytes' 8-bit kernels, which need a CUDA GPU, and "
                "none is in use here. Set `load_in_4bit: true` (NF4, also on a CPU) or `load_in_8bit: false` "
                "(--load_in_8bit false) to train the LoRA adapters on a full-precision base."
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(
                f"`{flag}`=true needs bitsandbytes: `pip install bitsandbytes` (or `pip install -e .[bitsandbytes]`), "
                f"or set `{flag}: false`."
            )


def main(data_args: DataArguments, training_args, model_args):
    """Train with :class:`trl_prime.PrimeRLOOTrainer` and LoRA; saves both adapters. Returns the trainer."""
    from trl_prime import PrimeRLOOTrainer

    check_args(training_args, model_args)
    model_path, dataset, rewards, peft_config = build(data_args, training_args, model_args)
    trainer = PrimeRLOOTrainer(
        model=model_path, reward_funcs=rewards, args=training_args, train_dataset=dataset, peft_config=peft_config
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)  # the policy adapter, and the PRM adapter in <output_dir>/prm
    return trainer


if __name__ == "__main__":
    from trl_prime import PrimeRLOOConfig

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*parse(PrimeRLOOConfig, with_default_config()))
