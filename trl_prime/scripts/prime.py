"""``trl-prime prime``: PRIME (arXiv 2502.01456), the policy trained with an implicit PRM updated online from the
outcome labels (Eq. 5 advantages, online prompt filter).

The trainer is the ``trainer`` field (a flag or a key of the YAML): ``prime_rloo`` (default,
:class:`trl_prime.PrimeRLOOTrainer` and :class:`trl_prime.PrimeRLOOConfig`, the paper's setup) or ``prime_grpo``
(:class:`trl_prime.PrimeGRPOTrainer` and :class:`trl_prime.PrimeGRPOConfig`). Every field of
:class:`~trl_prime.scripts.utils.RLScriptArguments`, of that config and of ``trl.ModelConfig`` is a flag or a key of
the ``--config`` YAML; flags override the YAML::

    trl-prime prime --config recipes/configs/prime_qwen7b.yaml --accelerate_config zero3    # 8 GPUs
    trl-prime prime --config recipes/configs/prime_lora.yaml --load_in_4bit true --accelerate_config single_gpu
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/prime_qwen7b.py   # the same, 8 GPUs

LoRA (``use_peft: true``): the policy and the implicit PRM are two adapters on one frozen base, optionally 4-bit
(``load_in_4bit``). The trained policy is saved to ``output_dir`` and the implicit PRM to ``output_dir/prm``.
"""

from __future__ import annotations

from functools import partial

from trl_prime.scripts.utils import check_run, end, parse_rl_args, rl_parser, train


#: ``make_parser(argv, default_trainer=None)``: the command's ``trl.TrlParser`` (for the trainer ``argv`` names)
make_parser = partial(rl_parser, "prime")
#: ``parse_args(argv=None, default_config=None, default_trainer=None) -> (script_args, training_args, model_args)``
parse_args = partial(parse_rl_args, "prime")


def check_args(training_args, model_args, require_peft: bool = False) -> None:
    """Fail early, naming the option and the fix.

    Raises:
        ValueError: ``require_peft`` and LoRA is off; a quantized base without bitsandbytes; an 8-bit base without
            CUDA (4-bit trains on a CPU too).
    """
    if require_peft and not model_args.use_peft:
        raise ValueError(
            "recipes/prime_lora.py trains the policy and the PRM as LoRA adapters: set `use_peft: true` (--use_peft "
            "true), or use recipes/prime_qwen7b.py for full fine-tuning."
        )
    if model_args.load_in_4bit or model_args.load_in_8bit:
        import importlib.util

        import torch

        flag = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit"
        if model_args.load_in_8bit and (not torch.cuda.is_available() or getattr(training_args, "use_cpu", False)):
            raise ValueError(
                "`load_in_8bit`=true quantizes the base with bitsandbytes' 8-bit kernels, which need a CUDA GPU, and "
                "none is in use here. Set `load_in_4bit: true` (NF4, also on a CPU) or `load_in_8bit: false` "
                "(--load_in_8bit false) to train the LoRA adapters on a full-precision base."
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(
                f"`{flag}`=true needs bitsandbytes: `pip install bitsandbytes` (or `pip install -e .[bitsandbytes]`), "
                f"or set `{flag}: false`."
            )


def check(script_args, training_args, model_args) -> None:
    """What ``trl-prime prime`` checks before launching (:func:`trl_prime.cli.check_before_launch`): :func:`check_args`
    and :func:`trl_prime.scripts.utils.check_run`.

    Raises:
        ValueError: naming the field and the fix.
    """
    check_args(training_args, model_args)
    check_run(script_args, training_args, model_args)


def main(script_args, training_args, model_args, require_peft: bool = False):
    """Train with PRIME; saves the policy (a LoRA adapter under ``use_peft``) and the implicit PRM. Returns the
    trainer."""
    check_args(training_args, model_args, require_peft)
    return train(script_args, training_args, model_args)


def run(argv=None, default_config: str | None = None, default_trainer: str | None = None, require_peft: bool = False):
    """The command line: parse ``argv`` (default ``sys.argv[1:]``), :func:`main`, then end the trainer
    (:func:`trl_prime.scripts.utils.end`)."""
    from trl_prime.cli_errors import command_line_errors

    with command_line_errors():
        parsed = parse_args(argv, default_config, default_trainer)
    return end(main(*parsed, require_peft=require_peft))


if (
    __name__ == "__main__"
):  # `python -m trl_prime.scripts.prime` (what `trl-prime prime` launches): its errors as one line
    import sys

    from trl_prime.cli import main as _cli

    raise SystemExit(_cli(["prime", *sys.argv[1:]], launch_training=False))
