"""``profile_model``: latency, memory, each output's scores, and the comparison with an FP32 twin."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import gc
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgeq import __version__
from edgeq.artifacts import atomic_path
from edgeq.errors import DataError, MissingExtraError, ModelLoadError, UsageError
from edgeq.models.spec import describe_tflite
from edgeq.profile.host import (
    collect_environment,
    current_rss_mb,
    peak_rss_mb,
    reset_peak_rss,
    thermal_state,
    throttled_between,
)
from edgeq.profile.results import (
    MAX_RUNS,
    PROGRESS_AFTER_S,
    SCHEMA,
    Agreement,
    Comparison,
    LatencyStats,
    MemoryStats,
    ModelFacts,
    ModelProfile,
    ProfileReport,
    ProfileSettings,
    RunResult,
    Scores,
    Thermal,
)
from edgeq.profile.samples import DeviceSamples, load_npz
from edgeq.runtime.delegation import delegate_structure
from edgeq.runtime.flatbuffer import is_integer_only, op_summary, read_tflite
from edgeq.runtime.inputs import (
    detection_beside,
    normalization_beside,
)
from edgeq.runtime.interpreter import TFLiteModel, quantize, with_joins
from edgeq.tasks.metrics import metric
from edgeq.tasks.table import TASKS, OutputSpec, compare, score

log = logging.getLogger(__name__)


def _progress(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr when tqdm is installed and ``enabled``; else a no-op."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, unit="run", leave=False, file=sys.stderr, mininterval=0.5)
        except ImportError:
            pass
    return _NoBar()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _sample_inputs(model: TFLiteModel, data: DeviceSamples | None) -> list[np.ndarray]:
    """One batch per model input: the first data sample, else deterministic random values."""
    rng = np.random.default_rng(0)
    batches = []
    for info, name in zip(model.inputs, model.input_names):
        x = (data.x.get(name) if isinstance(data.x, dict) else data.x) if data is not None else None
        if x is not None and (not isinstance(data.x, dict) or len(model.inputs) > 1):
            batch = info.shape[0] if info.shape and info.shape[0] > 0 else 1
            batches.append(quantize(x[:batch], info))
            continue
        dtype = np.dtype(info.dtype)
        shape = tuple(max(d, 1) for d in info.shape)
        if np.issubdtype(dtype, np.integer):
            limits = np.iinfo(dtype)
            batches.append(rng.integers(limits.min, int(limits.max) + 1, size=shape, dtype=dtype))
        elif dtype == np.bool_:
            batches.append(rng.integers(0, 2, size=shape).astype(bool))
        else:
            batches.append(rng.uniform(-1, 1, size=shape).astype(dtype))
    return batches


def latency_stats(times_ms: list[float], warmup: int, batch: int = 1) -> LatencyStats:
    arr = np.asarray(times_ms, dtype=np.float64)
    median = float(np.median(arr))
    return LatencyStats(
        runs=len(arr),
        warmup=warmup,
        total_s=round(float(arr.sum()) / 1000, 4),
        mean_ms=round(float(arr.mean()), 4),
        median_ms=round(median, 4),
        p90_ms=round(float(np.percentile(arr, 90)), 4),
        p99_ms=round(float(np.percentile(arr, 99)), 4),
        std_ms=round(float(arr.std(ddof=1)) if len(arr) > 1 else 0.0, 4),
        min_ms=round(float(arr.min()), 4),
        max_ms=round(float(arr.max()), 4),
        throughput_per_s=round(1000.0 * batch / median, 2) if median > 0 else math.inf,
    )


def measure_run(
    path: str | Path,
    *,
    threads: int,
    runs: int = 50,
    warmup: int = 5,
    min_seconds: float = 0.0,
    delegate: str | None = None,
    runtime: str | None = None,
    data: DeviceSamples | None = None,
    progress: bool | None = None,
) -> tuple[RunResult, TFLiteModel]:
    """Load ``path`` with ``threads`` threads and time ``runs`` invocations after ``warmup``.

    Returns the result and the loaded model (for an accuracy pass without reloading).
    """
    if runs < 1 or warmup < 0 or threads < 1 or min_seconds < 0:
        raise UsageError("--runs and --threads must be at least 1, --warmup and --min-seconds at least 0")
    gc.collect()
    reset_ok = reset_peak_rss()
    rss_before = current_rss_mb()
    start = time.perf_counter()
    model = TFLiteModel(path, runtime=runtime, num_threads=threads, delegate=delegate or "xnnpack")
    init_ms = (time.perf_counter() - start) * 1000
    peak_load = peak_rss_mb()

    interpreter = model.interpreter
    invoke = interpreter.invoke
    try:
        for info, batch in zip(model.inputs, _sample_inputs(model, data)):
            if tuple(batch.shape) != tuple(info.shape):
                interpreter.resize_tensor_input(info.index, list(batch.shape))
                interpreter.allocate_tensors()
            interpreter.set_tensor(info.index, batch)
        reset_peak_rss()
        t0 = time.perf_counter_ns()
        invoke()
    except (RuntimeError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path}: the interpreter cannot run it: {first}") from exc
    first_ms = (time.perf_counter_ns() - t0) / 1e6
    for _ in range(warmup):
        invoke()

    expected_s = max(first_ms / 1000 * runs, min_seconds)
    show = (expected_s > PROGRESS_AFTER_S) if progress is None else progress
    bar = _progress(runs, f"{Path(path).name} x{threads}", show)
    times: list[float] = []
    begin = time.perf_counter()
    clock = time.perf_counter_ns
    try:
        while len(times) < runs or (time.perf_counter() - begin < min_seconds and len(times) < MAX_RUNS):
            t0 = clock()
            invoke()
            times.append((clock() - t0) / 1e6)
            if len(times) <= runs:
                bar.update(1)
    finally:
        bar.close()
    peak_run = peak_rss_mb()
    batch = model.inputs[0].shape[0] if model.inputs and model.inputs[0].shape else 1
    structure = delegate_structure(interpreter).to_dict() if model.delegate_name == "xnnpack" else None
    result = RunResult(
        threads=threads,
        delegate=model.delegate_name,
        init_ms=round(init_ms, 3),
        first_inference_ms=round(first_ms, 4),
        latency=latency_stats(times, warmup, max(batch, 1)),
        memory=MemoryStats(
            rss_before_mb=rss_before,
            peak_rss_load_mb=peak_load,
            peak_rss_run_mb=peak_run,
            peak_reset=reset_ok,
        ),
        partitions=structure,
    )
    log.info("%s threads=%d median %.3f ms", path, threads, result.latency.median_ms)
    return result, model


def predict_all(
    model: TFLiteModel, x: np.ndarray | dict, progress: bool | None = None, desc: str = "accuracy"
) -> dict[str, np.ndarray]:
    """Every dequantized output, by name, for every sample of ``x``, a batch at a time."""
    first = model.inputs[0]
    batch = first.shape[0] if first.shape and first.shape[0] > 0 else 1
    count = len(next(iter(x.values()))) if isinstance(x, dict) else len(x)
    chunks = range(0, count, batch)
    bar = _progress(len(chunks), desc, bool(progress) if progress is not None else count > 2000)
    outputs: dict[str, list[np.ndarray]] = {}
    try:
        for start in chunks:
            part = (
                {k: v[start : start + batch] for k, v in x.items()} if isinstance(x, dict) else x[start : start + batch]
            )
            for name, value in model.predict_outputs(part, batch_size=batch).items():
                outputs.setdefault(name, []).append(value)
            bar.update(1)
    finally:
        bar.close()
    return {name: np.concatenate(parts, axis=0) for name, parts in outputs.items()}


def output_specs(path: Path, model: TFLiteModel, data: DeviceSamples | None) -> list[OutputSpec]:
    """Each output's task: what the conversion manifest beside the model recorded, else inferred
    from the labels (no activation is known on the device)."""
    described = describe_tflite(model, path)
    names = described.output_names
    return described.tasks(targets={n: data.targets(n, len(names)) for n in names} if data is not None else {})


def _scores(outputs: dict[str, np.ndarray], data: DeviceSamples, specs: list[OutputSpec], where: str) -> Scores:
    """Each output scored by its task against the data's labels (the same scoring as edgeq eval)."""
    if data.y is None:
        return Scores(samples=data.count, labelled=False, value=None)
    rows, first, first_metric = [], None, None
    for spec in specs:
        targets = data.targets(spec.name, len(specs))
        if spec.kind in ("classification", "binary") and targets is not None:
            classes = int(np.prod(spec.shape)) if spec.kind == "classification" else 2
            if np.issubdtype(np.asarray(targets).dtype, np.integer) and (targets.min() < 0 or targets.max() >= classes):
                raise DataError(
                    f"{data.info.path}: labels run from {int(targets.min())} to {int(targets.max())} "
                    f"but {where} has {classes} output classes"
                )
        metrics = score(spec, outputs[spec.name], targets, data.x if not isinstance(data.x, dict) else None)
        metrics = {k: round(v, 6) if isinstance(v, float) and math.isfinite(v) else v for k, v in metrics.items()}
        rows.append({"name": spec.name, "task": spec.kind, "metrics": metrics})
        primary = TASKS[spec.kind].primary
        if first is None and primary in metrics:
            first, first_metric = metrics[primary], primary
    return Scores(samples=data.count, labelled=True, value=first, outputs=tuple(rows), metric=first_metric)


