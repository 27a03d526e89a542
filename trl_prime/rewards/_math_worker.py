"""Preloaded by the math workers' forkserver: sets up and warms the judge once, so each worker forked from it (the
first ones, and every replacement of a killed one) starts ready instead of importing math-verify again."""

from trl_prime.rewards.math_verifier import _worker_init


_worker_init()
