"""Warnings logged once per distinct reason: the integrations' fallback messages.

A trainer calls the loss thousands of times; a fallback is worth one line per reason, not
one per step. Thread-safe; ``reset`` lets tests see every reason again.
"""

from __future__ import annotations

import logging
import threading
from typing import Set


class LogOnce:
    """Logs ``message % reason`` at WARNING on ``logger`` the first time ``reason`` is seen
    under ``key`` (a reason may be shared by several messages of one integration)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: Set[str] = set()
        self._lock = threading.Lock()

    def warn(self, message: str, reason: str, key: str = "") -> None:
        with self._lock:
            if key + reason in self._seen:
                return
            self._seen.add(key + reason)
        self._logger.warning(message, reason)

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()
