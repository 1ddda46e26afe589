"""The Keras suite of the benchmark: the training paths TF2 users have.

``python -m bench --suite keras`` runs, each in
its own process (so that one variant's memory never counts towards
another's):

==============  ==============================================================
case            what is trained
==============  ==============================================================
keras3_fit      Keras 3 ``fit`` on a ``tf.data`` ``.batch(B)`` pipeline (batch
                dimension unknown to the traced step), a conv net with BN
tf_keras_fit    tf_keras (Keras 2) ``fit`` of the same conv net
custom_loop     a ``tf.function`` with ``input_signature`` batch ``None``:
                ``tf.GradientTape`` + ``optimizer.apply_gradients`` (Keras 3)
gpt2_fit        keras-hub ``GPT2CausalLM`` from config, random weights
bert_fit        keras-hub ``BertTextClassifier`` from config, random weights
==============  ==============================================================

and for each the variants ``plain`` (no library), ``patched`` (``with
memory_saving_gradients.patched(): ...``), ``enable``
(``memory_saving_gradients.keras.enable(model)``, where the case calls
``fit``) and ``remat`` / ``remat_act`` (Keras 3's ``keras.RematScope`` with
``mode='full'`` / ``'activations'`` around model building, where the model is
Keras 3's).  Failures are rows too.

Columns: fit's own peak RSS (the process's peak resident set during all fit
calls, reset just before them, minus the resident set before them: tracing
and planning count), the allocator's peak of the timed steps (bytes in use
beyond what was in use before them, from TensorFlow's CPU allocator
statistics), the median step time and the CPU time per step (all threads)
with their ratios to ``plain`` (same run; other processes may share the
cores, which the CPU time feels less), and whether the losses equal
``plain``'s.

The model builders here are also used by the test suite (tests/
test_keras_models.py); Keras, tf_keras and keras-hub are imported only when
a builder runs.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from memory_saving_gradients._units import KIB, MIB

#: case -> variants that apply to it
CASES: Dict[str, Tuple[str, ...]] = {
    "keras3_fit": ("plain", "patched", "enable", "remat", "remat_act"),
    "tf_keras_fit": ("plain", "patched", "enable"),
    "custom_loop": ("plain", "patched", "remat", "remat_act"),
    "gpt2_fit": ("plain", "patched", "enable", "remat", "remat_act"),
    "bert_fit": ("plain", "patched", "enable", "remat", "remat_act"),
}

#: variant -> keras.RematScope mode
REMAT_MODES = {"remat": "full", "remat_act": "activations"}

VARIANT_HELP = {
    "plain": "no library",
    "patched": "with memory_saving_gradients.patched(): fit / the step",
    "enable": "memory_saving_gradients.keras.enable(model)",
    "remat": "keras.RematScope(mode='full') around building the model (Keras 3 only)",
    "remat_act": "keras.RematScope(mode='activations') around building the model (Keras 3 only)",
}

#: sizes of the suite (a few minutes on 2 cores) and of --quick (a smoke test)
SIZES: Dict[str, Dict[str, int]] = {
    "conv": dict(batch=64, image=32, channels=16, depth=12, classes=10, warm_steps=2, steps=6),
    "gpt2": dict(batch=16, seq=256, layers=4, hidden=128, heads=4, vocab=2048,
                 warm_steps=2, steps=6),
    "bert": dict(batch=16, seq=256, layers=4, hidden=128, heads=4, vocab=2048, classes=2,
                 warm_steps=2, steps=6),
}
QUICK_SIZES: Dict[str, Dict[str, int]] = {
    "conv": dict(batch=8, image=16, channels=8, depth=4, classes=10, warm_steps=1, steps=2),
    "gpt2": dict(batch=4, seq=32, layers=2, hidden=32, heads=2, vocab=128, warm_steps=1, steps=2),
    "bert": dict(batch=4, seq=32, layers=2, hidden=32, heads=2, vocab=128, classes=2,
                 warm_steps=1, steps=2),
}
_FAMILY = {"keras3_fit": "conv", "tf_keras_fit": "conv", "custom_loop": "conv",
           "gpt2_fit": "gpt2", "bert_fit": "bert"}

#: relative tolerance of "losses equal"
LOSS_RTOL = 1e-4


# ----------------------------------------------------------------------------- imports


def import_keras3():
    """Keras 3 with the TensorFlow backend (raises ImportError with what to install)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    if not keras.__version__.startswith("3."):
        raise ImportError(f"Keras 3 needed; found keras {keras.__version__}")
    return keras


