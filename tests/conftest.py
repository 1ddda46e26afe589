"""Shared fixtures of the test suite.

Graph tests run in a fresh ``tf.Graph`` (the ``graph`` fixture); eager
execution stays on outside it, so ``tf.function`` tests work in the same
process.  Sessions use the default ``ConfigProto`` (grappler on), as users run.

Helpers are fixtures that return functions, so test modules need no imports
from this file:

- ``run_both(fetches_a, fetches_b, feed)``: one ``Session.run`` of both
  (gradients compared in the same run see the same random draws).
- ``assert_grads_match(ours, theirs, values_ours, values_theirs)``: same
  structure as ``tf.gradients`` (None pattern, ``IndexedSlices`` where it
  gives one, dtypes) and the same values within float tolerance.
- ``measure_peak(fetches, feed)``: peak bytes of the second traced run in the
  default graph, summed over allocators, plus the per-allocator dict.

A test marked ``own_process`` runs in a new Python process of its own
(:func:`pytest_pyfunc_call`): ``profiling.peak_memory_during`` reads the CPU
allocator's whole chunks, and the free chunks that earlier tests of a long run
leave behind can be handed to the step's buffers (a request takes a free chunk
less than twice its size whole).  A sparse-table step that reads 40-46 MiB alone
read 57 MiB in one whole CI run.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf
from gradient_values import dense

from memory_saving_gradients import profiling
from memory_saving_gradients import tape as tape_lib

#: Size of one unit of the chain memory tests: 262144 float32 = 1 MiB.
MIB = 1 << 20


def pytest_configure(config):
    # The guard's fallback hides what the rewrite got wrong: in the tests it is an
    # error, except where a test catches it on purpose (tests/test_guard.py).
    config.addinivalue_line(
        "filterwarnings", "error::memory_saving_gradients.notices.FallbackWarning")


#: Set in the process that runs one ``own_process`` test (see :func:`pytest_pyfunc_call`).
OWN_PROCESS_ENV = "MSG_TEST_IN_OWN_PROCESS"
#: How long one ``own_process`` test may run, in seconds.
OWN_PROCESS_TIMEOUT = 900


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Runs a test marked ``own_process`` in a new Python process (pytest on its node id
    alone), where no earlier test's allocator chunks are held, and fails it with the
    child's output if the child fails; other tests run here as usual."""
    if (pyfuncitem.get_closest_marker("own_process") is None
            or os.environ.get(OWN_PROCESS_ENV)):
        return None
    root = pyfuncitem.config.rootpath
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               pyfuncitem.nodeid]
    try:
        done = subprocess.run(command, cwd=root, env={**os.environ, OWN_PROCESS_ENV: "1"},
                              capture_output=True, text=True, timeout=OWN_PROCESS_TIMEOUT)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{pyfuncitem.nodeid} ran past {OWN_PROCESS_TIMEOUT} s in its own "
                    f"process:\n{_tail(error.stdout)}", pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} failed in its own process (exit "
                    f"{done.returncode}):\n{_tail(done.stdout + done.stderr)}", pytrace=False)
    return True


def _tail(text, size: int = 6000) -> str:
    """The last ``size`` characters of a child's output (bytes or text)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-size:]


#: Fixtures that say what a test does, and the marker (pyproject.toml) it must carry.
MARKER_OF_FIXTURE = {"measure_peak": "memory"}
#: Fixtures that run a session: never in a ``unit`` test.
SESSION_FIXTURES = {"measure_peak", "run_both"}


def pytest_collection_modifyitems(config, items):
    """The layers hold: a test that measures peaks through ``measure_peak`` is marked
    ``memory``, a ``unit`` test runs no session through the fixtures, and an
    ``own_process`` test is marked ``subprocess``."""
    wrong = []
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        marks = {mark.name for mark in item.iter_markers()}
        wrong += [f"{item.nodeid} uses {name} but is not marked {marker}"
                  for name, marker in MARKER_OF_FIXTURE.items()
                  if name in fixtures and marker not in marks]
        if "unit" in marks:
            wrong += [f"{item.nodeid} is marked unit but uses {name}"
                      for name in sorted(fixtures & SESSION_FIXTURES)]
        if "own_process" in marks and "subprocess" not in marks:
            wrong.append(f"{item.nodeid} is marked own_process but not subprocess")
    if wrong:
        raise pytest.UsageError("test markers disagree with what the tests do "
                                "(docs/testing.md):\n  " + "\n  ".join(wrong))


@pytest.fixture
def graph():
    """A fresh v1 graph, made the default for the test's duration."""
    g = tf.Graph()
    with g.as_default():
        yield g


