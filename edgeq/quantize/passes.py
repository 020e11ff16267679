"""Edits of a converted .tflite flatbuffer that keep what it computes and make it integer-only.

``fuse_requantize``: the converter sometimes leaves ``DEQUANTIZE (int8 -> float) ->
QUANTIZE (float -> int8)`` between two integer ops, e.g. after a model input that feeds
a ``Rescaling`` with an offset (MobileNetV3's and EfficientNetV2's preprocessing). The
pair is one requantization, which TFLite's QUANTIZE op does int8 -> int8 in integer
arithmetic; the float tensor between them disappears. Verification after conversion
still compares the edited model with the Keras model.
"""

from __future__ import annotations

from edgeq.runtime.flatbuffer import schema

_INTEGER = ("INT8", "UINT8", "INT16")


def _builtin(model, op) -> int:
    code = model.operatorCodes[op.opcodeIndex]
    return max(code.builtinCode, code.deprecatedBuiltinCode)


def fuse_requantize(content: bytes) -> tuple[bytes, int]:
    """Replace each integer->float->integer DEQUANTIZE/QUANTIZE pair by one QUANTIZE.

    Returns the new flatbuffer and how many pairs were fused (0: ``content`` itself).
    """
    import flatbuffers

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
    builder = flatbuffers.Builder(len(content) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output()), fused
