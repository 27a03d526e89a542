"""Lazy package exports (PEP 562): ``import trl_prime.prof.config`` must not import a trainer module."""

from importlib import import_module


def attach(package: str, exports: dict[str, str]):
    """Module-level ``__getattr__``, ``__dir__`` and ``__all__`` for ``package``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> submodule (relative to ``package``) that defines it.

    Returns:
        ``(__getattr__, __dir__, __all__)``; a name is imported from its submodule on first access.
    """

    def __getattr__(name):
        if name in exports:
            return getattr(import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(exports)

    return __getattr__, __dir__, sorted(exports)
