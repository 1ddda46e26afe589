"""patch(tape=True): every tf.GradientTape checkpoints while a graph is traced.

Each case runs the same code under a plain ``tf.function`` and under
``patched('memory')`` and compares the results; where the library should
have rewritten the step, the traced graph must hold ``recompute`` copies.
"""

from __future__ import annotations

import inspect
import sys
import threading
import warnings

import numpy as np
import pytest
import tensorflow as tf
from tensorflow import GradientTape as EarlyBoundTape  # bound before any patch
from tensorflow.python.eager import backprop
from tensorflow.python.ops import gradients_impl

import memory_saving_gradients as msg
from memory_saving_gradients import memo, strategies, tape_hooks
from memory_saving_gradients import patching as patch_lib
from memory_saving_gradients import tape as tape_lib

DEPTH = 12


class EarlySubclass(tf.GradientTape):
    """A user's subclass, defined before any patch."""


@pytest.fixture(autouse=True)
def _clean():
    yield
    for handle in list(patch_lib._active):
        handle.undo()
    assert not tape_hooks.is_installed()


@pytest.fixture(scope="module")
def weights():
    return [
        tf.Variable(tf.random.stateless_normal([32, 32], seed=[i, 9]) * 0.3, name=f"w{i}")
        for i in range(DEPTH)
    ]


@pytest.fixture(scope="module")
def x():
    return tf.random.stateless_normal([512, 32], seed=[5, 6])


def _chain(weights, x):
    h = x
    for w in weights:
        h = tf.tanh(tf.matmul(h, w))
    return h


def _forward(weights, x):
    h = _chain(weights, x)
    return tf.reduce_sum(h * h)


def _both(body, *args):
    """``body`` traced plain and under ``patched('memory')``; (plain, ours, our graph)."""
    plain = tf.function(body)
    want = plain(*args)
    with msg.patched("memory"):
        ours = tf.function(body)
        graph = ours.get_concrete_function(*args).graph
        got = ours(*args)
    return want, got, graph


def _recomputes(graph) -> int:
    return sum("recompute" in op.name for op in graph.get_operations())


def _close(a, b, rtol=1e-4):
    for u, v in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
        assert (u is None) == (v is None), (u, v)
        if u is None:
            continue
        u, v = np.asarray(tf.convert_to_tensor(u)), np.asarray(tf.convert_to_tensor(v))
        scale = max(1.0, float(np.abs(v).max()))
        np.testing.assert_allclose(u, v, rtol=rtol, atol=1e-5 * scale)


@pytest.mark.parametrize("tape_class", [
    tf.GradientTape, tf.compat.v1.GradientTape, tf.compat.v2.GradientTape,
    EarlyBoundTape, EarlySubclass,
], ids=["tf", "compat.v1", "compat.v2", "bound-before", "subclass"])
def test_every_name_and_subclass_of_the_tape_is_checkpointed(weights, x, tape_class):
    def body(x):
        with tape_class() as tape:
            tape.watch(x)
            loss = _forward(weights, x)
        return tape.gradient(loss, {"w": weights, "x": x})

    want, got, graph = _both(body, x)
    _close(got, want)
    assert _recomputes(graph) > 0


def test_tape_false_leaves_tapes_alone_and_patches_tf_gradients(weights, x):
    with msg.patched("memory", tape=False) as handle:
        assert not tape_hooks.is_installed()
        assert tf.gradients is handle.replacements["v2"]

        @tf.function
        def body(x):
            with tf.GradientTape() as tape:
                loss = _forward(weights, x)
            return tape.gradient(loss, weights)

        assert _recomputes(body.get_concrete_function(x).graph) == 0


def _tape_step(weights):
    """A new tf.function of a tape step over ``weights`` (traced at its first call)."""
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = _forward(weights, x)
        return tape.gradient(loss, weights)
    return step


def test_tape_false_says_tapes_stay_plain_not_traced_before(weights, x):
    """A tape step under patch(tape=False) rewrote nothing because tapes are left alone:
    the warning says so (and names the user's line), not that the step was traced early."""
    with pytest.warns(msg.NothingRewrittenWarning) as warned:
        with msg.patched("memory", tape=False):
            _tape_step(weights)(x)
    said = [w for w in warned if w.category is msg.NothingRewrittenWarning]
    assert len(said) == 1 and "tape=False" in str(said[0].message), str(said[0].message)
    assert said[0].filename == __file__, said[0].filename


