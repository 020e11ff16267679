"""Graph passes on a float .tflite before LiteRT Quantizer sees it: what it computes stays, within float error.

Each pass answers what an int8 file of a downloaded model needs to run integer-only, in one XNNPACK
partition (``edgeq.runtime.delegation``):

- ``custom_ops``: MediaPipe's custom ops with a builtin equivalent become it
  (``Convolution2DTransposeBias`` -> ``TRANSPOSE_CONV`` with its bias); any other custom op is refused
  in one line that names it, since nothing quantizes or runs it here.
- ``fixed_batch``: an input whose batch dimension is free (-1) gets batch 1, so a Reshape target that
  a SHAPE op computed becomes a constant for ``folded_constants``.
- ``folded_constants``: every op whose inputs are all constants (DENSIFY of a sparse filter, a
  DEQUANTIZE after it, SHAPE of a static tensor and what is computed from it) is evaluated once by
  the interpreter and becomes the constant it computes. A filter that arrives through an op is seen
  by LiteRT Quantizer as an activation (asymmetric scale), which the interpreter then refuses.
- ``fused_activations``: a standalone RELU, RELU6 or RELU_N1_TO_1 becomes the fused activation of
  the CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED or ADD that writes its input (activation NONE, no
  other reader, not a graph output). XNNPACK takes int8 RELUs only fused: each standalone one cuts
  the graph into another partition and runs on the reference kernel.
- ``prelu``: PRELU(x, a) = x + c * relu(-x) with c = 1 - a, as a 1x1 DEPTHWISE_CONV_2D by -|c| with
  a fused RELU (relu(-|c| x) = |c| relu(-x)), then ADD (SUB where every c is negative; a second 1x1
  depthwise by the sign first where the channels' signs differ, as in MediaPipe's palm detector, alphas
  -4.6..3.6): ops that LiteRT Quantizer and XNNPACK both take at int8. Neither has an int8 PRELU (TF's
  converter writes one, which XNNPACK leaves to the reference kernel), nor (LiteRT Quantizer) a
  LEAKY_RELU, so a one-number alpha takes the same form. Of the forms timed on MediaPipe's face
  landmarks at int8 (1 thread, XNNPACK, AVX-512 VNNI host, 2026-12-07), this is the fastest: 1.19 ms
  (the float file 1.18); a * x + c * relu(x) as MUL, MUL + RELU, ADD took 1.55 ms; a broadcast MUL in
  place of the depthwise took 1.34 ms against its 1.29 (a probe that rewrote only the one-sign PRELUs);
  MAXIMUM(x, a * x) leaves XNNPACK at int8 (a partition each).
- ``global_pools``: an AVERAGE_POOL_2D over the whole map (a squeeze-and-excite block's squeeze, as
  MediaPipe's selfie segmentation writes it) becomes MEAN over height and width: XNNPACK has no int8
  AVERAGE_POOL_2D (on the selfie model: 11 partitions, 3.97 ms at int8; with the pass 1, 2.83 ms).
"""

from __future__ import annotations

import struct

import numpy as np

from edgeq.errors import ModelLoadError
from edgeq.quantize.passes import _builtin, _opcode, _packed, drop_unused_tensors

_NOT_FOLDED = ("VAR_HANDLE", "READ_VARIABLE", "ASSIGN_VARIABLE", "CALL_ONCE", "WHILE", "IF", "MULTINOMIAL",
               "RANDOM_STANDARD_NORMAL", "RANDOM_UNIFORM", "CUSTOM", "DELEGATE")  # fmt: skip
_FOLD_LIMIT = 1 << 24  # elements: a BROADCAST_TO of a constant is not made a 64 MiB constant
_ACTIVATIONS = {"RELU": "RELU", "RELU6": "RELU6", "RELU_N1_TO_1": "RELU_N1_TO_1"}
_FUSES_INTO = {"CONV_2D": "Conv2DOptions", "DEPTHWISE_CONV_2D": "DepthwiseConv2DOptions",
               "FULLY_CONNECTED": "FullyConnectedOptions", "ADD": "AddOptions"}  # fmt: skip
