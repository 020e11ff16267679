"""edgeq's public Python API: each stage of the workflow as one function.

Every ``edgeq`` command is a command over one of these; they are importable from the package
root (``edgeq.convert(...)``) and load their stage, and TensorFlow with it, only when called:
``import edgeq`` stays light, and ``edgeq.profile`` never needs TensorFlow at all.

Errors a user can fix raise subclasses of :class:`edgeq.errors.EdgeqError`, each with a
one-line message naming the file, layer or op and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the result types, for readers and type checkers; not imported at run time
    from edgeq.analyze.plan import PlanResult
    from edgeq.analyze.sensitivity import SensitivityReport
    from edgeq.convert.options import ConversionResult
    from edgeq.evaluate.run import EvalResult
    from edgeq.fleet.remote import DeviceOutcome, VerifyResult
    from edgeq.profile.results import ProfileReport
    from edgeq.report.build import ReportResult
    from edgeq.train.config import TrainResult

__all__ = ["train", "convert", "evaluate", "analyze", "optimize", "profile", "push", "verify", "report"]


def train(model: str, data: str | None = None, out_dir: str | Path = "runs/run", **options: Any) -> TrainResult:
    """FP32 training (if any epochs), then quantization-aware fine-tuning with TF-MOT.

    Args:
        model: a zoo name (``edgeq train --help`` lists them) or a .keras/.h5/SavedModel path.
        data: a data source (``digits``, ``npz:PATH``, ``images:DIR``, ...); None: the recipe's.
        out_dir: where the run's files go (fp32.keras, qat.h5, run.json, ...).
        **options: any field of :class:`edgeq.train.fit.TrainConfig` (``epochs``,
            ``qat_epochs``, ``weight_bits``, ``distill``, ``layer_config``, ...).

    Returns:
        The run's TrainResult: its files, and each stage's validation and test metric.

    Raises:
        UsageError: an unknown option or a combination that cannot work.
        DataError: data that does not fit the model.
    """
    from dataclasses import fields

    from edgeq.errors import UsageError
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train as run

    known = {f.name for f in fields(TrainConfig)} - {"model", "data", "out_dir"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UsageError(f"edgeq.train: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return run(TrainConfig(model=str(model), data=data, out_dir=str(out_dir), **options))


def convert(model: Any, out: str | Path | None = None, **options: Any) -> ConversionResult:
    """Convert a Keras model to TFLite, verify it in LiteRT against the model, then write it.

    Args:
        model: a Keras model object or a .keras/.h5/SavedModel path (a QAT model from ``train``
            needs no calibration data).
        out: the .tflite path; None: beside the model, named by the mode.
        **options: any field of :class:`edgeq.convert.options.ConvertOptions` (``mode="int8-only"``,
            ``calib="digits"``, ``plan=...``, ``weight_bits=4``, ``rounding="adaround"``, ...).

    Returns:
        The ConversionResult: path, manifest, size, verification per output.

    Raises:
        UsageError: options that cannot work together.
        ConversionError: the converter failed, or verification did not pass (nothing is written).
        IntegerOnlyError: float ops left in an integer-only model.
    """
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert as run

    return run(model, out, ConvertOptions(**options))


def evaluate(
    model: str | Path,
    reference: str | Path,
    data: str,
    split: str = "test",
    max_drop_pp: float | None = None,
) -> EvalResult:
    """A quantized model against its FP32 reference on a data split, output by output.

    Args:
        model: the quantized .tflite.
        reference: the FP32 .keras/.h5/SavedModel or .tflite.
        data: the data source; ``split``: train, val or test.
        max_drop_pp: the budget for each output's primary metric, in its task's unit.

    Returns:
        The EvalResult: accuracy (or the task's metrics) of both, the drop, MAE, MSE, SQNR, agreement.

    Raises:
        QualityGateError: the drop is over ``max_drop_pp``.
        DataError, ModelLoadError: data or model that cannot be read.
    """
    from edgeq.evaluate.run import evaluate as run

    return run(model, reference, data, split=split, max_drop_pp=max_drop_pp)


def analyze(
    model: str | Path,
    data: str,
    *,
    max_drop_pp: float | None = None,
    out: str | Path | None = None,
    fallback: str = "float",
    samples: int = 200,
) -> SensitivityReport | PlanResult:
    """Per-layer sensitivity of an FP32 model, or with ``max_drop_pp`` a layer-wise precision plan.

    Args:
        model: the FP32 .keras/.h5/SavedModel (one input, one output).
        data: a data source; without labels a classifier is measured by agreement with FP32.
        max_drop_pp: a budget: plan the fewest layers off int8 that meet it.
        out: the plan file (JSON) to write; default ``plan.json`` beside the model.
        fallback: what a layer int8 hurts becomes in a plan: "float", or "int16" (16-bit
            activations in an integer-only model).
        samples: calibration samples.

    Returns:
        The SensitivityReport (layers ranked), or the PlanResult (the plan and every point tried).

    Raises:
        UsageError: a QAT or multi-output model, or data that cannot score the model.
    """
    if max_drop_pp is None:
        from edgeq.analyze.from_tflite import analyze_tflite_sensitivity
        from edgeq.analyze.sensitivity import analyze_sensitivity

        ranker = analyze_tflite_sensitivity if str(model).endswith(".tflite") else analyze_sensitivity
        return ranker(model, data, samples=samples)
    from edgeq.analyze.from_tflite import make_tflite_plan
    from edgeq.analyze.plan import make_plan

    out = Path(out) if out else Path(model).with_name("plan.json")
    planner = make_tflite_plan if str(model).endswith(".tflite") else make_plan  # a .tflite's plan: its ops
    return planner(model, data, max_drop_pp, out, samples=samples, fallback=fallback)


def optimize(
    model: str | Path,
    data: str,
    *,
    max_drop_pp: float,
    target: str = "cpu",
    out: str | Path | None = None,
    **options: Any,
) -> dict:
    """The fastest verified model: PTQ with each range method, the target's plan, QAT, QAT with the plan's
    islands, stopping at the first rung faster than FP32 within the budget on test.

    Args:
        model: the FP32 .keras/.h5/SavedModel (one input, one output).
        data: a data source; its val split chooses each candidate, its test split confirms it, once.
        max_drop_pp: the budget, met by the upper end of the paired 95% interval.
        target: cpu, edgetpu, npu16x8 or a target .toml.
        out: the folder to write (new); default ``MODEL_optimized`` beside the model.
        **options: ``max_size`` (bytes), ``ranges``, ``calib_samples``, ``timer`` (``timer(model_bytes) -> ms``),
            ``task``, ``qat_epochs``, ``say`` (a progress printer).

    Returns:
        What optimize.json records: every rung, the chosen file, its test verdict and the closing line.

    Raises:
        QualityGateError: no rung met the budget on test faster than FP32 (optimize.json is written first).
        UsageError: a QAT model, a folder that is not empty, a model analyze cannot plan.
    """
    from edgeq.optimize.folder import optimize_folder
    from edgeq.optimize.ladder import gate

    out = Path(out) if out else Path(model).with_name(f"{Path(model).stem}_optimized")
    record = optimize_folder(model, data, target, max_drop_pp, out, **options)
    gate(record)
    return record


def profile(
    model: str | Path,
    *,
    compare: str | Path | None = None,
    threads: Sequence[int] = (1,),
    runs: int = 50,
    data: str | Path | None = None,
) -> ProfileReport:
    """Latency, memory and accuracy of a .tflite model on this machine, without TensorFlow.

    Args:
        model: the .tflite to time.
        compare: its FP32 .tflite: speedup, size ratio, accuracy drop and agreement against it.
        threads: interpreter thread counts to sweep.
        runs: timed runs per count (after 5 warm-up runs).
        data: an .npz with ``x`` (and ``y``) for accuracy (``edgeq data export`` writes one).

    Returns:
        The ProfileReport (what ``edgeq profile --json`` writes).

    Raises:
        UsageError, ModelLoadError: bad settings or a file that is not a model.
    """
    from edgeq.profile.run import profile_model

    return profile_model(model, compare=compare, threads=tuple(threads), runs=runs, data=data)


def push(
    files: Sequence[str | Path],
    devices: str | Sequence[str] = "all",
    *,
    inventory: str | Path | None = None,
    parallel: int = 4,
) -> list[DeviceOutcome]:
    """Push models (each with its manifest) and the edgeq runtime to devices over SSH.

    Args:
        files: the .tflite files (and any other files) to push.
        devices: device names, groups or "all", from the inventory.
        inventory: devices.toml or an Ansible YAML inventory; None: the usual places.
        parallel: devices at a time.

    Returns:
        One DeviceOutcome per device, in the inventory's order ("ok", "failed", "unhealthy").

    Raises:
        InventoryError: no inventory, or names it does not hold.
    """
    from edgeq.fleet.inventory import load_inventory
    from edgeq.fleet.remote import for_each_device, push_to

    chosen = load_inventory(inventory).select(devices)
    return for_each_device(chosen, lambda device, event: push_to(device, list(files), event), parallel=parallel)


def verify(
    model: str | Path,
    device: str,
    data: str | Path,
    *,
    inventory: str | Path | None = None,
    limit: int | None = 100,
) -> VerifyResult:
    """Run the same inputs on a device and on this host's interpreter; compare the raw outputs.

    Args:
        model: the .tflite, already pushed to the device.
        device: the device's name in the inventory.
        data: an .npz with ``x`` (float samples or integer codes).
        limit: at most this many samples.

    Returns:
        The VerifyResult: bit-exact or not, and how far the outputs differ.

    Raises:
        InventoryError, TransferError: an unknown device or one that cannot be reached.
    """
    from edgeq.fleet.inventory import load_inventory
    from edgeq.fleet.remote import verify_on

    (chosen,) = load_inventory(inventory).select([device])
    return verify_on(chosen, model, data, limit=limit)


def report(run_dir: str | Path, out: str | Path | None = None) -> ReportResult:
    """One self-contained HTML page of what quantization cost: accuracy, size, latency, devices.

    Args:
        run_dir: a training run's folder, or any folder of edgeq's JSON files and models.
        out: the HTML file; default ``report.html`` in ``run_dir``.

    Returns:
        The ReportResult: the page's path and size, its verdict and the sections it holds.

    Raises:
        UsageError: a folder with nothing edgeq can report on.
    """
    from edgeq.report.build import build_report

    return build_report([run_dir], out or Path(run_dir) / "report.html")
