"""PRIME (arXiv 2502.01456), the paper's setup: Eurus-2-7B-SFT (Qwen2.5-Math-7B SFT) trained with PRIME on
Eurus-2-RL-Data, 8 GPUs, DeepSpeed ZeRO-3, vLLM colocated generation (the paper's section 4.1 and Table 5).

- Policy, implicit PRM and the PRM's frozen reference all start from ``PRIME-RL/Eurus-2-7B-SFT``; the PRM gets its own
  DeepSpeed engine and AdamW (lr 1e-6), the policy lr is 5e-7, no KL (TRL's reference model is not loaded).
- Prompts: ``PRIME-RL/Eurus-2-RL-Data`` (math with boxed answers, code with test cases); each row is scored by
  :func:`trl_prime.rewards.math_reward` or :func:`trl_prime.rewards.code_reward` according to its ``ability`` /
  ``data_source`` (:data:`trl_prime.data.outcome_reward`).
- :class:`trl_prime.PrimeRLOOTrainer`: K=4 completions per prompt, online filter 0.2 <= accuracy <= 0.8, PPO clip 0.2,
  one PPO epoch, 256 prompts per step (8 GPUs x 8 completions x 16 accumulation steps / 4), completions up to 3072
  tokens, and the released code's advantage options (double forward, ``batch_norm``, coefficients 5/5, the reference
  baseline, whitening, last token excluded).

Usage (TRL script style: every field of :class:`trl_prime.scripts.utils.RLScriptArguments`,
:class:`trl_prime.PrimeRLOOConfig` and ``trl.ModelConfig`` is a flag or a key of the YAML; flags override the YAML;
without ``--config`` this file reads ``recipes/configs/prime_qwen7b.yaml``). This file is ``trl-prime prime``
(:mod:`trl_prime.scripts.prime`) with that default::

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/prime_qwen7b.py \\
        --config recipes/configs/prime_qwen7b.yaml
    accelerate launch recipes/prime_qwen7b.py                     # same YAML, accelerate's default config
    trl-prime prime --config recipes/configs/prime_qwen7b.yaml --accelerate_config zero3   # the same accelerate launch
    python recipes/prime_qwen7b.py                                 # one process, no launcher (e.g. under a debugger)
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/prime_qwen7b.py \\
        --model_name_or_path /models/Eurus-2-7B-SFT --dataset_name /data/eurus2_rl/train.parquet \\
        --output_dir /ckpt/prime --max_steps 500
    # ZeRO-2 (policy weights replicated: faster, needs more memory per GPU), same YAML:
    accelerate launch --config_file accelerate_configs/zero2.yaml recipes/prime_qwen7b.py
    # two nodes of 8 GPUs (run on each node, NODE_RANK 0 / 1):
    accelerate launch --config_file accelerate_configs/zero3_two_nodes.yaml --machine_rank $NODE_RANK \\
        --main_process_ip $MASTER_ADDR recipes/prime_qwen7b.py

Every path (model, data, output) is a Hub id or a local path and can be overridden by a flag; the PRM and its
reference can start elsewhere with ``--prm_model`` / ``--prm_ref_model``. The trained policy is saved to
``output_dir`` and the implicit PRM to ``output_dir/prm`` (loadable with
:meth:`trl_prime.ImplicitPRM.from_pretrained`).
"""

from __future__ import annotations

import os

from trl_prime.scripts import prime


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "prime_qwen7b.yaml")


if __name__ == "__main__":
    prime.run(default_config=DEFAULT_CONFIG)
