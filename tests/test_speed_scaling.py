"""'speed' stays linear on residual nets: segments must not overlap.

With only convolution/matmul outputs kept, each segment of a residual net
would recompute back through the whole residual stream (quadratic).  'speed'
also keeps branch points; the number of new ops then grows like the graph.
"""

import pytest
import tensorflow as tf

import memory_saving_gradients as msg
import test_models


def _new_ops(layers):
    graph = tf.Graph()
    with graph.as_default():
        model = test_models.build("transformer", layers=layers, d_model=16, seq_len=16, batch=2)
        before = len(graph.get_operations())
        msg.gradients(model.loss, model.params, checkpoints="speed")
        return before, len(graph.get_operations()) - before


@pytest.mark.slow
def test_speed_rewrite_grows_linearly():
    small_ops, small_new = _new_ops(8)
    large_ops, large_new = _new_ops(32)
    # 4x the layers: new ops grow like the graph (at most 1.25x its growth).
    assert large_new / small_new <= 1.25 * large_ops / small_ops, (small_new, large_new)
