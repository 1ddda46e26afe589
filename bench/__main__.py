"""``python -m bench``: the benchmark's command line (``--help`` lists it)."""

from __future__ import annotations

import os

if __name__ == "__main__":
    if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        # Set before TensorFlow is imported, so that its INFO logs (one per traced
        # step) stay off; set the variable yourself to keep them.
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    from .cli import main

    raise SystemExit(main())
