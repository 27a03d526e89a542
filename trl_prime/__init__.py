"""trl-prime: process rewards without process labels for Hugging Face TRL.

PRIME (arXiv 2502.01456), the Implicit PRM (arXiv 2412.01981), PRL (arXiv 2601.10201) and PROF
(arXiv 2509.03403) as TRL trainers over a pure tensor core, :mod:`trl_prime.functional`.

Heavy submodules (trainers, models) are imported lazily, so ``import trl_prime.functional`` stays cheap.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from trl_prime import _noise
from trl_prime import methods as _methods


__version__ = "0.1.0.dev0"

_noise.silence()  # third-party messages a user cannot act on (trl_prime/_noise.py), once, here

# public name -> submodule that defines it
_LAZY = {
    "ImplicitPRM": "trl_prime.implicit_prm.model",
    "ImplicitPRMConfig": "trl_prime.implicit_prm.config",
    "ImplicitPRMTrainer": "trl_prime.implicit_prm.trainer",
    "best_of_n": "trl_prime.implicit_prm.best_of_n",
    "build_outcome_dataset": "trl_prime.implicit_prm.data",
    "ProfFilter": "trl_prime.prof.filter",
}
# the config and trainer class of every registered RL trainer (trl_prime.methods.TRAINERS)
for _entry in _methods.TRAINERS.values():
    for _path in (_entry.config, _entry.trainer):
        _LAZY.setdefault(_path.rsplit(".", 1)[1], _path.rsplit(".", 1)[0])
del _entry, _path

__all__ = ["functional", "rewards", "__version__", *_LAZY]


def __getattr__(name):
    if name in ("functional", "rewards", "callbacks"):
        return import_module(f"trl_prime.{name}")
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_prime' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover
    from trl_prime import functional, rewards  # noqa: F401
