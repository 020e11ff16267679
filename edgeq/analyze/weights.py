"""Weight statistics per layer and what each quantization choice would cost them.

Works from a Keras model (host) or a .tflite file (weights read through LiteRT and
dequantized when they are stored quantized). All arithmetic is edgeq.quantize.numerics.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edgeq.errors import ModelLoadError, UsageError
from edgeq.quantize.numerics import QuantSpec, fake_quantize, sqnr_db
from edgeq.shims.litert import ops_details

OUTLIER_SIGMA = 3.0
INT4_SAFE_SQNR_DB = 14.0  # INT4 per-channel weights that keep this much SQNR rarely cost accuracy
INT8_MIN_SQNR_DB = 30.0
PER_CHANNEL_GAIN_DB = 6.0  # one bit's worth: per-channel is clearly needed
BIAS_SHIFT_LIMIT = 0.01  # INT8 error that does not average out: 1% of a channel's weight mass
CHANNEL_SPREAD_LIMIT = 8.0  # one channel's range 8x the median wastes 3 bits of the others under one scale


@dataclass(frozen=True)
class LayerWeights:
    name: str
    kind: str
    weights: np.ndarray  # output channels on the last axis


@dataclass(frozen=True)
class QuantError:
    bits: int
    granularity: str
    scheme: str
    rounding: str
    mse: float
    sqnr_db: float


@dataclass(frozen=True)
class WeightReport:
    name: str
    kind: str
    shape: tuple[int, ...]
    min: float
    max: float
    mean: float
    std: float
    kurtosis: float  # excess kurtosis: 0 for a Gaussian, large for outlier-heavy weights
    outlier_fraction: float  # share of weights beyond OUTLIER_SIGMA standard deviations
    channel_range_spread: float  # largest / median per-channel range
    bias_shift: float = 0.0  # largest |sum of INT8 per-tensor weight error| of a channel / its sum |w|
    errors: tuple[QuantError, ...] = field(default_factory=tuple)
    recommendation: str = ""

    def error(self, bits: int, granularity: str, scheme: str = "symmetric", rounding: str = "nearest") -> QuantError:
        for e in self.errors:
            if (e.bits, e.granularity, e.scheme, e.rounding) == (bits, granularity, scheme, rounding):
                return e
        raise KeyError((bits, granularity, scheme, rounding))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def keras_weights(model) -> list[LayerWeights]:
    """Kernels of Conv/Depthwise/Dense layers, output channels last."""
    result = []
    for layer in model.layers:
        kind = type(layer).__name__
        inner = getattr(layer, "layer", layer)  # a QAT wrapper's layer
        kind = type(inner).__name__
        if kind == "DepthwiseConv2D":
            w = inner.depthwise_kernel.numpy()
            w = w.reshape(w.shape[0], w.shape[1], -1)
        elif hasattr(inner, "kernel") and kind in ("Conv2D", "Conv1D", "Dense", "Conv2DTranspose"):
            w = inner.kernel.numpy()
        else:
            continue
        result.append(LayerWeights(inner.name, kind, w))
    return result


_TFLITE_WEIGHT_OPS = {"CONV_2D": 0, "DEPTHWISE_CONV_2D": 3, "FULLY_CONNECTED": 0}


def tflite_weights(path: str | Path) -> list[LayerWeights]:
    from edgeq.runtime.interpreter import TFLiteModel

    model = TFLiteModel(path, use_default_delegates=False)
    it = model.interpreter
    tensors = {d["index"]: d for d in it.get_tensor_details()}
    result = []
    for op in ops_details(it):
        axis = _TFLITE_WEIGHT_OPS.get(op["op_name"])
        if axis is None or len(op["inputs"]) < 2:
            continue
        detail = tensors[op["inputs"][1]]
        try:
            w = it.get_tensor(detail["index"])
        except ValueError:
            continue  # not a constant
        params = detail["quantization_parameters"]
        if np.issubdtype(w.dtype, np.integer) and len(params["scales"]):
            shape = [1] * w.ndim
            shape[params.get("quantized_dimension", 0)] = -1
            scales = np.asarray(params["scales"]).reshape(shape if len(params["scales"]) > 1 else [1] * w.ndim)
            zps = np.asarray(params["zero_points"]).reshape(scales.shape)
            w = (w.astype(np.float32) - zps) * scales
        w = np.moveaxis(np.asarray(w, dtype=np.float32), axis, -1)
        name = detail["name"].split(";")[0]
        result.append(LayerWeights(name, op["op_name"], w))
    return result


def load_weights(model_path: str | Path) -> list[LayerWeights]:
    path = Path(model_path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model file")
    if path.suffix == ".tflite":
        layers = tflite_weights(path)
    else:
        from edgeq.models.load import load_tf_keras_model

        layers = keras_weights(load_tf_keras_model(path))
    if not layers:
        raise UsageError(f"{path}: no quantizable layers (Conv, DepthwiseConv, Dense) with weights to analyze")
    return layers


def _kurtosis(x: np.ndarray) -> float:
    x = x.astype(np.float64).ravel()
    std = x.std()
    if std == 0:
        return 0.0
    return float(np.mean(((x - x.mean()) / std) ** 4) - 3.0)


def analyze_layer(layer: LayerWeights, seed: int = 0) -> WeightReport:
    w = layer.weights.astype(np.float64)
    flat = w.ravel()
    mean, std = float(flat.mean()), float(flat.std())
    outliers = float(np.mean(np.abs(flat - mean) > OUTLIER_SIGMA * std)) if std > 0 else 0.0
    channels = w.reshape(-1, w.shape[-1])
    ranges = channels.max(axis=0) - channels.min(axis=0)
    median = float(np.median(ranges))
    spread = float(ranges.max() / median) if median > 0 else float("inf")
    errors = []
    for bits, gran, scheme, rounding in itertools.product(
        (8, 4), ("per-tensor", "per-channel"), ("symmetric", "asymmetric"), ("nearest", "stochastic")
    ):
        spec = QuantSpec(
            bits=bits,
            symmetric=scheme == "symmetric",
            narrow_range=scheme == "symmetric",
            axis=-1 if gran == "per-channel" else None,
            rounding=rounding,
        )
        q = fake_quantize(w, spec, seed=seed)
        errors.append(QuantError(bits, gran, scheme, rounding, float(np.mean((q - w) ** 2)), float(sqnr_db(w, q))))
    per_tensor = fake_quantize(w, QuantSpec(bits=8, symmetric=True, narrow_range=True)).reshape(-1, w.shape[-1])
    error_sum = np.abs((per_tensor - channels).sum(axis=0))
    magnitude = np.abs(channels).sum(axis=0)
    bias_shift = float(np.max(np.where(magnitude > 0, error_sum / np.where(magnitude > 0, magnitude, 1), 0.0)))
    report = WeightReport(
        name=layer.name,
        kind=layer.kind,
        shape=tuple(int(d) for d in w.shape),
        min=float(flat.min()),
        max=float(flat.max()),
        mean=mean,
        std=std,
        kurtosis=_kurtosis(flat),
        outlier_fraction=outliers,
        channel_range_spread=spread,
        bias_shift=bias_shift,
        errors=tuple(errors),
    )
    return _with_recommendation(report)


def _with_recommendation(r: WeightReport) -> WeightReport:
    advice = []
    t8, c8 = r.error(8, "per-tensor").sqnr_db, r.error(8, "per-channel").sqnr_db
    c4 = r.error(4, "per-channel").sqnr_db
    # Whole-tensor SQNR hides small channels crushed by one large one: the range spread shows them.
    if c8 - t8 >= PER_CHANNEL_GAIN_DB or r.channel_range_spread >= CHANNEL_SPREAD_LIMIT:
        advice.append("needs per-channel")
    if r.channel_range_spread >= CHANNEL_SPREAD_LIMIT:
        advice.append("--equalize would help")
    if r.bias_shift >= BIAS_SHIFT_LIMIT:
        advice.append("--bias-correct would help")
    if c8 < INT8_MIN_SQNR_DB or r.kurtosis > 20:
        advice.append("keep >= 8 bit (outliers)")
    elif c4 >= INT4_SAFE_SQNR_DB and r.kurtosis < 5:
        advice.append("INT4 safe")
    else:
        advice.append("INT8")
    return WeightReport(**{**r.__dict__, "recommendation": "; ".join(advice)})


def analyze_weights(model_path: str | Path, seed: int = 0) -> list[WeightReport]:
    """One report per layer, most outlier-heavy (highest kurtosis) first."""
    reports = [analyze_layer(layer, seed) for layer in load_weights(model_path)]
    return sorted(reports, key=lambda r: -r.kurtosis)


@dataclass(frozen=True)
class RoundingError:
    """One layer's INT8 per-channel weights rounded one way, and what that costs."""

    layer: str
    method: str  # nearest | stochastic | adaround
    weight_mse: float
    output_mse: float  # the layer's output MSE vs its float kernel, on calibration inputs
    flipped: float  # share of weights rounded the other way than nearest


