"""PRL on GRPO (arXiv 2601.10201): KL-regularised reward-to-go weights ``rho_t = A - S_t / eta`` in the PPO-clip loss.

Usage (TRL script style: every field of :class:`trl_prime.scripts.utils.RLScriptArguments`,
:class:`trl_prime.PRLConfig` and ``trl.ModelConfig`` is a flag or a key of the YAML; flags override the YAML; without
``--config`` this file reads ``recipes/configs/prl_grpo.yaml``). This file is ``trl-prime prl``
(:mod:`trl_prime.scripts.prl`) with that default::

    python recipes/prl_grpo.py --config recipes/configs/prl_grpo.yaml
    trl-prime prl --config recipes/configs/prl_grpo.yaml            # the same
    python recipes/prl_grpo.py --config recipes/configs/prl_grpo.yaml --max_steps 5 --prl_eta 100
    # the paper's setup (Qwen2.5-Math-1.5B/7B, NuminaMath-style prompts, n=5, eta 100-300, step 256):
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/prl_grpo.py \\
        --config recipes/configs/prl_grpo.yaml --model_name_or_path Qwen/Qwen2.5-Math-1.5B \\
        --dataset_name PRIME-RL/Eurus-2-RL-Data --num_generations 5 --per_device_train_batch_size 10 \\
        --max_completion_length 3072 --learning_rate 1e-6 --prl_eta 200 --prl_step_len 256 --bf16 true

The YAML's defaults run offline on a CPU: the embedded SmolLM2-135M-Instruct and embedded arithmetic problems.
"""

from __future__ import annotations

import os

from trl_prime.scripts import prl


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "prl_grpo.yaml")


if __name__ == "__main__":
    prl.run(default_config=DEFAULT_CONFIG)