def test_nested_patches_the_inner_rewrites_and_the_outer_does_not_warn(weights, x):
    """With patched('balanced') inside patched('memory') the inner patch rewrites the step;
    the outer one, displaced, has no plan of its own and no 'traced before' warning."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with msg.patched("memory") as outer:
            with msg.patched("balanced") as inner:
                _tape_step(weights)(x)
    assert len(inner.plans) == 1 and not outer.plans
    assert not [w for w in caught if issubclass(w.category, msg.NothingRewrittenWarning)], [
        str(w.message) for w in caught]


def test_an_eager_tensor_the_step_captures_is_a_source(weights, x):
    """An eager tensor made outside the tf.function and watched inside it (a gradient
    penalty on a captured batch) is differentiated through the placeholder that captured
    it: the step is rewritten, with the tape's gradients; unwatched, it gets None as
    from the tape."""
    captured, other = x, tf.random.stateless_normal([512, 32], seed=[7, 8])

    def body(watch_other):
        with tf.GradientTape() as tape:
            tape.watch(captured)
            if watch_other:
                tape.watch(other)
            loss = _forward(weights, captured + other)
        return tape.gradient(loss, [captured, other] + weights)

    for watch_other in (False, True):
        want, got, graph = _both(lambda: body(watch_other))
        assert (got[1] is None) == (not watch_other) == (want[1] is None)
        _close(got, want)
        assert _recomputes(graph) > 0


def test_py_function_eager_tapes_are_not_called_eager_steps(weights, x):
    """A tf.py_function in a traced step is differentiated by TensorFlow with an eager
    tape of its own: that is neither an EagerExecutionWarning nor a hint to use tf.function."""
    tape_lib._eager_warned.clear()

    def body(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights[:4]:
                h = tf.py_function(lambda a: a * 1.5, [tf.tanh(tf.matmul(h, w))], tf.float32)
                h.set_shape([512, 32])
            loss = _forward(weights[4:], h)
        return tape.gradient(loss, weights)

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want, got, _ = _both(body, x)
    _close(got, want)
    assert not [w for w in caught if issubclass(w.category, msg.EagerExecutionWarning)], [
        str(w.message) for w in caught]


def test_persistent_tape_two_gradients_and_output_gradients(weights, x):
    def body(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            h = _chain(weights, x)
            loss = tf.reduce_sum(h * h)
        first = tape.gradient(loss, weights[:4])
        second = tape.gradient(h, [x, weights[-1]], output_gradients=tf.ones_like(h) * 0.5)
        return first, second

    want, got, graph = _both(body, x)
    _close(got, want)
    assert _recomputes(graph) > 0


def test_unconnected_zero_stop_recording_and_unwatched(weights, x):
    other = tf.Variable(tf.ones([32, 32]), name="unused")

    def body(x):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(weights[2:])
            with tape.stop_recording():
                early = tf.tanh(tf.matmul(x, weights[0]))  # not recorded: a constant
            h = tf.tanh(tf.matmul(early, weights[1]))
            loss = _forward(weights[2:], h)
        return tape.gradient(loss, weights + [other, x], unconnected_gradients="zero")

    want, got, graph = _both(body, x)
    _close(got, want)
    # weights[0] (under stop_recording) and weights[1] (not watched) get zeros, as plain
    assert float(tf.reduce_max(tf.abs(got[0]))) == 0.0
    assert float(tf.reduce_max(tf.abs(got[1]))) == 0.0



@pytest.mark.parametrize("case", ["loss_after_the_block", "one_target_after_the_block",
                                  "watched_target", "target_before_reset"])
def test_targets_made_outside_the_tape_give_what_the_plain_tape_gives(weights, x, case):
    """The tape differentiates from a target only where it recorded the target's op or
    watched the target: a loss computed after the ``with`` block gives None (plain
    Keras then says "no gradients"), and so must ours, not tf.gradients' values."""

    def body(x):
        with tf.GradientTape(persistent=case == "target_before_reset") as tape:
            tape.watch(x)
            h = x
            for w in weights:
                h = tf.tanh(tf.matmul(h, w))
            inside = tf.reduce_sum(h * h)
            if case == "target_before_reset":
                tape.reset()
                inside_after_reset = inside * 2.0 + tf.reduce_sum(weights[-1])
        outside = tf.reduce_sum(h * h)
        if case == "loss_after_the_block":
            targets = outside
        elif case == "one_target_after_the_block":
            targets = [inside, tf.reduce_sum(weights[0])]  # the second: made after the block
        elif case == "watched_target":
            targets = [outside, x]  # x watched: its own gradient is ones, nothing else
        else:
            targets = [inside, inside_after_reset]
        return tape.gradient(targets, weights + [x])

    want, got, _ = _both(body, x)
    _close(got, want)
    if case == "loss_after_the_block":
        assert all(g is None for g in got)
    if case == "watched_target":
        assert all(g is None for g in got[:-1])
        np.testing.assert_array_equal(got[-1], np.ones_like(x))

