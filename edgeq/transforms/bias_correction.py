"""Empirical bias correction for post-training quantization (Nagel et al., 2019).

Quantizing a layer's weights W to W_q shifts its expected output by (W_q - W) E[x]. That
shift is the same for every input, so subtracting it from the bias removes the biased
part of the quantization error. E[x] is each layer's mean input per channel, measured on
calibration data; W_q is what TFLite will store (symmetric, narrow range, per channel
or per tensor), computed with edgeq.quantize.numerics. BN must be folded first, so that the bias
exists and W is the deployed weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeq.quantize.numerics import QuantSpec, fake_quantize

_KINDS = ("Conv2D", "DepthwiseConv2D", "Dense")


@dataclass(frozen=True)
class BiasShift:
    layer: str
    max_abs_shift: float
    mean_abs_shift: float


def _quantized(kernel: np.ndarray, kind: str, per_tensor: bool) -> np.ndarray:
    spec = QuantSpec(bits=8, symmetric=True, narrow_range=True, axis=None if per_tensor else -1)
    if kind == "DepthwiseConv2D":  # TFLite stores (1, H, W, C*M): one scale per C*M channel
        flat = kernel.reshape(kernel.shape[0], kernel.shape[1], -1)
        return fake_quantize(flat, spec).reshape(kernel.shape)
    return fake_quantize(kernel, spec)


def correct_biases(
    model, x_calibration: np.ndarray, per_tensor: bool = False, keep: frozenset[str] = frozenset()
) -> list[BiasShift]:
    """Shift the bias of every Conv/Depthwise/Dense layer (that has one) in place.

    Layers named in ``keep`` stay float after conversion (a layer-wise plan): their weights
    are not quantized, so their biases are left alone.
    """
    from edgeq.models.compat import keras

    layers = [
        la
        for la in model.layers
        if type(la).__name__ in _KINDS and getattr(la, "use_bias", False) and la.name not in keep
    ]
    if not layers:
        return []
    probe = keras.Model(model.inputs, [la.input for la in layers])
    inputs = probe.predict(x_calibration, batch_size=64, verbose=0)
    if len(layers) == 1:
        inputs = [inputs]
    shifts = []
    for layer, x in zip(layers, inputs):
        mean_in = x.reshape(-1, x.shape[-1]).mean(axis=0)  # E[x] per input channel
        kernel, bias = layer.get_weights()[:2]
        kind = type(layer).__name__
        delta = _quantized(kernel, kind, per_tensor) - kernel
        if kind == "Dense":
            shift = mean_in @ delta
        elif kind == "DepthwiseConv2D":
            shift = (delta.sum(axis=(0, 1)) * mean_in[:, None]).reshape(-1)
        else:  # Conv2D: every tap of the kernel sees the channel mean (borders aside)
            shift = np.einsum("hwio,i->o", delta, mean_in)
        layer.set_weights([kernel, (bias - shift).astype(bias.dtype), *layer.get_weights()[2:]])
        shifts.append(BiasShift(layer.name, float(np.max(np.abs(shift))), float(np.mean(np.abs(shift)))))
    return shifts
