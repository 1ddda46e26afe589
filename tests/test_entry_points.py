"""The one-line entry points: mistakes raise at the call, failures leave nothing
behind, and each entry point says what it rewrote and what it did not.

Models are tiny (a few dense tanh layers, batch 16): these tests check
behaviour, not memory.
"""

from __future__ import annotations

import logging
import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gradients_impl

import memory_saving_gradients as msg
from memory_saving_gradients import (
    memo,
    patching,
    rewrite,
    tape_hooks,
)
from memory_saving_gradients import tape as tape_lib

pytestmark = pytest.mark.keras

LOGGER = "memory_saving_gradients"
WIDTH, DEPTH, BATCH = 64, 8, 256


def _data(n=2 * BATCH):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, WIDTH)).astype("float32"),
            rng.standard_normal((n, 1)).astype("float32"))


def _keras3_model(name="tiny_keras3", **compile_args):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((WIDTH,))]
        + [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)]
        + [keras.layers.Dense(1)],
        name=name,
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", **compile_args)
    return model


def _tf_keras_model(name="tiny_tf_keras"):
    tf_keras = pytest.importorskip("tf_keras")
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential(
        [tf_keras.Input((WIDTH,))]
        + [tf_keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)]
        + [tf_keras.layers.Dense(1)],
        name=name,
    )
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _fit(model):
    x, y = _data()
    return model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)


def _nothing_patched():
    return (not patching.is_patched() and not tape_hooks.is_installed()
            and tf.gradients is gradients_impl.gradients_v2
            and tf.compat.v1.gradients is gradients_impl.gradients)


# -- 1. mistakes raise at the call ---------------------------------------------------

MISTAKES = [
    (dict(checkpoints="memroy"), ValueError, "Unknown checkpoint strategy 'memroy'"),
    (dict(checkpoints="memory", memory_budgt=2**20), TypeError,
     "unexpected keyword argument 'memory_budgt'"),
    (dict(checkpoints="memory", memory_budget=-1), ValueError, "memory_budget must be a positive"),
    (dict(checkpoints="speed", memory_budget=2**20), ValueError, "memory_budget is used with"),
    (dict(checkpoints="memory", batch_size=0), ValueError, "batch_size must be a positive integer"),
    (dict(checkpoints="memory", memory_budget=float("inf")), ValueError,
     "memory_budget must be a positive, finite"),
    (dict(checkpoints="memory", memory_budget="50MB"), TypeError, "memory_budget must be a positive"),
    (dict(checkpoints="memory", batch_size="8"), TypeError, "batch_size must be a positive integer"),
]


def _gradients_error(arguments):
    """What gradients() raises for these arguments, in a graph."""
    arguments = dict(arguments)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4])
        loss = tf.reduce_sum(tf.tanh(tf.tanh(x)))
        with pytest.raises(Exception) as raised:
            msg.gradients(loss, [x], **arguments)
    return raised.value


