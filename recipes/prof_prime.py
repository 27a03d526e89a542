"""PROF inside PRIME (arXiv 2509.03403 + 2502.01456): the online implicit PRM ranks each prompt's completions, and the
policy trains on the m most process-consistent (PRIME's GRPO estimator on the kept rows). No extra model.

Usage (TRL script style: every field of :class:`trl_prime.scripts.utils.RLScriptArguments`,
:class:`trl_prime.PrimeGRPOConfig` (PRIME and ``prof_*`` options) and ``trl.ModelConfig`` is a flag or a key of the
YAML; flags override the YAML; without ``--config`` this file reads ``recipes/configs/prof_prime.yaml``). This file is
``trl-prime prof`` (:mod:`trl_prime.scripts.prof`) with that default and ``trainer: prime_grpo``::

    python recipes/prof_prime.py --config recipes/configs/prof_prime.yaml
    trl-prime prof --config recipes/configs/prof_prime.yaml          # the same (the YAML says trainer: prime_grpo)
    python recipes/prof_prime.py --config recipes/configs/prof_prime.yaml --prof_mode correct --max_steps 5
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/prof_prime.py \\
        --config recipes/configs/prof_prime.yaml --model_name_or_path Qwen/Qwen2.5-Math-7B \\
        --dataset_name PRIME-RL/Eurus-2-RL-Data --bf16 true

The YAML's defaults run offline on a CPU: the embedded SmolLM2-135M-Instruct and embedded arithmetic problems.
"""

from __future__ import annotations

import os

from trl_prime.scripts import prof


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "prof_prime.yaml")


if __name__ == "__main__":
    prof.run(default_config=DEFAULT_CONFIG, default_trainer="prime_grpo")
