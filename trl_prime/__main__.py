"""``python -m trl_prime``: the ``trl-prime`` command line (:mod:`trl_prime.cli`)."""

from trl_prime.cli import main


raise SystemExit(main())