def test_nested_tapes_gradient_penalty_and_hessian_vector_product(weights, x):
    def penalty(x):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                loss = _forward(weights[:6], x)
            dx = inner.gradient(loss, x)
            penalty = tf.reduce_mean(tf.square(dx)) + loss
        return outer.gradient(penalty, weights[:6])

    want, got, _ = _both(penalty, x)
    _close(got, want, rtol=2e-4)

    v = [tf.ones_like(w) * 0.01 for w in weights[:6]]

    def hvp(x):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                loss = _forward(weights[:6], x)
            grads = inner.gradient(loss, weights[:6])
            dot = tf.add_n([tf.reduce_sum(g * u) for g, u in zip(grads, v)])
        return outer.gradient(dot, weights[:6])

    want, got, _ = _both(hvp, x)
    _close(got, want, rtol=2e-4)


@pytest.mark.parametrize("outer", ["tape", "forward_accumulator"])
@pytest.mark.parametrize("inner", ["library_tape", "gradients"])
def test_second_derivatives_by_a_plain_outer_differentiator_are_right(weights, x, caplog,
                                                                       outer, inner):
    """A plain tf.GradientTape or ForwardAccumulator that differentiates the library's
    gradient (a Hessian-vector product) does not see the recomputed ops (they are made
    below the API that records). A tape is given the rewritten computation as one
    recorded operation, whose gradient goes through the copies: the inner gradient is
    rewritten. A forward accumulator gets plain tf.gradients, with a warning. Either
    way the second derivatives equal TensorFlow's; before, a plain outer tape over a
    library inner tape got them wrong by 2.0 (relative), a forward accumulator by 1.4."""
    ws = weights[:8]
    v = [tf.ones_like(w) * 0.01 for w in ws]

    def inner_gradients(x, library):
        if library and inner == "gradients":
            return msg.gradients(_forward(ws, x), ws, checkpoints="memory")
        tape_class = msg.GradientTape if library else tf.GradientTape
        with tape_class() as tape:
            loss = _forward(ws, x)
        return tape.gradient(loss, ws)

    def hvp(x, library):
        if outer == "tape":
            with tf.GradientTape() as tape:
                grads = inner_gradients(x, library)
                dot = tf.add_n([tf.reduce_sum(g * u) for g, u in zip(grads, v)])
            return tape.gradient(dot, ws)
        with tf.autodiff.ForwardAccumulator(ws, v) as accumulator:
            grads = inner_gradients(x, library)
        return [accumulator.jvp(g) for g in grads]

    want = tf.function(lambda x: hvp(x, False))(x)
    ours = tf.function(lambda x: hvp(x, True))
    with caplog.at_level("WARNING", logger="memory_saving_gradients"):
        graph = ours.get_concrete_function(x).graph
    got = ours(x)
    _close(got, want, rtol=2e-4)
    said = " ".join(r.getMessage() for r in caplog.records)
    if outer == "tape":
        assert _recomputes(graph) > 0 and "differentiates this" not in said, said
    else:
        assert _recomputes(graph) == 0 and "differentiates this gradient computation" in said, said


@pytest.mark.parametrize("tapes", ["plain_outer", "library_tapes", "patched"])
def test_a_hessian_by_an_outer_tape_s_jacobian_goes_through_the_recomputed_ops(weights, x, tapes):
    """``outer.jacobian(inner.gradient(loss, x), x)`` (and ``batch_jacobian``, and the
    outer tape's gradient of a penalty): TensorFlow computes jacobians from what the tape
    recorded, which did not include the rewrite's copies: a library outer tape (or any
    tape under patched()) gave None and zeros. The rewritten computation is recorded
    on the tape as one operation."""
    ws = weights[:8]
    rows = x[:64]

    def body(x, outer_class, inner_class):
        with outer_class(persistent=True) as outer:
            outer.watch(x)
            with inner_class() as inner:
                inner.watch(x)
                loss = _forward(ws, x)
            dx = inner.gradient(loss, x)
            top, penalty = dx[:2], tf.reduce_sum(dx * dx)
        return outer.batch_jacobian(dx, x), outer.jacobian(top, x), outer.gradient(penalty, ws)

    want = tf.function(lambda x: body(x, tf.GradientTape, tf.GradientTape))(rows)

    def library_tape(persistent=False):
        return msg.GradientTape(checkpoints="memory", persistent=persistent)

    outer_class = tf.GradientTape if tapes != "library_tapes" else library_tape
    inner_class = library_tape if tapes != "patched" else tf.GradientTape
    ours = tf.function(lambda x: body(x, outer_class, inner_class))
    if tapes == "patched":
        with msg.patched("memory"):
            graph = ours.get_concrete_function(rows).graph
    else:
        graph = ours.get_concrete_function(rows).graph
    assert _recomputes(graph) > 0
    got = ours(rows)
    assert all(g is not None for g in tf.nest.flatten(got))
    assert float(tf.reduce_max(tf.abs(want[0]))) > 0
    _close(got, want, rtol=2e-4)


