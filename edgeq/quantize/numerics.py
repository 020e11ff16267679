"""The precision engine: integer quantization in numpy, TensorFlow-free.

Uniform affine quantization ``q = clamp(round(x / scale) + zero_point, qmin, qmax)`` for
2 to 8 bits: symmetric (zero point 0) or asymmetric, optionally narrow range (drop the
most negative code so that the range is symmetric), per tensor or per channel along any
axis, with round-to-nearest or seeded stochastic rounding; and INT4 packing, two values
per byte. The analyzers use it to measure what each choice costs before converting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 8
    symmetric: bool = True
    narrow_range: bool = False
    axis: int | None = None  # None: per tensor; else per channel along this axis
    rounding: str = "nearest"

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be 2..8, got {self.bits}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")

    @property
    def qmin(self) -> int:
        low = -(2 ** (self.bits - 1))
        return low + 1 if self.narrow_range else low

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1


@dataclass(frozen=True)
class QuantParams:
    scale: np.ndarray  # shape () per tensor, or the broadcastable per-channel shape
    zero_point: np.ndarray
    spec: QuantSpec


def _reduce_axes(x: np.ndarray, axis: int | None) -> tuple[int, ...] | None:
    if axis is None:
        return None
    axis = axis % x.ndim
    return tuple(i for i in range(x.ndim) if i != axis)


def compute_params(x: np.ndarray, spec: QuantSpec) -> QuantParams:
    """Scale and zero point that cover the min/max range of ``x`` (per tensor or channel)."""
    x = np.asarray(x, dtype=np.float64)
    axes = _reduce_axes(x, spec.axis)
    lo = np.minimum(np.min(x, axis=axes, keepdims=axes is not None), 0.0)
    hi = np.maximum(np.max(x, axis=axes, keepdims=axes is not None), 0.0)
    if spec.symmetric:
        bound = np.maximum(np.abs(lo), np.abs(hi))
        scale = bound / spec.qmax
        zero_point = np.zeros_like(scale)
    else:
        levels = spec.qmax - spec.qmin
        scale = (hi - lo) / levels
        zero_point = np.round(spec.qmin - lo / np.where(scale > 0, scale, 1.0))
        zero_point = np.clip(zero_point, spec.qmin, spec.qmax)
    scale = np.where(scale > 0, scale, 1.0)  # an all-zero channel: any scale is exact
    return QuantParams(scale=scale, zero_point=zero_point, spec=spec)


def round_codes(v: np.ndarray, rounding: str, rng: np.random.Generator | None) -> np.ndarray:
    """v rounded to integers: nearest, or stochastic (up with probability of the fraction: unbiased)."""
    if rounding == "nearest":
        return np.round(v)
    if rng is None:
        raise ValueError("stochastic rounding needs a seeded numpy Generator (rng=np.random.default_rng(seed))")
    floor = np.floor(v)
    return floor + (rng.random(v.shape) < (v - floor))


def quantize(x: np.ndarray, params: QuantParams, rng: np.random.Generator | None = None) -> np.ndarray:
    """Float -> integer codes (int8 storage; values within [qmin, qmax] of ``params.spec``)."""
    spec = params.spec
    v = np.asarray(x, dtype=np.float64) / params.scale + params.zero_point
    q = round_codes(v, spec.rounding, rng)
    return np.clip(q, spec.qmin, spec.qmax).astype(np.int8)


def dequantize(q: np.ndarray, params: QuantParams) -> np.ndarray:
    return ((q.astype(np.float64) - params.zero_point) * params.scale).astype(np.float32)


def fake_quantize(x: np.ndarray, spec: QuantSpec, seed: int | None = 0) -> np.ndarray:
    """Quantize then dequantize with parameters computed from ``x`` itself."""
    params = compute_params(x, spec)
    rng = np.random.default_rng(seed) if spec.rounding == "stochastic" else None
    return dequantize(quantize(x, params, rng), params)


def weight_codes(
    kernel: np.ndarray, scale: np.ndarray, rounding: str = "nearest", seed: int = 0, bits: int = 8
) -> np.ndarray:
    """Codes (float64) of a symmetric kernel at per-channel ``scale``, narrow range: [-127, 127] at
    8 bits, [-7, 7] at 4."""
    rng = np.random.default_rng(seed) if rounding == "stochastic" else None
    scaled = np.asarray(kernel, np.float64) / np.asarray(scale, np.float64)
    top = 2 ** (bits - 1) - 1
    return np.clip(round_codes(scaled, rounding, rng), -top, top)


def weight_error(kernel: np.ndarray, scale: np.ndarray, q: np.ndarray) -> float:
    """Mean squared error of the weights that codes ``q`` at ``scale`` stand for."""
    return float(np.mean((np.asarray(kernel, np.float64) - q * np.asarray(scale, np.float64)) ** 2))


def sqnr_db(reference: np.ndarray, approx: np.ndarray) -> float:
    """edgeq's one SQNR: 10 log10(sum reference^2 / sum (reference - approx)^2) in dB; inf when
    nothing was lost, -inf when the reference is all zeros and the approximation is not."""
    return float(_sqnr(np.asarray(reference, dtype=np.float64), np.asarray(approx, dtype=np.float64), None))


def channel_sqnr_db(reference: np.ndarray, approx: np.ndarray) -> np.ndarray:
    """``sqnr_db`` of each channel (the last axis) that carries a signal; a tensor with one value per
    channel (a Dense or pooled output of one sample) is one channel, the whole vector."""
    ref = np.asarray(reference, dtype=np.float64)
    got = np.asarray(approx, dtype=np.float64).reshape(ref.shape)
    if ref.ndim < 2 or np.prod(ref.shape[:-1]) < 2:
        return np.array([_sqnr(ref, got, None)])
    ref, got = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, ref.shape[-1])
    live = np.any(ref != 0, axis=0)  # a channel that is all zeros carries nothing to lose
    if not np.any(live):
        return np.array([_sqnr(ref, got, None)])
    return _sqnr(ref[:, live], got[:, live], 0)


def _sqnr(ref: np.ndarray, got: np.ndarray, axis: int | None):
    signal, noise = np.sum(ref**2, axis=axis), np.sum((ref - got) ** 2, axis=axis)
    with np.errstate(divide="ignore"):
        return np.where(
            noise == 0, np.inf, np.where(signal > 0, 10.0 * np.log10(signal / np.where(noise == 0, 1, noise)), -np.inf)
        )


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Signed 4-bit values in [-8, 7] -> bytes, two per byte (low nibble first)."""
    flat = np.asarray(q).reshape(-1).astype(np.int16)
    if flat.size and (flat.min() < -8 or flat.max() > 7):
        raise ValueError("INT4 values must lie in [-8, 7]")
    if flat.size % 2:
        flat = np.append(flat, 0)
    nibbles = (flat & 0x0F).astype(np.uint8)
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, count: int) -> np.ndarray:
    """Bytes from ``pack_int4`` -> ``count`` signed values (int8)."""
    packed = np.asarray(packed, dtype=np.uint8)
    nibbles = np.empty(packed.size * 2, dtype=np.int16)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    nibbles = np.where(nibbles > 7, nibbles - 16, nibbles)
    return nibbles[:count].astype(np.int8)
