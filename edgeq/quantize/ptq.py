"""Post-training quantization with ranges edgeq chooses, not the converter's min/max.

The float model is wrapped for QAT (TF-MOT, the same schemes as ``edgeq train``), run on
the calibration samples once, and each fake-quant's min/max variables are set from what
it would see: activations by minmax, percentile, MSE search or entropy (KL), weights per
channel by minmax or MSE. Converting that model takes its ranges from the fake-quant ops,
so the result is an ordinary integer model whose ranges are exactly the chosen ones.
No training step runs. With ``rounding`` other than nearest, the weights are set to the
codes edgeq chose times their scale (BN folded first, so the converter does not
requantize them), and convert to exactly those int8 values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from edgeq.compat import keras
from edgeq.numerics import weight_codes, weight_error
from edgeq.quantize.ranges import activation_range, weight_ranges
from edgeq.training import schemes
from edgeq.training.observe import (
    activation_points,
    by_suffix,
    observe,
    same_scale_ranges,
    suffix,
    unquantized_same_scale,
)
from edgeq.transforms.adaround import ADAROUND_LAYERS, kernel_name
from edgeq.transforms.fold import fold_batchnorm
from edgeq.transforms.tfops import replace_tf_ops

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChosenRange:
    variable: str  # e.g. quant_conv1/output_min (its _max twin gets the upper bound)
    layer: str  # the float model's layer whose output (or input, pre-activation) it covers
    low: float
    high: float


def _set_weight_ranges(float_model, qat_model, method: str, bits: int = 8) -> list[ChosenRange]:
    chosen = []
    for layer in qat_model.layers:
        if not isinstance(layer, schemes.QuantizeWrapper):
            continue
        source = float_model.get_layer(layer.layer.name)
        found = by_suffix(layer)
        for weight in source.weights:
            name = suffix(weight)
            low_var, high_var = found.get(f"{name}_min"), found.get(f"{name}_max")
            if low_var is None:
                continue
            kernel = weight.numpy()
            per_channel = int(np.prod(low_var.shape)) > 1
            if type(source).__name__ == "DepthwiseConv2D" and per_channel:
                kernel = kernel.reshape(*kernel.shape[:2], -1)  # (kh, kw, C * multiplier)
            m = weight_ranges(kernel if per_channel else kernel.reshape(-1, 1), axis=-1, method=method, bits=bits)
            m = m.reshape(low_var.shape).astype(np.float32)
            low_var.assign(-m)
            high_var.assign(m)
            chosen.append(ChosenRange(low_var.name.split(":")[0], source.name, float(-m.max()), float(m.max())))
    return chosen


class RangeCalibration:
    """The float model wrapped and observed once; ``model(method)`` sets ranges by any method.

    Wrapping and the calibration pass are the slow part; trying another range method only
    re-assigns the fake-quant variables.
    """

    def __init__(
        self,
        float_model,
        x_calibration: np.ndarray,
        per_tensor: bool = False,
        batch_size: int = 16,
        seed=0,
        fold: bool = False,
        weight_bits: int = 8,
    ):
        float_model, _ = replace_tf_ops(float_model)
        # The converter's own BN fold is wrong after per-tensor fake-quant (see transforms.fold),
        # and it would requantize weights whose rounding edgeq chose: fold first for both. 4-bit
        # weights are always rounded here (their codes must be what the fold-free graph stores).
        self.weight_bits = weight_bits
        if per_tensor or fold or weight_bits != 8:
            float_model = fold_batchnorm(float_model)
        self.x_calibration = x_calibration
        self._rounded: dict = {}
        self.rounding: dict = {}
        settings = schemes.QuantSettings(
            granularity="per-tensor" if per_tensor else "per-channel", weight_bits=weight_bits
        )
        self.float_model = float_model
        self.qat_model = schemes.build_qat_model(float_model, settings)
        self.points = activation_points(float_model, self.qat_model)
        self.observers = observe(float_model, self.points, x_calibration, batch_size, seed)
        self.unquantized = unquantized_same_scale(float_model, self.points, x_calibration, batch_size, seed)

    def model(self, activations: str = "mse", weights: str = "minmax", rounding: str = "nearest", seed: int = 0):
        """The QAT model with ranges set by these methods, and the ranges chosen.

        With ``rounding`` other than nearest, each quantized kernel is set to the codes
        edgeq chose times its scale (``self.rounding`` then says what was done).
        """
        chosen = []
        ranges = [activation_range(observer.values(), activations) for observer in self.observers]
        unquantized = {name: activation_range(o.values(), activations) for name, o in self.unquantized.items()}
        ranges = same_scale_ranges(self.float_model, self.points, ranges, unquantized)
        for (low_var, high_var, _, layer), (low, high) in zip(self.points, ranges):
            low_var.assign(low)
            high_var.assign(high)
            chosen.append(ChosenRange(low_var.name.split(":")[0], layer, low, high))
        chosen += _set_weight_ranges(self.float_model, self.qat_model, weights, self.weight_bits)
        self.rounding = self._round_weights(rounding, seed, weights)
        return self.qat_model, chosen

    def _kernels(self):
        """[(wrapped kernel variable, float layer, its kernel, per-channel scale)] of every fake-quantized kernel."""
        kernels = []
        for layer in self.qat_model.layers:
            if not isinstance(layer, schemes.QuantizeWrapper) or type(layer.layer).__name__ not in ADAROUND_LAYERS:
                continue
            name = kernel_name(layer.layer)
            found = by_suffix(layer)
            if f"{name}_max" not in found:
                continue
            source = self.float_model.get_layer(layer.layer.name)
            kernel = getattr(source, name).numpy()
            scale = found[f"{name}_max"].numpy().astype(np.float64) / (2 ** (self.weight_bits - 1) - 1)
            if scale.size > 1 and name == "depthwise_kernel":
                scale = scale.reshape(kernel.shape[2:])
            kernels.append((found[name], source, kernel, scale))  # the wrapper's kernel variable
        return kernels

    def _layer_inputs(self, layers, samples: int = 64, budget_bytes: int = 1 << 30):
        """Yield each of ``layers``' FP32 input on ``samples`` calibration samples, in order.

        Consecutive layers are grouped until their inputs would pass ``budget_bytes``, and each
        group's inputs come from one pass of the model (one pass per layer cost MobileNetV2 at
        224x224 166 s of its AdaRound's 620 s); a group is computed when its first layer is asked
        for. At most 64 samples: a 112x112x96 input of 256 samples alone would be 1.2 GB.
        """
        x = self.x_calibration[:samples]
        groups, size = [[]], 0
        for layer in layers:
            need = len(x) * int(np.prod(layer.input.shape[1:])) * 4
            if groups[-1] and size + need > budget_bytes:
                groups.append([])
                size = 0
            groups[-1].append(layer)
            size += need
        for group in groups:
            probe = keras.Model(self.float_model.inputs, [layer.input for layer in group])
            got = probe.predict(x, batch_size=32, verbose=0)
            yield from got if len(group) > 1 else [got]

    def _round_weights(self, method: str, seed: int, weight_method: str, iterations: int = 300) -> dict:
        """Set every quantized kernel to its codes by ``method`` times its scale.

        "nearest" restores the FP32 kernels (the converter rounds them). Returns what was done
        and each layer's weight MSE (and, for adaround, output MSE vs nearest). The codes
        depend on the weight ranges, not the activation ranges: they are computed once.
        """
        key = (method, seed, weight_method)
        if key in self._rounded:
            values, record = self._rounded[key]
            for variable, value in values:
                variable.assign(value)
            return record
        layers, values = [], []
        kernels = self._kernels()
        inputs = self._layer_inputs([source for _, source, _, _ in kernels]) if method == "adaround" else None
        for variable, source, kernel, scale in kernels:
            if method == "nearest" and self.weight_bits == 8:
                values.append((variable, kernel))
                variable.assign(kernel)
                continue
            entry = {"layer": source.name}
            if method == "adaround":
                from edgeq.transforms.adaround import adaround

                q, result = adaround(
                    source, next(inputs), scale, iterations=iterations, seed=seed, bits=self.weight_bits
                )
                entry |= {
                    "output_mse_nearest": result.output_mse_nearest,
                    "output_mse": result.output_mse,
                    "flipped": round(result.flipped, 6),
                }
            else:
                q = weight_codes(kernel, scale, method, seed=seed + len(layers), bits=self.weight_bits)
            entry["weight_mse"] = weight_error(kernel, scale, q)
            nearest = weight_codes(kernel, scale, "nearest", bits=self.weight_bits)
            entry["weight_mse_nearest"] = weight_error(kernel, scale, nearest)
            value = (q * scale).astype(np.float32)
            values.append((variable, value))
            variable.assign(value)
            layers.append(entry)
        record = {"method": method, "seed": seed if method != "nearest" else None, "layers": layers}
        self._rounded[key] = (values, record)
        return record


def calibrated_model(
    float_model,
    x_calibration: np.ndarray,
    activations: str = "mse",
    weights: str = "minmax",
    per_tensor: bool = False,
    rounding: str = "nearest",
    seed: int = 0,
):
    """A TF-MOT-wrapped copy of ``float_model`` (tf_keras) whose fake-quant ranges are set.

    Returns (qat_model, chosen ranges). The QAT model converts like any QAT model.
    """
    calibration = RangeCalibration(float_model, x_calibration, per_tensor, fold=rounding != "nearest")
    return calibration.model(activations, weights, rounding, seed)
