"""Edits of a converted .tflite flatbuffer: what it computes stays, up to a rounding step.

- ``fuse_requantize``: the converter sometimes leaves ``DEQUANTIZE (int8 -> float) ->
  QUANTIZE (float -> int8)`` between two integer ops, e.g. after a model input that feeds
  a ``Rescaling`` with an offset (MobileNetV3's and EfficientNetV2's preprocessing). The
  pair is one requantization, which TFLite's QUANTIZE op does int8 -> int8 in integer
  arithmetic; the float tensor between them disappears.
- ``with_weight_codes``: edgeq's chosen weight codes and scales (``--weight-ranges``,
  ``--rounding``, W4A8) written into the filters the converter quantized.
- ``unfuse_hard_swish``: int8 HARD_SWISH as ADD/MUL, which XNNPACK runs in one partition.
- ``drop_unused_tensors``: tensors no op uses any more, removed (indices renumbered).

A float .tflite is made ready for LiteRT Quantizer in ``float_model`` and ``float_passes``.

Verification after conversion still compares the edited model with the Keras model.
"""

from __future__ import annotations

import numpy as np

from edgeq.runtime.flatbuffer import schema

_INTEGER = ("INT8", "UINT8", "INT16")


def _packed(model, size_hint: int) -> bytes:
    """An edited flatbuffer object model, written out as a .tflite."""
    import flatbuffers

    builder = flatbuffers.Builder(size_hint + 4096)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _unpacked(content: bytes):
    """The flatbuffer's object model, each buffer's bytes inside it: LiteRT Quantizer may write constants
    after the flatbuffer (a buffer's offset and size), which packing the object model would drop."""
    s = schema()
    model = s.ModelT.InitFromPackedBuf(content, 0)
    for buffer in model.buffers or []:
        if buffer.offset and buffer.offset > 1:
            buffer.data = np.frombuffer(content[buffer.offset : buffer.offset + buffer.size], np.uint8)
            buffer.offset = buffer.size = 0
    return model


def _builtin(model, op) -> int:
    code = model.operatorCodes[op.opcodeIndex]
    return max(code.builtinCode, code.deprecatedBuiltinCode)


def fuse_requantize(content: bytes) -> tuple[bytes, int]:
    """Replace each integer->float->integer DEQUANTIZE/QUANTIZE pair by one QUANTIZE.

    Returns the new flatbuffer and how many pairs were fused (0: ``content`` itself).
    """

    s = schema()
    model = _unpacked(content)
    dequantize, quantize = s.BuiltinOperator.DEQUANTIZE, s.BuiltinOperator.QUANTIZE
    integer = {getattr(s.TensorType, name) for name in _INTEGER}
    fused = 0
    for graph in model.subgraphs or []:
        uses: dict[int, int] = {}
        for op in graph.operators or []:
            for t in op.inputs if op.inputs is not None else []:
                uses[int(t)] = uses.get(int(t), 0) + 1
        outputs = {int(t) for t in (graph.outputs if graph.outputs is not None else [])}
        keep = []
        operators = [op for op in graph.operators or [] if op.inputs is not None and len(op.inputs)]
        consumer_of = {int(op.inputs[0]): op for op in operators}
        for op in graph.operators or []:
            if _builtin(model, op) == dequantize and len(op.inputs) == 1 and len(op.outputs) == 1:
                source, middle = int(op.inputs[0]), int(op.outputs[0])
                after = consumer_of.get(middle)
                if (
                    graph.tensors[source].type in integer
                    and uses.get(middle, 0) == 1
                    and middle not in outputs
                    and after is not None
                    and _builtin(model, after) == quantize
                    and graph.tensors[int(after.outputs[0])].type in integer
                ):
                    after.inputs = [source, *(int(t) for t in after.inputs[1:])]
                    # The float tensor between them is now unused; give it the source's type so
                    # that no float tensor is left in an integer-only graph.
                    graph.tensors[middle].type = graph.tensors[source].type
                    graph.tensors[middle].quantization = graph.tensors[source].quantization
                    fused += 1
                    continue
            keep.append(op)
        graph.operators = keep
    if not fused:
        return content, 0
    return _packed(model, len(content)), fused


