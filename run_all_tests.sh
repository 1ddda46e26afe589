#!/usr/bin/env bash
# Runs the whole test suite of memory_saving_gradients.
#
#   ./run_all_tests.sh [extra pytest arguments]          # everything (CI: .ci/run)
#   ./run_all_tests.sh --fast [extra pytest arguments]   # between edits: not "slow"
#
# The whole run prints the 25 slowest tests at the end (pytest --durations=25).
# --fast runs the tests not marked "slow" (pyproject.toml; docs/testing.md says what
# they cover and how long they take) and skips the GPU comparison.
#
# On first use it creates .venv (python3 -m venv), installs tensorflow-cpu
# there if no TensorFlow is importable in it (an installed GPU build or
# tensorflow-cpu is left alone), installs this package with its test, bench
# and keras extras, and tf-keras / keras-hub without their dependencies.
# Where TensorFlow sees a GPU it also runs the GPU ResNet comparison
# (benchmarks/gpu_resnet.py).  Exits non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")"

fast=0
if [ "${1:-}" = "--fast" ]; then
    fast=1
    shift
fi

# TensorFlow turns its oneDNN CPU kernels on by default only on some CPUs (by its docs,
# those with AVX-512 VNNI/BF16 or AMX; seen off on an AVX2-only AMD EPYC). Without them, TensorFlow's own (Eigen)
# convolution gradients allocate transient workspaces of 14-27 MB per op at batch 8, two
# at a time, which outweigh the activations the suite compares (docs/where-it-works.md).
# So the suite runs on oneDNN kernels on every machine, unless you say otherwise:
# TF_ENABLE_ONEDNN_OPTS=0 ./run_all_tests.sh
export TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-1}"

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

echo "run_all_tests: installing the package with its test, benchmark and keras extras (pip install -e .[test,bench,keras]; the benchmark has tests too)"
"$PY" -m pip install -q -e ".[test,bench,keras]"

# tf_keras and keras-hub (tests/test_tf_keras.py, tests/test_keras_models.py) go in
# without their dependencies: tf-keras asks for the full `tensorflow` wheel and
# keras-hub for tensorflow-text, which asks for it too, and either would install a
# second TensorFlow over tensorflow-cpu. What they import (regex, tokenizers) comes
# with the keras extra above.
if ! "$PY" -c "import tf_keras, keras_hub" >/dev/null 2>&1; then
    tf_minor="$("$PY" -c "import tensorflow as tf; print('.'.join(tf.__version__.split('.')[:2]))" 2>/dev/null | tail -n 1)"
    echo "run_all_tests: installing tf-keras==$tf_minor.* and keras-hub==0.32.0 with --no-deps (tensorflow-cpu stays the only TensorFlow)"
    "$PY" -m pip install -q --no-deps "tf-keras==$tf_minor.*" "keras-hub==0.32.0" \
        || echo "run_all_tests: could not install tf-keras / keras-hub; their tests skip and say why"
fi

status=0
optional=()

# GPU comparison first, so that pytest's summary comes at the end. --fast skips it and
# the probes below (each imports TensorFlow: seconds).
if [ "$fast" -eq 1 ]; then
    gpus=0
else
    gpus="$("$PY" -c "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))" 2>/dev/null | tail -n 1 || true)"
fi
case "$gpus" in
    ''|*[!0-9]*) gpus=0 ;;
esac
if [ "$fast" -eq 1 ]; then
    optional+=("GPU ResNet comparison skipped (--fast)")
elif [ "$gpus" -gt 0 ]; then
    if [ -f benchmarks/gpu_resnet.py ]; then
        echo "run_all_tests: $gpus GPU(s) visible; running benchmarks/gpu_resnet.py"
        if "$PY" benchmarks/gpu_resnet.py; then
            optional+=("GPU ResNet comparison ran ($gpus GPU(s))")
        else
            status=$?
            optional+=("GPU ResNet comparison ran and FAILED ($gpus GPU(s))")
        fi
    else
        echo "run_all_tests: $gpus GPU(s) visible, but benchmarks/gpu_resnet.py does not exist; GPU ResNet comparison skipped"
    fi
else
    echo "run_all_tests: TensorFlow sees no GPU; GPU ResNet comparison (benchmarks/gpu_resnet.py) skipped"
    optional+=("GPU ResNet comparison skipped (TensorFlow sees no GPU)")
fi
for package in tf_keras keras_hub; do
    [ "$fast" -eq 1 ] && break
    version="$("$PY" -c "import $package; print($package.__version__)" 2>/dev/null | tail -n 1 || true)"
    if [ -n "$version" ]; then
        optional+=("$package $version tests ran")
    else
        optional+=("$package tests skipped ($package cannot be imported: pip install --no-deps tf-keras keras-hub, see docs/keras.md)")
    fi
done

if [ "$fast" -eq 1 ]; then
    selection=(-m "not slow" --durations=10)
else
    selection=(--durations=25)
fi
# Lint first (pyproject.toml's [tool.ruff]): a finding fails the run, after the tests.
echo "run_all_tests: ruff check ."
"$PY" -m ruff check . || status=$?
"$PY" -m pytest -q tests "${selection[@]}" "$@" || status=$?
summary="$(printf '%s; ' "${optional[@]}")"
echo "run_all_tests: optional parts: ${summary%; }"
exit "$status"
