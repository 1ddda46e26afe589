"""cuts.live_cuts on graphs of a few ops: a chain, a diamond, a skip connection.

Each graph is built in a fresh ``tf.Graph`` (no session runs): every tensor
holds 256 float32 (1 KiB) and every op costs 1, so the expected cuts, live
sets, prefix sums and pruned copies are worked out by hand in each test from
what each op's gradient reads (``Tanh`` and ``Exp`` their outputs, ``Sin``
its input, ``AddV2`` and ``Sum`` nothing).  A brute-force live set per
position checks the sweep on every graph.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from memory_saving_gradients import cuts as cuts_lib
from memory_saving_gradients.graph import forward_region

pytestmark = pytest.mark.unit

KIB = 1024


def size(t) -> int:
    return t.shape.num_elements() * t.dtype.size


def cost(op) -> int:
    return 1


def _cuts(ys, xs, **kwargs):
    region = forward_region(ys, xs)
    return region, cuts_lib.live_cuts(region, size, cost, **kwargs)


def _names(cuts) -> list:
    return [sorted(t.op.name for t in ts) for ts in cuts.tensors]


def _live_by_brute_force(region) -> list:
    """Per position p before the last: the region's outputs made at or before p that an
    op of the region after p reads."""
    order = list(region.order)
    position = {op: i for i, op in enumerate(order)}
    live = []
    for p in range(len(order) - 1):
        live.append(sorted(
            t.op.name for op in order[:p + 1] for t in op.outputs
            if any(position.get(c, -1) > p for c in t.consumers())))
    return live


def _check_against_brute_force(region, cuts):
    live = _live_by_brute_force(region)
    for p, names in zip(cuts.positions, _names(cuts)):
        assert names == live[p], p
    # every position whose live set has bytes and differs from the next one's is a cut
    changes = [p for p in range(len(live))
               if live[p] and (p + 1 == len(live) or live[p + 1] != live[p])]
    assert tuple(changes) == cuts.positions


@pytest.fixture
def x(graph):
    return tf.compat.v1.placeholder(tf.float32, [256], name="x")


def test_chain(x):
    a1 = tf.tanh(x, name="a1")
    a2 = tf.tanh(a1, name="a2")
    a3 = tf.tanh(a2, name="a3")
    loss = tf.reduce_sum(a3, name="loss")
    region, cuts = _cuts([loss], [x])
    assert [op.name for op in region.order] == ["a1", "a2", "a3", "loss"]
    assert cuts.positions == (0, 1, 2)
    assert _names(cuts) == [["a1"], ["a2"], ["a3"]]
    assert cuts.new_bytes == (((0, KIB),), ((1, KIB),), ((2, KIB),))
    # the sum's scalar is read by no gradient: it is left out of the prefix sums
    assert cuts.output_bytes == (KIB, 2 * KIB, 3 * KIB, 3 * KIB)
    assert cuts.held_bytes == cuts.output_bytes  # tanh's gradient reads its output
    assert cuts.work == (1, 2, 3, 3)
    assert cuts.largest == (KIB, KIB, KIB, 4)
    assert cuts.pruned == ((), (), ())
    _check_against_brute_force(region, cuts)


def test_diamond(x):
    a = tf.tanh(x, name="a")
    b = tf.sin(a, name="b")  # its gradient reads a; nothing reads b
    c = tf.exp(a, name="c")  # its gradient reads c
    d = tf.add(b, c, name="d")
    loss = tf.reduce_sum(d, name="loss")
    region, cuts = _cuts([loss], [x])
    assert [op.name for op in region.order] == ["a", "b", "c", "d", "loss"]
    # after a: {a}; after b: {a, b}; after c: {b, c}; after d: {d}
    assert cuts.positions == (0, 1, 2, 3)
    assert _names(cuts) == [["a"], ["a", "b"], ["b", "c"], ["d"]]
    assert cuts.new_bytes[2] == ((1, KIB), (2, KIB))
    # no gradient reads b, d or the loss, nor what they feed: their copies never run
    assert cuts.output_bytes == (KIB, KIB, 2 * KIB, 2 * KIB, 2 * KIB)
    assert cuts.work == (1, 1, 2, 2, 2)
    assert cuts.held_bytes == (KIB, KIB, 2 * KIB, 2 * KIB, 2 * KIB)
    assert cuts.pruned == ((), (), (), ())
    _check_against_brute_force(region, cuts)


def test_skip_connection(x):
    a1 = tf.tanh(x, name="a1")
    a2 = tf.sin(a1, name="a2")  # read by a3's gradient only
    a3 = tf.sin(a2, name="a3")  # read by no gradient: it feeds the add
    y = tf.add(a3, a1, name="y")
    loss = tf.reduce_sum(y, name="loss")
    region, cuts = _cuts([loss], [x])
    assert cuts.positions == (0, 1, 2, 3)
    # a1 is live across the whole skip
    assert _names(cuts) == [["a1"], ["a1", "a2"], ["a1", "a3"], ["y"]]
    assert cuts.new_bytes[1] == ((0, KIB), (1, KIB))
    assert cuts.output_bytes == (KIB, 2 * KIB, 2 * KIB, 2 * KIB, 2 * KIB)
    assert cuts.work == (1, 2, 2, 2, 2)
    # a2 is first read at a3's position: a segment ending right after a2 skips its copy
    assert cuts.pruned == ((), ((1, 1, KIB, KIB),), (), ())
    _check_against_brute_force(region, cuts)


def test_a_product_reads_its_input_only_when_the_other_input_needs_a_gradient(x):
    w = tf.compat.v1.placeholder(tf.float32, [256], name="w")
    a = tf.sin(x, name="a")  # its own gradient reads x, not a
    p = tf.multiply(a, w, name="p")  # the gradient for w reads a
    loss = tf.reduce_sum(p, name="loss")
    region = forward_region([loss], [x])
    wanted = cuts_lib.live_cuts(region, size, cost)
    unwanted = cuts_lib.live_cuts(region, size, cost, needs_gradient=lambda t: t.op in region)
    assert wanted.positions == unwanted.positions == (0, 1)
    # w's gradient wanted: a is first read at p, so a segment ending after a skips a's copy
    assert wanted.output_bytes == (KIB, KIB, KIB)
    assert wanted.pruned == (((0, 1, KIB, KIB),), ())
    # not wanted: no copy of a ever runs
    assert unwanted.output_bytes == unwanted.work == (0, 0, 0)
    assert unwanted.pruned == ((), ())


def test_alias_outputs_have_no_bytes_and_keep_their_source_alive(x):
    a1 = tf.tanh(x, name="a1")
    view = tf.identity(a1, name="view")
    a2 = tf.tanh(view, name="a2")
    loss = tf.reduce_sum(a2, name="loss")
    region, plain = _cuts([loss], [x])
    _, aliased = _cuts([loss], [x], aliases=lambda op: op.type == "Identity")
    assert plain.positions == (0, 1, 2)
    # the view costs nothing, so a1 and its view make one cut, after the view
    assert aliased.positions == (1, 2)
    assert _names(aliased)[0] == ["a1", "view"]
    assert aliased.new_bytes[0] == ((0, KIB), (1, 0))
    assert aliased.largest[1] == 0


def test_at_most_max_cuts_the_cheapest_of_each_stretch(x):
    t = x
    for i in range(10):
        t = tf.tanh(t, name=f"a{i}")
    loss = tf.reduce_sum(t, name="loss")
    region, every = _cuts([loss], [x])
    assert every.positions == tuple(range(10))
    # 10 cuts, 3 stretches of 10/3: the last of each (equal bytes: the later wins)
    _, few = _cuts([loss], [x], max_cuts=3)
    assert few.positions == (2, 5, 9)
    assert len(few.pruned) == len(few.tensors) == 3
