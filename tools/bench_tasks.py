"""Tasks beyond classification: the anomaly-detection autoencoder's AUC and a regressor's error,
FP32 vs post-training int8 vs QAT int8, each difference with a paired bootstrap 95% interval.

The autoencoder is MLPerf Tiny's (ad-autoencoder recipe) on ``machine-sound:7200`` (a test
split of 1,440: 1,200 normal, 240 anomalous); the regressor is the diabetes-regression recipe
(scikit-learn's 442 real patients: a test split of 88, so its intervals are wide).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

BOOTSTRAP = 2000


def _paired_interval(metric, y, a, b, inputs=None, seed: int = 0) -> tuple[float, float]:
    """95% interval of metric(a) - metric(b) over paired bootstrap resamples of the test samples."""
    rng = np.random.default_rng(seed)
    n = len(y)
    diffs = []
    for _ in range(BOOTSTRAP):
        idx = rng.integers(0, n, n)
        diffs.append(metric(y[idx], a[idx]) - metric(y[idx], b[idx]))
    low, high = np.percentile(diffs, [2.5, 97.5])
    return float(low), float(high)


def _models(recipe: str, data: str, folder: Path) -> dict[str, Path]:
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    run = train(TrainConfig(model=recipe, data=data, out_dir=str(folder / "run")))
    ptq = convert(run.fp32_model, folder / "ptq_int8.tflite", ConvertOptions(mode="int8-only"))
    qat = convert(run.qat_model, folder / "qat_int8.tflite", ConvertOptions(mode="int8-only"))
    return {"fp32": run.fp32_model, "ptq": ptq.path, "qat": qat.path, "run": run.run}


def _autoencoder(folder: Path) -> list[str]:
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import load_user_model
    from edgeq.runtime.interpreter import TFLiteModel
    from edgeq.tasks.table import PAUC_MAX_FPR, anomaly_scores, roc_auc

    data = "machine-sound:7200"
    start = time.perf_counter()
    paths = _models("ad-autoencoder", data, folder)
    seconds = time.perf_counter() - start
    d = load_dataset(data)
    x, y = d.split("test")
    scores = {"fp32": anomaly_scores(load_user_model(paths["fp32"]).predict(x, verbose=0), x)}
    sizes = {"fp32": None}
    for name in ("ptq", "qat"):
        scores[name] = anomaly_scores(TFLiteModel(paths[name]).predict(x), x)
        sizes[name] = paths[name].stat().st_size

    def pauc(labels, s):
        return roc_auc(labels, s, PAUC_MAX_FPR)

    rows = [
        f"Test split: {len(y)} samples ({int((y == 0).sum())} normal, {int((y == 1).sum())} anomalous); "
        f"train + QAT + both conversions {seconds:.0f} s.",
        "",
        "| model | AUC | AUC - FP32 (95% CI) | pAUC (FPR <= 0.1) | pAUC - FP32 (95% CI) | size |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in (("fp32", "FP32 (Keras)"), ("ptq", "int8-only, PTQ"), ("qat", "int8-only, QAT")):
        auc, p = roc_auc(y, scores[name]), pauc(y, scores[name])
        if name == "fp32":
            rows.append(f"| {label} | {auc:.4f} | | {p:.4f} | | |")
            continue
        lo, hi = _paired_interval(roc_auc, y, scores[name], scores["fp32"])
        plo, phi = _paired_interval(pauc, y, scores[name], scores["fp32"])
        rows.append(
            f"| {label} | {auc:.4f} | {auc - roc_auc(y, scores['fp32']):+.4f} ({lo:+.4f}, {hi:+.4f}) | {p:.4f} | "
            f"{p - pauc(y, scores['fp32']):+.4f} ({plo:+.4f}, {phi:+.4f}) | {sizes[name] / 1024:.1f} KiB |"
        )
    return rows


def _regression(folder: Path) -> list[str]:
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import load_user_model
    from edgeq.runtime.interpreter import TFLiteModel

    paths = _models("diabetes-regression", "diabetes", folder)
    d = load_dataset("diabetes")
    x, y = d.split("test")
    y = y.reshape(-1)
    predictions = {"fp32": load_user_model(paths["fp32"]).predict(x, verbose=0).reshape(-1)}
    for name in ("ptq", "qat"):
        predictions[name] = TFLiteModel(paths[name]).predict(x).reshape(-1)

    def mae(t, p):
        return float(np.mean(np.abs(p - t)))

    def rmse(t, p):
        return float(np.sqrt(np.mean((p - t) ** 2)))

    rows = [
        f"Test split: {len(y)} patients (the target spans {y.min():.0f}..{y.max():.0f}, std {y.std():.1f}).",
        "",
        "| model | MAE | MAE - FP32 (95% CI) | RMSE | RMSE - FP32 (95% CI) |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("fp32", "FP32 (Keras)"), ("ptq", "int8-only, PTQ"), ("qat", "int8-only, QAT")):
        m, r = mae(y, predictions[name]), rmse(y, predictions[name])
        if name == "fp32":
            rows.append(f"| {label} | {m:.2f} | | {r:.2f} | |")
            continue
        lo, hi = _paired_interval(mae, y, predictions[name], predictions["fp32"])
        rlo, rhi = _paired_interval(rmse, y, predictions[name], predictions["fp32"])
        rows.append(
            f"| {label} | {m:.2f} | {m - mae(y, predictions['fp32']):+.2f} ({lo:+.2f}, {hi:+.2f}) | {r:.2f} | "
            f"{r - rmse(y, predictions['fp32']):+.2f} ({rlo:+.2f}, {rhi:+.2f}) |"
        )
    return rows


def run() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "ad").mkdir()
        (tmp / "reg").mkdir()
        ad = _autoencoder(tmp / "ad")
        reg = _regression(tmp / "reg")
    lines = [
        "## Tasks beyond classification: anomaly detection and regression, FP32 vs int8",
        "",
        "`tools/bench_tasks.py`: each recipe trained as it is (FP32, then QAT), then `edgeq convert --int8-only` "
        f"of the FP32 model (PTQ, `--ptq auto`) and of the QAT model. Intervals: paired bootstrap, {BOOTSTRAP} "
        "resamples of the test samples; an interval that holds 0 is a difference within noise.",
        "",
        "### MLPerf Tiny's anomaly-detection autoencoder on `machine-sound` (target: int8 AUC within 0.01 of FP32)",
        "",
        *ad,
        "",
        "### A regressor on scikit-learn's diabetes data",
        "",
        *reg,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
