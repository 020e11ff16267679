"""Verification of a converted model against its source: SQNR, the contract, each output's task verdict."""

from __future__ import annotations

import numpy as np

from edgeq.convert.converter import float_ops
from edgeq.convert.options import Mode, ModeSpec, Verification
from edgeq.errors import ConversionError, IntegerOnlyError, UsageError
from edgeq.runtime.interpreter import TFLiteModel
from edgeq.tasks.table import task
from edgeq.tasks.verdicts import NothingJudged, Verdict, judge


def _min_sqnr(spec: ModeSpec, value, names: list[str]) -> dict[str, float]:
    """Each output's verification threshold: the mode's, ``--min-sqnr DB`` for all, or NAME=DB,..."""
    thresholds = dict.fromkeys(names, spec.min_sqnr_db)
    if value is None or value == "":
        return thresholds
    if isinstance(value, (int, float)):
        return dict.fromkeys(names, float(value))
    text = str(value)
    if "=" not in text:
        try:
            return dict.fromkeys(names, float(text))
        except ValueError:
            raise UsageError(f"--min-sqnr {text!r}: give dB (e.g. 12) or NAME=DB,NAME=DB") from None
    for item in text.split(","):
        name, _, db = item.partition("=")
        if name.strip() not in thresholds:
            raise UsageError(f"--min-sqnr names output {name.strip()!r}; the model's outputs are {', '.join(names)}")
        try:
            thresholds[name.strip()] = float(db)
        except ValueError:
            raise UsageError(f"--min-sqnr {item!r}: the threshold must be a number of dB") from None
    return thresholds


def _check_contract(tflite, spec: ModeSpec, io_type: str, source_name: str, names: list[str]) -> tuple[str, ...]:
    """What the mode promised before any number is compared: every output by its Keras name, the
    I/O dtypes, and no float op in an integer-only model. Returns the ops still in float."""
    missing = [n for n in names if n not in tflite.output_names]
    if missing:
        raise ConversionError(
            f"{source_name}: the .tflite has no output named {', '.join(missing)} (its outputs: "
            f"{', '.join(tflite.output_names)}); convert the model with edgeq, which names them as Keras does"
        )
    expected_io = io_type if spec.integer_io else "float32"
    tensors = [("input", n, t) for n, t in zip(tflite.input_names, tflite.inputs)]
    tensors += [("output", n, t) for n, t in zip(tflite.output_names, tflite.outputs)]
    for kind, name, tensor in tensors:
        # a mixed int8/int16 model whose last layer computes at 16 bits answers in int16
        wide_output = kind == "output" and tensor.dtype == "int16" and spec.mode in (Mode.INT8_ONLY, Mode.INT16X8)
        if tensor.dtype != expected_io and not wide_output:
            raise ConversionError(
                f"{source_name}: mode {spec.mode.value} promised {expected_io} {kind}s "
                f"but the converter wrote {tensor.dtype} for {kind} {name!r}"
            )
    floats = float_ops(tflite)
    post = sorted({f.split("#")[0] for f in floats if "NON_MAX_SUPPRESSION" in f or "Detection_PostProcess" in f})
    if spec.integer_only and post:
        raise IntegerOnlyError(
            f"{source_name}: the model ends in {', '.join(post)}, which has no integer kernel: export the model "
            "without its post-processing (its box and score heads as two outputs) and let edgeq decode and NMS "
            "them (edgeq.tasks.detection, layouts centre and plain), or convert with --int8 to keep it float"
        )
    if spec.integer_only and floats:
        # the ops that compute in float, named first (the DEQUANTIZE/QUANTIZE around each only carry it)
        computing = sorted({f.split("#")[0] for f in floats} - {"DEQUANTIZE", "QUANTIZE"})
        kinds = f"no int8 form here for {', '.join(computing)}; " if computing else ""
        raise IntegerOnlyError(
            f"{source_name}: not integer-only: {kinds}{len(floats)} op(s) still run in float: "
            f"{', '.join(floats[:12])}{' ...' if len(floats) > 12 else ''}; replace those ops or convert with --int8 "
            "(float fallback)"
        )
    return tuple(floats)


def _held_targets(dataset, held, outputs) -> dict:
    """The labels of the held-out samples verification runs on, by output (none where the data has none)."""
    if dataset is None or held is None or held.indices is None or not dataset.labelled:
        return {}
    found = {}
    for o in outputs:
        targets = dataset.targets(held.split, o.name if len(outputs) > 1 else None)
        if targets is not None:
            found[o.name] = np.asarray(targets)[held.indices]
    return found


