"""Bad input: a ValueError/TypeError (RuntimeError when eager) that says what
was wrong and what to do, and the graph is left exactly as it was.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from test_models import chain

#: made at import, eagerly: a value, not a node of any graph
EAGER_ONES = tf.ones([8])


@pytest.fixture
def model(graph):
    return chain.build_tanh_chain(n=6, size=8)


@pytest.fixture
def outside(model):
    """A tensor of the graph that is not between xs and ys."""
    return tf.tanh(tf.constant([1.0]), name="outside")


@pytest.fixture
def unchanged(graph, op_snapshot):
    """Asserts after the test that the graph has the same ops with the same NodeDefs."""
    before = op_snapshot(graph)
    yield
    assert op_snapshot(graph) == before, "a failed call left ops behind or changed some"


def call_fails(error, words, *args, **kwargs):
    """``gradients(*args, **kwargs)`` raises ``error`` whose message contains every word (regex)."""
    with pytest.raises(error) as info:
        msg.gradients(*args, **kwargs)
    text = str(info.value)
    for word in words:
        assert re.search(word, text, re.IGNORECASE), f"{word!r} not in message: {text}"
    return text


@pytest.mark.unit
def test_checkpoint_from_another_graph(model, unchanged):
    other = tf.Graph()
    with other.as_default():
        foreign = tf.tanh(tf.constant([1.0]), name="foreign")
    call_fails(ValueError, ["another graph", "foreign", "graph being differentiated"],
               model.loss, model.inputs, checkpoints=[model.units[2], foreign])


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["chain_tanh/Tanh_2:0", 3, 2.5, None])
def test_non_tensor_in_checkpoint_list(model, unchanged, bad):
    text = call_fails(TypeError, ["checkpoint", "tensor"],
                      model.loss, model.inputs, checkpoints=[model.units[1], bad])
    assert type(bad).__name__ in text


@pytest.mark.unit
def test_a_name_or_an_op_as_a_checkpoint_says_what_to_pass(model, unchanged):
    """The original tool's users name tensors: a name or an op is refused with the call
    that gives the tensor (a helper's trial: the error named the string only)."""
    call_fails(TypeError, ["get_tensor_by_name"],
               model.loss, model.inputs, checkpoints=[model.units[1], model.units[2].name])
    call_fails(TypeError, [r"op\.outputs\[0\]"],
               model.loss, model.inputs, checkpoints=[model.units[1], model.units[2].op])


@pytest.mark.unit
def test_a_keras_symbolic_tensor_as_a_checkpoint_says_what_to_pass(model, unchanged):
    keras = pytest.importorskip("keras")
    with tf.Graph().as_default():  # the layer's variables stay out of the model's graph
        symbolic = keras.layers.Dense(4)(keras.Input((8,)))
    call_fails(TypeError, ["KerasTensor", "symbolic tensor", "strategy"],
               model.loss, model.inputs, checkpoints=[model.units[1], symbolic])


@pytest.mark.unit
@pytest.mark.parametrize("bad", [3, 2.5, object()])
def test_number_or_object_as_checkpoints(model, unchanged, bad):
    call_fails(TypeError, ["checkpoints", "strategy|list"], model.loss, model.inputs, checkpoints=bad)


@pytest.mark.unit
def test_unknown_strategy_name(model, unchanged):
    call_fails(ValueError, ["no_such_strategy", "collection"],
               model.loss, model.inputs, checkpoints="no_such_strategy")


@pytest.mark.unit
def test_a_name_where_gradients_takes_checkpoints_says_so(model, unchanged):
    """gradients()' fourth argument is checkpoints (as in the original tool), where
    tf.compat.v1.gradients' is name: a call in TensorFlow's order says so."""
    call_fails(ValueError, ["'mygrads'", "fourth argument is checkpoints", "gradients_memory"],
               model.loss, model.inputs, None, "mygrads")


@pytest.mark.unit
def test_a_strategy_passed_third_is_refused_as_grad_ys(model, unchanged):
    """``gradients(loss, xs, "memory")``: the third argument is grad_ys, as in
    tf.gradients (plan()'s is checkpoints). The string went on to plain tf.gradients,
    which left ops behind and raised about a "Gradient type string"."""
    call_fails(TypeError, [r"grad_ys\[0\]", "'memory'", "third argument is grad_ys",
                           "checkpoints= by keyword"], model.loss, model.inputs, "memory")


@pytest.mark.parametrize("entry", ["gradients_memory", "gradients_speed", "gradients_collection"])
def test_the_strategy_entry_points_take_tf_gradients_arguments_in_its_order(graph, entry):
    """gradients_memory & co. stand in for tf.gradients (``tf.__dict__['gradients'] =
    gradients_memory``), so a call in tf.compat.v1.gradients' order works: they took
    only ys, xs and grad_ys positionally."""
    model = chain.build_tanh_chain(n=6, size=8, add_to_collection=True)
    x = model.inputs[0]
    ours = getattr(msg, entry)(model.loss, [x], None, "mine", True, True,
                               tf.AggregationMethod.ADD_N, None, "zero")
    want = tf.compat.v1.gradients(model.loss, [x], None, "theirs", True, True,
                                  tf.AggregationMethod.ADD_N, None, "zero")
    assert ours[0].name.startswith("mine"), ours[0].name
    with tf.compat.v1.Session() as session:
        got, expected = session.run([ours, want], model.feed_dict)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="chooses its checkpoints itself"):
        getattr(msg, entry)(model.loss, [x], checkpoints=[model.units[2]])


