"""Mixed int8/int16 integer-only post-training quantization.

LiteRT runs 16x8 ops (16-bit activations, 8-bit weights, 64-bit bias) with integer kernels,
so a model can keep its sensitive layers at 16-bit activations and every other layer at
int8 and still be integer-only: the boundaries are QUANTIZE ops that rescale int8 <-> int16.
The TFLite converter quantizes a whole model one way; LiteRT Quantizer (``litert-quantizer``)
takes a recipe per op, so that is what builds these models. Its scope for an op is the op's
output tensor names, which is how a Keras layer is matched to its ops here.

The float model is converted and calibrated once (min/max of every tensor on the
calibration samples); each mix is then a quantization of that one calibration.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from edgeq.errors import UsageError
from edgeq.quantize.calibration import layer_name_for
from edgeq.runtime.flatbuffer import op_precision, verify_tflite
from edgeq.shims.tflite import keras_converter, native_output_silenced

WIDE_BITS = 16


@dataclass(frozen=True)
class OpScope:
    index: int
    op_type: str
    scope: str  # LiteRT Quantizer's name for the op: its output tensors' names, each followed by ";"
    layer: str  # the Keras layer the op computes


def _litert_quantizer():
    try:
        from litert_quantizer import qtyping, quantizer
    except ImportError as exc:
        raise UsageError('mixed int8/int16 quantization needs LiteRT Quantizer: pip install "edgeq[train]"') from exc
    return qtyping, quantizer


def _op_layers(desc, layer_names: list[str]):
    """(op, its output names, the Keras layer it computes) for each op of the main subgraph.

    An op whose output names no layer (a Dense layer's softmax is named by the model output
    it writes, a QUANTIZE op by what it converts) belongs to the layer that produced its input.
    """
    tensors = desc.main.tensors
    layer_of_tensor: dict[int, str] = {}
    for op in desc.main.operators:
        names = [tensors[i].name for i in op.outputs if i >= 0 and tensors[i].name]
        if not names:
            continue
        layer = layer_name_for(names[0], layer_names)
        if layer not in layer_names:
            layer = next((layer_of_tensor[i] for i in op.inputs if i in layer_of_tensor), layer)
        layer_of_tensor.update((i, layer) for i in op.outputs)
        yield op, names, layer


def op_scopes(model_bytes: bytes, layer_names: list[str]) -> list[OpScope]:
    """Each op of the float model, with LiteRT Quantizer's scope and the layer it belongs to."""
    desc = verify_tflite(model_bytes, "the float model")
    return [
        OpScope(op.index, op.op_type, "".join(f"{n};" for n in names), layer)
        for op, names, layer in _op_layers(desc, layer_names)
    ]


def wide_layers(model_bytes: bytes, layer_names: list[str]) -> dict[str, list[str]]:
    """{layer: [op types]} of the ops that compute at 16-bit in a quantized model (QUANTIZE excluded)."""
    desc = verify_tflite(model_bytes, "the quantized model")
    found: dict[str, list[str]] = {}
    for op, _, layer in _op_layers(desc, layer_names):
        if op.op_type not in ("QUANTIZE", "DEQUANTIZE") and op_precision(desc, op) == "int16":
            found.setdefault(layer, []).append(op.op_type)
    return found


@dataclass
class MixedCalibration:
    """A float model calibrated once, ready to be quantized with any set of layers at 16-bit."""

    float_model: bytes
    calibration: dict  # every tensor's range for 8 bits
    ops: tuple[OpScope, ...]
    layer_names: list[str]
    wide_ranges: dict = field(default_factory=dict)  # tensor -> (min, max) chosen for 16 bits (mse, entropy)

    @property
    def layers(self) -> list[str]:
        """The layers that have ops, in graph order."""
        seen: list[str] = []
        for op in self.ops:
            if op.layer in self.layer_names and op.layer not in seen:
                seen.append(op.layer)
        return seen

    def quantize(self, wide: Iterable[str] = (), weight_bits: int = 8) -> bytes:
        """Integer-only model (int8 I/O): ``wide`` layers at 16-bit activations, the rest int8;
        ``weight_bits`` 4: W4A8 (4-bit weights in LiteRT Quantizer's packed INT4)."""
        qtyping, quantizer = _litert_quantizer()
        wide = list(dict.fromkeys(wide))
        missing = [name for name in wide if name not in self.layers]
        if missing:
            raise UsageError(
                f"layer(s) {', '.join(missing)} have no op in the converted model; "
                f"layers that do: {', '.join(self.layers[:12])}{' ...' if len(self.layers) > 12 else ''}"
            )
        qt = quantizer.Quantizer(self.float_model)
        every = qtyping.TFLOperationName.ALL_SUPPORTED
        qt.add_static_config(regex=".*", operation_name=every, activation_num_bits=8, weight_num_bits=weight_bits)
        calibration = dict(self.calibration)
        for op in self.ops:
            if op.layer in wide:
                for tensor in (t for t in op.scope.split(";") if t in self.wide_ranges):
                    low, high = self.wide_ranges[tensor]  # a 16-bit tensor's range is chosen for 16 bits
                    shape = np.shape(calibration[tensor]["min"])
                    calibration[tensor] = {
                        **calibration[tensor],
                        "min": np.full(shape, low, np.float32),
                        "max": np.full(shape, high, np.float32),
                    }
                qt.add_static_config(
                    regex=f"^{re.escape(op.scope)}$",
                    operation_name=every,
                    activation_num_bits=WIDE_BITS,
                    weight_num_bits=weight_bits,
                )
        with native_output_silenced():
            result = qt.quantize(calibration, enable_progress_report=False)
        return bytes(result.quantized_model)