# MediaPipe's TfLitePadding in a custom op's raw options -> the schema's Padding
_TFLITE_PADDING = {1: "SAME", 2: "VALID"}


def _op_name(s, model, op) -> str:
    code = model.operatorCodes[op.opcodeIndex]
    if code.customCode:
        return code.customCode.decode() if isinstance(code.customCode, bytes) else str(code.customCode)
    number = _builtin(model, op)
    return next((k for k, v in vars(s.BuiltinOperator).items() if v == number), str(number))


def _is_constant(model, tensor) -> bool:
    data = model.buffers[tensor.buffer].data if 0 < tensor.buffer < len(model.buffers) else None
    return data is not None and len(data) > 0


def _readers(graph) -> dict[int, list]:
    found: dict[int, list] = {}
    for op in graph.operators or []:
        for t in op.inputs if op.inputs is not None else []:
            if int(t) >= 0:
                found.setdefault(int(t), []).append(op)
    return found


def custom_ops(model, s, where: str) -> int:
    """Rewrite each custom op that has a builtin equivalent; refuse any other in one line."""
    graph, rewritten = model.subgraphs[0], 0
    for op in graph.operators or []:
        code = model.operatorCodes[op.opcodeIndex]
        if not code.customCode:
            continue
        name = _op_name(s, model, op)
        if name != "Convolution2DTransposeBias":
            raise ModelLoadError(
                f"{where}: custom op {name!r} has no builtin equivalent: LiteRT Quantizer cannot quantize it nor "
                "LiteRT run it; export the model without it (or cut the graph before it)"
            )
        _transpose_conv(model, s, graph, op, where)
        rewritten += 1
    return rewritten


def _transpose_conv(model, s, graph, op, where: str) -> None:
    """MediaPipe's Convolution2DTransposeBias (input, weights OHWI, bias; raw TfLiteTransposeConvParams)
    as TRANSPOSE_CONV (output_shape, weights, input, bias), version 3: the one that takes a bias."""
    raw = bytes(bytearray(op.customOptions)) if op.customOptions is not None else b""
    if len(raw) < 12 or struct.unpack_from("<i", raw)[0] not in _TFLITE_PADDING:
        raise ModelLoadError(f"{where}: Convolution2DTransposeBias has options edgeq cannot read ({raw.hex()})")
    padding, stride_w, stride_h = struct.unpack_from("<iii", raw)
    x, weights, bias = (int(t) for t in op.inputs)
    out = graph.tensors[int(op.outputs[0])]
    shape = s.TensorT()
    shape.name, shape.type, shape.shape = out.name + b"/output_shape", s.TensorType.INT32, np.asarray([4], np.int32)
    buffer = s.BufferT()
    buffer.data = np.asarray(out.shape, "<i4").view(np.uint8)
    model.buffers.append(buffer)
    shape.buffer = len(model.buffers) - 1
    graph.tensors.append(shape)
    options = s.TransposeConvOptionsT()
    options.padding = getattr(s.Padding, _TFLITE_PADDING[padding])
    options.strideW, options.strideH = stride_w, stride_h
    op.opcodeIndex = _opcode(model, s, s.BuiltinOperator.TRANSPOSE_CONV, 3)
    op.inputs = np.asarray([len(graph.tensors) - 1, weights, x, bias], np.int32)
    op.builtinOptionsType, op.builtinOptions = s.BuiltinOptions.TransposeConvOptions, options
    op.customOptions, op.customOptionsFormat = None, 0


def fixed_batch(model) -> int:
    """A free (-1) batch dimension of an input becomes 1, in the inputs and the tensors that carry it."""
    graph = model.subgraphs[0]
    inputs = [graph.tensors[int(i)] for i in (graph.inputs if graph.inputs is not None else [])]
    free = [t for t in inputs if t.shapeSignature is not None and len(t.shapeSignature) and t.shapeSignature[0] == -1]
    if not free:
        return 0
    for tensor in graph.tensors:
        if tensor.shapeSignature is not None and len(tensor.shapeSignature) and tensor.shapeSignature[0] == -1:
            signature = np.asarray(tensor.shapeSignature, np.int32).copy()
            signature[0] = 1
            tensor.shapeSignature = None if (signature >= 0).all() else signature
            if tensor.shape is not None and len(tensor.shape):
                tensor.shape = np.asarray([1, *list(tensor.shape)[1:]], np.int32)
    return len(free)