def _dequantized(tensor, buffers, qdim: int):

    data = np.frombuffer(bytes(bytearray(buffers[tensor.buffer].data)), dtype=np.int8).reshape(tensor.shape)
    q = tensor.quantization
    shape = [1] * data.ndim
    scale = np.asarray(q.scale, np.float64)
    if scale.size > 1:
        shape[qdim] = -1
    return (data.astype(np.float64) - np.asarray(q.zeroPoint).reshape(shape)) * scale.reshape(shape), scale


def with_weight_codes(content: bytes, kernels) -> tuple[bytes, list[str]]:
    """Write edgeq's chosen weight codes and scales into a converted model's int8 filters.

    ``kernels``: ``edgeq.quantize.ptq.KernelCodes``, whose codes times scale are the float
    kernels the converter was given. Each is found as the one int8 constant of its layout's
    shape whose values the converter's codes reproduce (within half its step), its data and
    scale become edgeq's, and the int32 bias of each op reading it is requantized to the new
    input-times-filter scale. A filter the converter changed is not found: EfficientNet's input
    Normalization divides by a per-channel std that the converter folds into the stem conv's
    filter. Those keep the converter's codes. Returns the new flatbuffer and the layers not found.
    """

    from edgeq.quantize.numerics import pack_int4

    s = schema()
    model = _unpacked(content)
    graph = model.subgraphs[0]
    buffers = model.buffers
    int8, int32 = s.TensorType.INT8, s.TensorType.INT32
    candidates = [
        i
        for i, t in enumerate(graph.tensors)
        if t.type == int8 and t.buffer and buffers[t.buffer].data is not None and len(buffers[t.buffer].data)
        and t.quantization is not None and t.quantization.scale is not None
    ]  # fmt: skip
    readers: dict[int, list] = {}
    for op in graph.operators or []:
        if op.inputs is not None and len(op.inputs) > 1:
            readers.setdefault(int(op.inputs[1]), []).append(op)
    taken: set[int] = set()
    missing: list[str] = []
    for kernel in kernels:
        codes, scale, qdim = kernel.tflite_layout()
        want = codes.astype(np.float64) * (scale.reshape([-1 if d == qdim else 1 for d in range(codes.ndim)]))
        found = None
        for index in candidates:
            tensor = graph.tensors[index]
            if index in taken or tuple(tensor.shape) != codes.shape:
                continue
            values, step = _dequantized(tensor, buffers, int(tensor.quantization.quantizedDimension))
            if np.all(np.abs(values - want) <= 0.5 * step.max() * (1 + 1e-4) + 1e-12):
                found = index
                break
        if found is None:  # the converter changed it (a scale before it folded in): its own codes stay
            missing.append(kernel.layer)
            continue
        taken.add(found)
        tensor = graph.tensors[found]
        buffers.append(s.BufferT())
        if kernel.bits == 4:  # TFLite's INT4 tensors: two codes per byte, low nibble first
            buffers[-1].data = pack_int4(codes)
            tensor.type = s.TensorType.INT4
        else:
            buffers[-1].data = np.ascontiguousarray(codes, np.int8).view(np.uint8).reshape(-1)
        tensor.buffer = len(buffers) - 1
        tensor.quantization.scale = [float(v) for v in scale]
        tensor.quantization.zeroPoint = [0] * len(scale)
        tensor.quantization.quantizedDimension = qdim if len(scale) > 1 else 0
        for op in readers.get(found, []):
            if len(op.inputs) < 3 or int(op.inputs[2]) < 0:
                continue
            bias = graph.tensors[int(op.inputs[2])]
            if bias.type != int32 or not bias.buffer:
                continue
            values = np.frombuffer(bytes(bytearray(buffers[bias.buffer].data)), dtype=np.int32).astype(np.float64)
            in_scale = float(graph.tensors[int(op.inputs[0])].quantization.scale[0])
            old = np.asarray(bias.quantization.scale, np.float64)
            new = in_scale * scale  # one scale per channel, or one for all (per-tensor)
            requantized = np.clip(np.round(values * old / new), -(2**31), 2**31 - 1).astype(np.int32)
            buffers.append(s.BufferT())
            buffers[-1].data = requantized.view(np.uint8).reshape(-1)
            bias.buffer = len(buffers) - 1
            bias.quantization.scale = [float(v) for v in new]
            bias.quantization.zeroPoint = [0] * len(new)
    used = {int(t.buffer) for g in model.subgraphs for t in g.tensors}
    for index, buffer in enumerate(buffers):
        if index and index not in used:  # a replaced filter's or bias's old data: dropped, indices kept
            buffer.data = None
    return _packed(model, len(content)), missing


