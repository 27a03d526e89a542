"""Two-process PRIME run on CPU, launched by tests/prime/test_prime_distributed.py (or by hand):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
        tests/scripts/prime_distributed.py --mode ddp --model PATH --out DIR

``--mode ddp``: DDP over gloo (``use_cpu=True``). ``--mode ddp_lora``: the same with LoRA, the PRM being a second
adapter on the policy's base (its gradients all-reduced by hand). ``--mode zero3`` (``zero2``): DeepSpeed ZeRO-3 (ZeRO-2) over gloo
(``PartialState(backend="gloo")`` first, ``accelerator_config={"use_configured_state": True}``, ``use_cpu=False``,
``stage3_param_persistence_threshold: 0`` so the tiny model really is partitioned).

Every rank asserts ``num_processes == 2``, that the PRM and the policy changed, and that both are identical on the
two ranks (``--prm_loss dpo|nca|kto``: also that the PRM loss groups the global batch by prompt, the group split
across the ranks included); it writes its local PRIME payloads (token rewards, masks, outcomes, advantages per step) to
``DIR/rank{r}.pt`` for the test to recompute the advantages in one process; rank 0 writes ``DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "ddp_lora", "zero2", "zero3"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--prm_loss", default="ce", choices=["ce", "dpo", "nca", "kto"])
    parser.add_argument("--oversample_factor", type=float, default=1.0)
    cli = parser.parse_args()

    import time

    import torch

    t0 = time.time()

    def mark(what):
        if os.environ.get("PRIME_TIMING"):
            print(f"[timing rank{os.environ.get('RANK')}] {what}: {time.time() - t0:.1f}s", flush=True)

    extra = {}
    zero_stage = {"zero2": 2, "zero3": 3}.get(cli.mode)
    if zero_stage is not None:
        from deepspeed_cpu import gloo_state

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # the state must be a DeepSpeed one
        gloo_state()  # accelerate 1.15 sets no backend on CPU (see shared notes)
        extra = dict(
            use_cpu=False,
            accelerator_config={"use_configured_state": True},
            deepspeed={
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}
                if zero_stage == 3
                else {"stage": 2},
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
            self.prm_steps = []

        def on_rollouts_scored(self, args, state, control, **kw):
            self.steps.append(
                {
                    k: (v.detach().cpu() if torch.is_tensor(v) else v)
                    for k, v in kw.items()
                    if k
                    in (
                        "token_rewards",
                        "completion_mask",
                        "outcome_rewards",
                        "kept_mask",
                        "advantages",
                        "completion_ids",
                        "sequence_rewards",
                        "prompt_ids",
                        "prompt_mask",
                        "prompts",
                    )
                }
            )

        def on_prm_step(self, args, state, control, **kw):
            self.prm_steps.append(
                {
                    k: (v.detach().cpu() if torch.is_tensor(v) else v)
                    for k, v in kw.items()
                    if k in ("loss", "grad_norm", "loss_group_ids", "loss_labels")
                }
            )

    def split_reward(completions, **kwargs):
        """1, 0, 1 on rank 0 and 0, 1, 0 on rank 1: every group of 2 is mixed, including the one split across ranks."""
        first = 1 - int(os.environ.get("RANK", "0")) % 2
        return [float((i + first) % 2) for i in range(len(completions))]

    args = PrimeRLOOConfig(
        output_dir=cli.out,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=3,  # 3 rows per rank, groups of 2: one group is split across the ranks
        num_generations=2,
        max_completion_length=8,
        max_steps=cli.max_steps,
        logging_steps=1,
        save_strategy="steps",
        save_steps=cli.max_steps,
        seed=0,
        learning_rate=1e-3,
        prm_learning_rate=1e-2,
        filter_lower=0.0,
        filter_upper=1.0,
        prm_micro_batch_size=2,
        prm_loss=cli.prm_loss,
        oversample_factor=cli.oversample_factor,
        **extra,
    )
    mark("config")
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
    mark("trainer")
    compacted = []  # what TRL's loss receives on this rank (the oversampled batch compacted back)
    prepare = trainer._prepare_inputs

    def record_prepare(batch):
        out = prepare(batch)
        rows = out["prime_loss_mask"].sum(-1) > 0
        texts = trainer.processing_class.batch_decode(out["prompt_ids"], skip_special_tokens=True)
        compacted.append({"texts": texts, "weighted": rows.cpu(), "num_items": out["num_items_in_batch"].item()})
        return out

    trainer._prepare_inputs = record_prepare
    acc = trainer.accelerator
    assert acc.num_processes == 2, f"expected 2 processes, got {acc.num_processes}: launch with --multi_gpu"
    rank = acc.process_index

    def full_params(module, select=None):
        if module is None:
            return torch.zeros(1)
        named = [(n, p) for n, p in unwrap(module).named_parameters() if select is None or select(n)]
        params = [p for _, p in named]
        if zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return torch.cat([p.detach().flatten().clone() for p in params])
        return torch.cat([p.detach().flatten().clone() for p in params])

    def same_on_both_ranks(t, what):
        both = [torch.zeros_like(t) for _ in range(2)]
        dist.all_gather(both, t)
        assert torch.equal(both[0], both[1]), f"{what} differs between ranks"

    if cli.mode == "ddp_lora":
        parts = {
            "PRM adapter": lambda n: ".prm." in n,
            "policy adapter": lambda n: ".default." in n and "lora_B" in n,
            "base": lambda n: "lora_" not in n,
        }
        before = {k: full_params(trainer.model, f) for k, f in parts.items()}
        trainer.train()
        after = {k: full_params(trainer.model, f) for k, f in parts.items()}
        assert not torch.equal(before["PRM adapter"], after["PRM adapter"]), "the PRM adapter did not train"
        assert not torch.equal(before["policy adapter"], after["policy adapter"]), "the policy adapter did not train"
        assert torch.equal(before["base"], after["base"]), "the shared base changed"
        for k, t in after.items():
            same_on_both_ranks(t, k)
        prm1 = after["PRM adapter"]
    else:
        prm0 = full_params(trainer.implicit_prm.model)
        pol0 = full_params(trainer.model)
        ref0 = full_params(trainer.implicit_prm.ref_model)
        mark("before train")
        trainer.train()
        mark("train")
        prm1 = full_params(trainer.implicit_prm.model)
        pol1 = full_params(trainer.model_wrapped if zero_stage else trainer.model)
        ref1 = full_params(trainer.implicit_prm.ref_model)
        sizes = [
            p.ds_numel if hasattr(p, "ds_numel") else p.numel()
            for p in unwrap(trainer.implicit_prm.model).parameters()
        ]
        names = [n for n, _ in unwrap(trainer.implicit_prm.model).named_parameters()]
        frozen = [n for n, a, b in zip(names, prm0.split(sizes), prm1.split(sizes)) if torch.equal(a, b)]
        assert not frozen, f"PRM tensors that did not train: {frozen}"  # lm_head included (fused head under ZeRO-3)
        assert not torch.equal(pol0, pol1), "the policy did not train"
        assert torch.equal(ref0, ref1), "the PRM reference changed"
        same_on_both_ranks(prm1, "PRM weights")
        same_on_both_ranks(pol1, "policy weights")
    if cli.prm_loss in ("dpo", "nca", "kto"):
        # the pairwise / KTO loss sees the global batch: global group ids, every rank the same, and a group id
        # always names one prompt (the group split across the ranks included)
        for step, prm_step in zip(dump.steps, dump.prm_steps):
            prompts = [None, None]
            dist.all_gather_object(prompts, step["prompts"])
            prompts = prompts[0] + prompts[1]
            gids = prm_step["loss_group_ids"]
            assert gids.tolist() == [i // 2 for i in range(len(prompts))], gids
            same_on_both_ranks(gids, "PRM loss group ids")
            for i in range(len(prompts)):
                for j in range(len(prompts)):
                    if gids[i] == gids[j]:
                        assert prompts[i] == prompts[j], f"rows {i} and {j} share a PRM loss group but not a prompt"
    if zero_stage:
        assert trainer.prm_optim.engine is not None and type(trainer.implicit_prm.model).__name__ == "DeepSpeedEngine"
    torch.save(
        {
            "steps": dump.steps,
            "prm_steps": dump.prm_steps,
            "options": trainer._advantage_options(),
            "compacted": compacted,
        },
        os.path.join(cli.out, f"rank{rank}.pt"),
    )
    if acc.is_main_process:
        logs = [h for h in trainer.state.log_history if "prm/loss" in h]
        ckpt = os.path.join(cli.out, f"checkpoint-{cli.max_steps}")
        summary = {
            "num_processes": acc.num_processes,
            "logs": logs,
            "prm_checkpoint_files": sorted(os.listdir(os.path.join(ckpt, "prm"))),
            "checkpoint_files": sorted(os.listdir(ckpt)),
            "prm_numel": prm1.numel(),
            "num_updates": trainer.prm_optim.num_updates,
        }
        with open(os.path.join(cli.out, "summary.json"), "w") as f:
            json.dump(summary, f)
    acc.wait_for_everyone()
    mark("end")


if __name__ == "__main__":
    main()
    from tiny import exit_launched_process

    exit_launched_process()  # skip interpreter teardown with gloo threads alive (see tests/tiny.py)
