"""AdaRound (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training Quantization").

For one Conv2D / DepthwiseConv2D / Dense layer with its per-channel scale fixed, learn for
each weight whether to round down or up, so that the layer's output on calibration inputs
moves as little as possible. The rounding is a soft variable h(V) in [0, 1] (rectified
sigmoid); a regulariser, annealed from beta=20 to 2, pushes every h to 0 or 1. Inputs are
the FP32 model's (the paper's simpler variant); layers are rounded one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeq.models.compat import keras, tf
from edgeq.quantize.numerics import weight_codes

ADAROUND_LAYERS = ("Conv2D", "DepthwiseConv2D", "Dense")
_ZETA, _GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch


@dataclass(frozen=True)
class AdaRoundResult:
    layer: str
    output_mse_nearest: float  # the layer's output MSE vs FP32 with round-to-nearest
    output_mse: float  # ... with the learned rounding
    flipped: float  # share of weights rounded the other way than nearest


def kernel_name(layer) -> str:
    return "depthwise_kernel" if type(layer).__name__ == "DepthwiseConv2D" else "kernel"


def _linear(layer):
    """f(x, kernel): the layer's output with another kernel (bias and activation included)."""
    kind = type(layer).__name__
    activation = layer.activation
    bias = layer.bias if getattr(layer, "use_bias", False) else None

    if kind == "Dense":

        def op(x, kernel):
            return tf.tensordot(x, kernel, [[x.shape.rank - 1], [0]])

    elif kind == "DepthwiseConv2D":
        strides = (1, *layer.strides, 1)
        padding = layer.padding.upper()

        def op(x, kernel):
            return tf.nn.depthwise_conv2d(x, kernel, strides, padding, dilations=layer.dilation_rate)

    elif tuple(layer.kernel_size) == (1, 1) and tuple(layer.strides) != (1, 1):
        # A 1x1 kernel at stride s reads every s-th pixel (with "same" or "valid" padding alike):
        # take those first and convolve at stride 1. TF 2.21's CPU gradient of a strided 1x1
        # convolution crashes the process (a double free, Conv2DBackpropFilter), and AdaRound
        # differentiates through this op (mini-Xception's residual 1x1 stride-2 convs).
        rows, cols = layer.strides

        def op(x, kernel):
            return tf.nn.conv2d(x[:, ::rows, ::cols, :], kernel, 1, "VALID")

    else:
        op = layer.convolution_op

    def f(x, kernel):
        y = op(x, kernel)
        return activation(y + bias if bias is not None else y)

    return f


def output_mse(layer, inputs: np.ndarray, codes: np.ndarray, scale: np.ndarray) -> float:
    """MSE of ``layer``'s output on ``inputs`` with kernel ``codes * scale`` against its float kernel."""
    f = _linear(layer)
    x = tf.constant(inputs, dtype=tf.float32)
    kernel = getattr(layer, kernel_name(layer))
    reference = f(x, kernel).numpy()
    quantized = f(x, tf.constant((codes * np.broadcast_to(scale, codes.shape)).astype(np.float32))).numpy()
    return float(np.mean((quantized - reference) ** 2))


def kernel_scale(layer, bits: int = 8) -> np.ndarray:
    """Per-channel symmetric scale (min/max) of ``layer``'s kernel, shaped to broadcast on it."""
    from edgeq.quantize.ranges import weight_ranges

    kernel = getattr(layer, kernel_name(layer)).numpy()
    levels = 2 ** (bits - 1) - 1
    if type(layer).__name__ == "DepthwiseConv2D":  # (kh, kw, C, multiplier): one scale per output channel
        m = weight_ranges(kernel.reshape(*kernel.shape[:2], -1), axis=-1)
        return (m / levels).reshape(kernel.shape[2:])
    return weight_ranges(kernel, axis=-1) / levels


def _rectified_sigmoid(v):
    return tf.clip_by_value(tf.sigmoid(v) * (_ZETA - _GAMMA) + _GAMMA, 0.0, 1.0)