def _detect(path: Path, outputs: dict, data: DeviceSamples, scores: Scores):
    """A detector's outputs decoded and NMS'd here, as on the host (edgeq.tasks.detection); scored by
    pycocotools where this device has it, else by the host that fetches them (profile --on)."""
    from edgeq.tasks.detection import DetectionSpec, decode, mean_average_precision

    recorded = detection_beside(path)
    if recorded is None:
        return scores, None
    spec = DetectionSpec.from_dict(recorded)
    detections = decode(spec, outputs)
    found: dict[str, Any] = {
        **spec.to_dict(),
        "images": data.count,
        "detections": sum(len(d.scores) for d in detections),
    }
    try:
        size = tuple(next(iter(data.x.values())).shape[1:3]) if isinstance(data.x, dict) else tuple(data.x.shape[1:3])
        found |= mean_average_precision(detections, data.y["gt_boxes"], data.y["gt_classes"], size, spec.classes)
        found["scored_by"] = "pycocotools on this device"
    except MissingExtraError:
        found |= {"map": None, "map50": None, "scored_by": "the host (pycocotools is not installed here)"}
    return dataclasses.replace(scores, detection=found, value=found.get("map50"), metric="map50"), tuple(detections)


def write_detections(profile: ModelProfile, path: str | Path) -> Path | None:
    """The decoded detections of a profiled detector as .npz (image, box, score, class rows)."""
    if profile.detections is None:
        return None
    rows = [(i, b, s, c) for i, d in enumerate(profile.detections) for b, s, c in zip(d.boxes, d.scores, d.classes)]
    arrays = {
        "image": np.asarray([r[0] for r in rows], np.int64),
        "boxes": np.asarray([r[1] for r in rows], np.float32).reshape(-1, 4),
        "scores": np.asarray([r[2] for r in rows], np.float32),
        "classes": np.asarray([r[3] for r in rows], np.int64),
        "images": np.asarray(len(profile.detections)),
    }
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    return Path(path)


