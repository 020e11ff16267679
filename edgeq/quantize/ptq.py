"""Post-training quantization's weights, when edgeq chooses them instead of the converter.

Activation ranges enter through the converter's own calibration
(``edgeq.quantize.calibration.ActivationRanges``). The weights are the other half: by
default the converter quantizes each kernel per channel by its min/max, rounded to
nearest, at 8 bits. ``--weight-ranges mse``, ``--rounding stochastic|adaround`` and
``--weight-bits 4`` choose otherwise. Then BN is folded into a copy of the float model (so
the kernel edgeq rounds is the kernel that is deployed), each Conv2D/DepthwiseConv2D/Dense
kernel gets per-channel codes and scales, the copy's kernels are set to codes times
scale, and after conversion ``edgeq.quantize.passes.with_weight_codes`` writes those very
codes and scales into the .tflite (the converter would re-derive a scale from the values,
which for 4-bit codes in an int8 container is not the 4-bit scale).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from edgeq.models.compat import keras
from edgeq.quantize.numerics import weight_codes, weight_error
from edgeq.quantize.ranges import weight_ranges
from edgeq.transforms.adaround import ADAROUND_LAYERS, kernel_name
from edgeq.transforms.fold import folded_copy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelCodes:
    """One kernel's chosen integer codes (Keras layout) and per-channel (or one) scale."""

    layer: str
    kind: str  # Conv2D, DepthwiseConv2D or Dense
    codes: np.ndarray
    scale: np.ndarray
    bits: int = 8  # 4: stored packed, two codes per byte (TFLite's INT4 tensor type)

    def tflite_layout(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(codes in the .tflite's layout, scale per quantized channel, the quantized dimension)."""
        q = self.codes
        if self.kind == "Conv2D":  # (kh, kw, in, out) -> (out, kh, kw, in)
            return np.transpose(q, (3, 0, 1, 2)), self.scale.reshape(-1), 0
        if self.kind == "DepthwiseConv2D":  # (kh, kw, C, m) -> (1, kh, kw, C * m)
            return q.reshape(1, *q.shape[:2], -1), self.scale.reshape(-1), 3
        return q.T, self.scale.reshape(-1), 0  # Dense: (in, out) -> (out, in)


@dataclass
class ChosenWeights:
    """A float model whose kernels are edgeq's codes times their scales, and those codes."""

    model: object  # the BN-folded copy to convert
    kernels: list[KernelCodes]
    record: dict = field(default_factory=dict)  # the manifest's record of the rounding


def _layer_inputs(model, layers, x: np.ndarray, samples: int = 64, budget_bytes: int = 1 << 30):
    """Yield each of ``layers``' FP32 input on ``samples`` calibration samples, in order.

    Consecutive layers are grouped until their inputs would pass ``budget_bytes``, and each
    group's inputs come from one pass of the model (one pass per layer cost MobileNetV2 at
    224x224 166 s of its AdaRound's 620 s); a group is computed when its first layer is asked
    for. At most 64 samples: a 112x112x96 input of 256 samples alone would be 1.2 GB.
    """
    x = x[:samples]
    groups, size = [[]], 0
    for layer in layers:
        need = len(x) * int(np.prod(layer.input.shape[1:])) * 4
        if groups[-1] and size + need > budget_bytes:
            groups.append([])
            size = 0
        groups[-1].append(layer)
        size += need
    for group in groups:
        probe = keras.Model(model.inputs, [layer.input for layer in group])
        got = probe.predict(x, batch_size=32, verbose=0)
        yield from got if len(group) > 1 else [got]


def choose_weights(
    float_model,
    x_calibration: np.ndarray,
    ranges: str = "minmax",
    rounding: str = "nearest",
    seed: int = 0,
    bits: int = 8,
    per_tensor: bool = False,
    iterations: int = 300,
) -> ChosenWeights:
    """Codes for every Conv2D/DepthwiseConv2D/Dense kernel: ``ranges`` (minmax, mse) picks each
    channel's clipping magnitude m, the scale is m / (2^(bits-1) - 1), ``rounding`` (nearest,
    stochastic, adaround) the codes. Returns the folded copy with kernels = codes x scale."""
    model = folded_copy(float_model)
    layers = [layer for layer in model.layers if type(layer).__name__ in ADAROUND_LAYERS]
    inputs = _layer_inputs(model, layers, x_calibration) if rounding == "adaround" else None
    top = 2 ** (bits - 1) - 1
    kernels, entries = [], []
    for layer in layers:
        kind, name = type(layer).__name__, kernel_name(layer)
        variable = getattr(layer, name)
        kernel = variable.numpy()
        flat = kernel.reshape(*kernel.shape[:2], -1) if kind == "DepthwiseConv2D" else kernel
        m = weight_ranges(flat.reshape(-1, 1) if per_tensor else flat, axis=-1, method=ranges, bits=bits)
        scale = np.maximum(m, np.finfo(np.float32).tiny) / top
        if kind == "DepthwiseConv2D" and not per_tensor:
            scale = scale.reshape(kernel.shape[2:])
        entry = {"layer": layer.name}
        if rounding == "adaround":
            from edgeq.transforms.adaround import adaround

            q, result = adaround(layer, next(inputs), scale, iterations=iterations, seed=seed, bits=bits)
            entry |= {
                "output_mse_nearest": result.output_mse_nearest,
                "output_mse": result.output_mse,
                "flipped": round(result.flipped, 6),
            }
        else:
            q = weight_codes(kernel, scale, rounding, seed=seed + len(kernels), bits=bits)
        entry["weight_mse"] = weight_error(kernel, scale, q)
        entry["weight_mse_nearest"] = weight_error(kernel, scale, weight_codes(kernel, scale, "nearest", bits=bits))
        variable.assign((q * scale).astype(kernel.dtype))
        kernels.append(KernelCodes(layer.name, kind, q.astype(np.int8), np.asarray(scale, np.float64), bits))
        entries.append(entry)
    others = [
        la.name
        for la in model.layers
        if type(la).__name__ not in ADAROUND_LAYERS and any("kernel" in w.name for w in la.weights)
    ]
    record = {
        "converter_weights": others,  # kernels edgeq does not choose (Conv1D, SeparableConv2D...): the converter's
        "method": rounding,
        "seed": seed if rounding != "nearest" else None,
        "weight_ranges": ranges,
        "weight_bits": bits,
        "layers": entries,
    }
    return ChosenWeights(model, kernels, record)
