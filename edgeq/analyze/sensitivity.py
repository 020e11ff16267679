"""Per-layer quantization sensitivity, two ways, from one calibration.

fast:  one pass of TFLite's QuantizationDebugger: each quantized op against its float
       twin on the same inputs (MSE, RMSE/scale, max abs error, and the mean SQNR of the
       op's output channels, which catches a layer whose small channels are crushed by
       one large one even when the whole-tensor error looks small).
exact: for each layer, the model quantized everywhere but there, and quantized only
       there; accuracy and output MSE against FP32 on real data.

The calibrated model is made once; every variant is a re-quantization of it
(``mlir_quantize`` with denylisted nodes), as the debugger itself does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from edgeq.data import Dataset
from edgeq.errors import UsageError

log = logging.getLogger(__name__)


@contextlib.contextmanager
def native_output_silenced():
    """Silence what native code writes to the process's stdout (fd 1) for a moment."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


@dataclass
class Calibrated:
    """A float model calibrated once, ready to be quantized with any layers left float."""

    float_model: bytes
    calibrated: bytes
    per_tensor: bool
    nodes: list[str]  # quantized ops' output tensor names, graph order
    layer_of: dict[str, str]  # node -> Keras layer name (or the node itself)
    debugger: object = field(repr=False, default=None)

    def quantize(self, float_nodes: Iterable[str] = ()) -> bytes:
        """Full-integer model (float I/O) with ``float_nodes`` left in float."""
        from tensorflow.lite.python import convert as _convert

        denylist = sorted(set(float_nodes))
        with native_output_silenced():  # the quantizer prints a line per call on stdout
            return _convert.mlir_quantize(
                self.calibrated,
                disable_per_channel=self.per_tensor,
                fully_quantize=False,
                denylisted_nodes=denylist or None,
            )

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


def _channel_sqnr(float_tensor, quant_tensor, scale, zero_point) -> float:
    f = np.asarray(float_tensor, dtype=np.float64)
    q = (np.asarray(quant_tensor, dtype=np.float64) - zero_point) * scale
    f2 = f.reshape(-1, f.shape[-1]) if f.ndim > 1 else f.reshape(-1, 1)
    q2 = q.reshape(f2.shape)
    if f2.shape[0] < 2:  # one value per channel (Dense, pooled): the whole vector is the signal
        noise_all = float(np.sum((f2 - q2) ** 2))
        return (
            100.0 if noise_all == 0 else float(min(100.0, 10 * np.log10(max(float(np.sum(f2**2)), 1e-30) / noise_all)))
        )
    noise = np.sum((f2 - q2) ** 2, axis=0)
    signal = np.sum((f2 - f2.mean(axis=0)) ** 2, axis=0)  # what the channel carries, not its offset
    live = signal > 0
    if not np.any(live):
        return 100.0
    per_channel = np.where(noise[live] > 0, 10 * np.log10(signal[live] / np.maximum(noise[live], 1e-30)), 100.0)
    return float(np.median(np.minimum(per_channel, 100.0)))


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


