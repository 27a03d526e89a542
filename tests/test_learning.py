"""Does it learn? Short RL runs on the controlled task of ``benchmarks/learning.py`` (issue 14).

Each trainer trains the cached warm start (``benchmarks/learning_task.py``: a 1.06M-parameter Llama with a
character-level tokenizer, SFT'd on step-by-step multi-operand addition) for ``STEPS`` steps, single seed, with the
benchmark's settings, and held-out greedy accuracy (256 problems never trained on) must rise by ``MARGIN``. The same
run with the sign of every advantage flipped (a test-only wrapper of ``_generate_and_score_completions``,
:func:`learning.flip_advantage_sign`) must NOT improve. A sign or wiring error in an advantage makes the first test
fail; a trainer that ignores its advantages makes the second fail (both runs would then move alike).

The margin is calibrated from the benchmark's seed spread (benchmarks/RESULTS.md, "Learning"): see ``MARGIN``.

In CI the cache (``~/.cache/trl_prime/learning/``, or ``$TRL_PRIME_CACHE``) is empty: the session fixture builds the
warm start once (TRL ``SFTTrainer``, about 2 minutes on one core), then every test reuses it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

STEPS = 40
LR = 2e-5
PRM_LR = 2e-5
# Held-out greedy accuracy must rise by at least MARGIN after STEPS steps (calibrated in benchmarks/RESULTS.md).
MARGIN = 0.08
# ... and the sign-flipped run must not rise by more than FLIP_SLACK (it falls in practice).
FLIP_SLACK = 0.02


@pytest.fixture(scope="session")
def warm_start():
    import torch

    import learning_task as lt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return lt.warm_start()
    finally:
        torch.set_num_threads(threads)


def _run(method: str, warm: str, flip: bool) -> dict:
    import torch

    import learning
    import learning_task as lt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return learning.run_one(method, 0, warm=warm, spec=lt.TaskSpec(), steps=STEPS, eval_every=STEPS, lr=LR,
                                prm_lr=PRM_LR, eval_samples=0, flip_sign=flip)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("method", ["prime_rloo", "prime_grpo", "prl"])
def test_trainer_learns_and_sign_flip_unlearns(method, warm_start):
    up = _run(method, warm_start, flip=False)
    down = _run(method, warm_start, flip=True)
    start = up["greedy"][0]
    assert down["greedy"][0] == start  # same warm start, same held-out set, greedy: deterministic
    gain, flip_gain = up["greedy"][-1] - start, down["greedy"][-1] - start
    assert gain >= MARGIN, f"{method}: held-out accuracy {start:.3f} -> {up['greedy'][-1]:.3f} (needs +{MARGIN})"
    assert flip_gain <= FLIP_SLACK, (
        f"{method} with the advantage's sign flipped: {start:.3f} -> {down['greedy'][-1]:.3f}; it should not improve"
    )
