"""Invariants of the rewrite: nothing that existed changes; copies keep device
and colocation; the same graph and arguments give the same ops and checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients import checkpointing, rewrite
from memory_saving_gradients import graph as graph_lib
from test_models import chain, mlp, resnet

COPY_SCOPE = re.compile(r"^(.*/)?recompute[^/]*/")


def original_name(copy_name: str) -> str | None:
    """Name of the op a copy was made from (copies live under ``.../recompute.../``)."""
    match = COPY_SCOPE.match(copy_name)
    return copy_name[match.end():] if match else None


def _dropout_embedding_model(graph):
    rng = np.random.RandomState(0)
    table = tf.Variable(rng.randn(20, 8).astype(np.float32), name="table")
    w = tf.Variable(rng.randn(8, 8).astype(np.float32), name="w")
    ids = tf.compat.v1.placeholder(tf.int32, [4], name="ids")
    h1 = tf.tanh(tf.matmul(tf.gather(table, ids), w))
    h2 = tf.nn.dropout(tf.tanh(h1), rate=0.3)
    with tf.control_dependencies([h1.op]):
        h3 = tf.tanh(tf.matmul(h2, w))
    h4 = tf.tanh(h3)
    loss = tf.reduce_sum(h4 * h4)
    return loss, [table, w], [h1, h3]


CASES = {
    "mlp": lambda g: (lambda m: (m.loss, m.params, m.units[1::2]))(mlp.build(depth=4, width=8, batch=2)),
    "resnet": lambda g: (lambda m: (m.loss, m.params, m.units[:2]))(
        resnet.build(depth=8, batch=2, width=4, image_size=8)),
    "chain": lambda g: (lambda m: (m.loss, m.inputs, m.units[2::3]))(chain.build_tanh_chain(n=10, size=8)),
    "dropout_embedding_control_deps": _dropout_embedding_model,
}

OPTIONS = [
    {},
    {"colocate_gradients_with_ops": True, "gate_gradients": True},
    {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_TREE,
     "unconnected_gradients": "zero"},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["defaults", "colocate_gate", "tree_zero"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_existing_node_defs_are_unchanged(graph, op_snapshot, case, options):
    """Inputs, control inputs, attrs and device of every pre-existing op: byte-identical NodeDefs."""
    loss, xs, checkpoints = CASES[case](graph)
    before = op_snapshot(graph)
    control_inputs = {op.name: [c.name for c in op.control_inputs] for op in graph.get_operations()}
    outputs = {op.name: [(t.dtype, t.shape.as_list() if t.shape.rank is not None else None)
                         for t in op.outputs] for op in graph.get_operations()}
    grads = msg.gradients(loss, xs, checkpoints=checkpoints, **options)
    assert any(g is not None for g in grads)
    after = op_snapshot(graph)
    assert len(after) > len(before)
    changed = [name for name, node_def in before.items() if after.get(name) != node_def]
    assert not changed, f"pre-existing ops changed: {changed[:10]}"
    for op in graph.get_operations():
        if op.name in before:
            assert [c.name for c in op.control_inputs] == control_inputs[op.name], op.name
            assert [(t.dtype, t.shape.as_list() if t.shape.rank is not None else None)
                    for t in op.outputs] == outputs[op.name], op.name


def test_only_the_backward_pass_s_own_sums_are_marked(graph):
    """A part of a sum that is a sum is marked to stay as built only where the backward
    pass made it: a user's tensor handed on as a gradient keeps its NodeDef."""
    users = tf.ones([4]) + tf.ones([4])
    built_after = graph_lib.last_op_id(graph)
    ours = tf.math.add_n([tf.ones([4]), tf.ones([4])])
    before = users.op.node_def.SerializeToString()
    total = rewrite.sum_gradients([users, ours, tf.ones([4])], built_after=built_after)
    assert users.op.node_def.SerializeToString() == before
    assert ours.op.get_attr("_grappler_do_not_remove") is True
    assert "_grappler_do_not_remove" not in total.op.node_def.attr