@pytest.mark.parametrize("how", ["patched", "library_tape"])
def test_a_gradient_taken_inside_the_with_block_is_rewritten(weights, x, how):
    """``grads = tape.gradient(loss, ws)`` indented inside the ``with`` block of a
    non-persistent tape: the loss was made in the span still open, which did not count
    as recorded, so nothing was rewritten and the warning said the loss was computed
    after the block."""
    ws = weights[:8]

    def step(x, tape_class):
        with tape_class() as tape:
            loss = _forward(ws, x)
            grads = tape.gradient(loss, ws)
        return grads

    want = tf.function(lambda x: step(x, tf.GradientTape))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", msg.NothingRewrittenWarning)
        if how == "patched":
            with msg.patched("memory") as handle:
                got = tf.function(lambda x: step(x, tf.GradientTape))(x)
            plans = handle.plans
        else:
            tapes = []

            def library_tape():
                tapes.append(msg.GradientTape(checkpoints="memory"))
                return tapes[-1]

            got = tf.function(lambda x: step(x, library_tape))(x)
            plans = tapes[0].plans
    assert len(plans) == 1 and plans[0].checkpoints, plans
    _close(got, want)


def test_nested_library_tapes_both_rewrite_a_gradient_penalty(weights, x, caplog):
    """Two ``memory_saving_gradients.GradientTape`` s, the outer differentiating the inner's
    gradient (a gradient penalty): the outer one builds its gradient from the graph, so it
    sees the inner rewrite's copies, as tapes do under patched(). The inner fell back to
    plain tf.gradients with a warning that outer tapes are the library's under patched()."""
    ws = weights[:6]
    tapes = []

    def penalty(x, tape_class):
        with tape_class() as outer:
            with tape_class() as inner:
                inner.watch(x)
                loss = _forward(ws, x)
            dx = inner.gradient(loss, x)
            total = tf.reduce_mean(tf.square(dx)) + loss
        return outer.gradient(total, ws)

    def library_tape():
        tapes.append(msg.GradientTape(checkpoints="memory"))
        return tapes[-1]

    want = tf.function(lambda x: penalty(x, tf.GradientTape))(x)
    with caplog.at_level("WARNING", logger="memory_saving_gradients"):
        got = tf.function(lambda x: penalty(x, library_tape))(x)
    _close(got, want, rtol=2e-4)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "differentiates this gradient computation" not in said, said
    assert [len(t.plans) for t in tapes] == [1, 1], [t.plans for t in tapes]


@pytest.mark.parametrize("tapes", ["PLL", "PPL", "LPL", "LLP"])
def test_third_derivatives_through_any_mixture_of_tapes(weights, x, tapes):
    """Three nested tapes, plain (P) or the library's (L), outermost first: each takes the
    gradient of the squared gradient inside it. The recorded operation of a rewrite is
    differentiated by the tape outside it, whose result a third tape differentiates
    again: its gradient (built by tf.gradients through the copies) is recorded too, and
    the rewrites a library tape builds over an inner rewrite's copies read through them
    to what the tapes recorded (a helper's review: PLL and PPL were 10% and 120% off)."""
    ws = weights[:6]

    def library_tape(persistent=False):
        return msg.GradientTape(checkpoints="memory", persistent=persistent)

    def three(x, kinds):
        first, second, third = (tf.GradientTape if k == "P" else library_tape for k in kinds)
        with first(persistent=True) as t1:
            with second() as t2:
                with third() as t3:
                    loss = _forward(ws, x)
                g = t3.gradient(loss, ws[0])
                s = tf.reduce_sum(g * g)
            h = t2.gradient(s, ws[1])
            r = tf.reduce_sum(h * h)
        return t1.gradient(r, ws[2])

    want = tf.function(lambda x: three(x, "PPP"))(x)
    ours = tf.function(lambda x: three(x, tapes))
    assert _recomputes(ours.get_concrete_function(x).graph) > 0
    assert float(tf.reduce_max(tf.abs(want))) > 0
    _close(ours(x), want, rtol=2e-4)


@pytest.mark.parametrize("where", ["before_the_tape", "under_stop_recording"])
def test_a_forward_pass_the_outer_tape_did_not_record_stays_a_constant_to_it(weights, x, where):
    """A gradient ``g`` taken before an outer tape's ``with`` block (or under its
    ``stop_recording()``) is a constant to that tape; a later gradient inside the tape
    that reads it was rewritten and recorded as one operation whose gradient went through
    ``g``'s ops to x: off by 1.3 (relative) against TensorFlow (a helper's review)."""
    ws = weights[:8]
    keep = []

    def chain(x):
        h = x
        for i, w in enumerate(ws):
            h = tf.tanh(tf.matmul(h, w))
            if i % 3 == 1:
                keep.append(h)
        return h

    def step(x, gradients):
        def first():
            keep.clear()
            return gradients(tf.reduce_sum(chain(x) ** 2), x)

        g = first() if where == "before_the_tape" else None
        with tf.GradientTape() as outer:
            outer.watch(x)
            if g is None:
                with outer.stop_recording():
                    g = first()
            keep.clear()
            gz = gradients(tf.reduce_sum(g * chain(x) ** 2), x)
            total = tf.reduce_sum(gz ** 2)
        return outer.gradient(total, x)

    def plain(y, x):
        return tf.gradients(y, [x])[0]

    def ours(y, x):
        return msg.gradients(y, [x], checkpoints=list(keep))[0]

    want = tf.function(lambda x: step(x, plain))(x)
    mine = tf.function(lambda x: step(x, ours))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", msg.MemorySavingGradientsWarning)
        graph = mine.get_concrete_function(x).graph
    assert _recomputes(graph) > 0  # the first gradient is rewritten
    _close(mine(x), want, rtol=2e-4)


