"""Two-process PRIME-PPO run on CPU, launched by tests/prime/test_ppo.py (or by hand):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
        tests/scripts/ppo_distributed.py --mode ddp --model PATH --out DIR

``--mode ddp``: DDP over gloo (``use_cpu=True``): the value model's gradients are all-reduced by hand (``ddp_lora``:
the value model is the adapter ``"value"`` on the policy's LoRA base, which must not move). ``--mode
zero3`` (``zero2``): DeepSpeed ZeRO-3 (ZeRO-2) over gloo, the value model its own engine, partitioned under ZeRO-3
(the setup of ``tests/scripts/prime_distributed.py``). ``--mode ddp_pc0``: DDP with ``process_coef=0`` (plain PPO);
``--mode ddp_prm_value``: DDP with ``prime_value="implicit_prm"`` (no critic); ``zero3_pc0`` / ``zero3_prm_value``:
the same two under ZeRO-3.

Every rank asserts ``num_processes == 2``, that the value model changed and is identical on both ranks (no critic:
that there is none); it writes its ``on_rollouts_scored`` payloads (advantages, the global advantage inputs and
result) and the rows of its first value update (``value_batch``: input ids, attention mask, completion mask, PPO
token rewards, value-loss mask) to ``DIR/rank{r}.pt``; rank 0 writes ``DIR/summary.json`` and, with a separate
critic, ``DIR/value_step.pt``: the value model's parameters before and after its first optimizer step, for the test
to redo that step in a single process on the same global batch. ``value_max_grad_norm=None`` and ``adam_epsilon=1``
make that first AdamW step ``lr * g / (|g| + 1)``, close to linear in the gradient ``g``: a world-size scaling error
(AdamW alone is invariant to it) shows in the weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode",
        choices=["ddp", "ddp_lora", "zero2", "zero3", "ddp_pc0", "ddp_prm_value", "zero3_pc0", "zero3_prm_value"],
        required=True,
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()

    import torch

    zero3 = cli.mode.startswith("zero3")
    if cli.mode.startswith("zero"):
        from deepspeed_cpu import gloo_state

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        gloo_state()  # accelerate 1.15 sets no backend on CPU (see shared notes)
        extra = dict(
            use_cpu=False,
            accelerator_config={"use_configured_state": True},
            deepspeed={
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0} if zero3 else {"stage": 2},
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "gradient_clipping": "auto",
                "bf16": {"enabled": False},
                "fp16": {"enabled": False},
            },
        )
    else:
        extra = dict(use_cpu=True)

    import torch.distributed as dist
    from tiny import tiny_prompt_dataset

    from trl_prime import PrimeRLOOConfig, PrimeRLOOTrainer
    from trl_prime.callbacks import PrimeCallback
    from trl_prime.modeling import unwrap

    class Dump(PrimeCallback):
        def __init__(self):
            self.steps = []

        def on_rollouts_scored(self, args, state, control, **kw):
            keep = ("advantages", "global_advantages", "advantage_inputs")
            detach = lambda v: v.detach().cpu() if torch.is_tensor(v) else v  # noqa: E731
            self.steps.append({k: detach(kw[k]) for k in keep})
            self.steps[-1]["advantage_inputs"] = {k: detach(v) for k, v in kw["advantage_inputs"].items()}

    def split_reward(completions, **kwargs):
        first = 1 - int(os.environ.get("RANK", "0")) % 2
        return [float((i + first) % 2) for i in range(len(completions))]

    variant = (
        dict(process_coef=0.0)
        if cli.mode.endswith("_pc0")
        else dict(prime_value="implicit_prm")
        if cli.mode.endswith("_prm_value")
        else {}
    )
    args = PrimeRLOOConfig(
        output_dir=cli.out,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=3,  # 3 rows per rank, groups of 2: one group is split across the ranks
        num_generations=2,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        seed=0,
        learning_rate=1e-3,
        prm_learning_rate=1e-2,
        value_learning_rate=1e-3,
        filter_lower=0.0,
        filter_upper=1.0,
        prm_micro_batch_size=2,
        prime_estimator="ppo",
        whiten_advantages=True,
        value_max_grad_norm=None,
        adam_epsilon=1.0,
        **variant,
        **extra,
    )
    dump = Dump()
    peft = {}
    if cli.mode == "ddp_lora":
        from peft import LoraConfig

        peft = dict(
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
    trainer = PrimeRLOOTrainer(
        model=cli.model,
        reward_funcs=split_reward,
        args=args,
        train_dataset=tiny_prompt_dataset(12),
        callbacks=[dump],
        **peft,
    )
    acc = trainer.accelerator
    assert acc.num_processes == 2, f"expected 2 processes, got {acc.num_processes}: launch with --multi_gpu"
    if cli.mode.endswith("_prm_value"):
        assert trainer.value_function is None and trainer.value_optim is None
        trainer.train()
        finish(trainer, dump, cli, {}, value_updates=0)
        return

    def named_value_params():  # the full value model (gathered under ZeRO-3); collective
        named = list(trainer.value_function.module.named_parameters())
        gathered = contextlib.nullcontext()
        if zero3:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None)
        with gathered:
            return {n: p.detach().cpu().clone() for n, p in named}

    value_step = {}
    train_value = trainer._train_value

    def recording_train_value(r, rewards, train_mask):
        first = not value_step
        if first:
            value_step["before"] = named_value_params()
            keep = dict(input_ids=r.input_ids, attention_mask=r.attention_mask, actions=r.actions)
            dump.value_batch = {k: v.detach().cpu() for k, v in keep.items()}
            dump.value_batch.update(rewards=rewards.detach().cpu(), train_mask=train_mask.detach().cpu())
        out = train_value(r, rewards, train_mask)
        if first and not trainer.value_optim.pending:
            value_step["after"] = named_value_params()
        return out

    apply_pending = trainer.value_optim.apply_pending

    def recording_apply_pending():  # a step held for the policy's (single PRM update, no DeepSpeed) lands here
        apply_pending()
        if "before" in value_step and "after" not in value_step:
            value_step["after"] = named_value_params()

    trainer.value_optim.apply_pending = recording_apply_pending

    trainer._train_value = recording_train_value

    def value_params():
        params = trainer.value_function.trainable_parameters()
        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return torch.cat([p.detach().flatten().clone() for p in params])
        return torch.cat([p.detach().flatten().clone() for p in params])

    base = [p for n, p in unwrap(trainer.model).named_parameters() if "lora_" not in n]
    base0 = torch.cat([p.detach().flatten().clone() for p in base]) if cli.mode == "ddp_lora" else None
    before = value_params()
    trainer.train()
    after = value_params()
    if cli.mode == "ddp_lora":
        assert trainer.value_function.adapter_name == "value"
        assert torch.equal(base0, torch.cat([p.detach().flatten() for p in base])), "the shared base changed"
    assert not torch.equal(before, after), "the value model did not train"
    both = [torch.zeros_like(after) for _ in range(2)]
    dist.all_gather(both, after)
    assert torch.equal(both[0], both[1]), "value weights differ between ranks"
    if cli.mode.startswith("zero"):
        assert type(trainer.value_function.model).__name__ == "DeepSpeedEngine"
    finish(trainer, dump, cli, value_step, value_updates=trainer.value_optim.num_updates)


def finish(trainer, dump, cli, value_step: dict, value_updates: int) -> None:
    """Write ``rank{r}.pt``, and on rank 0 ``summary.json`` and (a separate critic) ``value_step.pt``."""
    import torch

    acc = trainer.accelerator
    torch.save(
        {"steps": dump.steps, "value_batch": getattr(dump, "value_batch", None)},
        os.path.join(cli.out, f"rank{acc.process_index}.pt"),
    )
    if acc.is_main_process:
        ckpt = os.path.join(cli.out, "checkpoint-2")
        value_dir = os.path.join(ckpt, "value")
        summary = {
            "num_processes": acc.num_processes,
            "logs": [h for h in trainer.state.log_history if "value/loss" in h or "prm/loss" in h],
            "value_checkpoint_files": sorted(os.listdir(value_dir)) if os.path.isdir(value_dir) else [],
            "checkpoint_files": sorted(os.listdir(ckpt)),
            "value_updates": value_updates,
            "value_lr": trainer.args.value_learning_rate,
            "adam": [trainer.args.adam_beta1, trainer.args.adam_beta2, trainer.args.adam_epsilon],
        }
        with open(os.path.join(cli.out, "summary.json"), "w") as f:
            json.dump(summary, f)
        if value_step and cli.mode != "ddp_lora":
            torch.save(value_step, os.path.join(cli.out, "value_step.pt"))
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
    from tiny import exit_launched_process

    exit_launched_process()  # skip interpreter teardown with gloo threads alive (see tests/tiny.py)