def test_copies_keep_device_and_colocation(graph):
    """Model built under tf.device('/cpu:0') with some ops colocated with a variable.

    The call itself runs under another device scope and a colocation scope:
    copies must take the original's device and ``_class``, not the caller's.
    """
    rng = np.random.RandomState(0)
    with tf.device("/cpu:0"):
        x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
        w = tf.Variable(rng.randn(8, 8).astype(np.float32), name="w")
        h = x
        units = []
        for i in range(6):
            if i % 2:
                with tf.compat.v1.colocate_with(w.handle.op):
                    h = tf.tanh(tf.matmul(h, w), name=f"colocated_{i}")
            else:
                h = tf.tanh(tf.matmul(h, w), name=f"plain_{i}")
            units.append(h)
        loss = tf.reduce_sum(h)
    originals = {op.name: op for op in graph.get_operations()}
    colocated = [op for op in originals.values() if op.colocation_groups() != [f"loc:@{op.name}".encode()]]
    assert colocated, "the model has no colocated ops; the test would prove nothing"

    with tf.device("/cpu:1"), tf.compat.v1.colocate_with(x.op):
        msg.gradients(loss, [w], checkpoints=[units[1], units[3]])

    copies = [op for op in graph.get_operations()
              if op.name not in originals and original_name(op.name) in originals]
    assert len(copies) >= 4
    copied_colocated = 0
    for copy in copies:
        original = originals[original_name(copy.name)]
        assert copy.type == original.type
        assert copy.device == original.device, (copy.name, copy.device, original.device)
        assert tf.DeviceSpec.from_string(copy.device).device_type == "CPU"
        assert copy.colocation_groups() == original.colocation_groups() or (
            original.colocation_groups() == [f"loc:@{original.name}".encode()]
            and copy.colocation_groups() == [f"loc:@{copy.name}".encode()]
        ), (copy.name, copy.colocation_groups(), original.colocation_groups())
        if original.colocation_groups() == [b"loc:@w"]:
            copied_colocated += 1
    assert copied_colocated >= 2, "no copy of a colocated op was made"


def _build_and_differentiate(checkpoints, seed=0):
    """Fresh graph, ResNet-8 + MLP-ish head, gradients(); returns (new op names, checkpoints, graph_def)."""
    g = tf.Graph()
    with g.as_default():
        model = resnet.build(depth=8, batch=2, width=4, image_size=8, seed=seed,
                             add_to_collection=True)
        n_before = len(g.get_operations())
        region = graph_lib.forward_region([model.loss], [p.handle for p in model.params])
        chosen = checkpointing.choose_checkpoints(
            checkpoints, [model.loss], [p.handle for p in model.params], region, g)
        msg.gradients(model.loss, model.params, checkpoints=checkpoints)
        new = [(op.name, op.type) for op in g.get_operations()[n_before:]]
        graph_def = g.as_graph_def()
    return new, [t.name for t in chosen or []], graph_def


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(set(msg.available_strategies())))
def test_deterministic_in_fresh_graphs(strategy):
    """Two fresh graphs built the same way: same new op names (in order), same checkpoints, same GraphDef."""
    first = _build_and_differentiate(strategy)
    second = _build_and_differentiate(strategy)
    assert first[0] == second[0]
    assert first[1] == second[1]
    assert first[2] == second[2]
    assert first[0], "gradients() created no ops"


def test_deterministic_explicit_list():
    def run():
        g = tf.Graph()
        with g.as_default():
            model = mlp.build(depth=6, width=8, batch=2)
            n_before = len(g.get_operations())
            msg.gradients(model.loss, model.params, checkpoints=model.units[::2])
            return [op.node_def.SerializeToString(deterministic=True)
                    for op in g.get_operations()[n_before:]]

    assert run() == run()


_CHILD = r"""
import hashlib, json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
import memory_saving_gradients as msg
from test_models import resnet
g = tf.Graph()
with g.as_default():
    m = resnet.build(depth=8, batch=2, width=4, image_size=8, add_to_collection=True)
    n = len(g.get_operations())
    msg.gradients(m.loss, m.params, checkpoints=sys.argv[1])
    ops = g.get_operations()[n:]
    print(json.dumps(hashlib.sha256("\n".join(
        op.name + " " + op.type + " " + ",".join(t.name for t in op.inputs)
        # control inputs are a set in TensorFlow's C graph: compare them sorted
        + " " + ",".join(sorted(c.name for c in op.control_inputs)) for op in ops
    ).encode()).hexdigest()))
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_deterministic_across_processes_and_hash_seeds():
    """Set and dict order of ops depends on object addresses and PYTHONHASHSEED; the rewrite must not."""
    strategy = "memory" if "memory" in msg.available_strategies() else "collection"
    children = [
        subprocess.Popen([sys.executable, "-c", _CHILD, strategy], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONHASHSEED=hash_seed, TF_CPP_MIN_LOG_LEVEL="2"))
        for hash_seed in ("1", "12345")
    ]
    digests = []
    for child in children:
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0, err[-3000:]
        digests.append(json.loads(out.strip().splitlines()[-1]))
    assert digests[0] == digests[1]