def import_tf_keras():
    """tf_keras (Keras 2), imported by its own name: works next to Keras 3 in one
    process, without TF_USE_LEGACY_KERAS."""
    try:
        import tf_keras
    except ImportError as error:
        raise ImportError("tf_keras is not installed: pip install --no-deps 'tf-keras==2.21.*' "
                          "(its metadata asks for the full tensorflow wheel)") from error
    return tf_keras


def import_keras_hub():
    """keras-hub (raises ImportError naming what is missing)."""
    import_keras3()
    try:
        import keras_hub
    except ImportError as error:
        raise ImportError(f"keras-hub cannot be imported ({error}); install it with "
                          "pip install --no-deps keras-hub regex tokenizers") from error
    return keras_hub


# ----------------------------------------------------------------------------- models


def conv_net(kmod, size: Dict[str, int], seed: int = 0):
    """A CIFAR-sized conv net (3x3 conv - batch norm - ReLU, ``depth`` times), uncompiled
    (:func:`compile_conv_net` compiles it).  ``kmod`` is the keras module: Keras 3 or
    tf_keras."""
    kmod.utils.set_random_seed(seed)
    layers = kmod.layers
    inputs = kmod.Input((size["image"], size["image"], 3))
    x = inputs
    for _ in range(size["depth"]):
        x = layers.Conv2D(size["channels"], 3, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(size["classes"])(x)
    return kmod.Model(inputs, outputs)


def compile_conv_net(kmod, model, **compile_kwargs):
    """SGD with momentum, sparse cross-entropy on logits."""
    model.compile(optimizer=kmod.optimizers.SGD(0.01, momentum=0.9),
                  loss=kmod.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **compile_kwargs)
    return model


def conv_data(size: Dict[str, int], batches: int, seed: int = 0):
    """(images, labels) numpy arrays of ``batches`` full batches."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = size["batch"] * batches
    x = rng.standard_normal((n, size["image"], size["image"], 3)).astype("float32")
    y = rng.integers(0, size["classes"], n).astype("int32")
    return x, y


def gpt2_model(size: Dict[str, int], seed: int = 0, dropout: float = 0.1):
    """keras-hub GPT2CausalLM built from config (random weights, no preprocessor), compiled
    with SGD and a masked sparse cross-entropy, ``jit_compile=False``."""
    keras = import_keras3()
    keras_hub = import_keras_hub()
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=size["vocab"], num_layers=size["layers"], num_heads=size["heads"],
        hidden_dim=size["hidden"], intermediate_dim=4 * size["hidden"],
        dropout=dropout, max_sequence_length=size["seq"])
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[], jit_compile=False)
    return model


def gpt2_data(size: Dict[str, int], batches: int, seed: int = 0):
    """(inputs dict, next-token labels) of ``batches`` full batches of random tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = size["batch"] * batches
    tokens = rng.integers(1, size["vocab"], (n, size["seq"] + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, size["seq"]), "int32")}
    return x, tokens[:, 1:]


def bert_model(size: Dict[str, int], seed: int = 0, dropout: float = 0.1):
    """keras-hub BertTextClassifier built from config (random weights, no preprocessor),
    compiled with SGD, ``jit_compile=False``."""
    keras = import_keras3()
    keras_hub = import_keras_hub()
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=size["vocab"], num_layers=size["layers"], num_heads=size["heads"],
        hidden_dim=size["hidden"], intermediate_dim=4 * size["hidden"],
        dropout=dropout, max_sequence_length=size["seq"])
    model = keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=size["classes"], preprocessor=None, dropout=dropout)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[], jit_compile=False)
    return model


