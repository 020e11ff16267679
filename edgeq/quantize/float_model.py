"""A float .tflite from any framework, made ready for LiteRT Quantizer: ``prepared_float_model``.

MediaPipe's, TF Hub's, LiteRT Torch's and onnx2tf's files: each float16 constant read by a DEQUANTIZE
op becomes the float32 constant that op computes (the op goes), a file without a signature gets one
(``serving_default``) from its main subgraph's inputs and outputs, named by their tensors' names, as the
interpreter names them in a file without one; then the graph passes of ``float_passes`` (custom ops
rewritten, the batch fixed, constants folded, activations fused, PRELU in int8-capable ops), each named
in what it returns, so that convert's notes and the manifest say what was done to the file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from edgeq.errors import ModelLoadError
from edgeq.quantize.passes import _builtin, _packed, _unpacked, drop_unused_tensors
from edgeq.runtime.flatbuffer import schema

SIGNATURE_KEY = "serving_default"
_QUANTIZED = ("INT8", "UINT8", "INT16", "INT4")


@dataclass(frozen=True)
class Prepared:
    """The float model LiteRT Quantizer takes, and what was changed to get it."""

    content: bytes
    float16_constants: int  # float16 constants made float32 (their DEQUANTIZE ops removed)
    signature_added: bool
    split: tuple[str, ...] = ()  # outputs that were a CONCATENATION, now its parts (--split-outputs)
    joins: tuple[tuple[str, tuple[str, ...], int], ...] = ()  # each split output: (name, its parts, axis)
    passes: tuple[tuple[str, int, str], ...] = ()  # (pass, ops changed, what it did): float_passes, for notes

    def notes(self) -> list[str]:
        """What was done to the file, one line a pass, as convert prints them."""
        return [text for _, _, text in self.passes]

    def record(self) -> dict[str, int]:
        """The manifest's record: each pass that changed the graph, with how many ops it changed."""
        return {name: count for name, count, _ in self.passes}


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
        drop_unused_tensors(model, graph, set(replaced.values()))
    return len(replaced)


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


def prepared_float_model(
    content: bytes, where: str, split_outputs: bool | Iterable[str] = False, graph_passes: bool = True
) -> Prepared:
    """``content`` as LiteRT Quantizer takes it: float32 constants and a signature (see the module);
    with ``split_outputs`` (True, or the names of some outputs), each output a CONCATENATION writes becomes
    its parts, each its own output."""
    from edgeq.runtime.flatbuffer import verify_tflite

    verify_tflite(content, where)  # every index and offset checked: a broken file is refused in one line
    s = schema()
    try:
        model = _unpacked(content)
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
    passes = _graph_passes(model, s, where) if graph_passes else []
    only = None if split_outputs is True else set(split_outputs or ())
    joins = _split_concatenated_outputs(model, s, only) if split_outputs else ()
    split = tuple(name for name, _, _ in joins)
    if not float16 and not added and not codes and not split and not passes:
        return Prepared(content, 0, False)
    size = len(content) * (4 if passes else 2 if float16 else 1)  # a folded sparse filter grows
    return Prepared(_packed(model, size), float16, added, split, joins, tuple(passes))