def _opcode(model, s, builtin: int, version: int) -> int:
    """The index of ``builtin``'s operator code in ``model``, added when missing."""
    for i, code in enumerate(model.operatorCodes):
        if max(code.builtinCode, code.deprecatedBuiltinCode) == builtin:
            return i
    code = s.OperatorCodeT()
    code.builtinCode, code.deprecatedBuiltinCode, code.version = builtin, min(builtin, 127), version
    model.operatorCodes.append(code)
    return len(model.operatorCodes) - 1


def _int8_tensor(model, graph, name: str, shape, scale: float, zero_point: int, data=None) -> int:
    """Add an int8 tensor (a constant when ``data`` is given) to ``graph``; its index."""

    s = schema()
    t = s.TensorT()
    t.name, t.type, t.shape = name.encode(), s.TensorType.INT8, np.asarray(shape, np.int32)
    t.quantization = s.QuantizationParametersT()
    t.quantization.scale, t.quantization.zeroPoint = [float(scale)], [int(zero_point)]
    buffer = s.BufferT()
    if data is not None:
        buffer.data = np.asarray(data, np.int8).view(np.uint8).reshape(-1)
    model.buffers.append(buffer)
    t.buffer = len(model.buffers) - 1
    graph.tensors.append(t)
    return len(graph.tensors) - 1


def _int8_op(model, builtin: int, options, inputs: list[int], output: int):
    """An int8 ADD or MUL operator (version 2) with these options."""

    s = schema()
    op = s.OperatorT()
    op.opcodeIndex = _opcode(model, s, builtin, 2)
    op.inputs, op.outputs = np.asarray(inputs, np.int32), np.asarray([output], np.int32)
    kind = "AddOptions" if builtin == s.BuiltinOperator.ADD else "MulOptions"
    op.builtinOptionsType, op.builtinOptions = getattr(s.BuiltinOptions, kind), options
    return op


def unfuse_hard_swish(content: bytes) -> tuple[bytes, int]:
    """Write each int8 HARD_SWISH as ADD(x, 3) with RELU6, MUL by x, MUL by 1/6.

    The converter fuses hard-swish (MobileNetV3, EfficientNet-Lite's kin) into HARD_SWISH,
    which this LiteRT's XNNPACK has no int8 kernel for: a MobileNetV3Small then runs in 20
    delegate partitions, 1.6x slower than as ADD/MUL, all in one. The three ops compute the
    same function: relu6(x + 3) gets the range [0, min(6, max x + 3)], x * relu6(x + 3) the
    output's grid times 6 (so dividing by 6 lands on the output's codes), and the constants 3
    and 1/6 are exact at their own scales. The two roundings cost up to about one more output
    step than HARD_SWISH's one. Where x's range is too wide for XNNPACK's ADD (its step 128 gate
    steps or more) nothing is gained, and HARD_SWISH stays. Returns the new flatbuffer and how
    many were unfused.
    """

    s = schema()
    model = _unpacked(content)
    swish, int8 = s.BuiltinOperator.HARD_SWISH, s.TensorType.INT8
    unfused = 0
    for graph in model.subgraphs or []:
        ops = []
        for op in graph.operators or []:
            x_index, y_index = (int(op.inputs[0]), int(op.outputs[0])) if len(op.inputs) == 1 else (-1, -1)
            x, y = graph.tensors[x_index], graph.tensors[y_index]
            if _builtin(model, op) != swish or x.type != int8 or y.type != int8:
                ops.append(op)
                continue

            name = (y.name or b"hard_swish").decode()
            sx, zx = float(x.quantization.scale[0]), int(x.quantization.zeroPoint[0])
            sy, zy = float(y.quantization.scale[0]), int(y.quantization.zeroPoint[0])
            high = min(6.0, sx * (127 - zx) + 3.0)
            gate_scale = (high if high > 0 else 6.0) / 255
            if sx / gate_scale >= 128:
                # XNNPACK takes an int8 ADD only while an input's scale is under 256 output steps,
                # and LiteRT's optimized ADD went wrong past 32767 gate steps (x = 795 at a 0.024
                # step gave relu6 = 0: a 16-bit intermediate, it seems). A range this wide gains no
                # partition and loses precision: HARD_SWISH stays.
                ops.append(op)
                continue
            three = _int8_tensor(model, graph, f"{name}/three", [], 3.0 / 127, 0, [127])
            gate = _int8_tensor(model, graph, f"{name}/relu6", x.shape, gate_scale, -128)
            product = _int8_tensor(model, graph, f"{name}/times6", x.shape, 6.0 * sy, zy)
            sixth = _int8_tensor(model, graph, f"{name}/sixth", [], 1.0 / 6 / 127, 0, [127])
            add = s.AddOptionsT()
            add.fusedActivationFunction = s.ActivationFunctionType.RELU6
            ops.append(_int8_op(model, s.BuiltinOperator.ADD, add, [x_index, three], gate))
            ops.append(_int8_op(model, s.BuiltinOperator.MUL, s.MulOptionsT(), [x_index, gate], product))
            ops.append(_int8_op(model, s.BuiltinOperator.MUL, s.MulOptionsT(), [product, sixth], y_index))
            unfused += 1
        graph.operators = ops
    if not unfused:
        return content, 0
    return _packed(model, len(content)), unfused