def bert_data(size: Dict[str, int], batches: int, seed: int = 0):
    """(inputs dict, class labels) of ``batches`` full batches."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = size["batch"] * batches
    x = {"token_ids": rng.integers(1, size["vocab"], (n, size["seq"])).astype("int32"),
         "segment_ids": np.zeros((n, size["seq"]), "int32"),
         "padding_mask": np.ones((n, size["seq"]), "int32")}
    y = rng.integers(0, size["classes"], n).astype("int32")
    return x, y


# ----------------------------------------------------------------------------- measuring


def rss_bytes() -> int:
    """The process's resident set now (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident set of the process while the ``with`` block runs, in bytes above
    the resident set at its start (``.grown``).

    Linux resets the high-water mark (VmHWM) on ``echo 5 > /proc/self/clear_refs``;
    where that is refused, a thread samples the resident set every 2 ms instead.
    """

    def __enter__(self):
        import threading

        self.before = rss_bytes()
        self._samples = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self._samples = [self.before]
            self._stop = threading.Event()

            def sample():
                while not self._stop.wait(0.002):
                    self._samples.append(rss_bytes())

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._samples is None:
            with open("/proc/self/status") as f:
                hwm = next(int(line.split()[1]) * KIB for line in f
                           if line.startswith("VmHWM:"))
            self.peak = hwm
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._samples + [rss_bytes()])
        self.grown = self.peak - self.before
        return False


def allocator_peak(run: Callable[[], object]) -> Optional[int]:
    """Peak bytes TensorFlow's allocator held while ``run()`` ran beyond what it held
    before (:func:`memory_saving_gradients.profiling.peak_memory_during`), or None where
    the allocator keeps no statistics (``run()`` still runs).  On CPU only buffers of
    256 KiB and more are counted (oneDNN's allocator)."""
    from memory_saving_gradients import profiling

    try:
        return profiling.peak_memory_during(run)
    except RuntimeError:
        run()
        return None


def _batch_recorder(kmod, losses: List[float], seconds: List[float]):
    """A Callback of ``kmod`` that appends Keras' running loss after every batch to
    ``losses`` and each batch's wall time (begin to end, the loss read included) to
    ``seconds``."""

    class Record(kmod.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))
            seconds.append(time.perf_counter() - self._start)

    return Record()


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def fit_and_measure(kmod, model, dataset_or_xy, warm_steps: int, steps: int,
                    batch_size: Optional[int] = None) -> Dict[str, object]:
    """Train ``warm_steps`` then ``steps`` batches with ``model.fit`` (two fit calls of
    one epoch each); returns losses (Keras' running mean after each batch), fit's own
    peak RSS (both calls), the allocator peak and the median seconds per batch of the
    second call."""
    losses: List[float] = []
    seconds: List[float] = []
    callback = _batch_recorder(kmod, losses, seconds)

    def fit(part: int, n: int):
        data = dataset_or_xy(part, n) if callable(dataset_or_xy) else dataset_or_xy
        if isinstance(data, tuple):
            model.fit(data[0], data[1], batch_size=batch_size, epochs=1, shuffle=False,
                      verbose=0, callbacks=[callback])
        else:
            model.fit(data, epochs=1, shuffle=False, verbose=0, callbacks=[callback])

    with PeakRSS() as rss:
        fit(0, warm_steps)
        cpu = time.process_time()
        alloc = allocator_peak(lambda: fit(1, steps))
        cpu = (time.process_time() - cpu) / steps
    return {"losses": losses, "fit_rss_mb": rss.grown / MIB,
            "alloc_peak_mb": None if alloc is None else alloc / MIB,
            "step_s": _median(seconds[warm_steps:]), "cpu_s": cpu}