@pytest.mark.unit
@pytest.mark.parametrize("which", ["xs", "ys", "outside", "all_three"])
def test_explicit_list_with_no_usable_tensor(model, outside, unchanged, which):
    """xs, ys, and tensors not between them are unusable; a list of only those is an error."""
    candidates = {
        "xs": [model.inputs[0]],
        "ys": [model.loss],
        "outside": [outside],
        "all_three": [model.inputs[0], model.loss, outside],
    }[which]
    names = [t.name for t in candidates]
    text = call_fails(ValueError, ["checkpoint", "xs", "ys", "pass|use"],
                      model.loss, model.inputs, checkpoints=candidates)
    assert all(name in text for name in names), text


@pytest.mark.unit
def test_checkpoints_only_inside_a_loop_body_say_so(graph):
    """A list whose only checkpoint lies in a while loop's body fails, and the error
    says that loops are kept whole (not only a log line beside it)."""
    x = tf.compat.v1.placeholder(tf.float32, [4, 8])
    w = tf.Variable(tf.ones([8, 8]))
    inner = []

    def body(i, h):
        h = tf.tanh(tf.matmul(h, w))
        inner.append(h)
        return i + 1, h

    _, h = tf.while_loop(lambda i, h: i < 3, body, (0, tf.tanh(x)))
    loss = tf.reduce_sum(tf.tanh(h))
    call_fails(ValueError, ["None of the 1 checkpoints", "while_loop", "kept whole", "outside"],
               loss, [w], checkpoints=inner)


@pytest.mark.unit
def test_empty_checkpoint_list(model, unchanged):
    call_fails(ValueError, ["empty", "strategy"], model.loss, model.inputs, checkpoints=[])


@pytest.mark.unit
@pytest.mark.parametrize("checkpoints", ["list", "memory"])
def test_no_xs_or_no_ys_get_tf_gradients_answer(model, checkpoints):
    """No xs or no ys is tf.gradients' own answer ([]; a None, or zeros, per x), through
    gradients() and the patched tf.gradients, as generic code (a model without weights)
    expects; it raised ValueError."""
    chosen = [model.units[2]] if checkpoints == "list" else checkpoints
    assert msg.gradients(model.loss, [], checkpoints=chosen) == []
    assert msg.gradients([], model.inputs, checkpoints=chosen) == [None] * len(model.inputs)
    zeros = msg.gradients([], model.inputs, checkpoints=chosen, unconnected_gradients="zero")
    assert [z.shape.as_list() for z in zeros] == [x.shape.as_list() for x in model.inputs]
    with pytest.warns(msg.NothingRewrittenWarning, match="nothing to differentiate"), \
            msg.patched("memory"):
        assert tf.gradients(model.loss, []) == []
        assert tf.compat.v1.gradients([], model.inputs) == [None] * len(model.inputs)