def _static(tensor) -> bool:
    signature = tensor.shapeSignature
    return signature is None or not len(signature) or all(int(d) >= 0 for d in signature)


def _static_shapes(model, s, graph) -> dict[str, int]:
    """Each SHAPE of a tensor whose shape is static becomes the constant it returns."""
    outputs = {int(t) for t in (graph.outputs if graph.outputs is not None else [])}
    gone = []
    for op in graph.operators or []:
        if _op_name(s, model, op) != "SHAPE" or int(op.outputs[0]) in outputs:
            continue
        source, out = graph.tensors[int(op.inputs[0])], graph.tensors[int(op.outputs[0])]
        if not _static(source):
            continue
        dtype = "<i8" if out.type == s.TensorType.INT64 else "<i4"
        buffer = s.BufferT()
        buffer.data = np.asarray(source.shape, dtype).view(np.uint8)
        model.buffers.append(buffer)
        out.buffer, out.shapeSignature = len(model.buffers) - 1, None
        gone.append(op)
    if not gone:
        return {}
    graph.operators = [op for op in graph.operators if all(op is not g for g in gone)]
    return {"SHAPE": len(gone)}


def _foldable(model, s, graph) -> list:
    """The ops whose value is known before any input (all inputs constant, or folded); never one that
    writes a graph output."""
    outputs = {int(t) for t in (graph.outputs if graph.outputs is not None else [])}
    known: set[int] = set()
    found = []
    for op in graph.operators or []:
        name = _op_name(s, model, op)
        ins = [int(t) for t in (op.inputs if op.inputs is not None else []) if int(t) >= 0]
        outs = [int(t) for t in (op.outputs if op.outputs is not None else [])]
        if name in _NOT_FOLDED or model.operatorCodes[op.opcodeIndex].customCode or not ins or not outs:
            continue
        if any(t in outputs for t in outs):
            continue
        ready = all(t in known or _is_constant(model, graph.tensors[t]) for t in ins)
        if ready and all(int(np.prod(graph.tensors[t].shape)) <= _FOLD_LIMIT for t in outs):
            found.append(op)
            known.update(outs)
    return found


def folded_constants(model, s, where: str) -> dict[str, int]:
    """Replace every constant-valued op by the constant it computes (see the module); the ops that went,
    by type."""
    graph = model.subgraphs[0]
    kinds = _static_shapes(model, s, graph)
    fold = _foldable(model, s, graph)
    if not fold:
        return kinds
    for op in fold:
        kinds[_op_name(s, model, op)] = kinds.get(_op_name(s, model, op), 0) + 1
    folded = {id(op) for op in fold}
    written = {int(t) for op in fold for t in op.outputs}
    needed = sorted({int(t) for op in graph.operators if id(op) not in folded for t in op.inputs if int(t) in written})
    values = _evaluated(model, s, fold, needed, where) if needed else {}
    for index, value in values.items():
        tensor = graph.tensors[index]
        buffer = s.BufferT()
        buffer.data = np.frombuffer(np.ascontiguousarray(value).tobytes(), np.uint8)
        model.buffers.append(buffer)
        tensor.buffer, tensor.sparsity = len(model.buffers) - 1, None
        tensor.shape, tensor.shapeSignature = np.asarray(value.shape, np.int32), None
    graph.operators = [op for op in graph.operators if id(op) not in folded]
    sources = {int(t) for op in fold for t in op.inputs if int(t) >= 0} | (written - set(needed))
    drop_unused_tensors(model, graph, sources)
    return kinds