def _tf_dataset(x, y, batch: int):
    """``Dataset.from_tensor_slices((x, y)).batch(batch)``: the batch dimension of its
    element spec is None (no ``drop_remainder``), as in most input pipelines."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _sliced(x, y, start: int, n: int):
    """Rows ``start:start + n`` of arrays, or of each array of a dict of inputs."""
    if isinstance(x, dict):
        return {k: v[start:start + n] for k, v in x.items()}, y[start:start + n]
    return x[start:start + n], y[start:start + n]


def run_case(case: str, variant: str, size: Dict[str, int]) -> Dict[str, object]:
    """Build, train and measure one case x variant in this process (see the module doc)."""
    import contextlib

    import memory_saving_gradients as msg

    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")
    if variant not in CASES[case]:
        raise ValueError(f"variant {variant!r} does not apply to {case!r}")
    warm, steps = size["warm_steps"], size["steps"]
    b = size["batch"]
    patch_ctx = msg.patched() if variant == "patched" else contextlib.nullcontext()
    remat_ctx = contextlib.nullcontext()
    if variant in REMAT_MODES:
        remat_ctx = import_keras3().RematScope(mode=REMAT_MODES[variant])

    if case == "custom_loop":
        return _run_custom_loop(size, patch_ctx, remat_ctx)
    if case in ("keras3_fit", "tf_keras_fit"):
        kmod = import_keras3() if case == "keras3_fit" else import_tf_keras()
        with remat_ctx:
            model = compile_conv_net(kmod, conv_net(kmod, size))
        x, y = conv_data(size, warm + steps)
    else:  # gpt2_fit, bert_fit
        kmod = import_keras3()
        build, make_data = (gpt2_model, gpt2_data) if case == "gpt2_fit" else (bert_model, bert_data)
        with remat_ctx:
            model = build(size)
        x, y = make_data(size, warm + steps)

    def data(part, n):  # part 0: the warm-up batches, 1: the timed ones
        xs, ys = _sliced(x, y, 0 if part == 0 else warm * b, n * b)
        return _tf_dataset(xs, ys, b)

    if variant == "enable":
        msg.keras.enable(model)
    with patch_ctx:
        return fit_and_measure(kmod, model, data, warm, steps)


def _run_custom_loop(size, patch_ctx, remat_ctx) -> Dict[str, object]:
    """A custom training loop: the step is a tf.function whose input_signature leaves the
    batch dimension unknown."""
    import tensorflow as tf

    keras = import_keras3()
    with remat_ctx:
        model = conv_net(keras, size)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    image = size["image"]

    @tf.function(input_signature=[tf.TensorSpec([None, image, image, 3], tf.float32),
                                  tf.TensorSpec([None], tf.int32)])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    warm, steps, b = size["warm_steps"], size["steps"], size["batch"]
    x, y = conv_data(size, warm + steps)
    losses = []
    with patch_ctx:
        with PeakRSS() as rss:
            for i in range(warm):
                losses.append(float(step(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])))
            seconds = []

            def timed_steps():
                for i in range(warm, warm + steps):
                    start = time.perf_counter()
                    losses.append(float(step(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])))
                    seconds.append(time.perf_counter() - start)

            cpu = time.process_time()
            alloc = allocator_peak(timed_steps)
            cpu = (time.process_time() - cpu) / steps
    return {"losses": losses, "fit_rss_mb": rss.grown / MIB,
            "alloc_peak_mb": None if alloc is None else alloc / MIB,
            "step_s": _median(seconds), "cpu_s": cpu}


# ----------------------------------------------------------------------------- the suite


@dataclasses.dataclass
class Row:
    case: str
    variant: str
    fit_rss_mb: Optional[float] = None
    alloc_peak_mb: Optional[float] = None
    step_s: Optional[float] = None
    cpu_s: Optional[float] = None
    losses: Optional[List[float]] = None
    error: Optional[str] = None
    rss_ratio: Optional[float] = None
    alloc_ratio: Optional[float] = None
    time_ratio: Optional[float] = None
    cpu_ratio: Optional[float] = None
    losses_equal: Optional[bool] = None
    wall_s: Optional[float] = None


def sizes_for(case: str, quick: bool) -> Dict[str, int]:
    return dict((QUICK_SIZES if quick else SIZES)[_FAMILY[case]])


def run_in_subprocess(case: str, variant: str, size: Dict[str, int], timeout: float = 600) -> Row:
    """:func:`run_case` in a fresh Python process; a crash, a timeout or an exception
    becomes the row's ``error``."""
    cmd = [sys.executable, "-m", "bench.keras_suite", "--worker",
           case, variant, json.dumps(size)]
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    start = time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Row(case, variant, error=f"timed out after {timeout:.0f} s",
                   wall_s=time.time() - start)
    wall = time.time() - start
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_MARK):
            got = json.loads(line[len(_MARK):])
            if "error" in got:
                return Row(case, variant, error=got["error"], wall_s=wall)
            return Row(case, variant, fit_rss_mb=got["fit_rss_mb"],
                       alloc_peak_mb=got["alloc_peak_mb"], step_s=got["step_s"],
                       cpu_s=got.get("cpu_s"), losses=got["losses"], wall_s=wall)
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return Row(case, variant, error=f"process exited {done.returncode}: {tail[:200]}", wall_s=wall)


_MARK = "KERAS_SUITE_RESULT "


def compare(rows: List[Row]) -> List[Row]:
    """Fill ratios to the case's ``plain`` row and whether the losses equal plain's."""
    import numpy as np

    plain = {r.case: r for r in rows if r.variant == "plain" and r.error is None}
    for r in rows:
        base = plain.get(r.case)
        if r.error is not None or base is None:
            continue
        if r.variant == "plain":
            r.rss_ratio = r.alloc_ratio = r.time_ratio = r.cpu_ratio = 1.0
            r.losses_equal = True
            continue
        r.rss_ratio = _ratio(r.fit_rss_mb, base.fit_rss_mb)
        r.alloc_ratio = _ratio(r.alloc_peak_mb, base.alloc_peak_mb)
        r.time_ratio = _ratio(r.step_s, base.step_s)
        r.cpu_ratio = _ratio(r.cpu_s, base.cpu_s)
        r.losses_equal = (len(r.losses) == len(base.losses) and bool(np.allclose(
            r.losses, base.losses, rtol=LOSS_RTOL, atol=1e-6)))
    return rows


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else a / b