ROUNDINGS = ("nearest", "stochastic", "adaround")


def rounding_errors(
    model_path: str | Path, data: str, samples: int = 64, seed: int = 0, iterations: int = 300, progress=None
) -> list[RoundingError]:
    """Every Conv/DepthwiseConv/Dense kernel of a Keras model rounded to INT8 per channel by each
    of ROUNDINGS; the weight error and the layer's output error on ``samples`` calibration inputs.

    Weight error alone favours nearest by construction; AdaRound trades weight error for
    output error, which is what the next layer sees.
    """
    from edgeq.analyze.sensitivity import load_fp32_with_data
    from edgeq.models.compat import keras
    from edgeq.quantize.numerics import weight_codes, weight_error
    from edgeq.transforms.adaround import ADAROUND_LAYERS, adaround, kernel_name, kernel_scale, output_mse

    if Path(model_path).suffix == ".tflite":
        raise UsageError(f"{model_path}: rounding needs the float layers: give the Keras model, not the .tflite")
    model, dataset, _ = load_fp32_with_data(model_path, data, "analyze the rounding of")
    x = dataset.calibration_samples(samples, seed)
    layers = [la for la in model.layers if type(la).__name__ in ADAROUND_LAYERS]
    results = []
    for index, layer in enumerate(layers):
        try:
            probe = keras.Model(model.inputs, layer.input)
        except (AttributeError, ValueError):  # a shared layer has no one input to learn its rounding on
            continue
        inputs = probe.predict(x, batch_size=32, verbose=0)
        kernel = getattr(layer, kernel_name(layer)).numpy()
        scale = kernel_scale(layer)
        nearest = weight_codes(kernel, scale, "nearest")
        codes = {
            "nearest": nearest,
            "stochastic": weight_codes(kernel, scale, "stochastic", seed=seed + index),
            "adaround": adaround(layer, inputs, scale, iterations=iterations, seed=seed)[0],
        }
        for method, q in codes.items():
            results.append(
                RoundingError(
                    layer.name,
                    method,
                    weight_error(kernel, scale, q),
                    output_mse(layer, inputs, q, scale),
                    float(np.mean(q != nearest)),
                )
            )
        if progress:
            progress(index + 1, len(layers))
    return results


