"""The tape-level patch: every ``tf.GradientTape`` checkpoints while a graph is traced.

Layer: entry points; imports: tape, _tensorflow.

TF2 code differentiates with ``tape.gradient``: Keras 3's and tf_keras'
``train_step``, custom training loops, ``optimizer.minimize(..., tape=tape)``.
Replacing the ``tf.gradients`` names does not reach them, and replacing the
name ``tf.GradientTape`` would miss tapes made through other names, names
bound before the patch, and subclasses.  So the methods themselves are
replaced on the class ``tf.GradientTape`` (which every name and subclass
shares): the span bookkeeping of :mod:`.tape` after ``_push_tape``,
``_pop_tape``, ``reset`` and ``watch``, and a ``gradient`` that goes through
:func:`.tape.checkpointed_gradient` with the innermost active configuration.
``jacobian`` and ``batch_jacobian`` keep TensorFlow's own gradients.

Configurations nest: :func:`push` returns a token that :func:`pop` takes
back, in any order; the newest one still active applies.  The methods are
installed when the first configuration is pushed and the objects that were
there are put back when the last one is popped.  :class:`.tape.GradientTape`
instances keep their own configuration and are not affected.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

from . import _tensorflow as _tf_internals
from . import tape as tape_lib

logger = logging.getLogger("memory_saving_gradients")

_lock = threading.RLock()
_configs: list = []  # [token, Config], oldest first
_installed: dict = {}  # method name -> (what was there before, our function)
_MISSING = object()


def current() -> tape_lib.Config | None:
    """The configuration tapes use now (the newest pushed), or None."""
    with _lock:
        return _configs[-1][1] if _configs else None


def push(config: tape_lib.Config) -> object:
    """Turn tape checkpointing on with ``config``; returns a token for :func:`pop`."""
    token = object()
    with _lock:
        if not _configs:
            _install()
        _configs.append([token, config])
    return token


def pop(token: object) -> None:
    """Take back what :func:`push` did (once; any order)."""
    with _lock:
        for i, (t, _) in enumerate(_configs):
            if t is token:
                del _configs[i]
                break
        else:
            return
        if not _configs:
            _uninstall()


@contextlib.contextmanager
def scope(config: tape_lib.Config) -> Iterator[None]:
    """Tape checkpointing with ``config`` inside the block."""
    token = push(config)
    try:
        yield
    finally:
        pop(token)


def is_installed() -> bool:
    """Whether ``tf.GradientTape``'s methods are ours now."""
    with _lock:
        return bool(_installed)


# -- the methods put on tf.GradientTape ---------------------------------------------


def _previous(name: str):
    return _installed[name][0] if name in _installed else tape_lib.ORIGINAL[name]


#: The methods put on ``tf.GradientTape``: over whatever was there, with the
#: innermost active configuration (none: the previous method's gradient).
_METHODS = tape_lib.hooked_methods(_previous, lambda tape: current())


def _install() -> None:
    cls = _tf_internals.GRADIENT_TAPE
    for name, function in _METHODS.items():
        previous = cls.__dict__.get(name, _MISSING)
        if previous is _MISSING:
            continue
        _installed[name] = (previous, function)
        setattr(cls, name, function)
    logger.debug("tf.GradientTape methods replaced")


def _uninstall() -> None:
    cls = _tf_internals.GRADIENT_TAPE
    for name, (previous, function) in _installed.items():
        if cls.__dict__.get(name) is not function:
            logger.warning(
                "tf.GradientTape.%s was replaced by someone else after "
                "memory_saving_gradients turned on tape checkpointing; restoring what "
                "was there before anyway.", name,
            )
        setattr(cls, name, previous)
    _installed.clear()
    logger.debug("tf.GradientTape methods restored")
