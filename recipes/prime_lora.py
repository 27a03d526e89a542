"""PRIME on one GPU with LoRA: the policy and the implicit PRM are two LoRA adapters on one frozen base model.

- Policy = adapter ``"default"`` (TRL's PEFT model), implicit PRM = adapter ``"prm"`` on the same base with its own
  AdamW, PRM reference = the same base with adapters disabled (the SFT model, no extra copy). One set of base weights
  in memory instead of three (policy, PRM, reference).
- Optionally a 4-bit base (``--load_in_4bit true``: bitsandbytes NF4), which fits a 7B model and both adapters on a
  single 24 GB GPU. It also trains on a CPU (``--use_cpu true``, slowly: tests and debugging); 8-bit needs CUDA.
- Same data, verifiers and PRIME options as ``recipes/prime_qwen7b.py`` (Eurus-2-RL-Data routed to math_reward /
  code_reward, K=4, filter 0.2-0.8, the released code's advantage options), with LoRA learning rates and a smaller
  batch (see ``recipes/configs/prime_lora.yaml``).

Usage (every field of :class:`trl_prime.scripts.utils.RLScriptArguments`, :class:`trl_prime.PrimeRLOOConfig` and
``trl.ModelConfig`` is a flag or a key of the YAML; flags override the YAML; without ``--config`` this file reads
``recipes/configs/prime_lora.yaml``). This file is ``trl-prime prime`` (:mod:`trl_prime.scripts.prime`) with that
default, and it refuses ``use_peft: false`` (use ``recipes/prime_qwen7b.py`` for full fine-tuning)::

    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/prime_lora.py \\
        --config recipes/configs/prime_lora.yaml
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/prime_lora.py --load_in_4bit true
    python recipes/prime_lora.py --model_name_or_path /models/Eurus-2-7B-SFT --lora_r 64 --lora_alpha 128
    trl-prime prime --config recipes/configs/prime_lora.yaml --load_in_4bit true

The policy adapter is saved to ``output_dir`` and the PRM adapter (with ``implicit_prm_config.json``) to
``output_dir/prm``.
"""

from __future__ import annotations

import os

from trl_prime.scripts import prime


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "prime_lora.yaml")


if __name__ == "__main__":
    prime.run(default_config=DEFAULT_CONFIG, require_peft=True)
