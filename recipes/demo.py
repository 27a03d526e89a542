"""The README's first Quickstart command (``make demo``): PRIME on the embedded default model and problems, offline.

This file is ``trl-prime demo`` (:mod:`trl_prime.scripts.demo`, where the steps, outputs and options are described)
reading ``recipes/configs/demo.yaml`` when no ``--config`` is given::

    make demo                                  # the full run (sets up .venv first)
    DEMO_STEPS=5 make demo                     # a short run
    python recipes/demo.py [--max_steps N] [--trainer rloo] [--output_dir D]
    trl-prime demo [--max_steps N] [--trainer rloo] [--output_dir D]    # the same
"""

from __future__ import annotations

import os

from trl_prime.scripts import demo


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo.yaml")


if __name__ == "__main__":
    demo.run(default_config=DEFAULT_CONFIG)
