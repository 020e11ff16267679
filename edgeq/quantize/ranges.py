"""Quantization ranges from observed values: minmax, percentile, MSE search, entropy (KL).

numpy only. Activations are quantized asymmetrically over 2**bits levels (TF-MOT's and
TFLite's int8 activations); weights symmetrically per channel over the narrow range
[-(2**(bits-1) - 1), 2**(bits-1) - 1]. Every range returned contains 0, as TFLite needs.
"""

from __future__ import annotations

import numpy as np

ACTIVATION_METHODS = ("minmax", "percentile", "mse", "entropy")
WEIGHT_METHODS = ("minmax", "mse")

# Clipping factors tried by the MSE search: 100 steps from 5% to 100% of the observed range.
_MSE_GRID = np.linspace(0.05, 1.0, 96)


def _with_zero(lo: float, hi: float) -> tuple[float, float]:
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if hi - lo < 1e-8:
        hi = lo + 1e-8
    return lo, hi


def fake_quant_asymmetric(x: np.ndarray, lo: float, hi: float, bits: int = 8) -> np.ndarray:
    """x quantized to 2**bits levels over [lo, hi] (zero exactly representable) and back."""
    levels = 2**bits - 1
    scale = (hi - lo) / levels
    zero_point = np.clip(np.round(-lo / scale), 0, levels)
    q = np.clip(np.round(x / scale) + zero_point, 0, levels)
    return (q - zero_point) * scale


def quantization_mse(x: np.ndarray, lo: float, hi: float, bits: int = 8) -> float:
    return float(np.mean((x - fake_quant_asymmetric(x, lo, hi, bits)) ** 2))


def _mse_range(x: np.ndarray, lo: float, hi: float, bits: int) -> tuple[float, float]:
    """The clipping of [lo, hi] (both ends scaled alike) with the least quantization MSE."""
    best, best_err = (lo, hi), quantization_mse(x, lo, hi, bits)
    for t in _MSE_GRID:
        candidate = _with_zero(lo * t, hi * t)
        err = quantization_mse(x, *candidate, bits)
        if err < best_err:
            best, best_err = candidate, err
    return best


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    mask = p > 0
    return float(np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-12))))