def calibrate_mixed(keras_model, samples, input_shapes: dict | None = None, ranges: str = "minmax") -> MixedCalibration:
    """Convert ``keras_model`` to float TFLite and choose every tensor's range on ``samples``
    (``calibrate_float``); its ops are matched to the Keras layers they compute."""
    with native_output_silenced():
        # batch 1, fixed: a free batch makes Reshape targets SHAPE ops on dequantized (float) tensors
        float_model = keras_converter(keras_model, static_batch=True, input_shapes=input_shapes).convert()
    return calibrate_float(float_model, samples, [layer.name for layer in keras_model.layers], ranges)


def op_names(float_model: bytes) -> list[str]:
    """A float .tflite's ops named by their first output tensor: its "layers" when it has no Keras model."""
    desc = verify_tflite(float_model, "the float model")
    tensors = desc.main.tensors
    first = (
        next((tensors[i].name for i in op.outputs if i >= 0 and tensors[i].name), "") for op in desc.main.operators
    )
    return list(dict.fromkeys(n.split(";")[0] for n in first if n))  # a fused op's name: its first part


def calibrate_float(float_model: bytes, samples, layer_names: list[str], ranges: str = "minmax") -> MixedCalibration:
    """Choose every tensor's range of a float .tflite (with a signature) on ``samples``.

    LiteRT Quantizer's own calibration keeps a moving average of each sample's min/max
    (smoothing 0.95), which clips every tensor to the extremes of its last few dozen samples:
    on a trained MobileNetV2 that cost 7 points even with every layer at 16 bits. So it runs
    on two samples only, to name the tensors it needs, and each range is then edgeq's: the
    float model runs every sample, each of those tensors is observed (edgeq.train.observe),
    and ``ranges`` (edgeq.quantize.ranges: minmax, percentile, mse, entropy) picks its min/max.

    ``samples``: an array (one input) or a dict of arrays by input name.
    """
    from ai_edge_litert.interpreter import Interpreter

    from edgeq.quantize.ranges import ACTIVATION_METHODS, Observer, activation_range

    if ranges not in ACTIVATION_METHODS:
        raise UsageError(f"activation ranges must be one of {', '.join(ACTIVATION_METHODS)}, got {ranges!r}")
    qtyping, quantizer = _litert_quantizer()
    signatures = Interpreter(model_content=float_model).get_signature_list()
    (key, signature), *_ = signatures.items()
    if not isinstance(samples, dict):
        (name,) = signature["inputs"]
        samples = {name: samples}
    n = len(next(iter(samples.values())))
    feeds = [
        {name: np.asarray(samples[name][i : i + 1], dtype=np.float32) for name in signature["inputs"]} for i in range(n)
    ]
    qt = quantizer.Quantizer(float_model)
    every = qtyping.TFLOperationName.ALL_SUPPORTED
    qt.add_static_config(regex=".*", operation_name=every, activation_num_bits=8, weight_num_bits=8)
    with native_output_silenced():
        calibration = qt.calibrate({key: feeds[:2]}, num_threads=1)
    with native_output_silenced():
        interpreter = Interpreter(model_content=float_model, experimental_preserve_all_tensors=True)
        runner = interpreter.get_signature_runner(key)
    index = {d["name"]: d["index"] for d in interpreter.get_tensor_details()}
    observers = {name: Observer() for name in calibration if name in index}
    for feed in feeds:
        runner(**feed)
        for name, observer in observers.items():
            observer.add(interpreter.get_tensor(index[name]))
    wide_ranges = {}
    for name, observer in observers.items():
        low, high = activation_range(observer.values(), ranges)
        if ranges in ("mse", "entropy"):  # the methods that trade clipping for resolution: 16 bits clips less
            wide_ranges[name] = activation_range(observer.values(), ranges, bits=WIDE_BITS)
        shape = np.shape(calibration[name]["min"])
        calibration[name] = {
            **calibration[name],
            "min": np.full(shape, low, np.float32),
            "max": np.full(shape, high, np.float32),
        }
    return MixedCalibration(
        float_model, calibration, tuple(op_scopes(float_model, layer_names)), layer_names, wide_ranges
    )
