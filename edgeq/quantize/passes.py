"""Edits of a converted .tflite flatbuffer: what it computes stays, up to a rounding step.

- ``fuse_requantize``: the converter sometimes leaves ``DEQUANTIZE (int8 -> float) ->
  QUANTIZE (float -> int8)`` between two integer ops, e.g. after a model input that feeds
  a ``Rescaling`` with an offset (MobileNetV3's and EfficientNetV2's preprocessing). The
  pair is one requantization, which TFLite's QUANTIZE op does int8 -> int8 in integer
  arithmetic; the float tensor between them disappears.
- ``with_weight_codes``: edgeq's chosen weight codes and scales (``--weight-ranges``,
  ``--rounding``, W4A8) written into the filters the converter quantized.
- ``unfuse_hard_swish``: int8 HARD_SWISH as ADD/MUL, which XNNPACK runs in one partition.
- ``prepared_float_model``: a float .tflite from any framework (MediaPipe, TF Hub, LiteRT Torch,
  onnx2tf) as LiteRT Quantizer takes it: each float16 constant read by a DEQUANTIZE op becomes the
  float32 constant that op computes (the op goes), and a file without a signature gets one
  (``serving_default``) from its main subgraph's inputs and outputs, named by their tensors' names,
  as the interpreter names them in a file without one.

Verification after conversion still compares the edited model with the Keras model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeq.errors import ModelLoadError
from edgeq.runtime.flatbuffer import schema

_INTEGER = ("INT8", "UINT8", "INT16")


def _packed(model, size_hint: int) -> bytes:
    """An edited flatbuffer object model, written out as a .tflite."""
    import flatbuffers

    builder = flatbuffers.Builder(size_hint + 4096)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _builtin(model, op) -> int:
    code = model.operatorCodes[op.opcodeIndex]
    return max(code.builtinCode, code.deprecatedBuiltinCode)


def fuse_requantize(content: bytes) -> tuple[bytes, int]:
    """Replace each integer->float->integer DEQUANTIZE/QUANTIZE pair by one QUANTIZE.

    Returns the new flatbuffer and how many pairs were fused (0: ``content`` itself).
    """

    s = schema()
    model = s.ModelT.InitFromPackedBuf(content, 0)
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
    model = s.ModelT.InitFromPackedBuf(content, 0)
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
    model = s.ModelT.InitFromPackedBuf(content, 0)
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


SIGNATURE_KEY = "serving_default"
_QUANTIZED = ("INT8", "UINT8", "INT16", "INT4")


@dataclass(frozen=True)
class Prepared:
    """The float model LiteRT Quantizer takes, and what was changed to get it."""

    content: bytes
    float16_constants: int  # float16 constants made float32 (their DEQUANTIZE ops removed)
    signature_added: bool
    split: tuple[str, ...] = ()  # outputs that were a CONCATENATION, now its parts (--split-outputs)


def _name(tensor) -> str:
    name = tensor.name
    return name.decode() if isinstance(name, bytes) else str(name or "")


def _check_float(model, s, where: str) -> None:
    """A model quantized already (integer weights or activations) is no float model to quantize."""
    integer = {getattr(s.TensorType, t) for t in _QUANTIZED if hasattr(s.TensorType, t)}
    graph = model.subgraphs[0]
    dequantize = s.BuiltinOperator.DEQUANTIZE
    fed_to_dequantize = {
        int(op.inputs[0])
        for op in graph.operators or []
        if _builtin(model, op) == dequantize and op.inputs is not None and len(op.inputs)
    }
    for index, tensor in enumerate(graph.tensors or []):
        if tensor.type in integer and index not in fed_to_dequantize:
            raise ModelLoadError(
                f"{where}: tensor {_name(tensor)!r} is {_dtype_name(s, tensor.type)}: the model is quantized already; "
                "edgeq quantizes float .tflite files (give the float model, or profile/eval this one as it is)"
            )


def _dtype_name(s, value: int) -> str:
    return next((k.lower() for k, v in vars(s.TensorType).items() if v == value), str(value))


def _float16_to_float32(model, s) -> int:
    """Replace each DEQUANTIZE of a float16 constant by the float32 constant it computes."""
    graph = model.subgraphs[0]
    dequantize, float16, float32 = s.BuiltinOperator.DEQUANTIZE, s.TensorType.FLOAT16, s.TensorType.FLOAT32
    replaced: dict[int, int] = {}  # output tensor -> the float16 constant it dequantized
    keep = []
    for op in graph.operators or []:
        if _builtin(model, op) == dequantize and op.inputs is not None and len(op.inputs) == 1:
            source, out = int(op.inputs[0]), int(op.outputs[0])
            tensor = graph.tensors[source]
            data = model.buffers[tensor.buffer].data if tensor.buffer < len(model.buffers) else None
            if tensor.type == float16 and data is not None and len(data):
                values = np.frombuffer(bytes(bytearray(data)), dtype="<f2").astype("<f4")
                target = graph.tensors[out]
                buffer = s.BufferT()
                buffer.data = np.frombuffer(values.tobytes(), dtype=np.uint8)
                model.buffers.append(buffer)
                target.buffer, target.type = len(model.buffers) - 1, float32
                replaced[out] = source
                continue
        keep.append(op)
    graph.operators = keep
    if replaced:
        _drop_unused_tensors(model, graph, set(replaced.values()))
    return len(replaced)


def _drop_unused_tensors(model, graph, candidates: set[int]) -> None:
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
    for index in gone:
        buffer = graph.tensors[index].buffer
        if 0 < buffer < len(model.buffers):
            model.buffers[buffer].data = None  # the bytes go; the empty buffer keeps the others' numbers
    kept = [i for i in range(len(graph.tensors)) if i not in set(gone)]
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


def _modern_op_codes(model) -> int:
    """Files of the old schema (MediaPipe's, 2020) name each op in ``deprecated_builtin_code`` only and
    leave ``builtin_code`` 0 (ADD): LiteRT Quantizer reads ``builtin_code``, and would quantize a
    CONV_2D's filter as an ADD's input. Each code gets both, as the current schema writes them."""
    fixed = 0
    for code in model.operatorCodes or []:
        real = max(code.builtinCode, code.deprecatedBuiltinCode)
        if code.builtinCode != real:
            code.builtinCode, fixed = real, fixed + 1
        code.deprecatedBuiltinCode = min(real, 127)  # the schema's PLACEHOLDER_FOR_GREATER_OP_CODES
    return fixed


def _add_signature(model, s) -> bool:
    if model.signatureDefs:
        return False
    graph = model.subgraphs[0]

    def entries(indices) -> list:
        found = []
        for i, index in enumerate(indices if indices is not None else []):
            entry = s.TensorMapT()
            # the tensor's own name: what the interpreter calls the input or output of a file without a
            # signature, so the quantized model's outputs match the float file's by name (eval, profile)
            entry.name = _name(graph.tensors[int(index)]) or f"tensor_{i}"
            entry.tensorIndex = int(index)
            found.append(entry)
        return found

    signature = s.SignatureDefT()
    signature.signatureKey = SIGNATURE_KEY
    signature.subgraphIndex = 0
    signature.inputs, signature.outputs = entries(graph.inputs), entries(graph.outputs)
    model.signatureDefs = [signature]
    return True


def prepared_float_model(content: bytes, where: str, split_outputs: bool = False) -> Prepared:
    """``content`` as LiteRT Quantizer takes it: float32 constants and a signature (see the module);
    with ``split_outputs``, each output a CONCATENATION writes becomes its parts, each its own output."""
    from edgeq.runtime.flatbuffer import verify_tflite

    verify_tflite(content, where)  # every index and offset checked: a broken file is refused in one line
    s = schema()
    try:
        model = s.ModelT.InitFromPackedBuf(content, 0)
    except Exception as exc:  # a corrupt flatbuffer raises many types
        raise ModelLoadError(f"{where}: not a readable .tflite flatbuffer ({type(exc).__name__})") from exc
    if not model.subgraphs:
        raise ModelLoadError(f"{where}: the .tflite has no subgraph")
    if len(model.subgraphs) > 1 and not model.signatureDefs:
        raise ModelLoadError(f"{where}: {len(model.subgraphs)} subgraphs and no signature: say which one to quantize")
    _check_float(model, s, where)
    codes = _modern_op_codes(model)
    float16 = _float16_to_float32(model, s)
    added = _add_signature(model, s)
    split = _split_concatenated_outputs(model, s) if split_outputs else ()
    if not float16 and not added and not codes and not split:
        return Prepared(content, 0, False)
    return Prepared(_packed(model, len(content) * (2 if float16 else 1)), float16, added, split)


def _split_concatenated_outputs(model, s) -> tuple[str, ...]:
    """Each output that a CONCATENATION of computed tensors writes (YOLO's boxes and scores) becomes
    those tensors, each an output with its own int8 scale; the op goes. Returns the outputs split."""
    graph = model.subgraphs[0]
    consumed = {int(t) for op in graph.operators or [] for t in (op.inputs if op.inputs is not None else [])}
    producer = {int(t): op for op in graph.operators or [] for t in (op.outputs if op.outputs is not None else [])}
    split, outputs = [], []
    for output in (int(t) for t in graph.outputs):
        op = producer.get(output)
        parts = [int(t) for t in op.inputs] if op is not None and op.inputs is not None else []
        constant = any(model.buffers[graph.tensors[t].buffer].data is not None for t in parts if t >= 0)
        if op is None or _builtin(model, op) != s.BuiltinOperator.CONCATENATION or output in consumed or constant:
            outputs.append(output)
            continue
        outputs += parts
        graph.operators = [o for o in graph.operators if o is not op]
        split.append(_name(graph.tensors[output]))
        for signature in model.signatureDefs or []:
            entries = []
            for entry in signature.outputs or []:
                if int(entry.tensorIndex) != output:
                    entries.append(entry)
                    continue
                for part in parts:
                    new = s.TensorMapT()
                    new.name, new.tensorIndex = _name(graph.tensors[part]), part
                    entries.append(new)
            signature.outputs = entries
    graph.outputs = outputs
    orphans = {i for i, t in enumerate(graph.tensors) if _name(t) in split}
    _drop_unused_tensors(model, graph, orphans)  # a tensor no op writes would have no value to calibrate
    return tuple(split)
