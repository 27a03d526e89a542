"""Third-party messages that say nothing a trl-prime user can act on, silenced once, when :mod:`trl_prime` loads.

Each is matched by its logger (or warning category) and its text, so that every other message of the same library
still shows:

- bitsandbytes on a CPU with AVX512-BF16 tries the optional ``kernels`` package for its 4-bit matmul and logs
  "Failed to load CPU gemm_4bit_forward from kernels-community ..." when it is not installed; it then uses its own
  CPU kernel (``bitsandbytes.backends.cpu.ops``).
- DeepSpeed logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
  whenever it is imported on a machine without a GPU (trl-prime imports it through transformers / accelerate).
- transformers 5.2x deprecates the ``gradient_checkpointing`` names (a ``FutureWarning`` on each use) that TRL 1.16's
  configs and trainers still use; the flag keeps working.
"""

from __future__ import annotations

import logging
import warnings


#: logger name -> substrings of the messages dropped from it
LOG_MESSAGES = {
    "bitsandbytes.backends.cpu.ops": ("from kernels-community",),
    "DeepSpeed": ("Setting accelerator to CPU",),
}
#: ``FutureWarning`` messages ignored (regular expressions matched at the start of the message)
FUTURE_WARNINGS = (
    r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated",
    r"`gradient_checkpointing_kwargs` is deprecated",
)


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def silence() -> None:
    """Install the filters (idempotent: a logger gets one filter of ours)."""
    for name, fragments in LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(fragments))
    for message in FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
