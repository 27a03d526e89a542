"""The ``trl-prime`` command-line scripts (TRL's ``trl/scripts`` layout), one module per command of
:mod:`trl_prime.cli`:

- :mod:`~trl_prime.scripts.prime` (``trl-prime prime``): PRIME, ``trainer: prime_rloo`` or ``prime_grpo``;
- :mod:`~trl_prime.scripts.prl` (``trl-prime prl``): PRL on GRPO;
- :mod:`~trl_prime.scripts.prof` (``trl-prime prof``): PROF on GRPO (``prof_grpo``) or inside PRIME (``prime_grpo``);
- :mod:`~trl_prime.scripts.implicit_prm` (``trl-prime implicit-prm``): an implicit PRM trained offline;
- :mod:`~trl_prime.scripts.evaluate` (``trl-prime eval``): pass@k / avg@k with the verifiers;
- :mod:`~trl_prime.scripts.best_of_n` (``trl-prime best-of-n``): best-of-N with implicit PRMs vs majority vote;
- :mod:`~trl_prime.scripts.demo` (``trl-prime demo``, ``make demo``): PRIME on the embedded model, offline.

Each module parses its dataclasses with ``trl.TrlParser`` (every field is a flag or a key of the ``--config`` YAML;
flags override the YAML) and has ``run(argv=None, ...)``, which the command line and the ``recipes/*.py`` entry
points call. The training scripts (``prime``, ``prl``, ``prof``, ``implicit_prm``) also have ``make_parser(argv)``:
``trl-prime`` splits the command line with it and launches ``python -m trl_prime.scripts.<module>`` through
``accelerate launch`` (:mod:`trl_prime.cli`).
"""
