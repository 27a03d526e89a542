"""PROF on GRPO (arXiv 2509.03403): a step PRM filters each prompt's completions to the m most process-consistent.

Usage (TRL script style: every field of ``DataArguments``, :class:`trl_prime.ProfGRPOConfig` and ``trl.ModelConfig``
is a flag or a key of the YAML; flags override the YAML)::

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
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _rl_common import DataArguments, build, parse  # noqa: E402


def main(data_args: DataArguments, training_args, model_args):
    """Train with :class:`trl_prime.ProfGRPOTrainer`; saves the policy to ``output_dir``. Returns the trainer."""
    from trl_prime import ProfGRPOTrainer

    model_path, dataset, rewards, peft_config = build(data_args, training_args, model_args)
    trainer = ProfGRPOTrainer(
        model=model_path, reward_funcs=rewards, args=training_args, train_dataset=dataset, peft_config=peft_config
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    return trainer


if __name__ == "__main__":
    from trl_prime import ProfGRPOConfig

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*parse(ProfGRPOConfig))