def _task_verdict(output, reference, got, targets, x, budget: float | None = None) -> dict | None:
    """What verification saw of the output's task metric on its labelled samples: both values, the
    change with n and its paired interval (edgeq.tasks.verdicts.Verdict); None where nothing scores it.
    With a budget (--max-drop), an output with a task metric that nothing scores is refused."""
    gated = budget is not None and bool(task(output.kind).primary) and not output.kind.startswith("detection")
    try:
        return judge(output, reference, got, targets, x if not isinstance(x, dict) else None, budget).to_dict()
    except NothingJudged as exc:
        if gated:
            raise NothingJudged(f"--max-drop {budget:g}: {exc} (the held-out samples verification uses)") from None
        return None


def _verify(
    tflite, keras_model, spec, held, data_spec, io_type, source, min_sqnr_db, outputs, targets=None, max_drop=None,
    against_float=frozenset(),
) -> Verification:  # fmt: skip
    """The converted model against the source (its ModelSpec: ``source``), output by output (matched
    by name, never position); with labels, each output's task metric too (n, change, paired interval).
    ``keras_model`` is the model it was converted from: a Keras model, or a float .tflite's TFLiteModel.
    ``against_float``: outputs with no labels judged by their task against the reference's own answers
    (a float .tflite's masks, points, presence scores), with edgeq.tasks.table.AGAINST_FLOAT's budgets."""
    from edgeq.models.load import keras_outputs

    names, source_name = [o.name for o in outputs], source.name
    floats = _check_contract(tflite, spec, io_type, source_name, names)
    x, classes, data_text = _verification_inputs(tflite, held, data_spec, source)
    if isinstance(keras_model, TFLiteModel):
        reference = keras_model.predict_outputs(x, batch_size=1)
    else:
        reference = keras_outputs(keras_model, x)
    got = tflite.predict_outputs(x, batch_size=1)
    thresholds = _min_sqnr(spec, min_sqnr_db, names)
    if against_float:
        targets = {**(targets or {}), **{n: np.asarray(reference[n]) for n in against_float}}
    per_output, failed = [], []
    for o in outputs:
        budget = max_drop if max_drop is not None or o.name not in against_float else _float_budget(o, x)
        row, failure = _output_row(o, np.asarray(reference[o.name]), got[o.name], thresholds[o.name], targets, x,
                                   budget, source_name)  # fmt: skip
        if o.name in against_float and row["verdict"]:
            row["verdict"]["against"] = "the float model's answers (no labels)"
        per_output.append(row)
        if failure:
            failed.append(failure)
    if max_drop is not None and not any(p["judged_by"] != "sqnr_db" for p in per_output):
        raise NothingJudged(
            f"--max-drop {max_drop:g}: no output of {source_name} has a task metric its held-out samples score "
            f"({', '.join(f'{o.name}: {o.kind}' for o in outputs)}); give labels ('y' or 'y_<output>'), declare "
            "the task with --task, or verify by SQNR without --max-drop"
        )
    first = per_output[0]
    agreements = [p["agreement"] for p in per_output if p["agreement"] is not None]
    verification = Verification(
        samples=_count(x),
        data=data_text,
        agreement=agreements[0] if agreements else None,
        max_abs_error=max(p["max_abs_error"] for p in per_output),
        mean_abs_error=first["mean_abs_error"],
        sqnr_db=min(p["sqnr_db"] for p in per_output),
        min_sqnr_db=first["min_sqnr_db"] if len(set(thresholds.values())) == 1 else min(thresholds.values()),
        float_ops=tuple(floats),
        integer_only=not floats,
        passed=not failed,
        classes=classes,
        outputs=tuple(per_output),
    )
    if failed:
        raise ConversionError(_verification_failure(source_name, failed, verification, per_output, max_drop))
    return verification


def _float_budget(output, x) -> float:
    """The budget an output judged against the float model gets (edgeq.tasks.table.AGAINST_FLOAT)."""
    from edgeq.tasks.table import AGAINST_FLOAT

    budget = AGAINST_FLOAT[output.kind]
    if output.kind == "landmarks":  # a share of the input's width, in its pixels
        width = np.shape(x)[2] if np.ndim(x) == 4 else 1
        return round(budget * width, 4)
    return budget


def _verification_inputs(tflite, held, data_spec, source):
    """The samples verification runs both models on, how many classes they hold, and what they are."""
    if held is not None:
        text = f"{held.split} samples of {data_spec} (calibration uses train; LiteRT's default kernels, XNNPACK)"
        if held.x_select is not None:
            text += f"; the --ptq choice used {len(held.x_select)} others"
        if held.classes is not None:
            text += f"; {held.classes} of {held.classes_in_split} classes"
        return held.x, held.classes, text
    rng = np.random.default_rng(0)
    x = {
        n: rng.uniform(0.0, 1.0, size=(32, *tflite.input_named(n).shape[1:])).astype(np.float32)
        for n in source.input_names
    }
    x = next(iter(x.values())) if len(x) == 1 else x
    return x, None, "random uniform [0, 1) inputs (no data given)"


