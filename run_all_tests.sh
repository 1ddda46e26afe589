#!/usr/bin/env bash
# Runs the whole test suite of memory_saving_gradients.
#
#   ./run_all_tests.sh [extra pytest arguments]
#
# On first use it creates .venv (python3 -m venv), installs tensorflow-cpu
# there if no TensorFlow is importable in it (an installed GPU build or
# tensorflow-cpu is left alone), and installs this package with its test
# extras.  Where TensorFlow sees a GPU it also runs the GPU ResNet comparison
# (benchmarks/gpu_resnet.py).  Exits non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")"

export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
TF_CPU_VERSION="2.21.0"
PY=".venv/bin/python"

if [ ! -x "$PY" ]; then
    echo "run_all_tests: creating .venv with $(python3 --version 2>&1)"
    python3 -m venv .venv
fi

if ! "$PY" -c "import tensorflow" >/dev/null 2>&1; then
    echo "run_all_tests: TensorFlow is not importable in .venv; installing tensorflow-cpu==$TF_CPU_VERSION"
    "$PY" -m pip install -q "tensorflow-cpu==$TF_CPU_VERSION"
fi

echo "run_all_tests: installing the package with its test and benchmark extras (pip install -e .[test,bench]; the benchmark has tests too)"
"$PY" -m pip install -q -e ".[test,bench]"

status=0

# GPU comparison first, so that pytest's summary is the last thing printed.
gpus="$("$PY" -c "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))" 2>/dev/null | tail -n 1 || true)"
case "$gpus" in
    ''|*[!0-9]*) gpus=0 ;;
esac
if [ "$gpus" -gt 0 ]; then
    if [ -f benchmarks/gpu_resnet.py ]; then
        echo "run_all_tests: $gpus GPU(s) visible; running benchmarks/gpu_resnet.py"
        "$PY" benchmarks/gpu_resnet.py || status=$?
    else
        echo "run_all_tests: $gpus GPU(s) visible, but benchmarks/gpu_resnet.py does not exist; GPU ResNet comparison skipped"
    fi
else
    echo "run_all_tests: TensorFlow sees no GPU; GPU ResNet comparison (benchmarks/gpu_resnet.py) skipped"
fi

"$PY" -m pytest -q tests "$@" || status=$?
exit "$status"
