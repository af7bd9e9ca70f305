"""bitsandbytes' CPU backend logs a warning about an optional kernel package on import, on some
CPUs: not the user's concern, so it is held back while peft or bitsandbytes is imported."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def bitsandbytes_quiet() -> Iterator[None]:
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