def run_suite(cases: Sequence[str], variants: Sequence[str], quick: bool = False,
              timeout: float = 600, on_row: Optional[Callable[[Row], None]] = None) -> List[Row]:
    """Every applicable case x variant, each in its own process; ratios filled."""
    rows = []
    for case in cases:
        for variant in CASES[case]:
            if variant not in variants:
                continue
            row = run_in_subprocess(case, variant, sizes_for(case, quick), timeout=timeout)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return compare(rows)


# ----------------------------------------------------------------------------- outputs

COLUMNS = ["case", "variant", "fit_rss_mb", "rss_ratio", "alloc_peak_mb", "alloc_ratio",
           "step_s", "time_ratio", "cpu_s", "cpu_ratio", "losses_equal", "final_loss", "note"]
HEADERS = {"case": "case", "variant": "variant", "fit_rss_mb": "fit's peak RSS MiB",
           "rss_ratio": "RSS / plain", "alloc_peak_mb": "allocator peak MiB",
           "alloc_ratio": "allocator / plain", "step_s": "step s",
           "time_ratio": "time / plain", "cpu_s": "CPU s/step",
           "cpu_ratio": "CPU / plain", "losses_equal": "losses equal plain",
           "final_loss": "last loss", "note": "note"}


def row_dict(row: Row) -> Dict[str, object]:
    return {"case": row.case, "variant": row.variant, "fit_rss_mb": row.fit_rss_mb,
            "rss_ratio": row.rss_ratio, "alloc_peak_mb": row.alloc_peak_mb,
            "alloc_ratio": row.alloc_ratio, "step_s": row.step_s, "time_ratio": row.time_ratio,
            "cpu_s": row.cpu_s, "cpu_ratio": row.cpu_ratio,
            "losses_equal": (None if row.losses_equal is None
                             else ("yes" if row.losses_equal else "NO")),
            "final_loss": row.losses[-1] if row.losses else None,
            "note": "" if row.error is None else "FAILED: " + row.error[:160]}


def _fmt(column: str, value) -> str:
    if value is None:
        return ""
    if column.endswith("ratio"):
        return f"{value:.2f}x"
    if column.endswith("_mb"):
        return f"{value:.0f}"
    if column in ("step_s", "cpu_s"):
        return f"{value:.3f}"
    if column == "final_loss":
        return f"{value:.5f}"
    return str(value).replace("|", "/").replace("\n", " ")


def markdown_table(rows: List[Row]) -> str:
    from .report import markdown

    return markdown(COLUMNS, HEADERS, (row_dict(r) for r in rows), _fmt)


def write_csv(rows: List[Row], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS + ["losses"])
        w.writeheader()
        for r in rows:
            d = row_dict(r)
            d["losses"] = "" if r.losses is None else " ".join(f"{v:.7g}" for v in r.losses)
            w.writerow(d)


