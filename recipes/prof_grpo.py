"""PROF on GRPO (arXiv 2509.03403): a step PRM filters each prompt's completions to the m most process-consistent.

Usage (TRL script style: every field of :class:`trl_prime.scripts.utils.RLScriptArguments`,
:class:`trl_prime.ProfGRPOConfig` and ``trl.ModelConfig`` is a flag or a key of the YAML; flags override the YAML;
without ``--config`` this file reads ``recipes/configs/prof_grpo.yaml``). This file is ``trl-prime prof``
(:mod:`trl_prime.scripts.prof`, ``trainer: prof_grpo``) with that default::

    trl-prime prof --config recipes/configs/prof_grpo.yaml   # through accelerate launch (accelerate's default config)
    python recipes/prof_grpo.py                              # one process, no launcher (e.g. under a debugger)

    # the paper's setup: Qwen2.5-Math-7B, n=8, m=4, Qwen2.5-Math-PRM-7B as step PRM (GPUs and the Hub needed)
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/prof_grpo.py \\
        --config recipes/configs/prof_grpo.yaml
    # PROF-POS (random incorrect completions), another PRM, a local dataset:
    accelerate launch recipes/prof_grpo.py --config recipes/configs/prof_grpo.yaml --prof_mode correct \\
        --prof_prm path/to/step_prm --dataset_name data/train.jsonl

``prof_prm`` is a token-classification step PRM (Qwen2.5-Math-PRM style: probability of label 1 at the ``<extra_0>``
placed after every ``"\\n\\n"`` step) or a folder saved by ``ImplicitPRM.save_pretrained``. For PROF with the online
implicit PRM of PRIME (no extra model; runs offline on a CPU) see ``recipes/prof_prime.py``.
"""

from __future__ import annotations

import os

from trl_prime.scripts import prof


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "prof_grpo.yaml")


if __name__ == "__main__":
    prof.run(default_config=DEFAULT_CONFIG)