def save_histograms(model_path: str | Path, out_dir: str | Path, bins: int = 80) -> list[Path]:
    """One PNG per layer: the weight histogram (log counts) with the INT8/INT4 grid extent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgeq.artifacts import atomic_path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for layer in load_weights(model_path):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.hist(layer.weights.ravel(), bins=bins, log=True, color="#4062bb")
        bound = float(np.abs(layer.weights).max())
        for b in (-bound, bound):
            ax.axvline(b, color="#c33", lw=0.8)
        ax.set_title(f"{layer.name} ({layer.kind}, {layer.weights.size} weights)")
        ax.set_xlabel("weight value (red: symmetric per-tensor range)")
        ax.set_ylabel("count (log)")
        fig.tight_layout()
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in layer.name)
        target = out_dir / f"hist_{safe}.png"
        with atomic_path(target) as tmp:
            fig.savefig(tmp, dpi=90)
        plt.close(fig)
        written.append(target)
    return written


def weights_document(model, reports, plots_dir, rounding, data, samples: int, seed: int) -> dict:
    """``analyze weights --json``: every figure, where the histograms are, and the rounding errors."""
    document = {"kind": "edgeq.analyze.weights", "model": str(model), "layers": [r.to_dict() for r in reports]}
    if plots_dir:  # where the histograms are, for `edgeq report`
        document["plots"] = str(plots_dir)
    if rounding:
        document["rounding"] = {"data": data, "samples": samples, "seed": seed, "layers": [asdict(e) for e in rounding]}
    return document


def write_weights_csv(reports, path) -> None:
    """``analyze weights --csv``: one row per layer, with the SQNR of every quantization choice."""
    import csv

    from edgeq.artifacts import atomic_path

    header = ["layer", "kind", "shape", "min", "max", "mean", "std", "kurtosis", "outlier_fraction"]
    header += ["channel_range_spread", "recommendation"]
    combos = [(e.bits, e.granularity, e.scheme, e.rounding) for e in reports[0].errors] if reports else []
    header += [f"sqnr_db_int{b}_{g}_{s}_{r}" for b, g, s, r in combos]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        for r in reports:
            row = [r.name, r.kind, "x".join(map(str, r.shape)), r.min, r.max, r.mean, r.std, r.kurtosis]
            row += [r.outlier_fraction, r.channel_range_spread, r.recommendation]
            writer.writerow(row + [r.error(*c).sqnr_db for c in combos])
