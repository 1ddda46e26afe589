"""Checkpoint selection policies.

A strategy is a pure function ``(ys, xs, region, **options) -> list of tensors``
that reads the forward graph and returns the tensors to keep.  It never
changes the graph: the rewrite is done elsewhere, from whatever a strategy
returns, exactly as from a list the user gives.  New strategies register
with :func:`register`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ._tensorflow import tf
from .graph import ForwardRegion

Strategy = Callable[..., list]

COLLECTION_NAME = "checkpoints"

_STRATEGIES: dict = {}


def register(name: str) -> Callable[[Strategy], Strategy]:
    """Decorator: make ``fn`` available as ``checkpoints=name``."""

    def decorate(fn: Strategy) -> Strategy:
        _STRATEGIES[name] = fn
        return fn

    return decorate


def available() -> list:
    """Names accepted as ``checkpoints=...``."""
    return sorted(_STRATEGIES)


def get(name: str) -> Strategy:
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"Unknown checkpoint strategy {name!r}. Use one of {available()}, "
            "or pass a list of tensors."
        ) from None


@register("collection")
def collection(
    ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], region: ForwardRegion, **_
) -> list:
    """The tensors in the graph collection ``'checkpoints'``."""
    graph = ys[0].graph
    return [t for t in graph.get_collection(COLLECTION_NAME) if isinstance(t, tf.Tensor)]
