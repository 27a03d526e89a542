"""Best-of-N with implicit PRMs (Implicit PRM arXiv 2412.01981) vs majority vote vs first sample vs oracle (pass@N).

This file is ``trl-prime best-of-n`` (:mod:`trl_prime.scripts.best_of_n`, where the method and every option are
described)::

    python recipes/evaluate_best_of_n.py --config recipes/configs/implicit_prm_eval.yaml
    trl-prime best-of-n --config recipes/configs/implicit_prm_eval.yaml     # the same
    trl-prime best-of-n --config recipes/configs/implicit_prm_eval.yaml \\
        --prm_paths initial outputs/implicit_prm/prm_dpo outputs/implicit_prm/prm_ce_pairable --score_problems 32
"""

from __future__ import annotations

from trl_prime.scripts import best_of_n


if __name__ == "__main__":
    best_of_n.run()