ENTRY_POINTS = {
    "patch": lambda a: msg.patch(**a),
    "patched": lambda a: msg.patched(**a),  # raises when called, not when entered
    "GradientTape": lambda a: msg.GradientTape(**a),
    "keras.enable": lambda a: msg.keras.enable(_keras3_model(), **a),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("arguments, error, text", MISTAKES, ids=[m[2][:24] for m in MISTAKES])
def test_a_mistake_raises_at_the_call_with_the_message_of_gradients(entry, arguments, error, text):
    expected = _gradients_error(arguments)
    assert isinstance(expected, error) and text in str(expected)
    with pytest.raises(error) as raised:
        ENTRY_POINTS[entry](arguments)
    assert str(expected) in str(raised.value) or str(raised.value) in str(expected), (
        str(raised.value), str(expected))
    assert _nothing_patched()


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("checkpoints", [None, 3])
def test_checkpoints_neither_a_name_nor_tensors_is_a_type_error_that_says_so(entry, checkpoints):
    """... and names what it got (keras.enable said only why tensors cannot be named)."""
    with pytest.raises(TypeError, match="takes a strategy name|must be a strategy name") as raised:
        ENTRY_POINTS[entry](dict(checkpoints=checkpoints))
    assert f"got {type(checkpoints).__name__}" in str(raised.value), raised.value
    assert _nothing_patched()


def test_keras_enable_that_raises_leaves_the_model_as_it_was():
    model = _keras3_model()
    with pytest.raises(ValueError, match="memroy"):
        msg.keras.enable(model, checkpoints="memroy")
    assert not msg.keras.is_enabled(model) and "train_step" not in model.__dict__


def test_options_the_entry_point_passes_itself_are_refused_at_the_call():
    with pytest.raises(TypeError, match="stop_gradients= is not an option here"):
        msg.patch("memory", stop_gradients=[])
    with pytest.raises(TypeError, match="unconnected_gradients= is not an option"):
        msg.GradientTape(unconnected_gradients="zero")
    assert _nothing_patched()


def test_numpy_xs_is_a_short_type_error_that_says_what_to_pass():
    with tf.Graph().as_default():
        loss = tf.reduce_sum(tf.tanh(tf.ones([3, 3])))
        with pytest.raises(TypeError) as raised:
            msg.gradients(loss, np.ones((30, 40)))
    text = str(raised.value)
    assert "\n" not in text and len(text) < 300, text
    assert "numpy.ndarray of shape (30, 40)" in text and "tf.Variable" in text


# -- 2. a failed trace leaves nothing behind ------------------------------------------

def _impossible_budget(monkeypatch):
    return dict(memory_budget=1)


def _internal_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("forced internal error")

    monkeypatch.setattr(rewrite, "copy_ops", broken)
    return {}


def _tensorflow_error(monkeypatch):
    """TensorFlow itself raises on the graph the library builds."""
    original = rewrite.copy_ops

    def copies_then_bad_reshape(*args, **kwargs):
        copies = original(*args, **kwargs)
        tensor = next(iter(copies.values()))
        tf.reshape(tensor, [tensor.shape.num_elements() + 1])  # TF's shape check raises
        return copies

    monkeypatch.setattr(rewrite, "copy_ops", copies_then_bad_reshape)
    return {}


FAILURES = {"impossible budget": _impossible_budget, "internal error": _internal_error,
            "tensorflow error": _tensorflow_error}


@pytest.mark.slow
@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("entry", ["patched", "keras.enable"])
def test_a_failed_trace_in_keras_3_fit_leaves_a_model_that_fits_plainly(entry, failure,
                                                                        monkeypatch):
    memo.forget()
    model = _keras3_model()
    with monkeypatch.context() as patch_context:
        options = FAILURES[failure](patch_context)
        with pytest.raises(Exception) as raised:
            if entry == "patched":
                with msg.patched("memory", **options):
                    _fit(model)
            else:
                msg.keras.enable(model, "memory", **options)
                try:
                    _fit(model)
                finally:
                    msg.keras.disable(model)
    assert "non-first call" not in str(raised.value)
    assert _nothing_patched()
    history = _fit(model)  # plain, no compile() in between
    assert np.isfinite(history.history["loss"][-1])


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["impossible budget", "internal error"])
def test_a_failed_trace_in_tf_keras_fit_leaves_a_model_that_fits_plainly(failure, monkeypatch):
    memo.forget()
    model = _tf_keras_model()
    with monkeypatch.context() as patch_context:
        options = FAILURES[failure](patch_context)
        with pytest.raises(Exception):  # noqa: B017  (each injected failure raises its own type)
            with msg.patched("memory", **options):
                _fit(model)
    history = _fit(model)
    assert np.isfinite(history.history["loss"][-1])


