"""Activation ranges, and a float model calibrated once then quantized with any layers left float.

``ActivationRanges`` is how every command that names a range method sets activation
ranges: the converter's own calibration, each recorded min/max re-chosen by the method.
TFLite's QuantizationDebugger calibrates (through it) and records each quantized op against
its float twin; every variant (full INT8, all but one layer, one layer only, a plan) is then
a re-quantization of that one calibration. ``analyze`` measures with it, ``convert --plan``
converts with it, ``convert --ptq`` converts through the same ``ActivationRanges``.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from edgeq.data.splits import Dataset
from edgeq.errors import UsageError
from edgeq.models.compat import tf
from edgeq.models.names import producer_of
from edgeq.quantize.numerics import channel_sqnr_db
from edgeq.quantize.ranges import ACTIVATION_METHODS, activation_range
from edgeq.runtime.interpreter import TFLiteModel
from edgeq.shims.litert import ops_details
from edgeq.shims.tflite import (
    calibration_replaced,
    debugger_keeping_every_tensor,
    disable_per_channel,
    keras_converter,
    native_output_silenced,
    quantize_calibrated,
    tensor_ranges,
    with_tensor_ranges,
)


@dataclass
class Calibrated:
    """A float model calibrated once, ready to be quantized with any layers left float."""

    float_model: bytes
    calibrated: bytes
    per_tensor: bool
    nodes: list[str]  # quantized ops' output tensor names, graph order
    layer_of: dict[str, str]  # node -> Keras layer name (or the node itself)
    debugger: object = field(repr=False, default=None)
    ranges: str = "minmax"  # how the activation ranges were set (edgeq.quantize.ranges), minmax: the converter's

    def quantize(self, float_nodes: Iterable[str] = ()) -> bytes:
        """Full-integer model (float I/O) with ``float_nodes`` left in float."""
        return quantize_calibrated(self.calibrated, self.per_tensor, sorted(set(float_nodes)))

    def nodes_of_layers(self, layers: Iterable[str]) -> list[str]:
        wanted = set(layers)
        return [n for n in self.nodes if self.layer_of[n] in wanted or n in wanted]

    @property
    def layers(self) -> list[str]:
        seen: list[str] = []
        for n in self.nodes:
            if self.layer_of[n] not in seen:
                seen.append(self.layer_of[n])
        return seen


def _per_channel_sqnr(float_tensor, quant_tensor, scale, zero_point) -> np.ndarray:
    """The SQNR (``numerics.sqnr_db``, the one convert and eval print) of each output channel that
    carries a signal."""
    return channel_sqnr_db(float_tensor, (np.asarray(quant_tensor, dtype=np.float64) - zero_point) * scale)


def _channel_sqnr(float_tensor, quant_tensor, scale, zero_point) -> float:
    """The median SQNR over the op's output channels (what sensitivity ranks by; inf: lossless)."""
    return float(np.median(_per_channel_sqnr(float_tensor, quant_tensor, scale, zero_point)))


def _mean_channel_sqnr(float_tensor, quant_tensor, scale, zero_point) -> float:
    """The mean SQNR over the op's lossy output channels (inf when every channel is lossless)."""
    per_channel = _per_channel_sqnr(float_tensor, quant_tensor, scale, zero_point)
    lossy = per_channel[np.isfinite(per_channel)]
    return float(np.mean(lossy)) if len(lossy) else float(np.min(per_channel))


def _worst_channel_sqnr(float_tensor, quant_tensor, scale, zero_point) -> float:
    """The SQNR of the op's worst output channel: one crushed channel shows here, not in the mean."""
    return float(np.min(_per_channel_sqnr(float_tensor, quant_tensor, scale, zero_point)))


def _rmse_over_scale(float_tensor, quant_tensor, scale, zero_point) -> float:
    q = (np.asarray(quant_tensor, dtype=np.float64) - zero_point) * scale
    return float(np.sqrt(np.mean((np.asarray(float_tensor, dtype=np.float64) - q) ** 2)) / scale) if scale else 0.0


def layer_name_for(node: str, layer_names: list[str]) -> str:
    """The Keras layer an op's output tensor belongs to, from its name path."""
    parts = set(re.split(r"[/;:]", node))
    for name in sorted(layer_names, key=len, reverse=True):
        if name in parts or f"quant_{name}" in parts:
            return name
    return node.split(";")[0]


