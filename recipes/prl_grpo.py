"""PRL on GRPO (arXiv 2601.10201): KL-regularised reward-to-go weights ``rho_t = A - S_t / eta`` in the PPO-clip loss.

Usage (TRL script style: every field of ``DataArguments``, :class:`trl_prime.PRLConfig` and ``trl.ModelConfig`` is a
flag or a key of the YAML; flags override the YAML)::

    python recipes/prl_grpo.py --config recipes/configs/prl_grpo.yaml
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
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _rl_common import DataArguments, build, parse  # noqa: E402


def main(data_args: DataArguments, training_args, model_args):
    """Train with :class:`trl_prime.PRLGRPOTrainer`; saves the policy to ``output_dir``. Returns the trainer."""
    from trl_prime import PRLGRPOTrainer

    model_path, dataset, rewards, peft_config = build(data_args, training_args, model_args)
    trainer = PRLGRPOTrainer(
        model=model_path, reward_funcs=rewards, args=training_args, train_dataset=dataset, peft_config=peft_config
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    return trainer


if __name__ == "__main__":
    from trl_prime import PRLConfig

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*parse(PRLConfig))
