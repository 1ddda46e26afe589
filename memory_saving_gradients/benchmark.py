"""The benchmark: memory and time of memory_saving_gradients vs TensorFlow's own answers.

Command line (``python -m memory_saving_gradients.benchmark --help``): the
default sweep over the models in ``test_models/`` (a source checkout has
them), a "fits in N MB" search, a training-curve check, and CSV / Markdown
/ PNG outputs in ``bench_out/``.

From Python, on your own model::

    from memory_saving_gradients.benchmark import measure

    def build(add_to_collection=False):      # builds in the current v1 graph
        ...
        return model                         # .loss, .params, .feed_dict

    for variant in ("tf.gradients", "memory"):
        print(measure(build, variant))

The pieces live in :mod:`memory_saving_gradients.bench`: ``core`` (measuring),
``sweep``, ``fits``, ``training``, ``report`` (tables, plots), ``cli``.
"""

from __future__ import annotations

from .bench.core import (
    VARIANTS,
    Functional,
    ModelSpec,
    Result,
    measure,
    prepare,
    spec_from_module,
    time_interleaved,
)
from .bench.cli import main

__all__ = [
    "VARIANTS",
    "Functional",
    "ModelSpec",
    "Result",
    "measure",
    "prepare",
    "spec_from_module",
    "time_interleaved",
    "main",
]

if __name__ == "__main__":
    import os
    import sys

    if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        # TensorFlow read its C++ log level when the package imported it; start again
        # with INFO logs (one per traced step) off.  Set the variable to keep them.
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        os.execv(sys.executable, [sys.executable, "-m", "memory_saving_gradients.benchmark"]
                 + sys.argv[1:])
    raise SystemExit(main())
