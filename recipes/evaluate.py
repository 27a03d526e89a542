"""Evaluate a model: pass@1, avg@k and pass@k with the math / code verifiers on one or more datasets.

This file is ``trl-prime eval`` (:mod:`trl_prime.scripts.evaluate`, where the metrics and every option are
described)::

    python recipes/evaluate.py --config recipes/configs/evaluate.yaml
    trl-prime eval --config recipes/configs/evaluate.yaml                   # the same
    trl-prime eval --model_name_or_path PRIME-RL/Eurus-2-7B-PRIME --datasets PRIME-RL/Eurus-2-RL-Data \\
        --dataset_split test --use_vllm true --num_samples 16
"""

from __future__ import annotations

from trl_prime.scripts import evaluate


if __name__ == "__main__":
    evaluate.run()