def _graph_passes(model, s, where: str) -> list[tuple[str, int, str]]:
    """``float_passes`` in order, each that changed the graph with its count and its note."""
    from edgeq.quantize import float_passes as fp

    done = []
    custom = fp.custom_ops(model, s, where)  # first: nothing else here runs a custom op
    if custom:
        done.append(("custom_ops", custom, f"{custom} custom Convolution2DTransposeBias op(s) rewritten as "
                     "TRANSPOSE_CONV with its bias"))  # fmt: skip
    batch = fp.fixed_batch(model)
    if batch:
        done.append(("fixed_batch", batch, f"{batch} input(s) with a free batch dimension fixed to batch 1"))
    folded = fp.folded_constants(model, s, where)
    if folded:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(folded.items(), key=lambda kv: (-kv[1], kv[0])))
        done.append(
            (
                "folded_constants",
                sum(folded.values()),
                f"{sum(folded.values())} op(s) of constants folded "
                f"into the constants they compute ({kinds}): no filter is quantized as an activation",
            )
        )
    fused = fp.fused_activations(model, s)
    if fused:
        done.append(("fused_activations", fused, f"{fused} standalone RELU/RELU6 op(s) fused into the op before "
                     "each: XNNPACK takes int8 RELUs only fused"))  # fmt: skip
    rewritten = fp.prelu(model, s)
    if rewritten:
        done.append(("prelu", rewritten, f"{rewritten} PRELU op(s) written as x + (1 - a) * relu(-x) in 1x1 "
                     "DEPTHWISE_CONV_2D and ADD/SUB ops: int8 kernels in LiteRT Quantizer and XNNPACK, where PRELU "
                     "has none"))  # fmt: skip
    pooled = fp.global_pools(model, s)
    if pooled:
        done.append(("global_pools", pooled, f"{pooled} AVERAGE_POOL_2D op(s) over the whole input written as MEAN "
                     "over height and width: XNNPACK has no int8 AVERAGE_POOL_2D"))  # fmt: skip
    negated = fp.negations(model, s)
    if negated:
        done.append(("negations", negated, f"{negated} NEG op(s) written as MUL by -1: LiteRT has no int8 NEG"))
    squared = fp.squares(model, s)
    if squared:
        done.append(("squares", squared, f"{squared} SQUARE op(s) written as MUL(x, x): int8 kernels where SQUARE "
                     "has none in LiteRT Quantizer"))  # fmt: skip
    return done


def _split_concatenated_outputs(model, s, only=None) -> tuple[tuple[str, tuple[str, ...], int], ...]:
    """Each output that a CONCATENATION of computed tensors writes (YOLO's boxes and scores; with ``only``,
    those of these names) becomes those tensors, each an output with its own int8 scale; the op goes.
    Returns each output split: its name, its parts' names and the axis they were joined on."""
    graph = model.subgraphs[0]
    consumed = {int(t) for op in graph.operators or [] for t in (op.inputs if op.inputs is not None else [])}
    producer = {int(t): op for op in graph.operators or [] for t in (op.outputs if op.outputs is not None else [])}
    split, outputs, dropped = [], [], set()
    for output in (int(t) for t in graph.outputs):
        op = producer.get(output)
        parts = [int(t) for t in op.inputs] if op is not None and op.inputs is not None else []
        constant = any(model.buffers[graph.tensors[t].buffer].data is not None for t in parts if t >= 0)
        if (
            op is None
            or _builtin(model, op) != s.BuiltinOperator.CONCATENATION
            or output in consumed
            or constant
            or (only is not None and _name(graph.tensors[output]) not in only)
        ):
            outputs.append(output)
            continue
        outputs += parts
        graph.operators = [o for o in graph.operators if o is not op]
        axis = int(op.builtinOptions.axis) % len(graph.tensors[output].shape)
        shown = _name(graph.tensors[output])  # the name a reader sees: the signature's where it has one
        for signature in model.signatureDefs or []:
            entries = []
            for entry in signature.outputs or []:
                if int(entry.tensorIndex) != output:
                    entries.append(entry)
                    continue
                shown = entry.name.decode() if isinstance(entry.name, bytes) else str(entry.name)
                for part in parts:
                    new = s.TensorMapT()
                    new.name, new.tensorIndex = _name(graph.tensors[part]), part
                    entries.append(new)
            signature.outputs = entries
        split.append((shown, tuple(_name(graph.tensors[p]) for p in parts), axis))
        dropped.add(output)
    graph.outputs = outputs
    orphans = dropped
    drop_unused_tensors(model, graph, orphans)  # a tensor no op writes would have no value to calibrate
    return tuple(split)