def _output_row(o, ref, got, threshold: float, targets, x, max_drop, source_name: str) -> tuple[dict, str | None]:
    """One output's verification row, and the failure it adds to the one-line error (None: passed)."""
    from edgeq.tasks.table import compare

    if got.shape != ref.shape:
        raise ConversionError(f"{source_name}: TFLite output {o.name!r} has shape {got.shape}, Keras {ref.shape}")
    if not np.all(np.isfinite(got)):
        raise ConversionError(f"{source_name}: the converted model's output {o.name!r} holds NaN/inf")
    cmp = compare(o, ref, got)
    verdict = _task_verdict(o, ref, got, (targets or {}).get(o.name), x, max_drop)
    # with --max-drop an output with a task metric is judged by it; the rest (and without it, all) by SQNR
    by_task = verdict is not None and verdict["passed"] is not None
    ok = verdict["passed"] if by_task else cmp.sqnr_db >= threshold
    row = {
        "name": o.name,
        "task": o.kind,
        "sqnr_db": cmp.sqnr_db,
        "min_sqnr_db": threshold,
        "agreement": cmp.agreement if np.isfinite(cmp.agreement) else None,
        "max_abs_error": cmp.max_abs_error,
        "mean_abs_error": cmp.mae,
        "cosine": cmp.cosine,
        "passed": bool(ok),
        "judged_by": verdict["metric"] if by_task else "sqnr_db",
        "verdict": verdict,
    }
    if ok:
        return row, None
    sqnr = f"{o.name} SQNR {cmp.sqnr_db:.1f} dB < {threshold:.1f}"
    return row, Verdict.from_dict(verdict).line() if by_task else sqnr


def _verification_failure(source_name, failed, verification, per_output, max_drop) -> str:
    """The one line a failed verification ends with: what failed, on how many samples, and what to try."""
    n = verification.samples
    if max_drop is not None:
        return f"{source_name}: verification failed on {n} held-out samples: {'; '.join(failed)}; try QAT (edgeq train)"
    agreement = f", top-1 agreement {verification.agreement:.1%}" if verification.agreement is not None else ""
    answers = [Verdict.from_dict(p["verdict"]).line() for p in per_output if p.get("verdict") and not p["passed"]]
    answers = [a for a in answers if a not in failed]  # a task's verdict that failed is said once
    judged = f"; by its task: {'; '.join(answers)}" if answers else ""
    hint = "; --max-drop PP judges a classifier by its answers" if answers or agreement else ""
    if str(source_name).endswith(".tflite"):  # no source model: QAT is out of reach, these are not
        against, tries = "the float .tflite", "--ptq mse or percentile, --int16x8, edgeq analyze plan, or --task"
    else:
        against, tries = "the Keras model", "QAT (edgeq train), per-channel"
    # what failed, in its own terms: an SQNR below --min-sqnr, or a task's verdict (a mask's IoU, points' error)
    by_sqnr = any(p["judged_by"] == "sqnr_db" and not p["passed"] for p in per_output)
    accept = ", or --min-sqnr to accept it" if by_sqnr else ", or --task other (judged by SQNR) to accept it"
    return (
        f"{source_name}: verification failed vs {against} on {n} held-out samples ({'; '.join(failed)}{agreement})"
        f"{judged}; try {tries}{accept}{hint}"
    )


def _count(x) -> int:
    return len(next(iter(x.values()))) if isinstance(x, dict) else len(x)


def _detection_record(outputs, dataset, task_spec: str | None = None) -> dict | None:
    """What the manifest records of a detector (heads, layout, classes, decoder): a device decodes with it."""
    from dataclasses import replace

    from edgeq.tasks.detection import declared_detection, detection_spec_of

    spec = detection_spec_of(outputs, declared_detection(task_spec))
    if spec is None:
        return None
    names = tuple(getattr(dataset, "class_names", ()) or ()) if dataset is not None else ()
    return replace(spec, class_names=names if len(names) == spec.classes else ()).to_dict()


def _num_classes(outputs) -> int | None:
    """Classes of the first classifier output (None: the model has none)."""
    for o in outputs:
        if o.kind == "classification":
            return int(np.prod(o.shape)) if o.shape else None
        if o.kind == "binary":
            return 2
    return None