@pytest.mark.slow
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_first_trace_of_a_custom_step_can_be_traced_again(failure, monkeypatch):
    """The same tf.function, which creates a variable on its first call (after the
    gradient, as an optimizer's slots are), runs after the failure."""
    memo.forget()
    model = _keras3_model()
    optimizer = keras.optimizers.SGD(0.01)
    x, y = _data(BATCH)
    steps = []

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        if not steps:
            steps.append(tf.Variable(0))  # allowed on a tf.function's first trace only
        steps[0].assign_add(1)
        return loss

    with monkeypatch.context() as patch_context:
        options = FAILURES[failure](patch_context)
        with pytest.raises(Exception):  # noqa: B017  (each injected failure raises its own type)
            with msg.patched("memory", **options):
                step(x, y)
    assert np.isfinite(step(x, y).numpy())
    assert optimizer.iterations.numpy() == 1 and steps[0].numpy() == 1


def test_a_failed_patched_step_raises_without_saying_it_rewrote_nothing():
    """The error is what happened: no NothingRewrittenWarning claims plain gradients
    were used beside it."""
    model = _keras3_model()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return tape.gradient(loss, model.trainable_variables)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="cannot be met"):
            with msg.patched("memory", memory_budget=1) as handle:
                step(*_data(BATCH))
    assert not [w for w in caught if issubclass(w.category, msg.NothingRewrittenWarning)], \
        [str(w.message) for w in caught]
    assert not handle.active  # the patch is undone all the same


def test_a_gradient_that_raised_inside_the_block_is_named_as_such():
    """A gradient that raised (the error caught inside the block) is not reported as one
    that "kept no checkpoint and used plain tf.gradients", nor as a step "traced before"
    the patch: the warning says it raised."""
    w = tf.Variable(tf.ones([16, 16]) * 0.05)

    @tf.function
    def bad_grad_ys(x):
        return tf.gradients(tf.reduce_sum(tf.tanh(tf.tanh(x @ w) @ w)), [w],
                            grad_ys=[tf.ones([3])])

    @tf.function
    def none_target(x):
        with tf.GradientTape() as tape:
            tf.tanh(x @ w)
        return tape.gradient(None, w)

    for step, error in ((bad_grad_ys, ValueError), (none_target, TypeError)):
        with pytest.warns(msg.NothingRewrittenWarning) as caught:
            with msg.patched("memory"):
                with pytest.raises(error):
                    step(tf.ones([8, 16]))
        text = " ".join(str(w.message) for w in caught
                        if issubclass(w.category, msg.NothingRewrittenWarning))
        assert f"raised (1x {error.__name__})" in text, text
        assert "used plain" not in text and "traced before" not in text, text


# -- 3. it says what it did -----------------------------------------------------------

def _rewrite_lines(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.INFO and "rewrote the gradients" in
            r.getMessage()]


