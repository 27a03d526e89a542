"""``trl-prime prof``: PROF (arXiv 2509.03403), a step PRM filters each prompt's completions to the m most
process-consistent before the policy update.

The trainer is the ``trainer`` field (a flag or a key of the YAML):

- ``prof_grpo`` (default): PROF on GRPO (:class:`trl_prime.ProfGRPOTrainer`, :class:`trl_prime.ProfGRPOConfig`);
  ``prof_prm`` is a token-classification step PRM (Qwen2.5-Math-PRM style) or an ``ImplicitPRM`` folder.
- ``prime_grpo``: PROF inside PRIME (:class:`trl_prime.PrimeGRPOTrainer`, :class:`trl_prime.PrimeGRPOConfig` with
  ``prof_prm: implicit``): the online implicit PRM of PRIME (arXiv 2502.01456) ranks the completions, no extra model;
  the implicit PRM is saved to ``output_dir/prm``.

Every field of :class:`~trl_prime.scripts.utils.RLScriptArguments`, of that config and of ``trl.ModelConfig`` is a
flag or a key of the ``--config`` YAML; flags override the YAML::

    trl-prime prof --config recipes/configs/prof_grpo.yaml
    trl-prime prof --config recipes/configs/prof_prime.yaml --prof_mode correct --max_steps 5

``make_parser``, ``parse_args``, ``main`` and ``run`` as in :mod:`trl_prime.scripts.prl`.
"""

from __future__ import annotations

from trl_prime.scripts.utils import check_run, rl_command


#: what the command checks before launching (:func:`trl_prime.cli.check_before_launch`)
check = check_run
make_parser, parse_args, main, run = rl_command("prof")


if (
    __name__ == "__main__"
):  # `python -m trl_prime.scripts.prof` (what `trl-prime prof` launches): its errors as one line
    import sys

    from trl_prime.cli import main as _cli

    raise SystemExit(_cli(["prof", *sys.argv[1:]], launch_training=False))
