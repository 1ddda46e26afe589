"""Which fed tensors' unknown first dimensions must be the same size.

Layer: analysis (reads the user's graph, changes nothing); imports: graph, _tensorflow.

The planner counts every unknown dimension as one size, the batch.  That is right
for the inputs of a supervised step (images and labels are fed the same number
of rows: the loss combines them elementwise), and wrong where a step is fed
counts that differ (a graph network's nodes and edges, a mixture of experts'
tokens and routes): there the plan can be off by the ratio of the counts.

TensorFlow's own shape functions tell the two apart.  The ops the region is
computed from are imported into a scratch graph with each fed tensor's unknown
first dimension set to a known size; where one group of them is given a size
different from the rest and every op still infers its shape, nothing ties the
group to the rest.  The user's graph is only read (``as_graph_def``).
"""

from __future__ import annotations

import itertools
import logging
import weakref

from . import graph as graph_lib
from ._tensorflow import tf

logger = logging.getLogger(__name__)

#: Sizes given to the unknown first dimensions: equal in their factors of 2, 3, 5 and 7
#: (a reshape into ``[-1, 32]`` divides both or neither), different in one prime.
SAME_SIZE, OTHER_SIZE = 2**6 * 3**2 * 5 * 7 * 11, 2**6 * 3**2 * 5 * 7 * 13
#: Most fed tensors looked at, and most scratch imports made, per region: every group
#: of one or two of five fed tensors (a graph network's nodes, senders, receivers, edge
#: features and targets).
MOST_FED = 6
MOST_IMPORTS = 16
#: Graphs whose definition is larger than this are not imported (constants held in a
#: ``tf.compat.v1`` graph): the check says nothing there.
MOST_GRAPH_BYTES = 64 * 2**20

_found: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()


def fed_with_unknown_first_dimension(region: graph_lib.ForwardRegion) -> list:
    """The tensors fed to the region (:func:`graph.fed_tensors`) whose first dimension is
    unknown, in the order their ops were made: the outputs of ops that read no data
    (placeholders, a dataset iterator's elements), not those made from scalars (a
    ``tf.range`` over another input's count, which its shape ties), and only those some
    op reads (not a dataset element the model leaves unused)."""
    fed = [t for t in graph_lib.fed_tensors(region)
           if t.shape.rank and t.shape.as_list()[0] is None
           and t.dtype not in (tf.resource, tf.variant)
           and all(i.dtype in (tf.resource, tf.variant) for i in t.op.inputs)
           and t.consumers()]
    return sorted(fed, key=graph_lib.tensor_order)


def untied_group(region: graph_lib.ForwardRegion) -> tuple:
    """``(group, rest)``: fed tensors whose unknown first dimension nothing in the graph
    ties to that of the ``rest`` (each a non-empty list), or ``()`` where every such
    tensor must be fed the same number of rows, where fewer than two are fed, or where
    the check could not be made.  Remembered per graph and region."""
    fed = fed_with_unknown_first_dimension(region)
    if len(fed) < 2:
        return ()
    graph = fed[0].graph
    key = (tuple(t.name for t in fed), frozenset(op.name for op in region.ops))
    known = _found.setdefault(graph, {})
    if key not in known:
        try:
            known[key] = _untied_group(region, fed)
        except Exception as error:  # advice only: it must never fail a rewrite
            logger.debug("size ties: not checked (%s: %s)", type(error).__name__, error)
            known[key] = ()
    return known[key]