def _fetchable(grads):
    """Fetchable structure for a gradient list with Nones (None is not fetchable)."""
    return [g for g in grads if g is not None]


@pytest.fixture
def run_both():
    """Run two gradient lists in ONE ``Session.run`` of the default graph.

    Returns the fetched values, with None where the gradient is None.
    Extra keyword ``session`` reuses an open session (for several steps).
    """

    def run(ours, theirs, feed_dict=None, session=None, init=True):
        def fill(grads, values):
            values = iter(values)
            return [None if g is None else next(values) for g in grads]

        def go(sess):
            got_ours, got_theirs = sess.run(
                [_fetchable(ours), _fetchable(theirs)], feed_dict=feed_dict
            )
            return fill(ours, got_ours), fill(theirs, got_theirs)

        if session is not None:
            return go(session)
        with tf.compat.v1.Session() as sess:
            if init:
                sess.run(tf.compat.v1.global_variables_initializer())
            return go(sess)

    return run


@pytest.fixture
def assert_grads_match():
    """Structure and values of our gradients equal tf.gradients' (float tolerance)."""

    def check(ours, theirs, values_ours, values_theirs, rtol=1e-4, atol=1e-5):
        assert isinstance(ours, list), type(ours)
        assert len(ours) == len(theirs)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert (a is None) == (b is None), f"gradient {i}: ours {a}, tf.gradients {b}"
            if a is None:
                continue
            assert type(a) is type(b), f"gradient {i}: ours {type(a)}, tf.gradients {type(b)}"
            assert a.dtype == b.dtype, f"gradient {i}: ours {a.dtype}, tf.gradients {b.dtype}"
            np.testing.assert_allclose(
                dense(values_ours[i]), dense(values_theirs[i]), rtol=rtol, atol=atol,
                err_msg=f"gradient {i} ({b.name if hasattr(b, 'name') else b})",
            )

    return check


@pytest.fixture
def measure_peak():
    """Peak bytes of a traced step (second of two runs) in the default graph.

    Returns ``(total, per_allocator)``; ``total`` sums the allocators' peaks
    (on this CPU build there is one, 'mklcpu' or 'cpu').
    """

    def measure(fetches, feed_dict=None):
        with tf.compat.v1.Session() as sess:  # default ConfigProto: grappler on
            sess.run(tf.compat.v1.global_variables_initializer())
            _, metadata = profiling.traced_run(sess, fetches, feed_dict, runs=2)
        peaks = profiling.peak_memory(metadata)
        return sum(peaks.values()), peaks

    return measure


@pytest.fixture
def op_snapshot():
    """``snapshot(graph) -> {name: NodeDef bytes}`` of every op now in ``graph``."""

    def snapshot(g):
        return {op.name: op.node_def.SerializeToString(deterministic=True)
                for op in g.get_operations()}

    return snapshot


@pytest.fixture
def recorded_graphs(monkeypatch):
    """Graphs in which GradientTape called gradients() (Keras builds them out of reach)."""
    graphs = []
    real = tape_lib._checkpointed_gradients

    def spy(ys, *args, **kwargs):
        graphs.append(ys[0].graph)
        return real(ys, *args, **kwargs)

    monkeypatch.setattr(tape_lib, "_checkpointed_gradients", spy)
    return graphs
