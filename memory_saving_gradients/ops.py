"""What the library knows about TensorFlow op types: one documented set per property.

Layer: foundation (pure data); imports nothing of the library or TensorFlow.

Every rule that depends on an op's type reads one of these sets, so that
supporting a new op type (a new matrix product, say) is an edit here.
``tests/test_ops.py`` checks that the sets agree with each other and that
each name is an op type registered in the installed TensorFlow.  Types are
filtered by these sets, never by op name.
"""

from __future__ import annotations

# -- control flow ------------------------------------------------------------------

#: v1 ``tf.while_loop`` / ``tf.cond`` primitives (``Ref`` variants included).
V1_CONTROL_FLOW = frozenset({
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
    "RefExit", "NextIteration", "RefNextIteration", "LoopCond",
})
#: v1 ``Merge`` s: the op that joins a ``tf.cond``'s branches.
V1_MERGES = frozenset({"Merge", "RefMerge"})
#: v1 ``Enter`` s: the ops through which a ``tf.while_loop``'s frame is entered.
V1_ENTERS = frozenset({"Enter", "RefEnter"})
#: v1 ``Switch`` es: the op that feeds a ``tf.cond``'s branches.
V1_SWITCHES = frozenset({"Switch", "RefSwitch"})

#: Control flow (v1 and v2) and function calls: kept whole, never recomputed, since
#: copying them one op at a time would split loop frames or function semantics.
CONTROL_FLOW = V1_CONTROL_FLOW | frozenset({
    "ControlTrigger", "While", "StatelessWhile", "If", "StatelessIf", "Case",
    "StatelessCase", "PartitionedCall", "StatefulPartitionedCall",
    "SymbolicGradient", "TPUPartitionedCall",
})

#: Calls of a ``tf.function`` (a ``FunctionDef`` of the graph's library).
FUNCTION_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})

# -- aliases: ops whose output is their input's buffer ------------------------------

#: Output is the first input's value: grappler removes them and hands their consumers
#: the input itself.
VALUE_FORWARDING = frozenset(
    {"Identity", "Snapshot", "StopGradient", "PreventGradient", "EnsureShape"})
#: Output holds exactly the first input's elements (a new shape, the same buffer);
#: grappler removes them when the static shapes are equal.
SAME_ELEMENTS = frozenset({"Reshape", "Squeeze", "ExpandDims"})
#: Transposes: one by the identity permutation shares its input's buffer
#: (:func:`.graph.is_identity_transpose`).
TRANSPOSES = frozenset({"Transpose"})
#: What grappler calls cast-like: ops that change the element type and keep the element
#: count.  Its arithmetic optimizer moves a widening one past an ``Identity`` that reads
#: it (``Identity(Cast(x))`` becomes ``Cast(Identity(x))``), so that the identity then
#: holds ``x`` (:func:`.rewrite.proxies` keeps its proxies of them as built).
CAST_LIKE = frozenset({
    "Angle", "Bucketize", "Cast", "Dequantize", "HistogramFixedWidth", "Imag", "IsFinite",
    "IsInf", "IsNan", "QuantizeDownAndShrinkRange", "QuantizeV2",
    "QuantizedInstanceNorm", "QuantizedRelu", "QuantizedRelu6", "QuantizedReluX", "Real",
    "Requantize",
})
#: Reads of a resource variable's value.
VARIABLE_READS = frozenset({"ReadVariableOp"})
#: Ops that touch a resource variable sparsely, which switches it to copy-on-read for
#: good (TensorFlow's ``EnsureSparseVariableAccess``): gathers and scatters on the variable
#: itself.  The sparse optimizer updates (``ResourceSparseApply*``) do too
#: (:func:`.graph.copies_on_read`).
SPARSE_VARIABLE_ACCESS = frozenset({
    "ResourceGather", "ResourceGatherNd", "ResourceScatterAdd", "ResourceScatterSub",
    "ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterMin", "ResourceScatterMax",
    "ResourceScatterUpdate", "ResourceScatterNdAdd", "ResourceScatterNdSub",
    "ResourceScatterNdUpdate", "ResourceScatterNdMin", "ResourceScatterNdMax",
})
#: A TensorList made from a tensor: its elements are slices of that tensor's buffer,
#: which the list holds as long as it lives (a recurrent layer's input sequence).
LISTS_OF_SLICES = frozenset({"TensorListFromTensor"})
#: v1 reference variables (an ``Identity`` of one is the read of its value).
REF_VARIABLES = frozenset({"VariableV2", "Variable"})
#: Checks that pass their input on (its buffer), raising where it holds a NaN or an
#: infinity (``tf.debugging.check_numerics``).  They are registered stateful only so
#: that grappler neither folds nor prunes them: their result is a function of their
#: input, so a copy of them is recomputed like a pure op (kept, each one made every
#: layer a checkpoint and the step saved nothing).
CHECKS_OF_THEIR_INPUT = frozenset({"CheckNumerics", "CheckNumericsV2"})
#: Ops whose output may be all zeros (a fill, a constant), which grappler's arithmetic
#: optimizer drops from a sum.
MAY_BE_ZEROS = frozenset({"ZerosLike", "Fill", "Const", "BroadcastTo"})
#: ``tf.py_function``: its Python code runs eagerly, and its gradient reads the eager
#: tape TensorFlow records at each call (stateful: never recomputed).
EAGER_PYTHON_FUNCTIONS = frozenset({"EagerPyFunc"})
#: ``tf.numpy_function(..., stateful=False)``: registered stateless, so recomputed; its
#: Python code then runs again.
STATELESS_PYTHON_FUNCTIONS = frozenset({"PyFuncStateless"})
#: Outputs that share their input's memory in the memory model: no new buffer.
ALIASES = (VALUE_FORWARDING | SAME_ELEMENTS | VARIABLE_READS | LISTS_OF_SLICES
           | CHECKS_OF_THEIR_INPUT)

