"""TensorFlow import check and references to TensorFlow's own gradient functions.

TensorFlow is the user's own build (``tensorflow``, ``tensorflow-cpu``, a
nightly, ...), so it is not a hard requirement of the package; this module
fails at import with a message that says how to install it.  It also keeps a
reference to TensorFlow's ``gradients`` taken at import time, before anything
can monkeypatch it, so that this library never calls itself through a patch.
"""

from __future__ import annotations

try:
    import tensorflow as tf
except ImportError as error:  # pragma: no cover - exercised only without TF
    raise ImportError(
        "memory_saving_gradients needs TensorFlow 2.x, which is not installed. "
        "Install the build you want, e.g. `pip install tensorflow-cpu` or "
        "`pip install tensorflow`, or install this package with an extra: "
        "`pip install memory_saving_gradients[cpu]` / `[gpu]`."
    ) from error

if not tf.__version__.startswith("2."):  # pragma: no cover
    raise ImportError(
        f"memory_saving_gradients needs TensorFlow 2.x; found {tf.__version__}."
    )

from tensorflow.python.ops import gradients_impl as _gradients_impl

#: TensorFlow's own ``tf.compat.v1.gradients``, captured before any patching.
tf_gradients = _gradients_impl.gradients



def onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN CPU kernels are on in this process.

    TensorFlow decides at import, from ``TF_ENABLE_ONEDNN_OPTS`` or, when it is
    unset, from the CPU (by TensorFlow's documentation on by default with
    AVX-512 VNNI/BF16 or AMX; seen off on an AVX2-only AMD EPYC).  True when
    TensorFlow does not say (other builds).
    """
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # pragma: no cover - builds without the probe
        return True
    probe = getattr(_pywrap_util_port, "IsMklEnabled", None)
    return True if probe is None else bool(probe())


__all__ = ["tf", "tf_gradients", "onednn_enabled"]
