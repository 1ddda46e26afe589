"""Loss terms computed by separate forward passes, whose backward passes TensorFlow
may start each on its own.

The memory model runs the whole forward pass, then the whole backward pass.  Where
``ys`` sum terms (through ops whose gradients read nothing the region makes: adds,
means, a product with a constant) and each term comes from a forward pass of its own
(a WGAN critic's fake, real and gradient-penalty passes, which share only weights),
a term's incoming gradient does not wait for the other terms: TensorFlow's executor
starts its backward pass as soon as its own forward pass is done, while the others'
still run, and frees its activations early.  Plain ``tf.gradients`` then peaks well
below the model's figure (a WGAN-GP critic step: 47 MB measured, 81.6 planned), and
a plan said to save may not (every strategy measured 1.2-1.7x plain's peak there).
Pure analysis: nothing here changes a graph.
"""

from __future__ import annotations

from typing import Callable, Sequence

from . import graph as graph_lib
from ._tensorflow import tf

#: A term counts where its forward pass makes at least this share of the region's bytes.
LEAST_SHARE = 0.1


def separate_terms(region: graph_lib.ForwardRegion, ys: Sequence[tf.Tensor],
                   xs: Sequence[tf.Tensor]) -> list:
    """The forward passes (lists of ops, in the region's order) that ``ys`` sum and that
    meet only in the ops combining them (whose gradients read nothing the region makes)
    and in the xs they read, each reading a batch of its own (:func:`_reads_data`); none
    where fewer than two such passes are found.  About linear in the region."""
    x_keys = {x.ref() for x in xs}
    wanted = graph_lib.needs_gradient_in(region, x_keys)

    def made_inside(t: tf.Tensor) -> bool:
        return t.op in region and t.ref() not in x_keys

    combining, roots = set(), set()
    stack = [y.op for y in ys if y.op in region]
    while stack:
        op = stack.pop()
        if op in combining or op in roots:
            continue
        reads_in, reads_out = graph_lib.gradient_reads(op, wanted)
        if any(made_inside(t) for t in list(reads_in) + list(reads_out)):
            roots.add(op)  # a term's last op: its gradient reads its own forward pass
            continue
        combining.add(op)
        stack.extend(t.op for t in op.inputs if made_inside(t))
    if len(roots) < 2:
        return []
    # a combining op that a pass also reads (a residual stream's add, read by the next
    # block) belongs to that pass: the terms do not meet only in sums there
    worklist = list(combining)
    while worklist:
        op = worklist.pop()
        if op in combining and any(c in region and c not in combining
                                   for t in op.outputs for c in t.consumers()):
            combining.discard(op)
            worklist.extend(t.op for t in op.inputs if t.op in combining)
    parent: dict = {}

    def find(op):  # union-find with path halving
        while parent.get(op, op) is not op:
            parent[op] = parent.get(parent[op], parent[op])
            op = parent[op]
        return op

    for op in region.order:
        if op in combining:
            continue
        for t in op.inputs:
            source = t.op
            # ops that read only xs (a variable's read) are shared by every pass
            if (made_inside(t) and source not in combining
                    and any(made_inside(s) for s in source.inputs)):
                a, b = find(op), find(source)
                if a is not b:
                    parent[a] = b
    passes: dict = {}
    for op in region.order:
        if op not in combining:
            passes.setdefault(find(op), []).append(op)
    with_root = {find(op) for op in roots}
    return [ops for key, ops in passes.items() if key in with_root and _reads_data(ops, x_keys, region)]


def _reads_data(ops: list, x_keys: set, region: graph_lib.ForwardRegion) -> bool:
    """Whether a pass reads values fed or made outside the region besides the xs and
    variables (a batch; not a scalar, an axis or a shape): a weight penalty
    (``sum(square(w))``, ``tf.norm(w)``) reads only its weights, and its gradient runs
    whenever the weights are read."""
    return any(t.op not in region and t.ref() not in x_keys
               and not graph_lib.reads_a_variable(t) and graph_lib.is_float_or_complex(t)
               and t.shape.rank != 0
               for op in ops for t in op.inputs)


def note(region: graph_lib.ForwardRegion, ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
         size: Callable[[tf.Tensor], int]) -> tuple:
    """A line for ``Plan.assumptions`` where ``ys`` sum two or more terms from separate
    forward passes that each make at least :data:`LEAST_SHARE` of the region's bytes."""
    passes = separate_terms(region, ys, xs)
    if len(passes) < 2:
        return ()
    total = sum(size(t) for op in region.order for t in op.outputs) or 1
    weighed = sorted(((sum(size(t) for op in ops for t in op.outputs), ops) for ops in passes),
                     key=lambda pair: -pair[0])
    large = [ops for nbytes, ops in weighed if nbytes >= LEAST_SHARE * total]
    if len(large) < 2:
        return ()
    examples = ", ".join(ops[-1].name for ops in large[:2]) + (", ..." if len(large) > 2 else "")
    return (f"ys sum {len(large)} terms computed by separate forward passes (ending at "
            f"{examples}): TensorFlow may run one term's backward pass while another's "
            "forward pass runs, which neither peak counts, so plain tf.gradients may peak "
            "well below its figure and a plan may save less than said or nothing (a WGAN-GP "
            "critic step: plain 47 MB measured against 81.6 planned, every strategy above "
            "plain): measure the step (peak_memory_during)",)
