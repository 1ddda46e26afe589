"""A per-thread nesting counter: ``with counter: ...`` marks the thread as inside.

Layer: foundation; imports nothing of the library.
"""

from __future__ import annotations

import threading


class Nesting:
    """How deep the current thread is inside ``with`` blocks of this counter."""

    def __init__(self):
        self._local = threading.local()

    def __enter__(self) -> "Nesting":
        self._local.depth = getattr(self._local, "depth", 0) + 1
        return self

    def __exit__(self, *exc) -> None:
        self._local.depth -= 1

    def active(self) -> bool:
        """Whether this thread is inside at least one block."""
        return getattr(self._local, "depth", 0) > 0
