"""The benchmark: memory and time of memory_saving_gradients against TensorFlow's own answers.

Not part of the installed package: it runs from a source checkout, as
``python -m bench`` (or ``./run_benchmark.sh``), over the synthetic models in
``test_models/`` beside it.  Its parts, one job each: ``core`` (measure one
model with one variant: peak, time, rewrite time, predicted peak, gradients
equal), ``models`` (the sweep's models and sizes), ``sweep`` (every size x
every variant, ratios to tf.gradients), ``fits`` (the largest model under a
memory cap), ``largest_batch``, ``training`` (the same loss curve with and
without memory-saving gradients), ``xla``, ``keras_suite``, ``rewrite_time``
(rewrite time against graph size), ``report`` (CSV, Markdown, PNG) and
``cli``.

From Python, on your own model::

    from bench import measure

    def build(add_to_collection=False):      # builds in the current v1 graph
        ...
        return model                         # .loss, .params, .feed_dict

    for variant in ("tf.gradients", "memory"):
        print(measure(build, variant))
"""

from __future__ import annotations

__all__ = [
    "VARIANTS",
    "Functional",
    "ModelSpec",
    "Result",
    "measure",
    "prepare",
    "spec_from_module",
    "time_interleaved",
]


def __getattr__(name: str):
    """The names of ``__all__``, from :mod:`.core` on first use: importing the package
    alone imports no TensorFlow, so that ``python -m bench`` can set TensorFlow's
    environment first."""
    if name in __all__:
        from . import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
