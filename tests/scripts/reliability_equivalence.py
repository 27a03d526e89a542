"""Same batch on 1 and on 2 processes (tests/core/test_reliability_distributed.py).

    python tests/scripts/reliability_equivalence.py --model PATH --out DIR                      # 1 process
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        tests/scripts/reliability_equivalence.py --model PATH --out DIR                          # 2 processes

Generation is replaced by a deterministic function of the *global* row index and the step, so both launches train on
exactly the same global batch of 12 completions (3 prompts x 4): 12 rows per device on 1 process, 6 per device on 2
(the group of global rows 4..7 is split across the ranks), with completion lengths 1..6 that differ between the ranks.
Runs, 2 steps each: PrimeRLOOTrainer with the online prompt filter and PROF on the implicit PRM (rows dropped:
2 of 4 per prompt), and PRLGRPOTrainer. Every rank writes its local advantages and loss masks per step, and rank 0 the
logged losses and the final policy / PRM weights, to DIR/<run>_rank{r}.pt.
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


def deterministic_completions(trainer, n_local: int) -> list[list[int]]:
    import torch

    offset = trainer.accelerator.process_index * n_local
    step = trainer.state.global_step
    vocab = len(trainer._tokenizer)
    eos = trainer._tokenizer.eos_token_id
    out = []
    for i in range(n_local):
        g = offset + i
        gen = torch.Generator().manual_seed(1000 * step + g)
        length = 1 + (g * 7 + step * 3) % (6 if g < 6 else 4)  # rows 6..11 (rank 1 of 2) are shorter
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        if length < 6 and g % 3:
            ids[-1] = eos
        out.append(ids)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()

    import torch
    from tiny import contains_reward, tiny_prompt_dataset

    from trl_prime import PrimeRLOOConfig, PrimeRLOOTrainer, PRLConfig, PRLGRPOTrainer
    from trl_prime.modeling import unwrap

    n_proc = int(os.environ.get("WORLD_SIZE", "1"))  # accelerate launch sets it; the trainer checks it below
    per_device = 12 // n_proc
    common = dict(
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=per_device,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        learning_rate=1e-3,
        shuffle_dataset=False,
    )

    class PrimeDet(PrimeRLOOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
            return deterministic_completions(self, len(prompt_ids))

    class PRLDet(PRLGRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            return deterministic_completions(self, len(prompt_ids)), None

    def flat(module):
        return torch.cat([p.detach().flatten().clone() for p in unwrap(module).parameters()])

    runs = {
        "prime": lambda: PrimeDet(
            model=cli.model,
            reward_funcs=contains_reward("e"),
            train_dataset=tiny_prompt_dataset(9),
            args=PrimeRLOOConfig(
                output_dir=os.path.join(cli.out, "prime"),
                prm_learning_rate=1e-2,
                filter_lower=0.0,
                filter_upper=0.8,
                prof_mode="both",
                prof_prm="implicit",
                prof_num_keep=2,
                prm_micro_batch_size=4,
                **common,
            ),
        ),
        "prl": lambda: PRLDet(
            model=cli.model,
            reward_funcs=contains_reward("e"),
            train_dataset=tiny_prompt_dataset(9),
            args=PRLConfig(
                output_dir=os.path.join(cli.out, "prl"), prl_eta=2.0, prl_step_split="length", prl_step_len=2, **common
            ),
        ),
    }
    for name, make in runs.items():
        tr = make()
        assert tr.accelerator.num_processes == n_proc
        records = []
        real_step = tr._algorithm_step

        def spy(output, cap, real_step=real_step, records=records):
            out = real_step(output, cap)
            lm = out.get("prime_loss_mask")
            if lm is None:
                tm = out.get("tool_mask")
                lm = out["completion_mask"] * (tm if tm is not None else 1)
            records.append(
                {
                    "advantages": out["advantages"].detach().cpu().clone(),
                    "loss_mask": lm.detach().cpu().clone(),
                    "completion_ids": out["completion_ids"].cpu().clone(),
                    "num_items": float(out["num_items_in_batch"]),
                }
            )
            return out

        tr._algorithm_step = spy
        tr.train()
        result = {"records": records}
        if tr.accelerator.is_main_process:
            result["logs"] = [h for h in tr.state.log_history if "loss" in h and "train_runtime" not in h]
            result["policy"] = flat(tr.model)
            if name == "prime":
                result["prm"] = flat(tr.prm_model)
        torch.save(result, os.path.join(cli.out, f"{name}_np{n_proc}_rank{tr.accelerator.process_index}.pt"))
        tr.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    from tiny import exit_launched_process

    exit_launched_process()  # skip interpreter teardown with gloo threads alive (see tests/tiny.py)