def test_ops_without_a_gradient_inside_the_outer_tape_do_not_stop_the_rewrite(weights, x):
    """A straight-through estimator (``h + tf.stop_gradient(tf.round(h) - h)``) inside
    an outer tape: ops without a gradient are never recorded by a tape, which made the
    inner gradient look like one over a forward pass the tape recorded only in part, and
    fall back to plain tf.gradients."""
    ws = weights[:10]

    def step(x, library):
        with tf.GradientTape() as outer:
            outer.watch(x)
            h = x
            for i, w in enumerate(ws):
                h = tf.tanh(tf.matmul(h, w))
                if i == 4:
                    h = h + tf.stop_gradient(tf.round(h) - h)
            loss = tf.reduce_sum(h * h)
            grads = (msg.gradients(loss, [x], checkpoints="memory") if library
                     else tf.gradients(loss, [x]))
            total = tf.reduce_sum(grads[0] * grads[0])
        return outer.gradient(total, x)

    want = tf.function(lambda x: step(x, False))(x)
    ours = tf.function(lambda x: step(x, True))
    assert _recomputes(ours.get_concrete_function(x).graph) > 0
    _close(ours(x), want, rtol=2e-4)


def test_jacobian_and_batch_jacobian_equal_the_plain_tape(weights):
    small = tf.random.stateless_normal([4, 32], seed=[1, 2])

    def jac(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, weights[0])), weights[1]))
            out = tf.reduce_sum(h, axis=1)
        return tape.jacobian(out, weights[0]), tape.batch_jacobian(h, x)

    want, got, _ = _both(jac, small)
    _close(got, want)


def test_a_step_of_jacobians_only_says_they_were_left_to_tensorflow(weights):
    """A patch under which only jacobians ran rewrote nothing because TensorFlow computes
    those (documented), not because the step was traced before the patch."""
    small = tf.random.stateless_normal([2, 32], seed=[3, 4])

    def jac(x):
        with tf.GradientTape() as tape:
            out = tf.reduce_sum(tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, weights[0])), weights[1])), 1)
        return tape.jacobian(out, weights[0])

    with pytest.warns(msg.NothingRewrittenWarning) as warned:
        with msg.patched("memory"):
            tf.function(jac)(small)
    said = " ".join(str(w.message) for w in warned if w.category is msg.NothingRewrittenWarning)
    assert "left to TensorFlow" in said and "jacobian" in said, said
    assert "traced before" not in said, said