def _evaluated(model, s, fold: list, needed: list[int], where: str) -> dict[int, np.ndarray]:
    """The values of the ``needed`` tensors: a copy of the model whose graph is only the folded ops, with
    those tensors as its outputs and no input, run once."""
    from edgeq.runtime.interpreter import select_backend

    copy = s.ModelT.InitFromPackedBuf(_packed(model, 1 << 20), 0)
    graph = copy.subgraphs[0]
    graph.operators = [graph.operators[i] for i, op in enumerate(model.subgraphs[0].operators) if op in fold]
    graph.inputs = []
    graph.outputs = list(needed)
    copy.signatureDefs, copy.subgraphs = [], [graph]
    _, module = select_backend(None)
    try:
        interpreter = module.Interpreter(
            model_content=_packed(copy, 1 << 20),
            experimental_op_resolver_type=module.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        )
        interpreter.allocate_tensors()
        interpreter.invoke()
        return {t: np.array(interpreter.get_tensor(int(d["index"]))) for t, d in
                zip(needed, interpreter.get_output_details())}  # fmt: skip
    except (ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{where}: its constant ops could not be evaluated ({first}): an edgeq bug") from exc


def fused_activations(model, s) -> int:
    """Fuse each standalone RELU/RELU6/RELU_N1_TO_1 into the op that writes its input (see the module)."""
    graph = model.subgraphs[0]
    outputs = {int(t) for t in (graph.outputs if graph.outputs is not None else [])}
    readers = _readers(graph)
    writer = {int(t): op for op in graph.operators or [] for t in (op.outputs if op.outputs is not None else [])}
    gone = []
    for op in graph.operators or []:
        kind = _ACTIVATIONS.get(_op_name(s, model, op))
        if kind is None or len(op.inputs) != 1:
            continue
        source = int(op.inputs[0])
        producer = writer.get(source)
        options_kind = _FUSES_INTO.get(_op_name(s, model, producer)) if producer is not None else None
        if (
            options_kind is None
            or len(readers.get(source, [])) != 1
            or source in outputs
            or producer.builtinOptions is None
            or producer.builtinOptions.fusedActivationFunction != s.ActivationFunctionType.NONE
        ):
            continue
        producer.builtinOptions.fusedActivationFunction = getattr(s.ActivationFunctionType, kind)
        producer.outputs = np.asarray([int(op.outputs[0])], np.int32)
        writer[int(op.outputs[0])] = producer
        gone.append(op)
    if gone:
        graph.operators = [op for op in graph.operators if all(op is not g for g in gone)]
        drop_unused_tensors(model, graph, {int(op.inputs[0]) for op in gone})
    return len(gone)


def _float_constant(model, s, graph, name: bytes, values: np.ndarray) -> int:
    return _constant(model, s, graph, name, values, s.TensorType.FLOAT32, "<f4")


def _constant(model, s, graph, name: bytes, values: np.ndarray, kind: int, dtype: str) -> int:
    """A constant tensor of ``values`` (``kind``: the schema's TensorType, ``dtype`` its little-endian numpy
    type) with its own buffer; its index."""
    tensor = s.TensorT()
    tensor.name, tensor.type = name, kind
    tensor.shape = np.asarray(np.shape(values), np.int32)
    buffer = s.BufferT()
    buffer.data = np.frombuffer(np.ascontiguousarray(values, dtype).tobytes(), np.uint8)
    model.buffers.append(buffer)
    tensor.buffer = len(model.buffers) - 1
    graph.tensors.append(tensor)
    return len(graph.tensors) - 1


def _float_tensor(s, graph, like, name: bytes) -> int:
    tensor = s.TensorT()
    tensor.name, tensor.type, tensor.buffer = name, s.TensorType.FLOAT32, 0
    tensor.shape = np.asarray(like.shape, np.int32)
    tensor.shapeSignature = like.shapeSignature
    graph.tensors.append(tensor)
    return len(graph.tensors) - 1


def _binary(model, s, builtin: int, inputs: list[int], output: int, activation: str = "NONE"):
    op = s.OperatorT()
    op.opcodeIndex = _opcode(model, s, builtin, 1)
    op.inputs, op.outputs = np.asarray(inputs, np.int32), np.asarray([output], np.int32)
    kind = {s.BuiltinOperator.ADD: "AddOptions", s.BuiltinOperator.SUB: "SubOptions"}.get(builtin, "MulOptions")
    options = getattr(s, f"{kind}T")()
    options.fusedActivationFunction = getattr(s.ActivationFunctionType, activation)
    op.builtinOptionsType, op.builtinOptions = getattr(s.BuiltinOptions, kind), options
    return op


def prelu(model, s) -> int:
    """Each PRELU with a constant alpha as x + (1 - a) * relu(-x) (see the module); how many."""
    graph = model.subgraphs[0]
    rewritten, ops = 0, []
    for op in graph.operators or []:
        alpha_tensor = graph.tensors[int(op.inputs[1])] if _op_name(s, model, op) == "PRELU" else None
        if alpha_tensor is None or not _is_constant(model, alpha_tensor) or alpha_tensor.type != s.TensorType.FLOAT32:
            ops.append(op)
            continue
        data = bytes(bytearray(model.buffers[alpha_tensor.buffer].data))
        alpha = np.frombuffer(data, "<f4").reshape(tuple(int(d) for d in alpha_tensor.shape)).astype(np.float64)
        if np.all(alpha == alpha.flat[0]):
            alpha = alpha.reshape(-1)[:1].reshape([])  # one number: a scalar constant
        ops.extend(_prelu_ops(model, s, graph, int(op.inputs[0]), alpha, int(op.outputs[0])))
        rewritten += 1
    graph.operators = ops
    if rewritten:
        drop_unused_tensors(model, graph, set(range(len(graph.tensors))))
    return rewritten


def _prelu_ops(model, s, graph, x: int, alpha: np.ndarray, y: int) -> list:
    """x + c * relu(-x), c = 1 - a (see the module): relu(-|c| x) = |c| relu(-x) as one op with a fused
    RELU, then ADD (every c >= 0), SUB (every c <= 0), or a scale by the sign and ADD (signs differ)."""
    out = graph.tensors[y]
    name = out.name or b"prelu"
    c = 1.0 - alpha
    rectified = _float_tensor(s, graph, out, name + b"/relu_part")
    ops = [_channel_scale(model, s, graph, x, -np.abs(c), rectified, "RELU")]
    if np.all(c >= 0) or np.all(c <= 0):
        join = s.BuiltinOperator.ADD if np.all(c >= 0) else s.BuiltinOperator.SUB
        return [*ops, _binary(model, s, join, [x, rectified], y)]
    signed = _float_tensor(s, graph, out, name + b"/signed_relu_part")
    ops.append(_channel_scale(model, s, graph, rectified, np.where(c < 0, -1.0, 1.0), signed, "NONE"))
    return [*ops, _binary(model, s, s.BuiltinOperator.ADD, [x, signed], y)]


def _channel_scale(model, s, graph, x: int, scale: np.ndarray, y: int, activation: str):
    """y = activation(scale * x), ``scale`` one number or one per channel (last axis). On an NHWC tensor a
    1x1 DEPTHWISE_CONV_2D with zero bias (its weights quantized per channel, run by XNNPACK's depthwise
    kernel: measured faster at int8 than a MUL that broadcasts a channel vector); else a MUL."""
    tensor = graph.tensors[x]
    name = (graph.tensors[y].name or b"scale") + b"/scale"
    shape = [int(d) for d in tensor.shape] if tensor.shape is not None else []
    if len(shape) != 4 or shape[-1] <= 0 or np.size(scale) not in (1, shape[-1]):  # alpha per pixel too
        return _binary(model, s, s.BuiltinOperator.MUL, [x, _float_constant(model, s, graph, name, scale.astype(
            np.float32))], y, activation)  # fmt: skip
    channels = shape[-1]
    weights = np.broadcast_to(np.reshape(scale, -1), (channels,)).reshape(1, 1, 1, channels)
    op = s.OperatorT()
    op.opcodeIndex = _opcode(model, s, s.BuiltinOperator.DEPTHWISE_CONV_2D, 1)
    inputs = [x, _float_constant(model, s, graph, name, weights.astype(np.float32)),
              _float_constant(model, s, graph, name + b"/bias", np.zeros(channels, np.float32))]  # fmt: skip
    op.inputs, op.outputs = np.asarray(inputs, np.int32), np.asarray([y], np.int32)
    options = s.DepthwiseConv2DOptionsT()
    options.padding, options.strideW, options.strideH, options.depthMultiplier = s.Padding.VALID, 1, 1, 1
    options.dilationWFactor = options.dilationHFactor = 1
    options.fusedActivationFunction = getattr(s.ActivationFunctionType, activation)
    op.builtinOptionsType, op.builtinOptions = s.BuiltinOptions.DepthwiseConv2DOptions, options
    return op


def _as_mul(model, s, op_name: str, second) -> int:
    """Each float ``op_name`` op as MUL(x, second(graph, x, y)); how many."""
    graph = model.subgraphs[0]
    rewritten, ops = 0, []
    for op in graph.operators or []:
        x = int(op.inputs[0]) if _op_name(s, model, op) == op_name else -1
        if x < 0 or graph.tensors[x].type != s.TensorType.FLOAT32:
            ops.append(op)
            continue
        y = int(op.outputs[0])
        ops.append(_binary(model, s, s.BuiltinOperator.MUL, [x, second(graph, x, y)], y))
        rewritten += 1
    graph.operators = ops
    return rewritten


def negations(model, s) -> int:
    """Each float NEG as MUL by a constant -1: LiteRT has no int8 NEG kernel (float, int32, int64 only),
    and int8 MUL runs in LiteRT and XNNPACK; -x is exact in float. How many."""

    def minus_one(graph, x, y):
        name = (graph.tensors[y].name or b"neg") + b"/minus_one"
        return _float_constant(model, s, graph, name, np.asarray(-1.0, np.float32))

    return _as_mul(model, s, "NEG", minus_one)


def squares(model, s) -> int:
    """Each float SQUARE as MUL(x, x): LiteRT Quantizer leaves SQUARE float, int8 MUL runs in LiteRT and
    XNNPACK; x * x is SQUARE's own float. How many."""
    return _as_mul(model, s, "SQUARE", lambda graph, x, y: x)


def global_pools(model, s) -> int:
    """Each float AVERAGE_POOL_2D that averages its whole input (the window is the input's height and width,
    one output pixel, no fused activation: the squeeze of a squeeze-and-excite block) as MEAN over axes 1
    and 2, keeping them: the same sum divided by the same count. XNNPACK has no int8 AVERAGE_POOL_2D, so each
    one runs outside the delegate on the reference kernel; int8 MEAN over the spatial axes it takes. How many."""
    graph = model.subgraphs[0]
    rewritten = 0
    for i, op in enumerate(graph.operators or []):
        if _op_name(s, model, op) != "AVERAGE_POOL_2D":
            continue
        x, y = graph.tensors[int(op.inputs[0])], graph.tensors[int(op.outputs[0])]
        o = op.builtinOptions
        in_shape = [int(d) for d in x.shape] if x.shape is not None else []
        out_shape = [int(d) for d in y.shape] if y.shape is not None else []
        whole = (
            x.type == s.TensorType.FLOAT32
            and len(in_shape) == 4
            and len(out_shape) == 4
            and out_shape[1:3] == [1, 1]
            and (o.filterHeight, o.filterWidth) == tuple(in_shape[1:3])
            and o.fusedActivationFunction == s.ActivationFunctionType.NONE
        )
        if not whole:
            continue
        axes = _constant(model, s, graph, (y.name or b"pool") + b"/axes", np.asarray([1, 2]), s.TensorType.INT32, "<i4")
        mean = s.OperatorT()
        mean.opcodeIndex = _opcode(model, s, s.BuiltinOperator.MEAN, 1)
        mean.inputs, mean.outputs = np.asarray([int(op.inputs[0]), axes], np.int32), np.asarray(op.outputs, np.int32)
        options = s.ReducerOptionsT()
        options.keepDims = True
        mean.builtinOptionsType, mean.builtinOptions = s.BuiltinOptions.ReducerOptions, options
        graph.operators[i] = mean
        rewritten += 1
    return rewritten
