"""The errors of the ``trl-prime`` command line, below both of its users: :mod:`trl_prime.cli` (which prints them)
and the scripts of :mod:`trl_prime.scripts` (whose parsing raises them).

:class:`CommandLineError` is a flag that cannot work; :func:`command_line_errors` turns what a script's parsing raises
into one; :func:`one_line` is an error of a training process as the one line ``trl-prime`` prints.
"""

from __future__ import annotations

import contextlib


class CommandLineError(ValueError):
    """A flag of ``trl-prime <command>`` that cannot work; the message names the flag and the fix. :func:`main` prints
    it as ``trl-prime <command>: error: <message>`` and exits with status 2."""


#: hints appended to messages of TRL's and transformers' config checks that do not name the fix
_HINTS = {
    "doesn't support bf16/gpu": "On a machine without a GPU pass --bf16 false (and --use_cpu true).",
}


def _with_hint(message: str) -> str:
    return " ".join([message, *(hint for key, hint in _HINTS.items() if key in message)])


@contextlib.contextmanager
def command_line_errors():
    """Inside a script's ``run``: turn what its parsing raises (``ValueError``: an unknown field, a value a config
    rejects; ``FileNotFoundError``: a model folder or data file that is not there; ``yaml.YAMLError``: a malformed
    ``--config``) into :class:`CommandLineError`, which :func:`main` prints
    as ``trl-prime <command>: error: ...`` with exit status 2 instead of a traceback."""
    import yaml

    try:
        yield
    except CommandLineError:
        raise
    except (ValueError, FileNotFoundError, yaml.YAMLError) as error:
        raise CommandLineError(_with_hint(str(error))) from error


#: set it (to anything) to see the traceback of an error in a training process instead of its one line
TRACEBACK_ENV = "TRL_PRIME_TRACEBACK"


def one_line(error: BaseException) -> str:
    """``error`` as one line: its message (with its type unless a ``ValueError``/``OSError``, whose messages name
    the problem), lines joined with ``"; "``; an error of another kind says how to see its traceback."""
    message = "; ".join(line.strip() for line in str(error).splitlines() if line.strip()) or repr(error)
    if isinstance(error, (ValueError, OSError)):
        return _with_hint(message)
    return f"{type(error).__name__}: {message} (the traceback: rerun with {TRACEBACK_ENV}=1)"