def drop_unused_tensors(model, graph, candidates: set[int]) -> None:
    """Remove the ``candidates`` no op, input or output uses any more (the float16 constants), with
    their buffers' bytes; every tensor index in the graph is renumbered."""
    used = set()
    for op in graph.operators or []:
        used |= {int(t) for t in (*(op.inputs if op.inputs is not None else []), *(op.outputs or []))}
    used |= {int(t) for t in (graph.inputs if graph.inputs is not None else [])}
    used |= {int(t) for t in (graph.outputs if graph.outputs is not None else [])}
    gone = sorted(i for i in candidates if i not in used)
    if not gone:
        return
    gone_set = set(gone)
    kept = [i for i in range(len(graph.tensors)) if i not in gone_set]
    # a buffer may back several tensors (converters share equal constants): its bytes go only with the last
    still = {
        int(t.buffer) for g in model.subgraphs for i, t in enumerate(g.tensors) if g is not graph or i not in gone_set
    }
    for index in gone:
        buffer = graph.tensors[index].buffer
        if 0 < buffer < len(model.buffers) and buffer not in still:
            model.buffers[buffer].data = None  # the bytes go; the empty buffer keeps the others' numbers
    new_index = {old: new for new, old in enumerate(kept)}

    def renumbered(indices):
        return None if indices is None else [new_index[int(i)] if int(i) >= 0 else int(i) for i in indices]

    for op in graph.operators or []:
        op.inputs, op.outputs = renumbered(op.inputs), renumbered(op.outputs)
        if getattr(op, "intermediates", None) is not None:
            op.intermediates = renumbered(op.intermediates)
    graph.inputs, graph.outputs = renumbered(graph.inputs), renumbered(graph.outputs)
    graph.tensors = [graph.tensors[i] for i in kept]
    for signature in model.signatureDefs or []:
        if signature.subgraphIndex == 0:
            for entry in (*(signature.inputs or []), *(signature.outputs or [])):
                entry.tensorIndex = new_index[int(entry.tensorIndex)]


# Ops that move int8 codes without computing on them: at int8 their output has their input's scale.
# each mover and the version of it that takes int8 (TFLite's op_version.cc: RESHAPE, SQUEEZE and EXPAND_DIMS
# move any type at version 1, and LiteRT registers EXPAND_DIMS at version 1 only: a 2 makes a file it refuses)
_MOVERS = {"DEPTH_TO_SPACE": 2, "SPACE_TO_DEPTH": 2, "RESHAPE": 1, "TRANSPOSE": 2, "SQUEEZE": 1, "EXPAND_DIMS": 1,
           "MIRROR_PAD": 2}  # fmt: skip


