"""Two-process PRL and PROF runs on CPU, launched by tests/prl/test_prl_prof_distributed.py (or by hand):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        tests/scripts/prl_prof_distributed.py --model PATH --prm PRM_PATH --out DIR

One launch runs, one after the other, over DDP/gloo (``use_cpu=True``): PRLGRPOTrainer (``--steps`` steps),
ProfGRPOTrainer with the external step PRM (``--steps`` steps), PrimeGRPOTrainer and PrimeRLOOTrainer with PROF on the
implicit PRM (2 steps each). Every generation batch splits a group across the two ranks.

Every rank asserts ``num_processes == 2``, that the policy trained and is identical on both ranks, that the global
PROF selection is identical on both ranks, and writes its local tensors per generation round to
``DIR/<run>_rank{r}.pt`` for the test to recompute everything in one process; rank 0 writes ``DIR/summary.json``.
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
    parser.add_argument("--model", required=True)
    parser.add_argument("--prm", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    cli = parser.parse_args()

    import torch
    import torch.distributed as dist
    from helpers import trainer_kinds
    from tiny import build_tokenizer, contains_reward, exit_launched_process, tiny_prompt_dataset

    from trl_prime import PRLConfig, PRLGRPOTrainer, ProfGRPOConfig, ProfGRPOTrainer
    from trl_prime.callbacks import PrimeCallback
    from trl_prime.modeling import unwrap

    bias = {"sequence_bias": {(build_tokenizer().convert_tokens_to_ids("Ċ"),): 4.0}}
    common = dict(
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        max_completion_length=10,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        learning_rate=1e-2,
    )

    def cpu(x):
        return x.detach().cpu().clone() if torch.is_tensor(x) else x

    def same_on_both_ranks(t, what):
        both = [torch.zeros_like(t) for _ in range(2)]
        dist.all_gather(both, t.contiguous())
        assert torch.equal(both[0], both[1]), f"{what} differs between ranks"

    def params(module):
        return torch.cat([p.detach().flatten().clone() for p in unwrap(module).parameters()])

    class PRLSpy(PRLGRPOTrainer):
        def _prl_logps(self, *a, **kw):
            self._cap_logps = super()._prl_logps(*a, **kw)
            return self._cap_logps

        def _algorithm_step(self, output, cap):
            ends = self._prl_step_ends(output["completion_ids"], output["completion_mask"])
            out = super()._algorithm_step(output, cap)
            last = self._prl_last
            same_on_both_ranks(last["advantages"], "PRL global advantages")
            self.records.append(
                dict(
                    old=cpu(self._cap_logps[0]),
                    ref=cpu(self._cap_logps[1]),
                    mask=cpu(output["completion_mask"]),
                    step_ends=cpu(ends),
                    advantages=cpu(out["advantages"]),
                    outcome=cpu(last["outcome_rewards"]),
                    num_items=cpu(out["num_items_in_batch"]),
                )
            )
            return out

    class ProfSpy(ProfGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            last = self.prof_filter.last
            same_on_both_ranks(last["kept"].long(), "PROF selection")
            self.records.append(
                dict(
                    kept=cpu(last["kept"]),
                    outcome=cpu(last["outcome"]),
                    consistency=cpu(last["consistency"]),
                    num_steps=cpu(last["num_steps"]),
                    mask=cpu(out["completion_mask"]),
                    tool_mask=cpu(out["tool_mask"]),
                    advantages=cpu(out["advantages"]),
                    num_items=cpu(out["num_items_in_batch"]),
                )
            )
            return out

    class PrimeRec(PrimeCallback):
        def __init__(self, trainer_ref):
            self.trainer = trainer_ref

        def on_rollouts_scored(self, args, state, control, **kw):
            last = self.trainer.prof_filter.last
            same_on_both_ranks(last["kept"].long(), "PROF selection (PRIME)")
            self.trainer.records.append(
                dict(
                    kept=cpu(last["kept"]),
                    outcome=cpu(kw["outcome_rewards"]),
                    token_rewards=cpu(kw["token_rewards"]),
                    mask=cpu(kw["completion_mask"]),
                    loss_mask=cpu(kw["loss_mask"]),
                    advantages=cpu(kw["advantages"]),
                    options=self.trainer._advantage_options(),
                )
            )

    runs = {}

    def run(name, trainer, n_rounds):
        acc = trainer.accelerator
        assert acc.num_processes == 2, f"expected 2 processes, got {acc.num_processes}: launch with --multi_gpu"
        trainer.records = getattr(trainer, "records", [])
        before = params(trainer.model)
        trainer.train()
        after = params(trainer.model)
        assert not torch.equal(before, after), f"{name}: the policy did not train"
        same_on_both_ranks(after, f"{name} policy weights")
        assert len(trainer.records) == n_rounds, (name, len(trainer.records))
        torch.save(trainer.records, os.path.join(cli.out, f"{name}_rank{acc.process_index}.pt"))
        runs[name] = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
        return trainer

    # PRL: groups of 4, 6 rows per rank: group 1 = global rows 4..7 is split across the ranks
    tr = PRLSpy(
        model=cli.model,
        reward_funcs=contains_reward("e"),
        train_dataset=tiny_prompt_dataset(40),
        args=PRLConfig(
            output_dir=os.path.join(cli.out, "prl"),
            per_device_train_batch_size=6,
            num_generations=4,
            max_steps=cli.steps,
            prl_eta=2.0,
            prl_step_split="newline",
            generation_kwargs=bias,
            **common,
        ),
    )
    tr.records = []
    ref0 = params(tr.prl_ref_model)
    run("prl", tr, cli.steps)
    assert torch.equal(ref0, params(tr.prl_ref_model)), "the PRL reference changed"

    # PROF on GRPO with the external step PRM: groups of 8, 12 rows per rank: group 1 = rows 8..15 is split
    prof_common = dict(per_device_train_batch_size=12, num_generations=8, generation_kwargs=bias, **common)
    tr = ProfSpy(
        model=cli.model,
        reward_funcs=contains_reward("e"),
        train_dataset=tiny_prompt_dataset(40),
        args=ProfGRPOConfig(
            output_dir=os.path.join(cli.out, "prof"),
            max_steps=cli.steps,
            prof_prm=cli.prm,
            prof_num_keep=4,
            **prof_common,
        ),
    )
    tr.records = []
    run("prof", tr, cli.steps)

    # PROF inside PRIME (implicit PRM)
    for name in ("prime_grpo", "prime_rloo"):
        cls, cfg_cls = trainer_kinds()[name]
        tr = cls(
            model=cli.model,
            reward_funcs=contains_reward("e"),
            train_dataset=tiny_prompt_dataset(12),
            args=cfg_cls(
                output_dir=os.path.join(cli.out, name),
                max_steps=2,
                prof_mode="both",
                prof_prm="implicit",
                prof_num_remove=4,
                filter_lower=0.0,
                filter_upper=1.0,
                prm_learning_rate=1e-2,
                **prof_common,
            ),
        )
        tr.records = []
        tr.add_callback(PrimeRec(tr))
        run(name, tr, 2)

    if tr.accelerator.is_main_process:
        with open(os.path.join(cli.out, "summary.json"), "w") as f:
            json.dump({"num_processes": tr.accelerator.num_processes, "logs": runs}, f)
    exit_launched_process(tr.accelerator)  # see tests/tiny.py: no interpreter teardown with gloo threads alive


if __name__ == "__main__":
    main()