def adaround(
    layer,
    inputs: np.ndarray,
    scale: np.ndarray,
    iterations: int = 300,
    batch_size: int = 16,
    regularization: float = 0.01,
    seed: int = 0,
    bits: int = 8,
) -> tuple[np.ndarray, AdaRoundResult]:
    """Integer codes for ``layer``'s kernel at ``scale`` (broadcast on the kernel), learned on ``inputs``;
    narrow range at ``bits`` ([-127, 127], or [-7, 7] at 4)."""
    top = float(2 ** (bits - 1) - 1)
    f = _linear(layer)
    kernel = getattr(layer, kernel_name(layer)).numpy().astype(np.float32)
    scale = np.broadcast_to(np.asarray(scale, dtype=np.float32), kernel.shape)
    floor = np.floor(kernel / scale)
    rest = np.clip(kernel / scale - floor, 1e-4, 1 - 1e-4)
    # V such that h(V) starts at the fractional part: the soft rounding starts at the float weights
    v = tf.Variable(-np.log((_ZETA - _GAMMA) / (rest - _GAMMA) - 1.0).astype(np.float32))
    floor_t, scale_t, kernel_t = tf.constant(floor), tf.constant(scale), tf.constant(kernel)
    x_all = tf.constant(inputs, dtype=tf.float32)
    optimizer = keras.optimizers.Adam(learning_rate=1e-2)
    warmup = int(0.2 * iterations)

    def soft_kernel():
        return scale_t * tf.clip_by_value(floor_t + _rectified_sigmoid(v), -top, top)

    # the float layer's outputs, once: each step gathers its batch's instead of recomputing them
    targets = tf.concat([f(x_all[i : i + batch_size], kernel_t) for i in range(0, len(inputs), batch_size)], axis=0)

    rng = np.random.default_rng(seed)
    n = len(inputs)
    # the whole schedule up front, so that every step runs in one tf.function call (a Python
    # loop of 300 steps per layer cost a few ms of overhead each)
    picks = np.array([rng.choice(n, size=min(batch_size, n), replace=False) for _ in range(iterations)], np.int64)
    progress = np.clip((np.arange(iterations) - warmup) / max(1, iterations - warmup), 0.0, None)
    betas = np.where(np.arange(iterations) < warmup, 20.0, 20.0 + (2.0 - 20.0) * progress).astype(np.float32)
    weights = np.where(np.arange(iterations) < warmup, 0.0, regularization).astype(np.float32)
    optimizer.build([v])  # its slots made here, not inside the loop

    @tf.function
    def train(picks, betas, weights):
        for i in tf.range(tf.shape(picks)[0]):
            x, target = tf.gather(x_all, picks[i]), tf.gather(targets, picks[i])
            with tf.GradientTape() as tape:
                diff = f(x, soft_kernel()) - target
                reconstruction = tf.reduce_mean(tf.reduce_sum(tf.square(diff), axis=-1))
                h = _rectified_sigmoid(v)
                rounding = tf.reduce_sum(1.0 - tf.pow(tf.abs(2.0 * h - 1.0), betas[i]))
                loss = reconstruction + weights[i] * rounding
            optimizer.apply_gradients([(tape.gradient(loss, v), v)])

    if iterations > 0:
        train(tf.constant(picks), tf.constant(betas), tf.constant(weights))

    learned = np.clip(floor + (_rectified_sigmoid(v).numpy() >= 0.5), -top, top)
    nearest = weight_codes(kernel, scale, "nearest", bits=bits)
    reference = targets.numpy()

    def output_mse(q):
        return float(np.mean((f(x_all, tf.constant((q * scale).astype(np.float32))).numpy() - reference) ** 2))

    result = AdaRoundResult(layer.name, output_mse(nearest), output_mse(learned), float(np.mean(learned != nearest)))
    if result.output_mse > result.output_mse_nearest:  # never worse than nearest on the data it saw
        learned = nearest
        result = AdaRoundResult(layer.name, result.output_mse_nearest, result.output_mse_nearest, 0.0)
    return learned, result
