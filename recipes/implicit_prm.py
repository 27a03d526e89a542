"""Train an implicit PRM offline (Implicit PRM arXiv 2412.01981): policy rollouts -> verifier labels -> PRM.

This file is ``trl-prime implicit-prm`` (:mod:`trl_prime.scripts.implicit_prm`, where the steps and every option are
described) reading ``recipes/configs/implicit_prm.yaml`` when no ``--config`` is given::

    python recipes/implicit_prm.py --config recipes/configs/implicit_prm.yaml
    trl-prime implicit-prm --config recipes/configs/implicit_prm.yaml       # the same
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/implicit_prm.py \\
        --config recipes/configs/implicit_prm.yaml --model_name_or_path Qwen/Qwen2.5-Math-7B-Instruct \\
        --dataset_name PRIME-RL/Eurus-2-RL-Data --num_generations 8 --bf16 true

Evaluate with ``recipes/evaluate_best_of_n.py`` (``trl-prime best-of-n``).
"""

from __future__ import annotations

import os

from trl_prime.scripts import implicit_prm


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "implicit_prm.yaml")


if __name__ == "__main__":
    implicit_prm.run(default_config=DEFAULT_CONFIG)