class ActivationRanges:
    """The one way edgeq's activation ranges enter a quantized model.

    The TFLite converter calibrates as always, recording min/max on every tensor it will
    quantize. Then the calibrated (float) model runs on the same samples, each of those
    tensors is observed (edgeq.quantize.ranges.Observer), and its min/max is replaced by the
    range a method picks. Everything after that is the converter's own: ``analyze`` (its
    QuantizationDebugger), ``convert --plan`` and ``convert --ptq METHOD`` all quantize
    through ``ranged(method)``, so one method gives one model whichever command asked.

    One instance serves one model converted with one set of converter options: the first
    calibration is kept and observed once, and every later conversion under ``ranged``
    reuses it (another method costs a quantization, not a calibration).
    """

    def __init__(self, x, seed: int = 0):
        self.x = x  # the calibration samples: an array, or a dict of arrays by input name
        self.seed = seed
        self.calibrated: bytes | None = None
        self.observers: dict = {}

    def _observe(self, calibrated: bytes) -> None:
        from edgeq.quantize.ranges import Observer

        with warnings.catch_warnings():  # tf.lite.Interpreter's deprecation; preserve_all_tensors is meant here
            warnings.simplefilter("ignore")
            interpreter = tf.lite.Interpreter(model_content=calibrated, experimental_preserve_all_tensors=True)
        with native_output_silenced():
            interpreter.allocate_tensors()
        inputs = interpreter.get_input_details()
        if isinstance(self.x, dict):  # by input name: the calibrated model's inputs carry the Keras names
            feeds = [(d, self.x[input_key(d["name"], list(self.x))]) for d in inputs]
        else:
            feeds = [(inputs[0], self.x)]
        observers = {index: Observer(self.seed) for index in tensor_ranges(calibrated)}
        with native_output_silenced():  # LiteRT's "Created TensorFlow Lite XNNPACK delegate" line
            for i in range(len(feeds[0][1])):
                for detail, x in feeds:
                    interpreter.set_tensor(detail["index"], np.asarray(x[i : i + 1]).astype(detail["dtype"]))
                interpreter.invoke()
                for index, observer in observers.items():
                    observer.add(interpreter.get_tensor(index))
        self.calibrated, self.observers = calibrated, observers

    def with_ranges(self, method: str) -> bytes:
        """The kept calibration with every recorded min/max re-chosen by ``method``."""
        chosen = {index: activation_range(o.values(), method) for index, o in self.observers.items()}
        return with_tensor_ranges(self.calibrated, chosen)

    @contextlib.contextmanager
    def ranged(self, method: str):
        """While open, a TFLite converter calibrating this model gets ``method``'s ranges."""

        def replace(run_calibration):
            if self.calibrated is None:
                self._observe(run_calibration())
            return self.with_ranges(method)

        with calibration_replaced(replace):
            yield


def calibrate(
    keras_model, dataset: Dataset, samples: int = 200, per_tensor: bool = False, ranges: str = "minmax"
) -> Calibrated:
    """Calibrate ``keras_model`` on ``samples`` training samples; activation ranges by ``ranges``."""
    if dataset.count("train") == 0:
        raise UsageError(f"data {dataset.source!r} has no samples to calibrate with")
    if ranges not in ACTIVATION_METHODS:
        raise UsageError(f"activation ranges must be one of {', '.join(ACTIVATION_METHODS)}, got {ranges!r}")
    converter = keras_converter(keras_model)
    with native_output_silenced():
        float_model = converter.convert()
    converter = keras_converter(keras_model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = dataset.representative_dataset(samples)
    if per_tensor:
        disable_per_channel(converter)
    options = tf.lite.experimental.QuantizationDebugOptions(
        layer_direct_compare_metrics={
            "channel_sqnr_db": _channel_sqnr,
            "mean_channel_sqnr_db": _mean_channel_sqnr,
            "worst_channel_sqnr_db": _worst_channel_sqnr,
            "rmse_over_scale": _rmse_over_scale,
        }
    )
    chosen = ActivationRanges(dataset.calibration_samples(samples)).ranged(ranges) if ranges != "minmax" else None
    with chosen or contextlib.nullcontext(), native_output_silenced():
        debugger = tf.lite.experimental.QuantizationDebugger(
            converter=converter,
            debug_dataset=dataset.representative_dataset(min(samples, 64), seed=2),
            debug_options=options,
        )
    debugger_keeping_every_tensor(debugger)
    # Nodes are named as denylisted_nodes wants them: the output tensors of the
    # calibrated model's ops, in graph order.
    graph = TFLiteModel(model_content=debugger.calibrated_model, use_default_delegates=False, verify=False)
    names = {d["index"]: d["name"] for d in graph.interpreter.get_tensor_details()}
    layer_names = [layer.name for layer in keras_model.layers]
    # the op that writes the model's output may carry only the signature's tensor name
    # (StatefulPartitionedCall:0 for a Keras 3 model): it is the output layer's
    graph_outputs = [d["index"] for d in graph.interpreter.get_output_details()]
    output_layers = [getattr(producer_of(t), "name", None) for t in keras_model.outputs]
    nodes, layer_of = [], {}
    for op in ops_details(graph.interpreter):
        if not op["outputs"].size:
            continue
        node = names[op["outputs"][0]]
        nodes.append(node)
        guess = layer_name_for(node, layer_names)
        if guess in layer_names:
            layer_of[node] = guess
        elif op["outputs"][0] in graph_outputs and len(graph_outputs) == len(output_layers) == 1 and output_layers[0]:
            layer_of[node] = output_layers[0]
        else:
            layer_of[node] = guess if guess != node.split(";")[0] or "/" in node else f"{op['op_name'].lower()}:{node}"
    return Calibrated(float_model, debugger.calibrated_model, per_tensor, nodes, layer_of, debugger, ranges)


def input_key(tensor_name: str, keys: list[str]) -> str:
    """Which of the data's arrays (``keys``: input names) feeds the model input ``tensor_name``
    (``serving_default_<name>:0`` as the converter writes it): the exact name, never a substring of
    another input's (``image`` inside ``image_meta``)."""
    bare = re.sub(r":\d+$", "", tensor_name)
    for candidate in (bare, re.sub(r"^serving_default_", "", bare)):
        if candidate in keys:
            return candidate
    raise UsageError(
        f"the calibrated model's input {tensor_name!r} matches none of the data's inputs ({', '.join(keys)}): "
        "name each array x_<input name> as the model names its inputs"
    )


def predict(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    """The model's outputs on ``x`` with the kernels eval, profile and a device run it with (XNNPACK)."""
    return TFLiteModel(model_content=model_bytes, verify=False).predict(x, batch_size=1)
