"""The largest batch each model trains in a fixed memory, plain and with ``'memory'``.

``python -m bench --largest-batch 256`` builds each
benchmark model with its batch dimension unknown (placeholders ``[None, ...]``),
asks the plan for the largest batch whose predicted peak (with
``batch.HEADROOM``) fits the memory, for plain ``tf.gradients``
(``plan.largest_batch(memory, plain=True)``) and for ``'memory'`` planned
without a batch, then verifies each answer: the graph fed at that batch, one
traced step per variant, the least and the most of ``core.PEAK_RUNS`` peaks.
The tanh chain has no batch dimension and is left out.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import time
from typing import Dict, List, Optional

from memory_saving_gradients._units import MIB

from . import core

#: Model sizes (the default sweep's, batch left out; ResNet-56 stands for the depths).
SIZES: Dict[str, dict] = {
    "resnet": dict(depth=56),
    "transformer": dict(layers=12, d_model=128, heads=4, seq_len=128),
    "unet": dict(levels=4, base=32, image_size=64),
    "mlp": dict(depth=64, width=256),
}
QUICK_SIZES: Dict[str, dict] = {
    # width 16: oneDNN crashes on 1x1 stride-2 filter gradients of <= 8 channels
    "resnet": dict(depth=8),
    "transformer": dict(layers=2, d_model=16, heads=2, seq_len=8, vocab=32),
    "unet": dict(levels=2, base=4, image_size=8),
    "mlp": dict(depth=6, width=16),
}


@dataclasses.dataclass
class Row:
    model: str
    size: str
    memory_mb: float
    variant: str                   # 'tf.gradients' or 'memory'
    batch: int                     # the largest batch predicted to fit
    predicted_mb: float            # the plan's predicted peak at that batch (no headroom)
    measured_mb: Optional[float]   # least of the traced steps at that batch
    measured_max_mb: Optional[float]
    seconds: float                 # planning and measuring this row
    error: str = ""

    @property
    def fits(self) -> Optional[bool]:
        return None if self.measured_max_mb is None else self.measured_max_mb <= self.memory_mb


def _graph(module, size: dict, batch: int):
    """Loss, trainable params and a feed for ``batch``, the batch dimension None."""
    from memory_saving_gradients._tensorflow import tf

    params = module.make_params(seed=0, **size)
    placeholders = []
    for spec in module.input_signature(**dict(size, batch=batch)):
        shape = [None] + list(spec.shape)[1:]
        placeholders.append(tf.compat.v1.placeholder(spec.dtype, shape))
    loss, _ = module.forward(params, *placeholders, training=True)
    feed = dict(zip(placeholders, module.make_inputs(seed=0, **dict(size, batch=batch))))
    return loss, params.trainable, feed


def _measure(module, size: dict, batch: int, checkpointed: bool) -> tuple:
    """(least, most) measured peak bytes of the step at ``batch``."""
    import memory_saving_gradients as msg
    from memory_saving_gradients import profiling
    from memory_saving_gradients._tensorflow import tf

    with tf.Graph().as_default():
        loss, xs, feed = _graph(module, size, batch)
        if checkpointed:
            grads = msg.gradients(loss, xs, checkpoints="memory")
        else:
            grads = tf.compat.v1.gradients(loss, xs)
        peaks = []
        with tf.compat.v1.Session(config=core.default_config()) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for _ in range(core.PEAK_RUNS):
                _, metadata = profiling.traced_run(session, grads, feed)
                peaks.append(sum(profiling.peak_memory(metadata).values()))
    return min(peaks), max(peaks)


def run(names: List[str], memory_mb: float, quick: bool = False) -> List[Row]:
    import memory_saving_gradients as msg
    from memory_saving_gradients._tensorflow import tf

    from .models import test_models_package

    tm = test_models_package()
    memory = memory_mb * MIB
    rows: List[Row] = []
    for name in names:
        if name not in SIZES:
            print(f"note: {name} has no batch dimension (or no size here); left out")
            continue
        size = (QUICK_SIZES if quick else SIZES)[name]
        module = tm.MODELS[name]
        label = ",".join(f"{k}={v}" for k, v in size.items())
        start = time.time()
        with tf.Graph().as_default():
            loss, xs, _ = _graph(module, size, 8)
            plan = msg.plan(loss, xs)
            found = {plain: plan.largest_batch(memory, plain=plain) for plain in (True, False)}
            predicted = {plain: plan.peak_at(max(b, 1), plain) for plain, b in found.items()}
        planned = time.time() - start
        for plain in (True, False):
            variant = "tf.gradients" if plain else "memory"
            batch = found[plain]
            start = time.time()
            least = most = None
            error = ""
            if batch > 0:
                try:
                    least, most = _measure(module, size, batch, checkpointed=not plain)
                except Exception as caught:  # reported in the table, not fatal
                    error = core._first_line(caught)
            rows.append(Row(name, label, memory_mb, variant, batch, predicted[plain] / MIB,
                            None if least is None else least / MIB,
                            None if most is None else most / MIB,
                            planned / 2 + time.time() - start, error))
            measured = "-" if least is None else f"{least / MIB:.1f}-{most / MIB:.1f}"
            print(f"  {name} {variant:>12}: batch {batch}, "
                  f"predicted {predicted[plain] / MIB:.1f} MB, measured {measured} MB")
    return rows


def markdown(rows: List[Row]) -> str:
    lines = [
        "| model | size | memory MB | variant | largest batch | predicted MB | measured MB "
        "(least-most) | fits | batch vs tf.gradients |",
        "|---|---|---:|---|---:|---:|---:|---|---:|",
    ]
    plain = {r.model: r.batch for r in rows if r.variant == "tf.gradients"}
    for r in rows:
        measured = "-" if r.measured_mb is None else f"{r.measured_mb:.1f}-{r.measured_max_mb:.1f}"
        ratio = r.batch / plain[r.model] if plain.get(r.model) else float("nan")
        fits = "" if r.fits is None else ("yes" if r.fits else "NO")
        if r.error:
            fits += " " + r.error
        lines.append(f"| {r.model} | {r.size} | {r.memory_mb:g} | {r.variant} | {r.batch} | "
                     f"{r.predicted_mb:.1f} | {measured} | {fits} | {ratio:.2f}x |")
    return "\n".join(lines)


def write(out: str, rows: List[Row], header: str) -> Dict[str, str]:
    os.makedirs(out, exist_ok=True)
    paths = {"csv": os.path.join(out, "largest_batch.csv"),
             "md": os.path.join(out, "largest_batch.md")}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "size", "memory_mb", "variant", "batch", "predicted_mb",
                         "measured_mb", "measured_max_mb", "fits", "seconds", "error"])
        for r in rows:
            writer.writerow([r.model, r.size, r.memory_mb, r.variant, r.batch,
                             f"{r.predicted_mb:.3f}",
                             "" if r.measured_mb is None else f"{r.measured_mb:.3f}",
                             "" if r.measured_max_mb is None else f"{r.measured_max_mb:.3f}",
                             r.fits, f"{r.seconds:.1f}", r.error])
    with open(paths["md"], "w") as f:
        f.write(header + "\n## The largest batch that fits\n\n" + __doc__.split("\n\n", 1)[1]
                + "\n" + markdown(rows) + "\n")
    return paths
