"""Gradient checkpointing for TensorFlow 2 graphs: a drop-in for ``tf.gradients``.

Layer: entry points (the public API); imports: checkpointing, keras, notices, patching,
planning, profiling, strategies, tape, _tensorflow.

``gradients(ys, xs, checkpoints=...)`` keeps only the chosen activations of
the forward pass and recomputes the rest, segment by segment, just before the
backward pass needs them.
"""

from __future__ import annotations

from . import keras  # Keras 3 integration; imports Keras only when used
from ._tensorflow import tf as _tf  # noqa: F401  (fails early, with advice, without TF)
from .checkpointing import (
    gradients,
    gradients_collection,
    gradients_memory,
    gradients_speed,
    plan,
)
from .notices import (
    EagerExecutionWarning,
    FallbackWarning,
    MemorySavingGradientsWarning,
    NothingKeptWarning,
    NothingRewrittenWarning,
)
from .patching import patch, patched
from .planning import Plan
from .profiling import peak_memory, peak_memory_by_device, peak_memory_during
from .strategies import available as available_strategies
from .tape import GradientTape

__all__ = [
    "gradients",
    "gradients_collection",
    "gradients_memory",
    "gradients_speed",
    "plan",
    "Plan",
    "MemorySavingGradientsWarning",
    "NothingKeptWarning",
    "NothingRewrittenWarning",
    "EagerExecutionWarning",
    "FallbackWarning",
    "peak_memory",
    "peak_memory_by_device",
    "peak_memory_during",
    "available_strategies",
    "patch",
    "patched",
    "GradientTape",
    "keras",
]
__version__ = "0.1.0"
