#!/usr/bin/env bash
# The benchmark's default sweep (README.md, "Benchmark"): peak memory and step time of
# memory_saving_gradients vs tf.gradients, grappler's recomputation and tf.recompute_grad,
# on ResNet v2, a GPT-style transformer, a U-Net, a deep MLP and a tanh chain, plus the
# "fits in N MB" search and the training-curve check. Tables and plots go to bench_out/.
#
# Creates .venv when it is missing (installs the package with its test and bench extras,
# and tensorflow-cpu 2.21.0 only when no TensorFlow is importable there).
# Options are passed on: ./run_benchmark.sh --help, ./run_benchmark.sh --quick, ...
# ./run_benchmark.sh --suite keras: the Keras suite instead (docs/keras.md; a few minutes).
set -euo pipefail
cd "$(dirname "$0")"

# TensorFlow turns its oneDNN CPU kernels on by default only on some CPUs (by its docs,
# those with AVX-512 VNNI/BF16 or AMX; seen off on an AVX2-only AMD EPYC). Without them, TensorFlow's own (Eigen)
# convolution gradients allocate transient workspaces of 14-27 MB per op at batch 8, two
# at a time, which outweigh the activations the benchmark compares (docs/where-it-works.md).
# So the benchmark runs on oneDNN kernels on every machine, unless you say otherwise:
# TF_ENABLE_ONEDNN_OPTS=0 ./run_benchmark.sh
export TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-1}"

PY=.venv/bin/python
if [ ! -x "$PY" ]; then
    echo "Creating .venv ..."
    python3 -m venv .venv
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -e ".[test,bench]"
fi
if ! "$PY" -c "import tensorflow" >/dev/null 2>&1; then
    echo "No TensorFlow in .venv: installing tensorflow-cpu==2.21.0 ..."
    "$PY" -m pip install -q "tensorflow-cpu==2.21.0"
fi
if ! "$PY" -c "import memory_saving_gradients, matplotlib, tqdm" >/dev/null 2>&1; then
    echo "Installing the package with its bench extras into .venv ..."
    "$PY" -m pip install -q -e ".[test,bench]"
fi

case " $* " in
    *" --suite keras "*|*" --suite=keras "*)
        # the Keras suite needs tf_keras and keras-hub: installed without their dependencies,
        # which would pull the full tensorflow wheel over tensorflow-cpu (see run_all_tests.sh)
        if ! "$PY" -c "import tf_keras, keras_hub" >/dev/null 2>&1; then
            tf_minor="$("$PY" -c "import tensorflow as tf; print('.'.join(tf.__version__.split('.')[:2]))" 2>/dev/null | tail -n 1)"
            echo "Installing tf-keras==$tf_minor.* and keras-hub==0.32.0 (--no-deps) and the keras extra ..."
            "$PY" -m pip install -q -e ".[keras]"
            "$PY" -m pip install -q --no-deps "tf-keras==$tf_minor.*" "keras-hub==0.32.0"
        fi
        ;;
esac

export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec "$PY" -m bench "$@"