def read_detections(path: str | Path) -> list:
    """What ``write_detections`` wrote, back as one edgeq.tasks.detection.Detections per image."""
    from edgeq.tasks.detection import Detections

    with np.load(path) as npz:
        image, boxes, scores, classes = npz["image"], npz["boxes"], npz["scores"], npz["classes"]
        count = int(npz["images"])
    return [Detections(boxes[image == i], scores[image == i], classes[image == i]) for i in range(count)]


def _facts(model: TFLiteModel) -> ModelFacts:
    desc = model.description
    assert desc is not None  # loaded with verify=True

    return ModelFacts(
        path=str(model.path),
        sha256=desc.sha256,
        size_bytes=desc.size_bytes,
        integer_only=is_integer_only(desc),
        inputs=tuple(model.inputs),
        outputs=tuple(model.outputs),
        ops=op_summary(desc),
    )


def _profile_one(
    path: Path, threads: tuple[int, ...], data: DeviceSamples | None, kwargs: dict[str, Any]
) -> tuple[ModelProfile, dict | None, list[OutputSpec]]:
    runs: list[RunResult] = []
    outputs = None
    facts = None
    specs: list[OutputSpec] = []
    for count in threads:
        result, model = measure_run(path, threads=count, data=data, **kwargs)
        runs.append(result)
        if facts is None:
            facts = _facts(model)
            joined = with_joins(model)  # outputs convert split, read as the file's one output
            specs = output_specs(path, joined, data)
            if data is not None:
                outputs = predict_all(joined, data.x, kwargs.get("progress"), desc=f"{path.name} accuracy")
            del joined
        del model
    scores = _scores(outputs, data, specs, str(path)) if data is not None and outputs is not None else None
    detections = None
    if scores is not None and isinstance(data.y, dict) and "gt_boxes" in data.y:
        scores, detections = _detect(path, outputs, data, scores)
    assert facts is not None
    profile = ModelProfile(model=facts, runs=tuple(runs), scores=scores, detections=detections)
    return profile, outputs, specs


