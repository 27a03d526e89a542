"""``trl-prime prl``: PRL on GRPO (arXiv 2601.10201), KL-regularised reward-to-go weights ``rho_t = A - S_t / eta``
in the PPO-clip loss (:class:`trl_prime.PRLGRPOTrainer`, :class:`trl_prime.PRLConfig`).

Every field of :class:`~trl_prime.scripts.utils.RLScriptArguments`, :class:`trl_prime.PRLConfig` and
``trl.ModelConfig`` is a flag or a key of the ``--config`` YAML; flags override the YAML::

    trl-prime prl --config recipes/configs/prl_grpo.yaml --max_steps 5 --prl_eta 100

``make_parser(argv)`` is the command's ``trl.TrlParser`` (``trl-prime`` splits the command line with it: what it
does not parse goes to ``accelerate launch``); ``parse_args(argv=None, default_config=None, default_trainer=None)``
returns ``(script_args, training_args,
model_args)``; ``main(script_args, training_args, model_args)`` trains and saves the policy to ``output_dir``;
``run(argv=None, default_config=None, default_trainer=None)`` does both.
"""

from __future__ import annotations

from trl_prime.scripts.utils import check_run, rl_command


#: what the command checks before launching (:func:`trl_prime.cli.check_before_launch`)
check = check_run
make_parser, parse_args, main, run = rl_command("prl")


if __name__ == "__main__":  # `python -m trl_prime.scripts.prl` (what `trl-prime prl` launches): its errors as one line
    import sys

    from trl_prime.cli import main as _cli

    raise SystemExit(_cli(["prl", *sys.argv[1:]], launch_training=False))
