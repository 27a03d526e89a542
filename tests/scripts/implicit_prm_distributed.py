"""ImplicitPRMTrainer under `accelerate launch` (2 CPU processes, DDP over gloo) or in one process, for
tests/implicit_prm/test_implicit_prm_distributed.py.

8 prompts with groups of 3-5 rows (2 correct at least, 1 incorrect at least), DPO loss, batches of whole prompt groups.
Two processes with batch `--batch` and accumulation 1 see the same batches per optimizer step as one process with
accumulation 2 (accelerate deals whole batches round-robin), so losses and weights must agree. Writes
`summary.json` (losses, per-rank batches' prompt groups, world size) and `weights.pt` (main process).
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def dataset():
    from datasets import Dataset

    rows = []
    for p in range(8):
        prompt = f"Question {p}: what is {p} + {p}?"
        n_good, n_bad = 2 + p % 2, 1 + (p % 3)
        for k in range(n_good):
            rows.append({"prompt": prompt, "completion": f"{p} + {p} = {2 * p}." + " ok" * k, "label": 1.0})
        for k in range(n_bad):
            rows.append({"prompt": prompt, "completion": f"{p} + {p} = {2 * p + 1 + k}.", "label": 0.0})
    # interleave prompts so grouping is the trainer's job
    rows = sorted(rows, key=lambda r: (len(r["completion"]) % 3, r["prompt"]))
    return Dataset.from_list(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--loss_type", default="dpo")
    ap.add_argument("--lora", action="store_true")
    a = ap.parse_args()

    from trl_prime import ImplicitPRM, ImplicitPRMConfig, ImplicitPRMTrainer

    torch.manual_seed(0)
    args = ImplicitPRMConfig(
        output_dir=a.out,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=5e-3,
        max_steps=2,
        beta=0.5,
        loss_type=a.loss_type,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        max_length=64,
        max_prompt_length=32,
        lr_scheduler_type="constant",
        optim="sgd",
    )
    peft_config = None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = ImplicitPRMTrainer(model=a.model, args=args, train_dataset=dataset(), peft_config=peft_config)
    seen = []
    orig = trainer.compute_loss

    def compute_loss(model, inputs, *rest, **kw):
        seen.append(inputs["group_ids"].tolist())
        return orig(model, inputs, *rest, **kw)

    trainer.compute_loss = compute_loss
    trainer.train()
    acc = trainer.accelerator
    from accelerate.utils import gather_object

    all_seen = gather_object([seen])
    trainer.save_model(os.path.join(a.out, "prm"))
    if acc.is_main_process:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
        pair = [h.get("pair_accuracy") for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
        group_sizes = {}
        for g in trainer.train_dataset["group_id"]:
            group_sizes[g] = group_sizes.get(g, 0) + 1
        state = {
            k: v.detach().cpu().clone()
            for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
        }
        torch.save(state, os.path.join(a.out, "weights.pt"))
        prm = ImplicitPRM.from_pretrained(os.path.join(a.out, "prm"))
        scores = prm.score(["Question 1: what is 1 + 1?"] * 2, ["1 + 1 = 2.", "1 + 1 = 3."])
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(
                {
                    "num_processes": acc.num_processes,
                    "losses": losses,
                    "pair_accuracy": pair,
                    "batches": all_seen,
                    "group_sizes": group_sizes,
                    "scores": scores,
                    "global_step": trainer.state.global_step,
                },
                f,
            )


if __name__ == "__main__":
    main()
    from tiny import exit_launched_process

    exit_launched_process()  # skip interpreter teardown with gloo threads alive (see tests/tiny.py)