def profile_model(
    model_path: str | Path,
    *,
    compare: str | Path | None = None,
    threads: tuple[int, ...] | list[int] = (1,),
    runs: int = 50,
    warmup: int = 5,
    min_seconds: float = 0.0,
    data: str | Path | None = None,
    labels: str | None = None,
    delegate: str | None = None,
    runtime: str | None = None,
    progress: bool | None = None,
) -> ProfileReport:
    """Profile ``model_path`` (and ``compare``, its FP32 reference) at each thread count.

    Args:
        compare: a reference .tflite (usually FP32): speedup, size ratio, accuracy drop,
            top-1 agreement and output error against it.
        threads: a sweep; each count loads a fresh interpreter.
        runs, warmup, min_seconds: timed runs (at least ``runs``, and at least
            ``min_seconds`` of them), after ``warmup`` untimed ones.
        data: an .npz with ``x`` (and labels ``y``) for accuracy; its first sample is
            also the timed input (random values otherwise).
        delegate: xnnpack (default), none, edgetpu or a delegate library path. The
            reference always runs on the CPU (xnnpack).
        progress: force the progress bar on/off; None shows it on long loops.
    """
    threads = tuple(int(t) for t in threads)
    if not threads:
        raise UsageError("--threads needs at least one count, e.g. 1,2,4")
    model_path = Path(model_path)
    if runs < 1 or warmup < 0 or min_seconds < 0:
        raise UsageError("--runs must be at least 1, --warmup and --min-seconds at least 0")
    if compare is not None:
        read_tflite(compare)  # a missing or broken reference fails now, not after the timing
    common = {"runs": runs, "warmup": warmup, "min_seconds": min_seconds, "runtime": runtime, "progress": progress}

    if labels is not None and data is None:
        raise UsageError("--labels needs --data")
    dataset = _samples(model_path, data, labels, runtime, delegate) if data is not None else None
    before = thermal_state()  # a throttling device's latency is not its latency: read it around the runs
    main, outputs, specs = _profile_one(model_path, threads, dataset, {**common, "delegate": delegate})
    reference = ref_outputs = agreement = None
    if compare is not None:
        compare = Path(compare)
        reference, ref_outputs, _ = _profile_one(compare, threads, dataset, {**common, "delegate": "xnnpack"})
        _check_same_network(main, reference, model_path, compare)
    if outputs is not None and ref_outputs is not None:
        agreement = _agreement(specs, outputs, ref_outputs, compare)

    comparison = _comparison(main, reference, agreement) if reference is not None else []
    after = thermal_state()
    backend, version = _backend_of(runtime)
    return ProfileReport(
        schema=SCHEMA,
        edgeq_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        environment=collect_environment(backend, version),
        settings=ProfileSettings(
            threads=threads,
            runs=runs,
            warmup=warmup,
            min_seconds=min_seconds,
            delegate=main.runs[0].delegate,
            runtime=runtime,
        ),
        model=main,
        reference=reference,
        agreement=agreement,
        comparison=tuple(comparison),
        data=dataset.info if dataset is not None else None,
        thermal=Thermal(before, after, throttled_between(before, after)),
    )


