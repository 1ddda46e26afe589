"""Embedding tables that optimizers update sparsely: what their reads and their
neighbours' gradients really hold.

Two things TensorFlow does that the memory model must know (measured on the step
below, batch 64, a 50000 x 64 table):

* once a scatter (a sparse optimizer update) has touched a resource variable, every
  read of it copies the whole table (copy-on-read); a plan that recomputes the lookup
  holds that 12 MB copy from the forward pass to the backward pass (the plan said 25 MB,
  the step measured 75.5 MB, more than plain's 69-74 MB);
* the gradient of a ``[B, T, K] @ [K, N]`` product with respect to the weight is the
  ``[B, K, N]`` product, summed over ``B`` after: 16 MB for a 256 KB weight.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients import graph as graph_lib
from memory_saving_gradients import simulate, workspace

MB = 2**20
VOCAB, WIDTH, STEPS, BATCH = 50000, 64, 64, 64


def _variables(seed: int) -> list:
    rng = np.random.RandomState(seed)
    table = tf.Variable(rng.normal(0, 0.05, (VOCAB, WIDTH)).astype("float32"))
    convs = [tf.Variable(rng.normal(0, 0.1, (3, WIDTH, WIDTH)).astype("float32"))
             for _ in range(2)]
    dense = [tf.Variable(rng.normal(0, 0.05, (WIDTH if i == 0 else 256, 256)).astype("float32"))
             for i in range(8)]
    return [table] + convs + dense


def _step(variables: list):
    """A Keras-like embedding (the table's read, then a gather), two convolutions and
    eight dense layers on the sequence; SGD with a scatter for the table's IndexedSlices."""

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            h = tf.gather(tf.convert_to_tensor(variables[0]), ids)
            for w in variables[1:3]:
                h = tf.nn.relu(tf.nn.conv1d(h, w, 1, "SAME"))
            for w in variables[3:]:
                h = tf.tanh(h @ w)
            loss = tf.reduce_mean(h * h)
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            if isinstance(g, tf.IndexedSlices):
                v.scatter_sub(tf.IndexedSlices(0.01 * g.values, g.indices, g.dense_shape))
            else:
                v.assign_sub(0.01 * g)
        return loss

    return step


@pytest.fixture(scope="module")
def ids():
    return tf.constant(np.random.RandomState(1).randint(0, VOCAB, (BATCH, STEPS)), tf.int32)


@pytest.mark.unit
@pytest.mark.parametrize("unused_read", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_a_table_read_only_by_lookups_is_read_as_a_copy(tied, unused_read):
    """A table whose every read feeds row gathers gets an IndexedSlices gradient, a
    scatter update, and copy-on-read; one also read densely (an output projection tied
    to it) gets a dense gradient and update, and its reads share its buffer.  A read
    whose value nothing uses (``tf.shape`` of a table of known shape is a constant, as
    Keras' embedding reads it) decides nothing: a helper's trial found a fresh plan
    counting the table as shared and the same plan, asked after the optimizer's scatter
    was built, as copied (1.06x against 0.94x of plain at batch 8)."""
    table = tf.Variable(tf.zeros([1000, 16]))

    @tf.function
    def lookup(ids):
        if unused_read:
            tf.shape(table)
        h = tf.gather(tf.identity(tf.convert_to_tensor(table)), ids)
        if tied:
            h = tf.matmul(h, tf.convert_to_tensor(table), transpose_b=True)
        return tf.reduce_sum(h)

    graph = lookup.get_concrete_function(tf.TensorSpec([4, 3], tf.int32)).graph
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
    assert len(reads) == (3 if tied else 2) if unused_read else reads
    assert all(graph_lib.copies_on_read(op) is not tied for op in reads)
    assert all(graph_lib.shares_input_buffer(op) is tied for op in reads)


@pytest.mark.unit
def test_a_table_no_lookup_reads_is_not_read_as_a_copy():
    """A variable whose reads only give its shape gets no gradient and no scatter: its
    reads share its buffer (a reviewer found it counted as copied)."""
    table = tf.Variable(tf.zeros([1000, 16]))

    @tf.function
    def shape_only():
        tf.shape(table)
        return tf.shape(tf.convert_to_tensor(table))

    graph = shape_only.get_concrete_function().graph
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
    assert reads and not any(graph_lib.copies_on_read(op) for op in reads)


@pytest.mark.memory
@pytest.mark.subprocess
@pytest.mark.own_process
@pytest.mark.slow
def test_a_sparsely_updated_tables_read_and_a_broadcast_products_gradient_are_counted(ids):
    step = _step(_variables(0))
    with msg.patched("memory") as handle:
        step(ids)
    plan = handle.plans[0]
    graph = step.get_concrete_function(ids).graph
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"
             and any(c.type == "GatherV2" for c in op.outputs[0].consumers())]
    assert reads and all(graph_lib.copies_on_read(op) for op in reads)
    assert not any(graph_lib.shares_input_buffer(op) for op in reads)
    products = [op for op in graph.get_operations() if op.type == "BatchMatMulV2"
                and op.inputs[1].shape.rank == 2 and "recompute" not in op.name]
    size = simulate.Sizer()
    assert products
    for op in products:
        rows = op.inputs[1].shape[0]
        assert workspace.gradient_bytes(op, size, size.shape) == BATCH * rows * 256 * 4
    # the lookup's output is kept rather than recomputed from a held copy of the table
    assert "GatherV2" not in dict(plan.recomputed_ops)
    step(ids)  # the table is copy-on-read from here on
    measured = min(msg.peak_memory_during(lambda: step(ids)) for _ in range(3))
    predicted = plan.in_step_peak_bytes
    # measured 40-46.5 MB against 38.25 predicted (the executor overlaps two of the
    # 16 MB weight-gradient products at times), 57 once in a whole CI run (hence its
    # own process: tests/conftest.py); before: 75.5 against 25
    assert measured <= 1.25 * predicted, (measured / MB, predicted / MB)
    assert predicted <= 1.05 * measured, (measured / MB, predicted / MB)