def test_custom_gradient_recompute_grad_and_while_loop(weights, x):
    @tf.custom_gradient
    def clipped_tanh(h):
        y = tf.tanh(h)

        def grad(dy):
            return tf.clip_by_value(dy * (1 - y * y), -0.1, 0.1)

        return y, grad

    block = tf.recompute_grad(lambda h: tf.tanh(tf.matmul(tf.tanh(tf.matmul(h, weights[4])),
                                                          weights[5])))

    def body(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights[:4]:
                h = clipped_tanh(tf.matmul(h, w))
            h = block(h)
            h = tf.while_loop(lambda i, h: i < 3,
                              lambda i, h: (i + 1, tf.tanh(tf.matmul(h, weights[6]))),
                              (tf.constant(0), h))[1]
            loss = _forward(weights[7:], h)
        return tape.gradient(loss, weights)

    want, got, graph = _both(body, x)
    _close(got, want)
    assert _recomputes(graph) > 0


def test_a_model_of_recompute_grad_blocks_is_checkpointed_across_its_blocks(weights, x):
    """Blocks the user already wrapped in tf.recompute_grad hold their arguments for the
    backward pass (the block's gradient closure reads them).  A recomputed copy's closure
    reads the copies of the arguments (:func:`rewrite.closures_read_copies`), so 'memory'
    can checkpoint across blocks (the plan found by dropping cuts from the program's:
    ``strategies._Proposals.without_a_cut``): it rewrites, and the gradients equal the
    plain tape's.  (Before, 'memory' kept nothing and said the blocks were why.  The
    memory it saves: ``tests/test_core_memory.py``.)"""
    memo.forget()
    block = tf.recompute_grad(lambda h, w: tf.tanh(tf.matmul(tf.tanh(tf.matmul(h, w)), w)))

    def body(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights[:6]:
                h = block(h, w)
            loss = tf.reduce_sum(h * h)
        return tape.gradient(loss, weights[:6])

    want, got, graph = _both(body, x)
    _close(got, want)
    assert _recomputes(graph) > 0


def test_a_model_called_as_a_tf_function_is_kept_whole_and_its_python_function_is_not(
        weights, x):
    """A model whose call is itself a ``tf.function`` (a ``tf.Module``'s decorated
    ``__call__``, a loaded SavedModel) is one function-call op in the step: kept whole,
    nothing is recomputed, and the warning says so.  Calling its ``python_function``
    in the step puts its ops in the step's graph, where they are checkpointed."""
    model = tf.function(lambda h: _chain(weights, h))

    def called(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        return tape.gradient(loss, weights)

    with pytest.warns(msg.NothingKeptWarning, match="function calls") as warned:
        want, got, graph = _both(called, x)
    _close(got, want)
    assert _recomputes(graph) == 0, [str(w.message) for w in warned]

    def inlined(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model.python_function(x) ** 2)
        return tape.gradient(loss, weights)

    want, got, graph = _both(inlined, x)
    _close(got, want)
    assert _recomputes(graph) > 0


def test_each_backward_pass_of_one_graph_gets_its_own_info_line(weights, x, caplog):
    """Gradient accumulation over micro-batches builds one backward pass per tape in one
    graph: the INFO lines were identical, with nothing to tell them apart.  The second
    and later name their place in the graph."""
    import logging

    def accumulated(x):
        total = [tf.zeros_like(w) for w in weights]
        for part in tf.split(x, 2):
            with tf.GradientTape() as tape:
                loss = _forward(weights, part)
            total = [t + g for t, g in zip(total, tape.gradient(loss, weights))]
        return total

    with caplog.at_level(logging.INFO, logger="memory_saving_gradients"):
        want, got, graph = _both(accumulated, x)
    _close(got, want)
    lines = [r.getMessage() for r in caplog.records if "rewrote the gradients" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "backward pass" not in lines[0] and "(backward pass 2 in this graph)" in lines[1], lines


def test_a_warning_from_a_step_traced_on_a_thread_of_its_own_names_the_users_line():
    """A tf.distribute replica's function is traced on a thread of its own, where no
    frame of the user's calls the library: its warnings were reported at threading.py
    (one location for every call site, so Python's once-per-location filter hid all but
    one).  They name the user's line in the code autograph converted."""
    weight = tf.Variable(tf.ones([256, 256]) * 0.01)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.tanh(x @ weight) @ weight))
        return tape.gradient(loss, weight)

    lines, first = inspect.getsourcelines(step)
    expected = first + next(i for i, line in enumerate(lines) if "tape.gradient" in line)
    traced = tf.function(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with msg.patched("memory"):
            thread = threading.Thread(target=traced.get_concrete_function,
                                      args=(tf.TensorSpec([4, 256], tf.float32),))
            thread.start()
            thread.join()
    kept = [w for w in caught if w.category is msg.NothingKeptWarning]
    assert kept, [str(w.message) for w in caught]
    assert (kept[0].filename, kept[0].lineno) == (__file__, expected), (
        kept[0].filename, kept[0].lineno)


@pytest.mark.parametrize("how", ["tape", "tape in a function", "tf.gradients"])
def test_a_gradient_accumulation_loop_is_planned_once(weights, x, how):
    """A ``tf.range`` loop whose loss is first set in its body: autograph traces the body
    once in a throwaway graph ('tmp') to learn the loss's type, then again for real.
    The throwaway trace was planned and rewritten too, so ``plans`` held two plans (and
    the log two lines) for one gradient; it stays plain now.  A ``tf.function`` the body
    calls is traced once, during the throwaway trace, in a graph of its own: it is
    rewritten, and the real trace reuses it."""

    def tape_gradient(xb):
        with tf.GradientTape() as tape:
            loss = _forward(weights, xb)
        return loss, tape.gradient(loss, weights)

    def graph_gradient(xb):
        loss = _forward(weights, xb)
        return loss, tf.gradients(loss, weights)

    def accumulate(x):
        step = {"tape": tape_gradient, "tape in a function": helper,
                "tf.gradients": graph_gradient}[how]
        total = [tf.zeros_like(w) for w in weights]
        for i in tf.range(4):
            loss, grads = step(x[i * 128:(i + 1) * 128])
            total = [a + g for a, g in zip(total, grads)]
        return loss, total

    helper = tf.function(tape_gradient)
    want = tf.function(accumulate)(x)
    helper = tf.function(tape_gradient)
    with msg.patched("memory") as handle:
        ours = tf.function(accumulate)
        got = ours(x)
    _close(got, want)
    assert len(handle.plans) == 1, handle.plans
    graph = ours.get_concrete_function(x).graph
    recomputes = sum("recompute" in node.name for function in graph.as_graph_def().library.function
                     for node in function.node_def)
    assert recomputes > 0  # the loop's own body (or the function it calls) is rewritten


@pytest.mark.filterwarnings("ignore::memory_saving_gradients.NothingRewrittenWarning")
@pytest.mark.parametrize("where", ["loop body", "cond branch", "cond in a loop body", "unread"])
def test_a_source_from_the_enclosing_function_is_differentiated(weights, x, where):
    """A tape in a loop body or a ``cond`` branch, watching a tensor of the function
    around it: the inner graph reads it through a placeholder it captured (a cond branch
    in a loop body captures the function's tensor itself), and the plain tape
    differentiates to it through that capture. The patch raised "belongs to another
    graph"; now it differentiates to the placeholder, or, where the inner graph never
    reads the tensor, leaves the gradient to the tape (which gives zeros here)."""

    def watched_gradient(xb, scale):
        with tf.GradientTape() as tape:
            tape.watch(xb)
            read = xb if where != "unread" else tf.ones_like(xb)
            loss = _forward(weights, read * scale)
        return tape.gradient(loss, xb, unconnected_gradients="zero")

    def body(xb):
        total = tf.zeros_like(xb)
        if where == "cond branch":
            if tf.reduce_sum(xb) > -1e9:
                total = watched_gradient(xb, 1.0)
            return total
        for i in tf.range(2):
            scale = tf.cast(i + 1, tf.float32)
            if where == "cond in a loop body":
                if i >= 0:
                    g = watched_gradient(xb, scale)
                else:
                    g = tf.zeros_like(xb)
            else:
                g = watched_gradient(xb, scale)
            total += g
        return total

    want = tf.function(body)(x)
    with msg.patched("memory") as handle:
        got = tf.function(body)(x)
    _close(got, want)
    assert len(handle.plans) == (0 if where == "unread" else 1), handle.plans


def test_eager_tapes_stay_plain_and_warn_once(weights, x):
    tape_lib._eager_warned.clear()
    with tf.GradientTape() as tape:
        want = tape.gradient(_forward(weights, x), weights)
    with pytest.warns(msg.EagerExecutionWarning) as caught:
        with msg.patched("memory"):
            for _ in range(2):
                with tf.GradientTape() as tape:
                    got = tape.gradient(_forward(weights, x), weights)
    _close(got, want)
    eager = [w for w in caught if w.category is msg.EagerExecutionWarning]
    assert len(eager) == 2  # the tape's, once per process, and the patch's at exit
    assert "ran eagerly" in str(eager[-1].message)


def test_undo_restores_the_tape_methods_in_any_order():
    originals = {name: backprop.GradientTape.__dict__[name] for name in tape_lib.ORIGINAL}
    first = msg.patch("memory")
    second = msg.patch("speed")
    assert tape_hooks.current().checkpoints == "speed"
    assert backprop.GradientTape.__dict__["gradient"] is not originals["gradient"]
    second.undo()
    assert tape_hooks.current().checkpoints == "memory"
    third = msg.patch("memory", tape=False)
    first.undo()  # the tape-less patch does not keep the hooks
    assert tape_hooks.current() is None and not tape_hooks.is_installed()
    third.undo()
    for name, method in originals.items():
        assert backprop.GradientTape.__dict__[name] is method, name


def test_patch_replaces_every_gradients_name_of_tensorflow():
    def tensorflow_functions():
        return sorted(
            name for name, module in sys.modules.items()
            if name.startswith("tensorflow") and module is not None
            and module is not gradients_impl
            and module.__dict__.get("gradients") in (gradients_impl.gradients,
                                                     gradients_impl.gradients_v2)
        )

    before = tensorflow_functions()
    # tf_keras' legacy optimizers call tensorflow.compat.v2.compat.v1.gradients
    assert "tensorflow._api.v2.compat.v2.compat.v1" in before, before
    with msg.patched("memory") as handle:
        assert tensorflow_functions() == []
        assert tf.compat.v2.compat.v1.gradients is handle.replacements["v1"]
        assert tf.compat.v1.compat.v2.gradients is handle.replacements["v2"]
        assert len(handle.slots) >= 8, handle.slots
    assert tensorflow_functions() == before
    assert gradients_impl.gradients is tf.compat.v1.gradients


def test_identical_retraces_are_planned_once(weights, x, monkeypatch):
    memo.forget()
    calls = []
    real = strategies._STRATEGIES["memory"]

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setitem(strategies._STRATEGIES, "memory", counting)

    def body(x):
        with tf.GradientTape() as tape:
            loss = _forward(weights, x)
        return tape.gradient(loss, weights)

    with msg.patched("memory"):
        graphs = [tf.function(body).get_concrete_function(x).graph for _ in range(3)]
        other = tf.function(body).get_concrete_function(x[:256]).graph  # other shapes
    assert all(_recomputes(g) > 0 for g in graphs + [other])
    assert len(calls) == 2, "an identical retrace was planned again"


@pytest.mark.slow
@pytest.mark.memory
def test_tape_step_in_tf_function_lowers_the_measured_peak(graph, measure_peak):
    """A training step with a plain tf.GradientTape, patched: its peak drops.

    24 tanh layers, batch 1024, width 256 (1 MiB per activation); the
    tf.function is called in a v1 graph so that its nodes show in the step stats.
    """
    rng = np.random.default_rng(0)
    ws = [tf.Variable((rng.standard_normal((256, 256)) / 16.0).astype(np.float32))
          for _ in range(24)]
    x = tf.compat.v1.placeholder(tf.float32, [None, 256])  # batch unknown, as tf.data
    feed = {x: rng.standard_normal((1024, 256)).astype(np.float32)}

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h * h)
        for w, g in zip(ws, tape.gradient(loss, ws)):
            w.assign_sub(0.01 * g)
        return loss

    plain, _ = measure_peak(tf.function(step)(x), feed)
    with msg.patched("memory", batch_size=1024):
        ours_loss = tf.function(step)(x)
    ours, _ = measure_peak(ours_loss, feed)
    print(f"patched tape step peak: plain {plain / 2**20:.1f} MiB, ours {ours / 2**20:.1f} MiB")
    assert ours < 0.6 * plain, (ours, plain)


def test_a_target_no_recorded_op_made_gets_the_tapes_own_gradient(weights, x):
    """A target made after the tape's with block gives what tf.GradientTape gives (None for
    the variables, the watched tensor's own gradient where the target is watched), and the
    patch names why it left that gradient to TensorFlow."""

    def body(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            loss = _forward(weights, x)
        late = loss * 2.0  # made after the with block: no recorded op made it
        return tape.gradient([loss, late], weights + [x])

    import warnings

    plain = tf.function(body)(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with msg.patched("memory") as handle:
            got = tf.function(body)(x)
    _close(got, plain)
    assert not handle.plans
    said = [str(w.message) for w in caught if issubclass(w.category, msg.NothingRewrittenWarning)]
    assert said and "no op recorded by the tape made" in said[0], said


@pytest.mark.parametrize("use_pfor", [True, False])
def test_a_persistent_tapes_gradient_after_its_jacobian_is_rewritten(weights, x, use_pfor):
    """``jacobian`` stays TensorFlow's; without pfor it records in a loop body's graph of
    its own. The same persistent tape's next gradient() is still the library's, on what
    the tape recorded in the step's graph, with the tape's values."""

    def body(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            h = _chain(weights, x)
            loss = tf.reduce_sum(h * h)
            small = tf.reduce_sum(h[:2, :3], axis=0)
        jacobian = tape.jacobian(small, weights[-1], experimental_use_pfor=use_pfor)
        return [jacobian] + tape.gradient(loss, weights)

    want, got, graph = _both(body, x)
    _close(got, want)
    assert _recomputes(graph) > 0


def test_a_gradient_to_sources_the_tape_never_saw_says_so(weights, x):
    """Sources the tape neither watched nor recorded (here tensors read from the weights
    before the tape began) get None, as from the tape; the warning says that is why
    nothing was rewritten, not that the step was traced before the patch."""
    import warnings

    values = [tf.convert_to_tensor(w) for w in weights]

    def body(x):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            loss = _forward(values, x)
        return tape.gradient(loss, values)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with msg.patched("memory") as handle:
            got = tf.function(body)(x)
    assert all(g is None for g in got)
    assert not handle.plans
    said = [str(w.message) for w in caught if issubclass(w.category, msg.NothingRewrittenWarning)]
    assert said and "no source the tape watched or recorded" in said[0], said


def test_no_sources_give_the_tapes_answer_and_say_why(weights, x):
    """A tape gradient to no sources (a model without trainable weights) gives the tape's
    own answer, and the warning says there were none, not that the tape did not watch
    them."""
    import warnings

    def body(x):
        with tf.GradientTape() as tape:
            loss = _forward(weights, x)
        return tape.gradient(loss, [])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with msg.patched("memory"):
            got = tf.function(body)(x)
    assert got == []
    said = [str(w.message) for w in caught if issubclass(w.category, msg.NothingRewrittenWarning)]
    assert said and "no sources (an empty list" in said[0], said


def test_wrong_output_gradients_are_named_in_the_tapes_words():
    """A tape's output_gradients of the wrong shape: the error names output_gradients and
    the target (it named grad_ys and ys, words the tape's user never wrote)."""
    w = tf.Variable(tf.ones([16, 16]) * 0.1)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.tanh(x @ w) @ w))
        return tape.gradient(loss, [w], output_gradients=tf.ones([3]))

    with msg.patched("memory"):
        with pytest.raises(ValueError, match=r"output_gradients\[0\] has shape \(3,\), but "
                                             r"target\[0\] .* has shape \(\)"):
            step(tf.ones([8, 16]))