def calibrate(keras_model, dataset: Dataset, samples: int = 200, per_tensor: bool = False) -> Calibrated:
    from edgeq.compat import tf

    if len(dataset.x_train) == 0:
        raise UsageError(f"data {dataset.source!r} has no samples to calibrate with")
    converter = tf.lite.TFLiteConverter.from_keras_model(keras_model)
    float_model = converter.convert()
    converter = tf.lite.TFLiteConverter.from_keras_model(keras_model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = dataset.representative_dataset(samples)
    if per_tensor:
        converter._experimental_disable_per_channel = True  # noqa: SLF001
    options = tf.lite.experimental.QuantizationDebugOptions(
        layer_direct_compare_metrics={"channel_sqnr_db": _channel_sqnr, "rmse_over_scale": _rmse_over_scale}
    )
    debugger = tf.lite.experimental.QuantizationDebugger(
        converter=converter,
        debug_dataset=dataset.representative_dataset(min(samples, 64), seed=2),
        debug_options=options,
    )
    # Nodes are named as denylisted_nodes wants them: the output tensors of the
    # calibrated model's ops, in graph order.
    from edgeq.runtime.interpreter import TFLiteModel

    graph = TFLiteModel(model_content=debugger.calibrated_model, use_default_delegates=False, verify=False)
    names = {d["index"]: d["name"] for d in graph.interpreter.get_tensor_details()}
    layer_names = [layer.name for layer in keras_model.layers]
    nodes, layer_of = [], {}
    for op in graph.interpreter._get_ops_details():  # noqa: SLF001
        if not op["outputs"].size:
            continue
        node = names[op["outputs"][0]]
        nodes.append(node)
        guess = layer_name_for(node, layer_names)
        layer_of[node] = guess if guess != node.split(";")[0] or "/" in node else f"{op['op_name'].lower()}:{node}"
    return Calibrated(float_model, debugger.calibrated_model, per_tensor, nodes, layer_of, debugger)


@dataclass(frozen=True)
class FastSensitivity:
    layer: str
    node: str
    mean_squared_error: float
    rmse_over_scale: float
    max_abs_error: float
    channel_sqnr_db: float


@dataclass(frozen=True)
class ExactSensitivity:
    layer: str
    nodes: int
    accuracy_all_but_this: float  # everything quantized except this layer
    accuracy_only_this: float  # only this layer quantized
    mse_only_this: float  # output MSE vs FP32 with only this layer quantized
    gain_pp: float  # accuracy regained by keeping this layer float (vs full INT8), in points
    loss_pp: float  # accuracy lost by quantizing only this layer (vs FP32), in points
    seconds: float


@dataclass(frozen=True)
class SensitivityReport:
    model: str
    data: str
    samples: int
    fp32_accuracy: float
    int8_accuracy: float
    fast: tuple[FastSensitivity, ...]
    exact: tuple[ExactSensitivity, ...]
    seconds_fast: float
    seconds_exact: float

    def to_dict(self) -> dict:
        d = asdict(self)
        return _finite(d)


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def predict(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    from edgeq.runtime.interpreter import TFLiteModel

    return TFLiteModel(model_content=model_bytes, use_default_delegates=False, verify=False).predict(x, batch_size=1)


def _node_for_debug_tensor(name: str, nodes: list[str]) -> str | None:
    """'NumericVerify/<node><uniquifying digits>:<index>' -> <node>."""
    base = re.sub(r":\d+$", "", name[len("NumericVerify/") :] if name.startswith("NumericVerify/") else name)
    candidates = [n for n in nodes if base.startswith(n) and base[len(n) :].isdigit() and len(base) - len(n) <= 2]
    if base in nodes:
        return base
    return max(candidates, key=len) if candidates else None


def fast_sensitivity(cal: Calibrated) -> list[FastSensitivity]:
    cal.debugger.run()
    stats = cal.debugger.layer_statistics
    by_layer: dict[str, FastSensitivity] = {}
    for key, metrics in stats.items():
        node = _node_for_debug_tensor(key, cal.nodes)
        if node is None:
            continue
        layer = cal.layer_of[node]
        entry = FastSensitivity(
            layer,
            node,
            float(metrics["mean_squared_error"]),
            float(metrics["rmse_over_scale"]),
            float(metrics["max_abs_error"]),
            float(metrics["channel_sqnr_db"]),
        )
        # A layer with several quantized ops is as sensitive as its worst op.
        if layer not in by_layer or entry.channel_sqnr_db < by_layer[layer].channel_sqnr_db:
            by_layer[layer] = entry
    return sorted(by_layer.values(), key=lambda s: s.channel_sqnr_db)


def exact_sensitivity(cal: Calibrated, x: np.ndarray, y: np.ndarray, progress=None) -> tuple[float, float, list]:
    reference = predict(cal.float_model, x)
    fp32_acc = float(np.mean(reference.argmax(-1) == y))
    int8_acc = float(np.mean(predict(cal.quantize(), x).argmax(-1) == y))
    results = []
    for layer in cal.layers:
        start = time.perf_counter()
        own = cal.nodes_of_layers([layer])
        others = [n for n in cal.nodes if n not in own]
        all_but = float(np.mean(predict(cal.quantize(own), x).argmax(-1) == y))
        only_out = predict(cal.quantize(others), x)
        only = float(np.mean(only_out.argmax(-1) == y))
        results.append(
            ExactSensitivity(
                layer,
                len(own),
                all_but,
                only,
                float(np.mean((only_out - reference) ** 2)),
                round((all_but - int8_acc) * 100, 4),
                round((fp32_acc - only) * 100, 4),
                round(time.perf_counter() - start, 3),
            )
        )
        if progress is not None:
            progress(layer)
    return fp32_acc, int8_acc, results


def load_fp32_with_data(model_path, data: str, verb: str):
    """The FP32 Keras model and a dataset that fits its input; a QAT model is refused."""
    from edgeq.data import load_dataset
    from edgeq.train.fit import load_user_model
    from edgeq.train.schemes import is_qat_model

    model = load_user_model(model_path)
    if is_qat_model(model):
        raise UsageError(f"{model_path} is a QAT model; {verb} the FP32 model it was trained from")
    input_shape = tuple(model.input_shape[1:])
    dataset = load_dataset(data, input_shape=input_shape)
    dataset.check_fits(input_shape, where=f"model {model_path}")
    return model, dataset


def analyze_sensitivity(
    model_path,
    data: str,
    method: str = "both",
    samples: int = 200,
    split: str = "test",
    per_tensor: bool = False,
    progress=None,
) -> SensitivityReport:
    model, dataset = load_fp32_with_data(model_path, data, "analyze")
    start = time.perf_counter()
    cal = calibrate(model, dataset, samples, per_tensor)
    if not cal.nodes:
        raise UsageError(f"{model_path}: the converter quantized no layer: nothing to analyze")
    fast = fast_sensitivity(cal) if method in ("fast", "both") else []
    seconds_fast = time.perf_counter() - start
    x, y = dataset.split(split)
    exact: list = []
    fp32_acc = int8_acc = float("nan")
    t1 = time.perf_counter()
    if method in ("exact", "both"):
        fp32_acc, int8_acc, exact = exact_sensitivity(cal, x, y, progress)
        # Output error with only this layer quantized: continuous, and it attributes a crushed
        # activation to the layer that produces it (accuracy ties between producer and consumer).
        exact.sort(key=lambda r: -r.mse_only_this)
    else:
        fp32_acc = float(np.mean(predict(cal.float_model, x).argmax(-1) == y))
        int8_acc = float(np.mean(predict(cal.quantize(), x).argmax(-1) == y))
    return SensitivityReport(
        str(model_path),
        f"{data} ({split})",
        len(x),
        fp32_acc,
        int8_acc,
        tuple(fast),
        tuple(exact),
        round(seconds_fast, 3),
        round(time.perf_counter() - t1, 3),
    )


def save_bar_chart(report: SensitivityReport, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgeq.artifacts import atomic_path

    rows = report.exact or report.fast
    labels = [r.layer for r in rows]
    if report.exact:
        values, xlabel = [r.gain_pp for r in rows], "accuracy regained by keeping the layer float (pp)"
    else:
        values, xlabel = [-r.channel_sqnr_db for r in rows], "-(mean channel SQNR, dB): higher is more sensitive"
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
    ax.barh(labels[::-1], values[::-1], color="#c0504d")
    ax.set_xlabel(xlabel)
    ax.set_title(f"Quantization sensitivity: {report.model}")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
