"""Warning categories of the library's user-facing notices.

Layer: foundation; imports nothing of the library.

Notices that tell a user the library saved no memory where it was asked to
go through :func:`warnings.warn` with one of these categories, so that they
can be filtered (``warnings.filterwarnings('ignore', category=...)``) and
tested (``pytest.warns``).  Diagnostics stay on the ``logging`` logger
``"memory_saving_gradients"`` (:data:`logger`), whose WARNING lines begin with the
library's name.
"""

from __future__ import annotations

import logging
import sys
import warnings

#: What the library's WARNING (and ERROR) log lines begin with: Python's last-resort
#: handler prints a record without any configuration, and then without the logger's name.
LOG_PREFIX = "memory_saving_gradients: "


class _NamedWarnings(logging.Filter):
    """Begins the message of each WARNING-or-above record with :data:`LOG_PREFIX`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            message = record.getMessage()
            if not message.startswith(LOG_PREFIX):
                record.msg, record.args = LOG_PREFIX + message, ()
        return True


#: The library's logger (every module logs to this one name).
logger = logging.getLogger("memory_saving_gradients")
if not any(isinstance(f, _NamedWarnings) for f in logger.filters):
    logger.addFilter(_NamedWarnings())


class MemorySavingGradientsWarning(UserWarning):
    """Base category of every warning this library issues."""


class NothingKeptWarning(MemorySavingGradientsWarning):
    """A strategy kept no checkpoint for a graph: plain ``tf.gradients`` was used."""


class NothingRewrittenWarning(MemorySavingGradientsWarning):
    """A patch or ``keras.enable`` rewrote no gradient while it was active."""


class EagerExecutionWarning(NothingRewrittenWarning):
    """Gradients ran eagerly (outside ``tf.function``, or Keras ``run_eagerly=True``):
    nothing can be rewritten there."""


class FallbackWarning(MemorySavingGradientsWarning):
    """A ``gradients()`` call used plain ``tf.gradients`` because the rewrite went wrong
    (its gradients' structure differed from ``tf.gradients``', or it failed inside):
    that call saves no memory, and its gradients are ``tf.gradients``' own."""


#: Top-level modules whose frames :func:`warn` skips: this library, the frameworks that
#: call it while they trace a step, and contextlib (a ``with patched():`` block ends there).
_SKIPPED_MODULES = frozenset({__name__.split(".")[0], "tensorflow", "keras", "tf_keras",
                              "contextlib"})
#: How the files of the functions TensorFlow's autograph converts are named.
_AUTOGRAPH_FILE = "__autograph_generated"


#: ``(filename, lineno) -> (filename, lineno) | None``: the user's line that a line of
#: code autograph generated came from.  The TensorFlow shim sets it (this module
#: imports nothing of the library); None: no line is mapped.
origin_of_converted_line = None


def _skipped(frame) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return (name.split(".")[0] in _SKIPPED_MODULES
            or _AUTOGRAPH_FILE in frame.f_code.co_filename)


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` reported at the user's own line: the first
    frame outside this library, TensorFlow and Keras (the ``fit``, the call that traces
    a step, the end of a ``with patched():`` block), so that Python's
    once-per-location filter tells one call site from another.

    Where no such frame calls it (a ``tf.distribute`` replica's function runs on a
    thread of its own), the user's line in the code autograph converted is named."""
    frame, level = sys._getframe(1), 2
    converted = None  # the innermost frame of code autograph generated
    while frame is not None and _skipped(frame):
        if converted is None and _AUTOGRAPH_FILE in frame.f_code.co_filename:
            converted = frame
        frame, level = frame.f_back, level + 1
    if converted is not None and (frame is None or _starts_a_thread(frame)):
        origin = origin_of_converted_line and origin_of_converted_line(
            converted.f_code.co_filename, converted.f_lineno)
        if origin:
            warnings.warn_explicit(
                message, category, origin[0], origin[1],
                module=converted.f_globals.get("__name__"),
                registry=converted.f_globals.setdefault("__warningregistry__", {}))
            return
    if frame is None:
        level = 2
    warnings.warn(message, category, stacklevel=level)


#: Modules whose frames start a thread or run a pool's work items.
_THREAD_STARTERS = ("threading", "concurrent.futures")


def _starts_a_thread(frame) -> bool:
    """Whether ``frame`` and every frame below it start a thread (the threading module,
    a ``concurrent.futures`` pool's worker): no caller of the user's there."""
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if not name.startswith(_THREAD_STARTERS):
            return False
        frame = frame.f_back
    return True
