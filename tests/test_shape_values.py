"""shape_values.evaluate: the values of shape tensors, from estimated shapes.

Graphs with an unknown batch, no session: each case builds the shape arithmetic a
layer builds (``tf.tensordot``, ``tf.reshape(x, [-1, d])``, ``tf.shape(x)[0]``) and
checks the value worked out from a stated shape of ``x``.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from memory_saving_gradients import graph as graph_lib
from memory_saving_gradients import shape_values, simulate

pytestmark = pytest.mark.unit


def _with_batch(batch):
    """A ``shape_of`` that counts each unknown dimension as ``batch``."""
    def shape_of(t):
        if t.shape.rank is None:
            return None
        return [batch if d is None else d for d in t.shape.as_list()]
    return shape_of


def test_shape_arithmetic_is_evaluated(graph):
    x = tf.compat.v1.placeholder(tf.float32, [None, 16, 8])
    shape = tf.shape(x)
    cases = {
        "batch": (shape[0], 5),
        "rows": (tf.reduce_prod(shape[:-1]), 80),
        "target": (tf.stack([tf.reduce_prod(tf.gather(shape, [0, 1])), shape[-1]]), [80, 8]),
        "concat": (tf.concat([tf.gather(shape, [0, 1]), [32]], 0), [5, 16, 32]),
        "arithmetic": (shape[0] * 2 + tf.size(x) // 40, 26),
        "cast": (tf.cast(shape, tf.int64), [5, 16, 8]),
    }
    for name, (tensor, want) in cases.items():
        assert shape_values.evaluate(tensor, _with_batch(5)) == want, name


def test_what_cannot_be_worked_out_is_none(graph):
    x = tf.compat.v1.placeholder(tf.float32, [None, 16])
    n = tf.compat.v1.placeholder(tf.int32, [])
    assert shape_values.evaluate(tf.stack([n, 16]), _with_batch(5)) is None
    assert shape_values.evaluate(tf.shape(x), lambda t: None) is None
    assert shape_values.evaluate(tf.shape(tf.shape(x)), _with_batch(5), limit=0) is None


def test_the_sizer_follows_a_reshape_to_a_computed_target(graph):
    x = tf.compat.v1.placeholder(tf.float32, [None, 16, 8])
    shape = tf.shape(x)  # as tf.tensordot builds its target
    rows = tf.reshape(x, tf.stack([tf.reduce_prod(tf.gather(shape, [0, 1])),
                                   tf.reduce_prod(tf.gather(shape, [2]))]))
    flat = tf.reshape(x, [-1, 4])
    product = tf.matmul(rows, tf.ones([8, 3]))
    weight_grad = tf.matmul(rows, product, transpose_a=True)
    assert rows.shape.as_list() == [None, None]
    size = simulate.Sizer(5)
    assert size.shape(rows) == [80, 8]
    assert size.shape(flat) == [160, 4]
    assert size.shape(product) == [80, 3]
    assert size.shape(weight_grad) == [8, 3]  # a^T @ g: a's columns, not g's rows


def test_split_parts_of_a_shape_are_evaluated(graph):
    """``SplitV`` (sizes with a -1) and ``Split`` of a shape vector, and a one-element
    part reshaped to a scalar, as ``tf.signal.frame`` builds its target."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 7, 16000])
    outer, length, rest = tf.split(tf.shape(x), [-1, 1, 0])
    halves = tf.split(tf.concat([tf.shape(x), [3]], 0), 2)
    shape_of = _with_batch(5)
    assert shape_values.evaluate(outer, shape_of) == [5, 7]
    assert shape_values.evaluate(length, shape_of) == [16000]
    assert shape_values.evaluate(rest, shape_of) == []
    assert shape_values.evaluate(tf.reshape(length, []) // 64, shape_of) == 250
    assert [shape_values.evaluate(h, shape_of) for h in halves] == [[5, 7], [16000, 3]]
    # two splits by one sizes tensor, in one evaluation: the -1 is filled in a copy
    y = tf.compat.v1.placeholder(tf.float32, [None, 4, 6, 7])
    sizes = tf.constant([-1, 2])
    both = tf.concat([tf.split(tf.shape(x), sizes)[0], tf.split(tf.shape(y), sizes)[0]], 0)
    assert shape_values.evaluate(both, shape_of) == [5, 5, 4]


def test_the_sizer_follows_an_stft_with_an_unknown_batch(graph):
    """``tf.signal.stft`` on ``[None, 16000]``: its frames (a reshape to a target split
    from the signal's shape, a gather on an axis computed from a rank) and everything
    after keep the batch.  The reshape's target was not worked out, so the frames
    took the leftover elements as their batch and all after them had batch 4 of 32:
    plans 10-20x low (a helper's trial, a Conv1D model under an STFT layer)."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 16000])
    frames = tf.signal.frame(x, 256, 64)
    spectrum = tf.abs(tf.signal.stft(x, frame_length=256, frame_step=64, fft_length=256))
    gathered = [op for op in graph.get_operations() if op.type == "GatherV2"][0]
    assert tf.get_static_value(gathered.inputs[2]) is None  # the axis is computed
    size = simulate.Sizer(32)
    assert size.shape(spectrum) == [32, 247, 129]
    assert size.shape(frames) == [32, 247, 256]
    assert size.shape(gathered.outputs[0]) == [32, 247, 4, 64]


def test_the_sizer_follows_signal_processing_with_an_unknown_batch(graph):
    """Every float tensor of unknown shape in an STFT with ``pad_end`` (a pad built from
    a division rounded up), a mel projection, MFCCs, an inverse STFT and an
    overlap-add is estimated at its real shape at batch 32 (checked by running it), in
    either order of asking.  With ``pad_end`` the pad was not worked out and 20 of the
    44 were wrong (batch 10 of 32, a frame count of 0: a reviewer's check)."""
    import numpy as np

    x = tf.compat.v1.placeholder(tf.float32, [None, 16000])
    spectrum = tf.signal.stft(x, frame_length=400, frame_step=160, fft_length=512,
                              pad_end=True)
    mel = tf.tensordot(tf.abs(spectrum), tf.ones([257, 40]), 1)
    tf.signal.mfccs_from_log_mel_spectrograms(tf.math.log(mel + 1e-6))
    tf.signal.inverse_stft(spectrum, 400, 160, 512)
    tf.signal.overlap_and_add(tf.signal.frame(x, 100, 50), 50)
    unknown = [t for op in graph.get_operations() for t in op.outputs
               if t.dtype.is_floating and t.shape.rank is not None
               and not t.shape.is_fully_defined()]
    with tf.compat.v1.Session() as session:
        real = session.run(unknown, {x: np.zeros((32, 16000), np.float32)})
    want = {t.name: list(value.shape) for t, value in zip(unknown, real)}
    for order in (unknown, unknown[::-1]):
        size = simulate.Sizer(32)
        got = {t.name: size.shape(t) for t in order}
        assert got == want, {name: (got[name], want[name]) for name in want
                             if got[name] != want[name]}


def test_the_sizer_looks_back_a_bounded_way(graph):
    """Below a frozen backbone of 2,000 layers with the batch unknown, estimating the
    head's shapes walks at most :data:`simulate.ANCESTOR_DEPTH` producers back, not the
    whole backbone (it did: a plan took 1.8 s against 0.2 before, a reviewer's check),
    and still gets the batch."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 64])
    frozen = tf.constant(0.01, shape=[64, 64])
    h = x
    for _ in range(2000):
        h = tf.nn.relu(h @ frozen + 0.1)
    head = tf.tanh(h @ tf.Variable(tf.ones([64, 64])))
    size = simulate.Sizer(32)
    assert size.shape(head) == [32, 64]
    assert len(size._walked) < 1000, len(size._walked)  # the backbone: 6,000 ops


def test_the_sizer_estimates_alike_whichever_tensor_it_is_asked_first(graph):
    """Asked first for a tensor 40 ops below a reshape to a computed target, the Sizer
    gives what it gives asked in order: it works down from the producers.  It looked
    back at most ``ESTIMATE_DEPTH`` ops and kept the guess it made there (batch 4, not
    32, below an STFT)."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 16000])
    h = tf.abs(tf.signal.stft(x, frame_length=256, frame_step=64, fft_length=256))
    chain = [h]
    for _ in range(simulate.ESTIMATE_DEPTH + 8):
        chain.append(tf.tanh(chain[-1]))
    deep_first = simulate.Sizer(32)
    in_order = simulate.Sizer(32)
    assert deep_first.shape(chain[-1]) == [32, 247, 129]
    assert [in_order.shape(t) for t in chain][-1] == [32, 247, 129]
    assert deep_first(chain[-1]) == in_order(chain[-1]) == 32 * 247 * 129 * 4


def test_identity_transposes_share_their_input(graph):
    x = tf.compat.v1.placeholder(tf.float32, [None, 4, 3])
    same = tf.transpose(x, tf.concat([[0, 1], [2]], 0))
    swapped = tf.transpose(x, [0, 2, 1])
    assert graph_lib.shares_input_buffer(same.op) and graph_lib.forwards_its_input(same.op)
    assert not graph_lib.shares_input_buffer(swapped.op)


def test_a_plan_lists_its_checkpoints_at_the_memory_models_sizes(graph):
    """``str(plan)`` sizes each checkpoint as the memory model does: a reshape to a
    run-time target (``(None, 32)``, as ``tf.tensordot`` makes) has the batch's 64 rows
    per example, not one row per example."""
    import memory_saving_gradients as msg

    x = tf.compat.v1.placeholder(tf.float32, [None, 64, 32])
    w = tf.Variable(tf.ones([32, 256]))
    shape = tf.shape(x)  # as tf.tensordot builds its target
    rows = tf.reshape(tf.tanh(x), tf.stack([tf.reduce_prod(shape[:2]), shape[2]]))
    hidden = tf.tanh(tf.matmul(rows, w))
    loss = tf.reduce_sum(tf.tanh(hidden))
    plan = msg.plan(loss, [x, w], checkpoints=[rows, hidden])
    assert rows.shape.as_list() == [None, 32] and plan.batch == 32
    lines = {line.split()[0]: line for line in str(plan).splitlines()[1:]}
    assert lines[rows.name].endswith(f"{32 * 64 * 32 * 4 / 2**20:9.2f} MB"), str(plan)
    assert lines[hidden.name].endswith(f"{32 * 64 * 256 * 4 / 2**20:9.2f} MB"), str(plan)
    assert plan.checkpoint_bytes == 32 * 64 * (32 + 256) * 4, str(plan)
    assert f"2 checkpoints ({plan.checkpoint_bytes / 2**20:.2f} MB)" in str(plan), str(plan)


def test_a_kept_tensor_and_its_reshape_count_once_in_the_checkpoint_bytes(graph):
    """A tensordot keeps its matmul's result and the reshape of it: one buffer."""
    import memory_saving_gradients as msg

    x = tf.compat.v1.placeholder(tf.float32, [16, 64, 32])
    w = tf.Variable(tf.ones([32, 256]))
    product = tf.matmul(tf.reshape(tf.tanh(x), [16 * 64, 32]), w)
    shaped = tf.reshape(product, [16, 64, 256])
    loss = tf.reduce_sum(tf.tanh(tf.tanh(shaped)))
    plan = msg.plan(loss, [x, w], checkpoints=[product, shaped])
    assert plan.checkpoint_bytes == 16 * 64 * 256 * 4, str(plan)


def test_affine_bounds_give_a_slice_extent_whatever_the_index():
    """Begin and end computed while the step runs, as affine functions of run-time
    integers: their difference is known when it does not depend on them."""
    from memory_saving_gradients.shape_values import affine, constant_difference

    with tf.Graph().as_default():
        i = tf.compat.v1.placeholder(tf.int32, [])
        n = tf.compat.v1.placeholder(tf.int32, [])
        start, stop = affine(i * 256), affine((i + 1) * 256)
        assert constant_difference(stop, start) == 256
        assert constant_difference(affine(i * 4 + 10), affine(i * 4 - 2)) == 12
        assert constant_difference(affine(n), affine(i)) is None
        assert constant_difference(affine(i * 2), affine(i)) is None
        assert affine(i * n) is None  # a product of two unknowns
        packed = affine(tf.stack([i * 8, 0]))
        assert isinstance(packed, list) and packed[1] == {None: 0}