#: v1 ``TensorArray`` ops whose registered gradient finds its accumulator by the name
#: scope of the gradient it receives (``tensor_array_grad._GetGradSource``): an in-place
#: step hands them gradients renamed into its own scope.
GRADIENT_FINDS_ACCUMULATOR_BY_NAME = frozenset({
    "TensorArrayReadV3", "TensorArrayWriteV3", "TensorArrayGatherV3", "TensorArrayScatterV3",
    "TensorArrayConcatV3", "TensorArraySplitV3",
})

#: Sources whose values the step does not allocate: what is fed, constants, variables,
#: a dataset's elements (made by the input pipeline, outside the step's kernels).
NOT_ALLOCATED_IN_STEP = frozenset({
    "Placeholder", "PlaceholderWithDefault", "Const", "VarHandleOp", "VariableV2", "Variable",
    "IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue",
    "MultiDeviceIteratorGetNextFromShard",
})

# -- shapes only ----------------------------------------------------------------------

#: Ops that read only the shapes of their inputs: a tensor they read holds no buffer
#: alive for them.
SHAPE_ONLY_READERS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs"})

# -- cost ----------------------------------------------------------------------------------

#: Convolutions TensorFlow's own CPU kernels give a transient workspace (without oneDNN).
CONVOLUTIONS = frozenset({
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv3DBackpropInputV2",
})
#: Matrix products.
MATRIX_PRODUCTS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
#: Ops expensive to recompute, whose outputs the ``'speed'`` strategy keeps: the
#: convolutions and matrix products, and grappler's fused forms of them.
EXPENSIVE = CONVOLUTIONS | MATRIX_PRODUCTS | frozenset({"_FusedConv2D", "_FusedMatMul"})
#: Fused batch normalisation (the forward ops).
BATCH_NORMS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})

# -- what an op's registered gradient reads of the forward pass (besides shapes) ------------
# Used by the memory model, and to decide whether a one-op segment is better
# differentiated in place.  Types in none of these sets are taken to read their inputs.

#: The gradient reads neither inputs nor outputs.
GRADIENT_READS_NOTHING = frozenset({
    "Add", "AddV2", "Sub", "AddN", "Neg", "Identity", "IdentityN", "Reshape",
    "Squeeze", "ExpandDims", "BiasAdd", "ConcatV2", "Concat", "Pack", "Unpack",
    "Split", "SplitV", "Slice", "StridedSlice", "Transpose", "Pad", "Cast",
    "Sum", "Mean", "Tile", "StopGradient", "ReadVariableOp", "ResourceGather",
    "GatherV2", "BroadcastTo", "ZerosLike", "OnesLike", "Snapshot", "EnsureShape",
    "TensorListFromTensor", "TensorListSetItem",
    # rearrangements whose gradient is the inverse rearrangement of the incoming one
    # (a dilated convolution's SpaceToBatchND / BatchToSpaceND, a mirror pad, a roll)
    "SpaceToBatchND", "BatchToSpaceND", "SpaceToBatch", "BatchToSpace", "SpaceToDepth",
    "DepthToSpace", "PadV2", "MirrorPad", "ReverseV2", "Roll", "MatrixBandPart",
    "GatherNd", "Cumsum", "ResizeNearestNeighbor", "AvgPool", "AvgPool3D",
    "CheckNumerics", "CheckNumericsV2",
})
#: The gradient reads the outputs only.
GRADIENT_READS_OUTPUTS = frozenset({
    "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "Exp", "Sqrt", "Rsqrt",
    "Softmax", "LogSoftmax", "Reciprocal", "Inv",
})
#: The gradient reads the first input only: a select's condition (its branches' shapes
#: are read, not their values).
GRADIENT_READS_FIRST_INPUT = frozenset({"Select", "SelectV2"})
#: The gradient reads the second input only: the gradients of rectifiers' gradients
#: (``ReluGrad(dy, features)``, differentiated again by a gradient penalty or a
#: Hessian-vector product) read the features, never the incoming gradient.
GRADIENT_READS_SECOND_INPUT = frozenset({"ReluGrad", "Relu6Grad", "LeakyReluGrad"})
#: Gradients that make ``zeros_like`` of an input (op type -> the input's index): where
#: the input's shape is not static, that is a ``ZerosLike`` op reading the input (in a
#: loop, TensorFlow keeps it for the gradient); a static shape makes a constant.
GRADIENT_ZEROS_LIKE_INPUT = {"TensorListSetItem": 2, "Select": 1}
#: The gradient reads the inputs and the outputs.
GRADIENT_READS_INPUTS_AND_OUTPUTS = frozenset({"MaxPool", "MaxPoolV2", "MaxPool3D", "Max", "Min", "Prod"})
#: The gradient reads the second output only (the loss's backprop, saved by the op).
GRADIENT_READS_SECOND_OUTPUT = frozenset(
    {"SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits"})
