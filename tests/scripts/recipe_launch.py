"""Run a recipe (``recipes/<name>.py``) under ``accelerate launch`` and write a summary for the test to check.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/scripts/recipe_launch.py \\
        --recipe prime_qwen7b --summary OUT/summary.json -- <the recipe's own arguments>

The recipe's arguments go through ``trl-prime prime``'s parser and ``main`` (:mod:`trl_prime.scripts.prime`)
unchanged, ``--config`` defaulting to the recipe's YAML (its ``DEFAULT_CONFIG``), exactly as ``accelerate launch
recipes/<name>.py`` does. One CPU-only addition, for DeepSpeed
launches (``accelerate_configs/cpu_zero3.yaml``): accelerate 1.15 sets no process-group backend on CPU, so the
state is created with ``PartialState(backend="gloo")`` before the config is parsed and the trainer reuses it
(``accelerator_config.use_configured_state``), as described in the shared notes on the training stack.

After training every rank gathers (under ZeRO-3: un-partitions) the PRM's and the policy's weights; the summary
written by rank 0 holds the number of processes, the log history, the parsed options, per-rank checksums of the
PRM, policy and PRM reference, and the type of the PRM's engine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.dirname(HERE)]


def _load_recipe(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(ROOT, "recipes", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--summary", required=True)
    cli = parser.parse_args(argv[:split])
    recipe_argv = argv[split + 1 :]

    import torch

    deepspeed_on_cpu = (
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not torch.cuda.is_available()
    )
    if deepspeed_on_cpu:
        from deepspeed_cpu import gloo_state

        gloo_state()
        # parsed with the config: TrainingArguments sets up its devices (resetting any state) in __post_init__
        recipe_argv = [*recipe_argv, "--accelerator_config", json.dumps({"use_configured_state": True})]

    from trl_prime.modeling import unwrap
    from trl_prime.scripts import prime

    mod = _load_recipe(cli.recipe)
    data_args, training_args, model_args = prime.parse_args(recipe_argv, mod.DEFAULT_CONFIG)
    trainer = prime.main(data_args, training_args, model_args, require_peft=cli.recipe == "prime_lora")

    import torch.distributed as dist

    acc = trainer.accelerator
    zero3 = trainer.is_deepspeed_enabled and acc.state.deepspeed_plugin.zero_stage == 3

    def checksum(module):
        if module is None:
            return None
        params = list(unwrap(module).parameters())
        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                flat = torch.cat([p.detach().flatten().double().clone() for p in params])
        else:
            flat = torch.cat([p.detach().flatten().double() for p in params])
        return [float(flat.sum()), float(flat.abs().sum()), int(flat.numel())]

    local = {
        "prm": checksum(trainer.implicit_prm.model),
        "policy": checksum(trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model),
        "prm_ref": checksum(trainer.implicit_prm.ref_model),
    }
    per_rank = [None] * acc.num_processes
    if acc.num_processes > 1:
        dist.all_gather_object(per_rank, local)
    else:
        per_rank = [local]
    if acc.is_main_process:
        args = trainer.args
        summary = {
            "num_processes": acc.num_processes,
            "distributed_type": str(acc.distributed_type),
            "zero_stage": acc.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None,
            "prm_engine": type(trainer.implicit_prm.model).__name__,
            "global_step": trainer.state.global_step,
            "num_prm_updates": trainer.prm_optim.num_updates,
            "logs": [h for h in trainer.state.log_history if "prm/loss" in h],
            "args": {
                k: getattr(args, k)
                for k in (
                    "num_generations",
                    "filter_lower",
                    "filter_upper",
                    "prm_beta",
                    "prm_learning_rate",
                    "learning_rate",
                    "prm_update",
                    "prime_baseline",
                    "process_reward_norm",
                    "process_coef",
                    "outcome_coef",
                    "whiten_advantages",
                    "include_last_token",
                    "beta",
                    "epsilon",
                    "num_iterations",
                    "vllm_mode",
                    "use_vllm",
                    "max_steps",
                )
            },
            "model_name_or_path": model_args.model_name_or_path,
            "dataset_name": data_args.dataset_name,
            "checksums": per_rank,
        }
        with open(cli.summary, "w") as f:
            json.dump(summary, f)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
    from tiny import exit_launched_process

    exit_launched_process()  # skip interpreter teardown with gloo threads alive (see tests/tiny.py)