def _untied_group(region: graph_lib.ForwardRegion, fed: list) -> tuple:
    needed = _ops_above(region)
    # an output of a source that nothing reads (a dataset element the model leaves
    # unused) is tied to nothing, and says nothing
    fed = [t for t in fed if any(c in needed for c in t.consumers())][:MOST_FED]
    if len(fed) < 2:
        return ()
    definition = _definition_of(needed)
    if definition is None:
        return ()
    unknown = sorted(op.name for op in region.ops
                     if any(graph_lib.has_unknown_size(t) for t in op.outputs))
    imports = 0
    # a group and its complement are the same test: groups up to half of the fed tensors
    for size in range(1, len(fed) // 2 + 1):
        for group in itertools.combinations(range(len(fed)), size):
            if imports == MOST_IMPORTS:
                return ()
            imports += 1
            inferred = _shapes_infer(definition, fed, set(group), unknown)
            if inferred is None:
                return ()  # some size stays unknown: an op that meets it cannot tie it
            if inferred:
                chosen = [fed[i] for i in group]
                return chosen, [t for i, t in enumerate(fed) if i not in group]
    return ()


def _ops_above(region: graph_lib.ForwardRegion) -> set:
    """The region's ops and every op they depend on (data and control inputs)."""
    needed, pending = set(), list(region.ops)
    while pending:
        op = pending.pop()
        if op in needed:
            continue
        needed.add(op)
        pending.extend(t.op for t in op.inputs)
        pending.extend(op.control_inputs)
    return needed


def _definition_of(ops: set):
    """The graph definition of ``ops`` (and the graph's functions), without colocation
    constraints (they may name ops left out); None where it is too large."""
    graph = next(iter(ops)).graph
    nodes = [op.node_def for op in sorted(ops, key=graph_lib.op_order)]
    if sum(node.ByteSize() for node in nodes) > MOST_GRAPH_BYTES:
        logger.debug("size ties: %d ops too large to import", len(nodes))
        return None
    whole = graph.as_graph_def()
    definition = tf.compat.v1.GraphDef()
    definition.versions.CopyFrom(whole.versions)
    definition.library.CopyFrom(whole.library)
    for node in nodes:
        kept = definition.node.add()
        kept.CopyFrom(node)
        if "_class" in kept.attr:
            del kept.attr["_class"]
    return definition, _variable_values(ops)


def _variable_values(ops: set) -> list:
    """The outputs of ops that read a resource and have a known shape (variables'
    values): in a ``tf.function`` the handles are captured placeholders, which carry the
    variables' shapes only in Python, so a scratch import would lose every shape that a
    weight decides."""
    return [t for op in ops if any(i.dtype == tf.resource for i in op.inputs)
            for t in op.outputs
            if t.dtype not in (tf.resource, tf.variant) and t.shape.is_fully_defined()]


def _shapes_infer(definition: tuple, fed: list, group: set, unknown: list) -> bool | None:
    """Whether every op of ``definition`` (a graph definition, and the variables' values
    to feed it with their shapes) infers its shape with the first dimension of the
    fed tensors in ``group`` set to one size and that of the others to another: False
    where one cannot; None where they can but an op named in ``unknown`` (the region's
    ops of unknown output size) still has an output of unknown size, which a later op
    could not have tied to anything (a loop's outputs keep their traced shapes, a
    ``tf.signal.frame`` loses its rows: an audio or recurrent classifier's images and
    labels then seemed untied)."""
    definition, values = definition
    with tf.Graph().as_default() as scratch:
        input_map = {t.name: tf.compat.v1.placeholder(t.dtype, t.shape) for t in values}
        for i, t in enumerate(fed):
            dims = t.shape.as_list()
            dims[0] = OTHER_SIZE if i in group else SAME_SIZE
            input_map[t.name] = tf.compat.v1.placeholder(t.dtype, dims)
        try:
            tf.graph_util.import_graph_def(definition, input_map=input_map, name="")
        except (ValueError, TypeError, tf.errors.OpError) as error:
            logger.debug("size ties: %s", str(error).splitlines()[0][:300])
            return False
        for name in unknown:
            op = scratch.get_operation_by_name(name)
            lost = next((t for t in op.outputs if graph_lib.has_unknown_size(t)), None)
            if lost is not None:
                logger.debug("size ties: %s %s stays unknown", lost.name, lost.shape)
                return None
    return True