def _entropy_threshold(magnitudes: np.ndarray, bits: int, bins: int = 2048) -> float:
    """The clipping threshold of |x| whose 2**bits-level histogram loses the least information (KL).

    Exact zeros are left out (as NVIDIA's pytorch-quantization does with ``skip_zeros``): after a
    ReLU half the values are 0, zero is exact at any range, and that spike in the first bin
    made the search clip 4 to 8% of a trained MobileNetV2's ReLU outputs (its int8 model fell to 0 dB).
    """
    magnitudes = magnitudes[magnitudes > 0]
    if magnitudes.size == 0:
        return 1e-8
    top = float(magnitudes.max())
    hist, edges = np.histogram(magnitudes, bins=bins, range=(0.0, top))
    hist = hist.astype(np.float64)
    levels = 2 ** (bits - 1) if bits > 1 else 2
    best_i, best_kl = bins, np.inf
    for i in range(levels, bins + 1, max(1, (bins - levels) // 128)):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()  # what is clipped lands in the last bin
        # q: the first i bins merged into `levels` chunks (as np.array_split cuts them), each
        # chunk's count spread back evenly over its non-empty bins
        sizes = np.full(levels, i // levels)
        sizes[: i % levels] += 1
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        nonzero = hist[:i] > 0
        sums = np.add.reduceat(hist[:i], starts)
        counts = np.add.reduceat(nonzero.astype(np.float64), starts)
        q = np.where(nonzero, np.repeat(sums / np.maximum(counts, 1.0), sizes), 0.0)
        if p.sum() == 0 or q.sum() == 0:
            continue
        kl = _kl(p / p.sum(), q / q.sum())
        if kl < best_kl:
            best_i, best_kl = i, kl
    return float(edges[best_i])


def activation_range(
    values: np.ndarray, method: str = "minmax", bits: int = 8, percentile: float = 99.99
) -> tuple[float, float]:
    """[lo, hi] for an activation tensor from a sample of its values."""
    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        return _with_zero(0.0, 1.0)
    lo, hi = _with_zero(x.min(), x.max())
    if method == "minmax":
        return lo, hi
    if method == "percentile":
        return _with_zero(np.percentile(x, 100.0 - percentile), np.percentile(x, percentile))
    if method == "mse":
        return _mse_range(x, lo, hi, bits)
    if method == "entropy":
        if lo >= 0:  # one-sided (after ReLU): all levels for [0, T]
            return _with_zero(0.0, min(hi, _entropy_threshold(x, bits + 1)))
        t = _entropy_threshold(np.abs(x), bits)
        return _with_zero(max(lo, -t), min(hi, t))
    raise ValueError(f"unknown range method {method!r}; choose one of {', '.join(ACTIVATION_METHODS)}")


def weight_ranges(kernel: np.ndarray, axis: int = -1, method: str = "minmax", bits: int = 8) -> np.ndarray:
    """Per-channel symmetric clipping magnitudes m (the range is [-m, m]) along ``axis``."""
    w = np.moveaxis(np.asarray(kernel, dtype=np.float64), axis, -1).reshape(-1, kernel.shape[axis])
    top = np.max(np.abs(w), axis=0)
    if method == "minmax":
        return np.maximum(top, 1e-8)
    if method != "mse":
        raise ValueError(f"unknown weight range method {method!r}; choose one of {', '.join(WEIGHT_METHODS)}")
    levels = 2 ** (bits - 1) - 1
    best, best_err = top.copy(), np.full(top.shape, np.inf)
    for t in _MSE_GRID:
        m = np.maximum(top * t, 1e-8)
        scale = m / levels
        err = np.mean((w - np.clip(np.round(w / scale), -levels, levels) * scale) ** 2, axis=0)
        better = err < best_err
        best[better], best_err[better] = m[better], err[better]
    return np.maximum(best, 1e-8)


# Values kept per observed tensor for percentile/MSE/entropy (min and max are exact).
_SAMPLE_CAP = 1 << 17


class Observer:
    """Running min/max and a uniform random sample of at most ``cap`` of one tensor's values.

    The sample is a bottom-k reservoir: every value gets a random key, and the ``cap`` values
    with the smallest keys are kept. So every value seen has the same chance to be kept,
    whether it came in the first batch or the last, and memory stays at ``cap`` values (plus
    the batch being added) however many batches come.

    Each observer draws its keys from its own generator (``seed``), one key per value in the
    order the values come: so what it keeps depends on its tensor's values alone, not on the
    batch size or on how many other tensors are observed beside it. The same tensor observed
    for analyze and convert --ptq (in the converter's calibrated model) and for an int16
    plan (in the float .tflite LiteRT Quantizer calibrates) yields the same sample, and so
    the same range.
    """

    def __init__(self, seed: int = 0, cap: int | None = None):
        self.rng, self.low, self.high, self.seen = np.random.default_rng(seed), np.inf, -np.inf, 0
        self.cap = int(cap if cap is not None else _SAMPLE_CAP)
        self.sample = np.zeros(0, dtype=np.float32)
        self.keys = np.zeros(0, dtype=np.float64)

    def add(self, values: np.ndarray) -> None:
        flat = np.asarray(values, dtype=np.float32).ravel()
        if not flat.size:
            return
        self.low, self.high = min(self.low, float(flat.min())), max(self.high, float(flat.max()))
        self.seen += flat.size
        keys = self.rng.random(flat.size)
        if len(self.keys) >= self.cap:  # full: only values whose key beats the largest kept one enter
            enter = keys < self.keys.max()
            flat, keys = flat[enter], keys[enter]
        sample, all_keys = np.concatenate([self.sample, flat]), np.concatenate([self.keys, keys])
        if len(all_keys) > self.cap:
            keep = np.argpartition(all_keys, self.cap - 1)[: self.cap]
            sample, all_keys = sample[keep], all_keys[keep]
        self.sample, self.keys = sample, all_keys

    def values(self) -> np.ndarray:
        sample = self.sample
        missing = [v for v in (self.low, self.high) if not np.any(sample == np.float32(v))]
        # the extremes always count, once: a sampled-away one is added, a kept one not doubled
        return np.concatenate([sample, np.asarray(missing, dtype=np.float32)]) if missing else sample
