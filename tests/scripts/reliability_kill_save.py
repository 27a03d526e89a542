"""A PRIME run killed in the middle of writing a checkpoint (tests/core/test_reliability.py).

    python tests/scripts/reliability_kill_save.py --model PATH --out DIR --kill_at 2   # exits 17 while saving ckpt 2
    python tests/scripts/reliability_kill_save.py --model PATH --out DIR --resume      # resume_from_checkpoint=True

Saves every step with ``save_total_limit=1``. With ``--kill_at N`` the process calls ``os._exit(17)`` after the policy
of checkpoint N is written and while its PRM is being written (no clean-up runs, as with a SIGKILL).
"""

from __future__ import annotations

import argparse
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill_at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    cli = parser.parse_args()

    from tiny import contains_reward, tiny_prompt_dataset
    from transformers.trainer_utils import get_last_checkpoint

    from trl_prime import ImplicitPRM, PrimeRLOOConfig, PrimeRLOOTrainer

    args = PrimeRLOOConfig(
        output_dir=cli.out,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        seed=0,
        learning_rate=1e-3,
        prm_learning_rate=1e-2,
        filter_lower=0.0,
        filter_upper=1.0,
    )
    trainer = PrimeRLOOTrainer(
        model=cli.model, reward_funcs=contains_reward("e"), args=args, train_dataset=tiny_prompt_dataset(24)
    )
    if cli.kill_at is not None:
        real = ImplicitPRM.save_pretrained

        def dying(self, *a, **kw):
            if trainer.state.global_step == cli.kill_at:
                os._exit(17)
            return real(self, *a, **kw)

        ImplicitPRM.save_pretrained = dying
    if cli.resume:
        last = get_last_checkpoint(cli.out)
        trainer.train(resume_from_checkpoint=True)
        print(
            f"RESUMED_FROM {os.path.basename(last)} GLOBAL_STEP {trainer.state.global_step} "
            f"PRM_UPDATES {trainer.prm_optim.num_updates}",
            flush=True,
        )
    else:
        trainer.train()


if __name__ == "__main__":
    main()
