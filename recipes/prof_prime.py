"""PROF inside PRIME (arXiv 2509.03403 + 2502.01456): the online implicit PRM ranks each prompt's completions, and the
policy trains on the m most process-consistent (PRIME's GRPO estimator on the kept rows). No extra model.

Usage (TRL script style: every field of ``DataArguments``, :class:`trl_prime.PrimeGRPOConfig` (PRIME and ``prof_*``
options) and ``trl.ModelConfig`` is a flag or a key of the YAML; flags override the YAML)::

    python recipes/prof_prime.py --config recipes/configs/prof_prime.yaml
    python recipes/prof_prime.py --config recipes/configs/prof_prime.yaml --prof_mode correct --max_steps 5
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/prof_prime.py \\
        --config recipes/configs/prof_prime.yaml --model_name_or_path Qwen/Qwen2.5-Math-7B \\
        --dataset_name PRIME-RL/Eurus-2-RL-Data --bf16 true

The YAML's defaults run offline on a CPU: the embedded SmolLM2-135M-Instruct and embedded arithmetic problems.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _rl_common import DataArguments, build, parse  # noqa: E402


def main(data_args: DataArguments, training_args, model_args):
    """Train with :class:`trl_prime.PrimeGRPOTrainer` and PROF; saves the policy and the PRM. Returns the trainer."""
    from trl_prime import PrimeGRPOTrainer

    model_path, dataset, rewards, peft_config = build(data_args, training_args, model_args)
    trainer = PrimeGRPOTrainer(
        model=model_path, reward_funcs=rewards, args=training_args, train_dataset=dataset, peft_config=peft_config
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)  # the policy, and the trained implicit PRM in <output_dir>/prm
    return trainer


if __name__ == "__main__":
    from trl_prime import PrimeGRPOConfig

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*parse(PrimeGRPOConfig))