#: Batch norms (and their gradients, when differentiated again): the gradient reads the
#: first two inputs (x, scale) and the saved statistics (outputs 3 on).
GRADIENT_READS_TWO_INPUTS_AND_SAVED_OUTPUTS = frozenset({
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
    "FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3",
})
#: Products of two inputs whose gradient for one input reads only the other: an input
#: is read only if the other one needs a gradient (grappler prunes the unused half).
GRADIENT_READS_OTHER_INPUT = frozenset({
    "Mul", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D",
    "Conv3D", "DepthwiseConv2dNative",
})

#: Max pools whose oneDNN kernel records the position of each output's maximum in a
#: workspace of one byte per output element (measured: 0.25 MB beside a 1 MB float32
#: output), which the pool's gradient reads: held until then, or freed when the kernel
#: returns where no gradient reads the pool (:func:`.workspace.kept_for_gradient_bytes`).
ONEDNN_MAX_POOLS = frozenset({"MaxPool", "MaxPoolV2"})

#: Divisions ``x / y``: the gradient for ``x`` reads ``y``; the one for ``y`` reads ``x``
#: and ``y``.  ``x`` is read only if ``y`` needs a gradient (attention scores divided by a
#: constant are not held for it: grappler prunes the unused half).
GRADIENT_READS_DIVISOR = frozenset({"RealDiv", "Div", "DivNoNan"})

# -- what kind of gradient an op's gradient function gives ------------------------------------

#: The gradient passes each output gradient's kind (dense / ``IndexedSlices``) on to
#: the matching input (or the one output's kind to every input).
GRADIENT_PASSES_KIND = frozenset({"Identity", "IdentityN", "ReadVariableOp", "AddN", "Cast"})
#: Activations whose gradient is one elementwise kernel of their output's (or input's)
#: value and their output's gradient (``ReluGrad``, ``TanhGrad``, ...): TensorFlow's
#: kernel writes its result into the incoming gradient's buffer when nothing else holds
#: it (``forward_input_or_allocate_output``), so the input's gradient takes no new buffer.
GRADIENT_WRITES_INTO_INCOMING = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Softplus", "Softsign",
})
#: Elementwise kernels that write their output into an input's buffer of the same size
#: and dtype where nothing else will read that input (``forward_input_or_allocate_output``):
#: measured in place on CPU (oneDNN on) for each unary kind here and for a product, sum,
#: difference, quotient, maximum or power with a constant, a bias add and a softmax; a
#: cast and a select take a new buffer.
IN_PLACE_ELEMENTWISE = frozenset({
    "Tanh", "Sigmoid", "Exp", "Log", "Log1p", "Expm1", "Square", "Sqrt", "Rsqrt", "Relu",
    "Relu6", "Elu", "Selu", "LeakyRelu", "Softplus", "Softsign", "Neg", "Abs", "Erf", "Erfc",
    "Sin", "Cos", "Reciprocal", "Inv", "Floor", "Ceil", "Round", "Sign", "Mul", "MulNoNan",
    "AddV2", "Add", "Sub", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "BiasAdd", "Softmax", "LogSoftmax",
})
#: Ops whose gradient is the incoming gradient itself, or a reshape of it (a variable
#: read's, an identity's): the input's gradient is the output's buffer, no new one.
GRADIENT_IS_INCOMING = frozenset({
    "Identity", "ReadVariableOp", "Snapshot", "Reshape", "Squeeze", "ExpandDims",
    "EnsureShape", "CheckNumerics", "CheckNumericsV2",
})
#: Of those, the ops that pass the incoming gradient on as it is, of the same kind: an
#: ``IndexedSlices`` (a gathered table's rows) stays one through a variable read or an
#: identity (a reshape, a squeeze, an expand makes it dense, and so does a check, whose
#: gradient is a check of the incoming gradient).
GRADIENT_PASSED_ON_AS_IS = (GRADIENT_IS_INCOMING - {"Reshape", "Squeeze", "ExpandDims"}
                            - CHECKS_OF_THEIR_INPUT)
#: Gathers: the gradient of the params is an ``IndexedSlices`` (for ``GatherV2``, on axis 0).
GATHERS = frozenset({"GatherV2", "ResourceGather", "Gather"})

#: Every set above, by name (for the consistency tests).
ALL_SETS = {
    name: value for name, value in dict(globals()).items()
    if name.isupper() and isinstance(value, frozenset)
}