@pytest.mark.unit
@pytest.mark.parametrize("where", ["xs", "ys", "stop_gradients"])
def test_string_where_a_tensor_belongs(model, unchanged, where):
    args = {"ys": model.loss, "xs": model.inputs, "stop_gradients": None}
    args[where] = ["chain_tanh/Tanh:0"]
    call_fails(TypeError, [where, "tensor", "str"], args["ys"], args["xs"],
               checkpoints=[model.units[2]], stop_gradients=args["stop_gradients"])


@pytest.mark.unit
@pytest.mark.parametrize("checkpoints", ["memory", "speed"])
def test_stop_gradients_from_another_graph_or_eager(model, unchanged, checkpoints):
    """Checked before anything is built, also by plan(): a strategy that kept nothing
    fell back to tf.gradients, which raised TensorFlow's own error after adding ops (an
    eager tensor: an AttributeError, three ops left), and plan() accepted them."""
    other = tf.Graph()
    with other.as_default():
        foreign = tf.ones([8], name="foreign_stop")
    eager = EAGER_ONES
    call_fails(ValueError, ["stop_gradients", "another graph", "foreign_stop"],
               model.loss, model.inputs, checkpoints=checkpoints, stop_gradients=[foreign])
    call_fails(ValueError, ["stop_gradients", "eager tensor", "shape \\(8,\\)", "inside the tf.function"],
               model.loss, model.inputs, checkpoints=checkpoints, stop_gradients=[eager])
    for stop in (foreign, eager):
        with pytest.raises(ValueError, match="stop_gradients"):
            msg.plan(model.loss, model.inputs, checkpoints=checkpoints, stop_gradients=[stop])


@pytest.mark.unit
def test_eager_tensor_as_a_checkpoint_inside_a_function():
    """An eager tensor among the checkpoints of a tf.function's gradient: the library's
    message (its check compared the tensor with a name and raised a TypeError)."""
    eager = tf.ones([8])

    @tf.function
    def step(x):
        h = tf.tanh(tf.tanh(x))
        return msg.gradients(tf.reduce_sum(tf.tanh(h)), [x], checkpoints=[h, eager])

    with pytest.raises(ValueError, match="checkpoints: an eager tensor .* outside the graph"):
        step(tf.ones([8]))


