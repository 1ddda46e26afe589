"""Gradient checkpointing for TensorFlow 2 graphs: a drop-in for ``tf.gradients``.

``gradients(ys, xs, checkpoints=...)`` keeps only the chosen activations of
the forward pass and recomputes the rest, segment by segment, just before the
backward pass needs them.
"""

from __future__ import annotations

from ._tensorflow import tf as _tf  # noqa: F401  (fails early, with advice, without TF)
from .checkpointing import gradients, gradients_collection
from .profiling import peak_memory, peak_memory_by_device
from .strategies import available as available_strategies

__all__ = [
    "gradients",
    "gradients_collection",
    "peak_memory",
    "peak_memory_by_device",
    "available_strategies",
]
__version__ = "0.1.0"