def _samples(model_path: Path, data, labels, runtime, delegate) -> DeviceSamples:
    """The --data samples, read for the model's inputs; the input spec comes from a quick load,
    so a bad .npz fails before any timing."""
    probe = TFLiteModel(model_path, runtime=runtime, num_threads=1, delegate=delegate or "xnnpack")
    infos = probe.input if len(probe.inputs) == 1 else dict(zip(probe.input_names, probe.inputs))
    return load_npz(data, infos, labels=labels, normalization=normalization_beside(model_path))


def _check_same_network(main: ModelProfile, reference: ModelProfile, model_path: Path, compare: Path) -> None:
    """--compare names the same network: the same input shape."""
    ref_in = reference.model.inputs[0].shape[1:] if reference.model.inputs else ()
    if main.model.inputs and tuple(ref_in) != tuple(main.model.inputs[0].shape[1:]):
        raise UsageError(
            f"--compare {compare} takes input {tuple(ref_in)}, "
            f"{model_path} takes {tuple(main.model.inputs[0].shape[1:])}: they are not the same network"
        )


def _comparison(main, reference, agreement) -> list[Comparison]:
    """The model against its reference at each thread count: speedup, size ratio, how much worse its task metric is."""
    drop, name = None, None
    if main.scores and reference.scores and main.scores.labelled and main.scores.value is not None:
        name = main.scores.metric or "accuracy"
        if reference.scores.value is not None:
            drop = metric(name).worse_by(reference.scores.value, main.scores.value)
    return [
        Comparison(
            threads=mine.threads,
            speedup=round(theirs.latency.median_ms / mine.latency.median_ms, 4),
            size_ratio=round(main.model.size_bytes / reference.model.size_bytes, 4),
            worse_by=drop,
            top1_agreement=agreement.top1_agreement if agreement else None,
            max_abs_error=agreement.max_abs_error if agreement else None,
            metric=name,
            change_unit=metric(name).change if name else None,
        )
        for mine, theirs in zip(main.runs, reference.runs)
    ]


def _agreement(specs: list[OutputSpec], outputs: dict, ref_outputs: dict, reference) -> Agreement:
    """Each output against the reference's output of the same name (the same measures as eval and convert)."""
    rows = []
    for spec in specs:
        if spec.name not in ref_outputs:
            raise UsageError(
                f"--compare {reference} has no output named {spec.name!r} (it has {', '.join(ref_outputs)}): "
                "it is not the same network"
            )
        got, ref = outputs[spec.name], ref_outputs[spec.name]
        if got.shape != ref.shape:
            raise UsageError(f"output {spec.name!r} differs in shape: {got.shape} vs reference {ref.shape}")
        cmp = compare(spec, ref, got)
        rows.append(
            {
                "name": spec.name,
                "task": spec.kind,
                "top1_agreement": round(cmp.agreement, 6) if math.isfinite(cmp.agreement) else None,
                "max_abs_error": round(cmp.max_abs_error, 6),
                "mean_abs_error": round(cmp.mae, 6),
                "rmse": round(float(np.sqrt(cmp.mse)), 6),
                "sqnr_db": round(cmp.sqnr_db, 3) if math.isfinite(cmp.sqnr_db) else None,
            }
        )
    first = rows[0]
    return Agreement(
        samples=len(next(iter(outputs.values()))),
        top1_agreement=first["top1_agreement"],
        max_abs_error=first["max_abs_error"],
        mean_abs_error=first["mean_abs_error"],
        rmse=first["rmse"],
        sqnr_db=first["sqnr_db"],
        outputs=tuple(rows),
    )


def _backend_of(runtime: str | None) -> tuple[str, str]:
    from edgeq.runtime.interpreter import backend_version, select_backend

    backend, _ = select_backend(runtime)
    return backend.name, backend_version(backend)