def _tape_gradients(model, x, y):
    """The gradients of the model's mean squared error, by a tape (trace it in a step)."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    return tape.gradient(loss, model.trainable_variables)


def _assert_reported(handle, lines, where):
    assert handle.plans, "no plan recorded"
    assert len(lines) == len(handle.plans), lines
    plan = handle.plans[0]
    assert isinstance(plan, msg.Plan) and plan.checkpoints and plan.strategy == "memory"
    assert "checkpoints='memory', " in lines[0], lines[0]
    assert plan.predicted_peak_bytes < plan.baseline_peak_bytes
    assert where in lines[0], lines[0]
    assert f"{len(plan.checkpoints)} checkpoints ({plan.checkpoint_bytes / 2**20:.2f} MB)" \
        in lines[0], lines[0]
    assert 0 < plan.checkpoint_bytes < plan.predicted_peak_bytes
    assert f"{plan.predicted_peak_bytes / 2**20:.2f} MB vs {plan.baseline_peak_bytes / 2**20:.2f}"\
        in lines[0]
    assert ("unknown size" in lines[0]) == (plan.batch is not None and not plan.batch_stated), \
        lines[0]


def test_the_info_line_of_an_unknown_batch_says_at_which_batch_its_figures_are(caplog):
    """Its figures are at the batch the plan counts (32 unless batch_size= says), and
    the ratio in a step at the batches the planner judges follows."""
    model = _keras3_model()

    @tf.function(input_signature=[tf.TensorSpec([None, WIDTH]), tf.TensorSpec([None, 1])])
    def step(x, y):
        return _tape_gradients(model, x, y)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        with msg.patched("memory") as handle:
            step.get_concrete_function()
    (line,) = _rewrite_lines(caplog)
    (plan,) = handle.plans
    assert plan.batch is not None, str(plan)
    assert f"at an unknown size counted as {plan.batch} " in line, line
    for b, ratio in plan.ratios_by_batch(in_step=True):
        assert f"{b}: {ratio:.2f}x" in line, line
    assert ratio < 1.0, line  # the largest batch: activations dominate, the plan saves
    # a stated batch is the batch the figures are at (the line said "an unknown size
    # counted as" it, with the ratios at the batches the planner judges for no batch)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with msg.patched("memory", batch_size=64) as handle:
            tf.function(step.python_function, input_signature=step.input_signature
                        ).get_concrete_function()
    (line,) = _rewrite_lines(caplog)
    assert handle.plans[0].batch_stated and "at batch_size=64, as passed" in line, line
    assert "unknown size" not in line, line


@pytest.mark.slow
def test_patched_keras_3_fit_logs_one_info_line_and_keeps_the_plan(caplog):
    model = _keras3_model(name="reported_keras3")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with msg.patched("memory") as handle:
            _fit(model)
    _assert_reported(handle, _rewrite_lines(caplog), "Keras model 'reported_keras3'")


@pytest.mark.slow
def test_patched_tf_keras_fit_logs_one_info_line_and_keeps_the_plan(caplog):
    model = _tf_keras_model(name="reported_tf_keras")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with msg.patched("memory") as handle:
            _fit(model)
    _assert_reported(handle, _rewrite_lines(caplog), "Keras model 'reported_tf_keras'")


def test_the_info_line_of_a_checkpoint_list_says_a_list(caplog):
    """Checkpoints given as a list read "checkpoints=a list": the line said
    checkpoints='list', like a strategy of that name (a helper's trial)."""
    ws = [tf.Variable(tf.random.normal([WIDTH, WIDTH], stddev=0.1)) for _ in range(6)]

    @tf.function
    def listed(x):
        h, hs = x, []
        for w in ws:
            h = tf.tanh(h @ w)
            hs.append(h)
        return msg.gradients(tf.reduce_sum(h * h), ws, checkpoints=hs[1::2][:2])

    with caplog.at_level(logging.INFO, logger=LOGGER):
        listed.get_concrete_function(tf.TensorSpec([BATCH, WIDTH]))
    (line,) = _rewrite_lines(caplog)
    assert "checkpoints=a list, 2 checkpoints (" in line, line
    assert "'list'" not in line, line


def test_patched_custom_loop_logs_one_info_line_and_keeps_the_plan(caplog):
    model = _keras3_model()
    x, y = _data(BATCH)

    @tf.function
    def custom_step(x, y):
        return _tape_gradients(model, x, y)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        with msg.patched("memory") as handle:
            custom_step(x, y)
            custom_step(x, y)  # no retrace: still one rewrite
    _assert_reported(handle, _rewrite_lines(caplog), "custom_step")


def test_a_function_traced_again_says_so_and_two_gradients_in_one_trace_do_not(caplog):
    """TensorFlow may trace a step twice (tf_keras' fit does): the repeat is named."""
    model = _keras3_model()

    @tf.function
    def two_gradients(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
            doubled = 2.0 * loss  # recorded: a target made after the block gives None
        first = tape.gradient(loss, model.trainable_variables)
        return first, tape.gradient(doubled, model.trainable_variables)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        with msg.patched("memory") as handle:
            two_gradients(*_data(BATCH))
            two_gradients(*_data(BATCH + 1))  # a new shape: TensorFlow traces again
    lines = _rewrite_lines(caplog)
    assert len(lines) == len(handle.plans) == 4, lines
    assert not any("traced again" in line for line in lines[:2]), lines
    assert all("(trace 2 under this name: traced again by TensorFlow, or another function "
               "of the same name)" in line for line in lines[2:]), lines


def test_two_functions_of_one_name_are_not_said_to_be_retraced(caplog):
    """Two tf.functions both named ``step``, each traced once: the second line said
    "traced again by TensorFlow" (a helper's trial).  A graph does not say which Python
    function it traces, so the line says both possibilities."""
    model = _keras3_model()

    def make():
        @tf.function
        def step(x, y):
            return _tape_gradients(model, x, y)
        return step

    first, second = make(), make()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with msg.patched("memory"):
            first(*_data(BATCH))
            second(*_data(BATCH))
    lines = _rewrite_lines(caplog)
    assert len(lines) == 2, lines
    assert first.experimental_get_tracing_count() == second.experimental_get_tracing_count() == 1
    assert not any("traced again by TensorFlow:" in line for line in lines), lines
    assert "or another function of the same name" in lines[1], lines


def test_a_gradient_in_a_dataset_loop_names_the_step_it_is_in(caplog):
    model = _keras3_model()
    dataset = tf.data.Dataset.from_tensor_slices(_data(2 * BATCH)).batch(BATCH)

    @tf.function
    def epoch(dataset):
        total = tf.constant(0.0)
        for x, y in dataset:  # autograph makes this a dataset scan with its own body
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            total += tf.add_n([tf.reduce_sum(g) for g in grads])
        return total

    with caplog.at_level(logging.INFO, logger=LOGGER):
        with msg.patched("memory"):
            epoch(dataset)
    (line,) = _rewrite_lines(caplog)
    assert "in function 'epoch'" in line, line


def test_gradient_tape_keeps_the_plans_of_what_it_rewrote():
    weights = [tf.Variable(tf.random.normal([WIDTH, WIDTH], seed=i) * 0.1) for i in range(DEPTH)]
    kept = []

    @tf.function
    def step(x):
        with msg.GradientTape(checkpoints="memory") as tape:
            h = x
            for w in weights:
                h = tf.tanh(h @ w)
            loss = tf.reduce_sum(h)
        kept.append(tape)
        return tape.gradient(loss, weights)

    step(tf.ones([BATCH, WIDTH]))
    (plan,) = kept[0].plans
    assert plan.checkpoints and plan.predicted_peak_bytes < plan.baseline_peak_bytes


@pytest.mark.slow
def test_keras_enable_keeps_the_plans_and_names_the_model(caplog):
    model = msg.keras.enable(_keras3_model(name="enabled_model"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _fit(model)
    plans = msg.keras.plans(model)  # Keras 3 may trace its step more than once
    assert plans and all(p.checkpoints for p in plans)
    assert len(_rewrite_lines(caplog)) == len(plans)
    assert "Keras model 'enabled_model'" in _rewrite_lines(caplog)[0]


def test_a_retrace_reuses_the_remembered_plan_and_predicts_nothing_again(monkeypatch):
    memo.forget()
    weights = [tf.Variable(tf.random.normal([WIDTH, WIDTH], seed=i)) for i in range(DEPTH)]

    def body(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights:
                h = tf.tanh(h @ w)
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, weights)

    spec = [tf.TensorSpec([BATCH, WIDTH], tf.float32)]
    with msg.patched("memory") as first:
        tf.function(body, input_signature=spec).get_concrete_function()
    from memory_saving_gradients import planning

    def no_prediction(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(planning, "make_plan", no_prediction)
    with msg.patched("memory") as second:
        tf.function(body, input_signature=spec).get_concrete_function()
    assert len(second.plans) == 1
    assert second.plans[0].predicted_peak_bytes == first.plans[0].predicted_peak_bytes
    assert [t.name for t in second.plans[0].checkpoints] == [
        t.name for t in first.plans[0].checkpoints]


# -- 4. it says what it did not do ------------------------------------------------------

def test_a_patch_around_a_step_traced_before_warns_with_the_cause():
    weights = tf.Variable(tf.ones([WIDTH, WIDTH]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.tanh(x @ weights) @ weights))
        return tape.gradient(loss, weights)

    x = tf.ones([BATCH, WIDTH])
    step(x)  # traced before the patch
    with pytest.warns(msg.NothingRewrittenWarning, match="traced before") as caught:
        with msg.patched("memory") as handle:
            step(x)
    assert handle.plans == []
    assert len([w for w in caught if issubclass(w.category, msg.NothingRewrittenWarning)]) == 1


def test_a_patch_around_functions_without_gradients_says_they_compute_none():
    """``patched()`` around a Keras model's predict and evaluate only: the functions it
    ran were traced in the block but compute no gradient. The warning said the step was
    most likely traced before the patch (a helper's trial)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile("sgd", "mse")
    x = np.ones((16, 8), "float32")
    with pytest.warns(msg.NothingRewrittenWarning) as caught:
        with msg.patched("memory"):
            model.predict(x, verbose=0)
            model.evaluate(x, np.zeros((16, 4), "float32"), verbose=0)
    said = " ".join(str(w.message) for w in caught if w.category is msg.NothingRewrittenWarning)
    assert "compute no gradient" in said and "traced before" not in said, said


def _tanh_step(weights):
    @tf.function
    def tanh_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.tanh(tf.tanh(x @ weights) @ weights) @ weights))
        return tape.gradient(loss, weights)

    return tanh_step


def test_a_patch_around_a_step_traced_before_names_the_function_it_ran():
    step = _tanh_step(tf.Variable(tf.ones([WIDTH, WIDTH]) * 0.01))
    x = tf.ones([BATCH, WIDTH])
    step(x)
    with pytest.warns(msg.NothingRewrittenWarning, match="it ran 'tanh_step', whose gradients no patch planned"):
        with msg.patched("memory"):
            step(x)


def test_a_step_checkpointed_under_an_earlier_patch_runs_in_the_next_without_a_warning(caplog):
    """A loop that wraps each call of its step in ``patched()``: the first block traces
    and rewrites it, the later ones run that graph; they must not say "traced before"."""
    step = _tanh_step(tf.Variable(tf.ones([WIDTH, WIDTH]) * 0.01))
    x = tf.ones([BATCH, WIDTH])
    with msg.patched("memory") as first:
        want = step(x)
    assert first.plans
    with warnings.catch_warnings():
        warnings.simplefilter("error", msg.MemorySavingGradientsWarning)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            for _ in range(2):
                with msg.patched("memory") as later:
                    got = step(x)
    assert later.plans == []
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    ran = [r.getMessage() for r in caplog.records if "built no gradient itself" in r.getMessage()]
    assert len(ran) == 2 and "'tanh_step'" in ran[0] and "earlier patch" in ran[0], ran


@pytest.mark.slow
def test_keras_3_fit_again_under_a_new_patch_does_not_warn():
    model = _keras3_model(name="fitted_under_a_patch")
    with msg.patched("memory") as first:
        _fit(model)
    assert first.plans
    with warnings.catch_warnings():
        warnings.simplefilter("error", msg.MemorySavingGradientsWarning)
        with msg.patched("memory"):
            _fit(model)
    other = _keras3_model(name="fitted_plainly")
    _fit(other)
    with pytest.warns(msg.NothingRewrittenWarning) as caught:
        with msg.patched("memory"):
            _fit(other)
    text = str(caught[0].message)
    assert "'fitted_plainly'" in text and "'fitted_under_a_patch'" not in text, text


@pytest.mark.slow
def test_a_patch_after_keras_fit_warns_naming_the_model_and_keras_enable_retraces():
    model = _keras3_model(name="fitted_before")
    _fit(model)  # its train_function exists now
    with pytest.warns(msg.NothingRewrittenWarning, match="compile.*'fitted_before'"):
        with msg.patched("memory") as handle:
            _fit(model)
    assert handle.plans == []
    msg.keras.enable(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", msg.MemorySavingGradientsWarning)
        _fit(model)
    assert msg.keras.plans(model)


@pytest.mark.slow
@pytest.mark.parametrize("make_model", [_keras3_model, _tf_keras_model])
def test_a_late_patch_names_only_the_models_it_trained(make_model):
    """Of the Keras models whose train_function was built before the patch, the warning
    names those that ran in the block (their variables were captured by a step that
    ran), not every one alive."""
    trained = make_model(name="trained_in_block")
    idle = make_model(name="idle_in_block")
    _fit(trained)
    _fit(idle)
    with pytest.warns(msg.NothingRewrittenWarning, match="built before") as caught:
        with msg.patched("memory"):
            _fit(trained)
    text = str(caught[0].message)
    assert "'trained_in_block'" in text and "'idle_in_block'" not in text, text
    with pytest.warns(msg.NothingRewrittenWarning) as caught:
        with msg.patched("memory"):
            pass  # nothing ran: no model is named
    assert "in_block'" not in str(caught[0].message), str(caught[0].message)


@pytest.mark.slow
def test_run_eagerly_warns_naming_run_eagerly():
    model = msg.keras.enable(_keras3_model(name="eager_model", run_eagerly=True))
    with pytest.warns(msg.EagerExecutionWarning, match="run_eagerly") as caught:
        _fit(model)
    assert "eager_model" in str(caught[0].message)
    tape_lib._eager_warned.clear()
    plain = _keras3_model(run_eagerly=True)
    with pytest.warns(msg.EagerExecutionWarning, match="run_eagerly"):
        with msg.patched("memory"):
            _fit(plain)


def test_keeping_nothing_for_a_loop_says_loops_are_kept_whole():
    memo.forget()
    weights = tf.Variable(tf.eye(WIDTH))

    def body(x):
        with tf.GradientTape() as tape:
            h = tf.while_loop(lambda i, h: i < 8, lambda i, h: (i + 1, tf.tanh(h @ weights)),
                              (0, x))[1]
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, weights)

    spec = [tf.TensorSpec([BATCH, WIDTH], tf.float32)]
    with pytest.warns(msg.NothingKeptWarning) as caught:
        with msg.patched("memory"):
            tf.function(body, input_signature=spec).get_concrete_function()
    text = str(next(w for w in caught if w.category is msg.NothingKeptWarning).message)
    assert "kept whole" in text and "While" in text, text
    assert "activations are small" not in text


def _nothing_kept_message(**arguments) -> str:
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [BATCH, WIDTH])
        h = x
        for _ in range(DEPTH):
            h = tf.tanh(h)
        with pytest.warns(msg.NothingKeptWarning) as caught:
            msg.gradients(tf.reduce_sum(h), [x], **arguments)
    return str(next(w for w in caught if w.category is msg.NothingKeptWarning).message)


def test_keeping_nothing_gives_the_reason_of_the_strategy_that_chose():
    speed = _nothing_kept_message(checkpoints="speed")  # no matmul or convolution here
    assert "convolutions and matrix products" in speed and "memory model" not in speed
    roomy = _nothing_kept_message(checkpoints="memory", memory_budget=2**40)
    assert "fits memory_budget=" in roomy and "memory model predicts" not in roomy


def test_categories_are_exported_and_share_one_base():
    for category in (msg.NothingKeptWarning, msg.NothingRewrittenWarning,
                     msg.EagerExecutionWarning):
        assert issubclass(category, msg.MemorySavingGradientsWarning)
    assert issubclass(msg.MemorySavingGradientsWarning, UserWarning)


def test_a_structure_that_keeps_nothing_says_so_each_time(caplog):
    """The NothingKeptWarning comes once per graph structure; a later graph of the same
    structure, planned from memory, still says at INFO that it used plain gradients."""
    caplog.set_level(logging.INFO, logger="memory_saving_gradients")
    said = []
    for _ in range(2):
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [7, 13])  # a structure no other
            w = tf.Variable(tf.ones([13, 11]))                 # test plans
            loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)))
            caplog.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                msg.gradients(loss, [w], checkpoints="memory")
            said.append(([str(c.message) for c in caught
                          if issubclass(c.category, msg.NothingKeptWarning)],
                         [r.getMessage() for r in caplog.records if "keeps nothing" in
                          r.getMessage()]))
    (first_warnings, _), (second_warnings, second_lines) = said
    assert first_warnings and not second_warnings, said
    assert second_lines and "planned before" in second_lines[0], said