def integer_movers(content: bytes) -> tuple[bytes, dict[str, int]]:
    """Each float data-movement op that LiteRT Quantizer left between DEQUANTIZE and QUANTIZE (it has no
    int8 DEPTH_TO_SPACE, which MediaPipe's sparse face and pose detectors have) made to move the int8
    codes itself: its output takes its input's scale, and a QUANTIZE after it to the same scale goes
    (another scale stays, as an int8 -> int8 requantize). Returns the new flatbuffer and the ops made
    int8, by type."""
    from edgeq.runtime.flatbuffer import builtin_op_name

    s = schema()
    model = _unpacked(content)
    graph = model.subgraphs[0]
    int8 = s.TensorType.INT8
    writer = {int(t): op for op in graph.operators for t in op.outputs}
    readers: dict[int, list] = {}
    for op in graph.operators:
        for t in op.inputs if op.inputs is not None else []:
            readers.setdefault(int(t), []).append(op)
    outputs = {int(t) for t in graph.outputs}
    done: dict[str, int] = {}
    gone = []
    for op in graph.operators:
        name = builtin_op_name(_builtin(model, op))
        source = writer.get(int(op.inputs[0])) if name in _MOVERS and op.inputs is not None else None
        out = int(op.outputs[0]) if source is not None else -1
        after = readers.get(out, [])
        if (
            source is None
            or _builtin(model, source) != s.BuiltinOperator.DEQUANTIZE
            or graph.tensors[int(source.inputs[0])].type != int8
            or out in outputs
            or not after
            or any(_builtin(model, q) != s.BuiltinOperator.QUANTIZE for q in after)
        ):
            continue
        codes = graph.tensors[int(source.inputs[0])]
        op.inputs = np.asarray([int(source.inputs[0]), *(int(t) for t in op.inputs[1:])], np.int32)
        moved = graph.tensors[out]
        moved.type, moved.quantization = int8, codes.quantization
        code = model.operatorCodes[op.opcodeIndex]
        code.version = max(code.version, _MOVERS[name])
        for quantize in after:
            target = graph.tensors[int(quantize.outputs[0])]
            same = (
                target.type == int8
                and list(target.quantization.scale) == list(codes.quantization.scale)
                and list(target.quantization.zeroPoint) == list(codes.quantization.zeroPoint)
            )
            if same and len(after) == 1:
                op.outputs = np.asarray([int(quantize.outputs[0])], np.int32)
                gone.append(quantize)
        done[name] = done.get(name, 0) + 1
    if not done:
        return content, {}
    graph.operators = [op for op in graph.operators if all(op is not g for g in gone)]
    used = {int(t) for op in graph.operators for t in op.inputs if int(t) >= 0}
    graph.operators = [  # a DEQUANTIZE no op reads any more
        op for op in graph.operators
        if _builtin(model, op) != s.BuiltinOperator.DEQUANTIZE or any(int(t) in used | outputs for t in op.outputs)
    ]  # fmt: skip
    drop_unused_tensors(model, graph, set(range(len(graph.tensors))))
    return _packed(model, len(content)), done


def signature_outputs(content: bytes) -> tuple[bytes, list[str]]:
    """A signature output that LiteRT Quantizer no longer makes a graph output, named again.

    Where a graph output is also read inside the graph (basic-pitch's ``contour`` feeds ``note`` and
    ``onset``), LiteRT Quantizer gives the graph a float DEQUANTIZE of it as the output
    (``..._dequant``) and leaves the signature on the int8 tensor, which is then no output: the
    interpreter drops its name. The int8 tensor becomes the output again (as every other output
    of the file: int8), and the ops inside read the DEQUANTIZE's float as before."""
    s = schema()
    model = _unpacked(content)
    graph = model.subgraphs[0]
    outputs = [int(t) for t in graph.outputs]
    dequantized = {
        int(op.inputs[0]): int(op.outputs[0])
        for op in graph.operators
        if _builtin(model, op) == s.BuiltinOperator.DEQUANTIZE and op.inputs is not None
    }
    named = []
    for signature in model.signatureDefs or []:
        if signature.subgraphIndex != 0:
            continue
        for entry in signature.outputs or []:
            index = int(entry.tensorIndex)
            if index in outputs or dequantized.get(index) not in outputs:
                continue
            outputs[outputs.index(dequantized[index])] = index
            named.append(entry.name.decode() if isinstance(entry.name, bytes) else str(entry.name))
    if not named:
        return content, []
    graph.outputs = np.asarray(outputs, np.int32)
    return _packed(model, len(content)), named