def plot(rows: List[Row], path: str) -> Optional[str]:
    """Grouped bars: fit's peak RSS and allocator peak per case and variant (failed
    variants marked)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cases = list(dict.fromkeys(r.case for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / max(1, len(variants))
    for ax, attr, title in ((axes[0], "fit_rss_mb", "fit's own peak RSS (MiB)"),
                            (axes[1], "alloc_peak_mb", "allocator peak of the timed steps (MiB)"),
                            (axes[2], "cpu_ratio", "CPU time per step / plain")):
        for j, v in enumerate(variants):
            for i, c in enumerate(cases):
                r = next((r for r in rows if r.case == c and r.variant == v), None)
                if r is None:
                    continue
                xpos = i + (j - (len(variants) - 1) / 2) * width
                value = getattr(r, attr)
                if r.error is not None or value is None:
                    ax.text(xpos, 0, "x", ha="center", va="bottom", color=f"C{j}", fontsize=9)
                    continue
                ax.bar(xpos, value, width, color=f"C{j}", label=v)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=20)
        ax.set_title(title)
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles))
        ax.legend(seen.values(), seen.keys(), fontsize=8)
    failed = sorted({r.variant for r in rows if r.error is not None})
    fig.suptitle("Keras suite: plain vs one line" + (
        f" (x: {', '.join(failed)} failed there; see the table)" if failed else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(out_dir: str, rows: List[Row], header: str = "") -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    path = os.path.join(out_dir, "keras_suite.csv")
    write_csv(rows, path)
    written["csv"] = path
    path = os.path.join(out_dir, "keras_suite.md")
    with open(path, "w") as f:
        f.write(header + "\n" + markdown_table(rows) + "\n")
    written["md"] = path
    png = plot(rows, os.path.join(out_dir, "keras_suite.png"))
    if png:
        written["png"] = png
    return written


def main(argv: Optional[List[str]] = None, out: str = "bench_out", quick: bool = False,
         cases: Optional[Sequence[str]] = None, variants: Optional[Sequence[str]] = None,
         command: str = "") -> int:
    """Run the suite and write ``keras_suite.{csv,md,png}`` into ``out``; exit status 1
    when a variant that ran gave losses different from plain's."""
    import datetime
    import platform

    cases = list(cases or CASES)
    variants = list(variants or VARIANT_HELP)
    started = time.time()
    print(f"Keras suite: {len(cases)} cases, variants {', '.join(variants)}, each in its own "
          f"process; output in {out}/", flush=True)

    def show(r: Row):
        if r.error:
            print(f"  {r.case} {r.variant}: FAILED ({r.error[:120]})", flush=True)
        else:
            alloc = "" if r.alloc_peak_mb is None else f", allocator {r.alloc_peak_mb:.0f} MiB"
            print(f"  {r.case} {r.variant}: fit RSS {r.fit_rss_mb:.0f} MiB{alloc}, "
                  f"{r.step_s:.3f} s/step ({r.wall_s:.0f} s)", flush=True)

    rows = run_suite(cases, variants, quick=quick, on_row=show)
    wall = time.time() - started
    try:
        load = "%.1f" % os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = "?"
    import tensorflow as tf

    header = "\n".join([
        "# Keras suite",
        "",
        f"- command: `{command or 'python -m bench --suite keras'}`",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; wall time {wall:.0f} s",
        f"- TensorFlow {tf.__version__}, Python {platform.python_version()}, {os.cpu_count()} "
        f"CPUs; 1-min load average {load} at the end",
        "- each variant in its own process; fit's peak RSS: the process's peak resident set "
        "during the fit calls (warm-up with tracing and planning, then the timed steps) minus "
        "the resident set before them; allocator peak: TensorFlow's CPU allocator, peak bytes "
        "of the timed steps beyond those in use before them; step s: median wall time of a "
        "timed step (noisy on shared cores); CPU s/step: the process's CPU time (all threads) "
        "over the timed steps / steps, less sensitive to other processes on the cores; "
        "losses equal: Keras' running loss after "
        f"every batch within rtol {LOSS_RTOL:g} of plain's",
        "- sizes: " + "; ".join(f"{k}: " + ", ".join(f"{a}={b}" for a, b in v.items())
                                for k, v in (QUICK_SIZES if quick else SIZES).items()),
        "",
    ])
    written = write_outputs(out, rows, header)
    print()
    print(markdown_table(rows))
    print(f"\nWall time {wall:.0f} s. Written: " + ", ".join(sorted(written.values())))
    bad = [r for r in rows if r.losses_equal is False]
    if bad:
        print("LOSSES DIFFER for: " + ", ".join(f"{r.case} {r.variant}" for r in bad))
        return 1
    return 0


def describe_error(error: BaseException) -> str:
    """One line: the exception's type and its first telling line (Keras' wrapper line
    "Exception encountered when calling ..." skipped, terminal colours removed)."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("in user code"):
        # autograph: a traceback, then the inner error ("ValueError: ...") and its lines
        inner = [i for i, line in enumerate(lines) if re.match(r"^\w+(Error|Exception): ", line)]
        if inner:
            lines = lines[inner[-1]:]
            lines[0] = lines[0].split(": ", 1)[1]
    if len(lines) > 1 and lines[0].startswith("Exception encountered"):
        lines = lines[1:]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:400]


def _worker(argv: List[str]) -> int:
    case, variant, size = argv[0], argv[1], json.loads(argv[2])
    try:
        result = run_case(case, variant, size)
    except Exception as error:
        result = {"error": describe_error(error)}
    print(_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        raise SystemExit(_worker(sys.argv[2:]))
    p = argparse.ArgumentParser(prog="python -m bench.keras_suite")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--variants", default=",".join(VARIANT_HELP))
    a = p.parse_args()
    raise SystemExit(main(out=a.out, quick=a.quick, cases=a.cases.split(","),
                          variants=a.variants.split(",")))