@pytest.mark.unit
def test_eager_grad_ys_inside_a_function_is_captured_as_tf_gradients_does():
    """A loss scale made eagerly, passed as grad_ys inside a tf.function: tf.gradients
    captures it, and so do gradients() and the patched tf.gradients (both raised)."""
    scale = tf.constant(0.5)
    weights = tf.Variable(tf.eye(8) * 0.9)

    @tf.function
    def step(x):
        h = x
        for _ in range(4):
            h = tf.tanh(h @ weights)
        loss = tf.reduce_sum(h * h)
        plain = tf.gradients(loss, weights, grad_ys=scale)
        ours = msg.gradients(loss, weights, grad_ys=scale, checkpoints="memory")
        with msg.patched("memory"):
            patched = tf.gradients(loss, weights, grad_ys=scale)
        return plain, ours, patched

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", msg.MemorySavingGradientsWarning)  # a small graph
        plain, ours, patched = step(tf.ones([4, 8]))
    assert float(tf.reduce_max(tf.abs(plain[0]))) > 0
    np.testing.assert_allclose(ours[0].numpy(), plain[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(patched[0].numpy(), plain[0].numpy(), rtol=1e-6)


def test_grad_ys_as_a_variable_or_a_list_of_tensors_as_in_tf_gradients():
    """tf.gradients converts a variable, or a (nested) list of tensors, given as a
    grad_y; the check of grad_ys raised NotImplementedError on them (numpy of a symbolic
    tensor)."""
    scale = tf.Variable(2.0)
    weights = tf.Variable(tf.random.stateless_normal([8, 8], seed=[1, 2]) * 0.3)

    def step(gradients, x):
        h = x
        for _ in range(4):
            h = tf.tanh(h @ weights)
        pair = tf.reduce_sum(h, 0)[:2]
        by_variable = gradients(tf.reduce_sum(h * h), [weights], grad_ys=scale)
        by_list = gradients(pair, [weights], grad_ys=[[pair[0] * 0 + 1.0, pair[1] * 0 + 2.0]])
        return by_variable + by_list

    def ours(ys, xs, grad_ys):
        return msg.gradients(ys, xs, grad_ys=grad_ys, checkpoints="memory")

    x = tf.ones([4, 8])
    want = tf.function(lambda x: step(tf.gradients, x))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", msg.MemorySavingGradientsWarning)  # a small graph
        got = tf.function(lambda x: step(ours, x))(x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


@pytest.mark.unit
def test_a_number_among_ys_is_a_constant_as_in_tf_gradients():
    """``tf.gradients([loss, 1.0], xs)`` converts the number (it adds nothing); so do
    gradients() and the patched name, which raised a TypeError."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8))
        h = x
        for _ in range(6):
            h = tf.tanh(h * 1.1)
        loss = tf.reduce_sum(h)
        plain = tf.compat.v1.gradients([loss, 1.0], [x])
        ours = msg.gradients([loss, np.float32(1.0)], [x], checkpoints="memory")
        with msg.patched("memory"):
            patched = tf.compat.v1.gradients([loss, 1.0], [x])
        with tf.compat.v1.Session() as sess:
            plain, ours, patched = sess.run((plain, ours, patched))
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    np.testing.assert_allclose(patched[0], plain[0], rtol=1e-6)


@pytest.mark.unit
def test_ys_of_numbers_alone_get_tf_gradients_answer():
    """``tf.gradients(3.0, xs)`` gives None per x (the number becomes a constant of the
    graph being built); gradients() and the patched name raised a TypeError."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        plain = tf.compat.v1.gradients(3.0, [x])
        with warnings.catch_warnings():  # nothing to keep, so nothing rewritten: said
            warnings.simplefilter("ignore", msg.MemorySavingGradientsWarning)
            ours = msg.gradients([3.0, np.float32(2.0)], [x], checkpoints="memory")
            with msg.patched("memory"):
                patched = tf.compat.v1.gradients(3.0, [x])
    assert plain == [None] and ours == [None] and patched == [None]

    @tf.function
    def step(v):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", msg.NothingKeptWarning)
            return msg.gradients(1.0, [v], checkpoints="memory", unconnected_gradients="zero")

    np.testing.assert_array_equal(step(tf.ones([3])).pop().numpy(), np.zeros(3))


@pytest.mark.unit
def test_xs_from_another_graph(model, unchanged):
    other = tf.Graph()
    with other.as_default():
        foreign = tf.compat.v1.placeholder(tf.float32, [8], name="foreign_x")
    call_fails(ValueError, ["another graph", "foreign_x"], model.loss, [foreign],
               checkpoints=[model.units[2]])


@pytest.mark.unit
def test_ys_from_another_graph_names_both_sides(model, unchanged):
    """ys from another graph than xs: the message names the x and ys[0], so that either
    side of the mistake can be found (it named only the x, as if the x were wrong)."""
    other = tf.Graph()
    with other.as_default():
        foreign = tf.reduce_sum(tf.tanh(tf.constant([1.0])), name="foreign_loss")
    text = call_fails(ValueError, ["another graph", "foreign_loss"], foreign, model.inputs)
    assert model.inputs[0].name in text, text


@pytest.mark.unit
def test_grad_ys_length_mismatch(model, unchanged):
    call_fails(ValueError, ["grad_ys", "ys"], model.loss, model.inputs,
               grad_ys=[None, None],
               checkpoints=[model.units[2]])


@pytest.fixture
def bad_grad_ys(model):
    """grad_ys that do not fit the loss (made before the graph's snapshot)."""
    return {"shape": tf.ones([5]), "dtype": tf.ones(model.loss.shape, tf.float64),
            "array": np.ones([5], np.float32), "string": "ones", "object": object()}


@pytest.mark.unit
@pytest.mark.parametrize("kind, error, words", [
    ("shape", ValueError, [r"grad_ys\[0\]", r"shape \(5,\)", "has that y's shape"]),
    ("dtype", TypeError, [r"grad_ys\[0\]", "float64", "float32", "tf.cast"]),
    ("array", ValueError, [r"grad_ys\[0\]", r"shape \(5,\)"]),
    ("string", TypeError, [r"grad_ys\[0\]", "'ones'", "gradient of its y"]),
    ("object", TypeError, [r"grad_ys\[0\]", "object", "gradient of its y"]),
])
@pytest.mark.parametrize("checkpoints", ["memory", "list"])
def test_grad_ys_that_do_not_fit_their_y(model, bad_grad_ys, unchanged, kind, error, words,
                                         checkpoints):
    """tf.gradients finds these only while it builds the gradients (leaving ops behind);
    here they are refused before anything is built, by gradients() and plan() alike."""
    chosen = [model.units[2]] if checkpoints == "list" else checkpoints
    call_fails(error, words, model.loss, model.inputs, grad_ys=bad_grad_ys[kind],
               checkpoints=chosen)
    with pytest.raises(error):
        msg.plan(model.loss, model.inputs, checkpoints=chosen, grad_ys=bad_grad_ys[kind])


@pytest.mark.unit
@pytest.mark.parametrize("checkpoints", ["list", "memory"])
@pytest.mark.parametrize("option, value, words", [
    ("unconnected_gradients", "sometimes", ["unconnected_gradients", "ZERO", "sometimes"]),
    ("aggregation_method", 7, ["aggregation_method", "ADD_N", "EXPERIMENTAL_TREE", "got 7"]),
    ("aggregation_method", "tree", ["aggregation_method", "got 'tree'"]),
    ("aggregation_method", [1], ["aggregation_method", r"got \[1\]"]),
])
def test_a_bad_gradient_option_raises_before_anything_is_built(model, unchanged, checkpoints,
                                                               option, value, words):
    """tf.gradients' own check of aggregation_method comes midway, after the rewrite had
    built 9-24 ops; and GradientTape, which takes it as an option, checks it when made (it
    took aggregation_method=7 and raised only in gradient())."""
    chosen = [model.units[2]] if checkpoints == "list" else checkpoints
    call_fails(ValueError, words, model.loss, model.inputs, checkpoints=chosen,
               **{option: value})
    if option == "aggregation_method":  # a tape's option (the other is gradient()'s argument)
        with pytest.raises(ValueError, match=option):
            msg.GradientTape(checkpoints="memory", aggregation_method=value)
        for good in (None, tf.AggregationMethod.EXPERIMENTAL_TREE, 1.0, True):  # as tf
            msg.GradientTape(checkpoints="memory", aggregation_method=good)


@pytest.mark.unit
def test_eager_call_raises_runtime_error():
    assert tf.executing_eagerly()
    x = tf.constant([1.0, 2.0])
    with pytest.raises(RuntimeError) as info:
        msg.gradients(tf.reduce_sum(tf.tanh(x)), [x])
    text = str(info.value)
    assert "tf.function" in text and "graph" in text, text


def test_graph_usable_after_errors(graph, model, run_both, assert_grads_match):
    """After a rejected call the same graph still differentiates correctly."""
    with pytest.raises(TypeError):
        msg.gradients(model.loss, model.inputs, checkpoints=[model.units[1], "nope"])
    with pytest.raises(ValueError):
        msg.gradients(model.loss, model.inputs, checkpoints=[model.loss])
    ours = msg.gradients(model.loss, model.inputs, checkpoints=[model.units[1], model.units[3]])
    theirs = tf.compat.v1.gradients(model.loss, model.inputs)
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


@pytest.mark.unit
def test_an_unmet_budget_on_a_small_graph_gives_the_least_peak_in_bytes():
    """The least peak of a graph whose tensors weigh kilobytes is said in bytes, not as
    "0.0 MB"."""
    with tf.Graph().as_default():
        h = tf.compat.v1.placeholder(tf.float32, [4, 16])
        weights = [tf.Variable(tf.ones([16, 16]) * 0.1) for _ in range(6)]
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h)
        with pytest.raises(ValueError, match="cannot be met") as raised:
            msg.gradients(loss, weights, checkpoints="memory", memory_budget=10)
        with pytest.raises(ValueError, match="memory_budget=1.5 bytes cannot be met"):
            msg.plan(loss, weights, checkpoints="memory", memory_budget=1.5)  # was "1 bytes"
    said = str(raised.value)
    assert "0.0 MB" not in said and re.search(r"finds for this graph is \d+ bytes", said), said


def test_a_listed_checkpoint_off_the_path_is_named(model, caplog):
    """A listed tensor that is not between xs and ys is ignored, and a warning says which
    (it was dropped silently, the INFO line counting one checkpoint fewer)."""
    side = tf.sin(model.inputs[0], name="side_branch")
    with caplog.at_level("WARNING", logger="memory_saving_gradients"):
        grads = msg.gradients(model.loss, model.inputs, checkpoints=[model.units[2], side])
    said = [r.getMessage() for r in caplog.records if "side_branch" in r.getMessage()]
    assert said and said[0].startswith("memory_saving_gradients: Ignoring 1 of the 2 "
                                       "checkpoints"), said
    assert "stop_gradients" not in said[0], said  # none was passed
    with caplog.at_level("WARNING", logger="memory_saving_gradients"):
        caplog.clear()
        msg.gradients(model.loss, model.inputs, checkpoints=[model.units[2], model.loss])
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]  # a y: as documented
    assert grads[0] is not None


@pytest.mark.unit
def test_named_strategy_functions_and_patch_say_what_they_take(model, unchanged):
    """gradients_memory(..., checkpoints=...) said only Python's "got multiple values for
    keyword argument"; patch(tape='yes') was taken as true."""
    for function in (msg.gradients_memory, msg.gradients_speed, msg.gradients_collection):
        with pytest.raises(TypeError, match="chooses its checkpoints itself.*gradients\\(\\.\\.\\., "):
            function(model.loss, model.inputs, checkpoints="speed")
    with pytest.raises(TypeError, match="tape=.* True or False; got 'yes'"):
        msg.patch("memory", tape="yes")
    from memory_saving_gradients import patching

    assert not patching.is_patched()


@pytest.mark.unit
def test_a_collection_of_non_tensors_says_what_it_holds(model, recwarn):
    """Strings and variables added to the 'checkpoints' collection are ignored; the
    warning names them (it said only that the collection held no tensor)."""
    tf.compat.v1.add_to_collection("checkpoints", "chain_tanh/Tanh_2:0")
    with pytest.warns(msg.NothingKeptWarning, match="2 entries that are not tensors.*str"):
        tf.compat.v1.add_to_collection("checkpoints", tf.Variable(1.0))
        grads = msg.gradients(model.loss, model.inputs, checkpoints="collection")
    assert grads[0] is not None


@pytest.mark.unit
@pytest.mark.parametrize("checkpoints", ["list", "memory"])
def test_an_integer_y_is_named_as_the_reason_nothing_is_kept(model, checkpoints):
    """A y cast to integers: a list said "ys do not depend on xs through any op (that
    stop_gradients leaves)" with no stop_gradients passed; 'memory' named the dtype."""
    chosen = [model.units[2]] if checkpoints == "list" else checkpoints
    y = tf.cast(model.loss, tf.int32)
    with pytest.warns(msg.NothingKeptWarning) as caught:
        grads = msg.gradients(y, model.inputs, checkpoints=chosen)
    assert grads == tf.compat.v1.gradients(y, model.inputs) == [None] * len(model.inputs)
    said = " ".join(str(w.message) for w in caught)
    assert "no y can carry a gradient (dtype int32" in said, said
    assert "stop_gradients" not in said, said


@pytest.mark.unit
def test_nothing_kept_says_which_gradient_and_where():
    """A step with two gradients, one too small to save anything (an inner gradient of a
    Hessian-vector product): the warning names its y, its xs and the function, and gives
    a tiny peak in bytes, not "0.00 MB" (a helper's trial)."""
    w = tf.Variable(tf.ones([4]))

    @tf.function
    def tiny_step(x):
        loss = tf.reduce_sum(tf.tanh(x * w), name="tiny_loss")
        return msg.gradients(loss, [w], checkpoints="memory")

    with pytest.warns(msg.NothingKeptWarning) as caught:
        tiny_step.get_concrete_function(tf.TensorSpec([4]))
    said = " ".join(str(w.message) for w in caught)
    assert "keeps nothing for the gradient of 'tiny_loss:0' with respect to " in said, said
    assert "in function 'tiny_step'" in said, said
    assert "0.00 MB" not in said and " bytes" in said, said
