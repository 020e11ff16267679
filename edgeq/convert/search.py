"""`--ptq auto` and range searches: candidates converted in turn, chosen on held-out data."""

from __future__ import annotations

import time

import numpy as np

from edgeq.convert.converter import _convert_tflite
from edgeq.convert.options import PTQ_AUTO, ConvertOptions, ModeSpec
from edgeq.convert.verify import _count
from edgeq.data.splits import Dataset, HeldOut
from edgeq.errors import ConversionError, DataError, UsageError
from edgeq.runtime.interpreter import TFLiteModel
from edgeq.tasks.metrics import compare_outputs


def _check_held_out(held, dataset, choosing: bool, ptq: str) -> None:
    """Refuse, naming the sizes, data too small to verify on (or, for a --ptq search, to choose on too)."""
    from edgeq.data.splits import size

    if size(held.x) and not (choosing and held.x_select is None):
        return
    need = f"--ptq {ptq} chooses ranges on one half of it and verification gates on the other" if choosing else (
        "verification needs at least one sample"
    )  # fmt: skip
    raise DataError(
        f"data {dataset.source!r} is too small: its {held.split} split holds {dataset.count(held.split)} sample(s) "
        f"({dataset.count('train')} train) and {need}; give more data, or --ptq converter"
    )


def _convert_searching_ranges(
    keras_model, reference_model, spec: ModeSpec, dataset, options: ConvertOptions, held: HeldOut, by_answers=False
):
    """Integer PTQ by each --ptq candidate; the best by SQNR against FP32 on held-out samples (``by_answers``,
    a classifier: by top-1 agreement with FP32, then SQNR: it is judged by its answers, not its logits).

    Every candidate is a real conversion, measured in LiteRT. ``converter`` is the converter's
    own calibration; each of edgeq's methods is the same conversion with every calibrated
    min/max re-chosen by that method (``ActivationRanges``: one calibration and one observation
    pass serve them all, as they serve ``analyze``). With edgeq's weights (--weight-ranges,
    --rounding, --weight-bits) every candidate carries the same chosen codes. Candidates are
    tried in order until one reaches the target; the best measured is kept, so ``auto`` is
    never worse than the converter on the samples checked. Those samples (``held.x_select``)
    are disjoint from the ones verification then gates and records.
    Returns the flatbuffer and the manifest's record of every candidate (and a note).
    """
    from edgeq.models.load import keras_outputs
    from edgeq.quantize.calibration import ActivationRanges

    methods = PTQ_AUTO if options.ptq == "auto" else (options.ptq,)
    target = options.ptq_target_db
    if target is None:
        target = spec.min_sqnr_db if options.min_sqnr_db is None else float(options.min_sqnr_db)
    weights = _chosen_weights(keras_model, dataset, options)
    if weights is not None:  # the converter rounds to nearest, at 8 bits, by min/max: only edgeq's candidates
        methods = tuple(m for m in methods if m != "converter")
    model = weights.model if weights is not None else keras_model
    x_check = held.x_select
    reference = keras_outputs(reference_model, x_check)  # by output name
    ranges = ActivationRanges(dataset.calibration_samples(options.calib_samples))
    candidates, best, stopped_at = [], None, None
    for method in methods:
        start = time.perf_counter()
        try:
            flatbuffer, cmp = _try_candidate(method, model, spec, dataset, options, ranges, weights, x_check, reference)
        except (UsageError, DataError):
            raise
        except Exception as exc:  # one candidate failing must not hide the others
            if len(methods) == 1:
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            candidates.append({"method": method, "error": first, "seconds": round(time.perf_counter() - start, 3)})
            continue
        candidates.append(_candidate(method, cmp, start, by_answers))
        key = (cmp.agreement, cmp.sqnr_db) if by_answers else (cmp.sqnr_db,)
        if best is None or key > best[1]:
            best = (method, key, flatbuffer)
        if cmp.sqnr_db >= target and method != methods[-1]:
            stopped_at = target  # good enough: the rest are not tried
            break
    if best is None:
        raise ConversionError(
            f"every --ptq candidate failed: {'; '.join(c['method'] + ': ' + c['error'] for c in candidates)}"
        )
    record = _search_record(options, best, by_answers, candidates, stopped_at, target, held, weights)
    return best[2], record


def _try_candidate(method: str, model, spec: ModeSpec, dataset, options: ConvertOptions, ranges, weights, x, reference):
    """One --ptq candidate converted (with edgeq's weight codes, when chosen) and compared with FP32 on ``x``."""
    import contextlib

    from edgeq.quantize.passes import with_weight_codes

    with contextlib.nullcontext() if method == "converter" else ranges.ranged(method):
        flatbuffer, _ = _convert_tflite(model, spec, dataset, options, False)
    if weights is not None:
        flatbuffer, folded = with_weight_codes(flatbuffer, weights.kernels)
        weights.record["converter_folded"] = folded
    got = TFLiteModel(model_content=flatbuffer).predict_outputs(x)
    # several outputs (a detector's heads): the worst one decides, as in verification
    return flatbuffer, min((compare_outputs(reference[n], got[n]) for n in reference), key=lambda c: c.sqnr_db)


def _search_record(options: ConvertOptions, best, by_answers, candidates, stopped_at, target, held, weights) -> dict:
    """The manifest's record of a --ptq search: what was chosen, by what, on which samples, every candidate."""
    x_check, split = held.x_select, held.split
    tried = ", ".join(_described(c) for c in candidates)
    by = f"top-1 agreement with FP32 ({best[1][0]:.1%}), then SQNR," if by_answers else "SQNR vs FP32"
    note = (
        f"--ptq {options.ptq}: {best[0]} ranges chosen by {by} on {_count(x_check)} {split} samples, "
        f"not those verification uses ({tried}"
        f"{'; stopped at the target ' + format(stopped_at, '.1f') + ' dB' if stopped_at is not None else ''})"
    )
    rounding = {"method": "nearest", "seed": None, "layers": []}
    if weights is not None:
        rounding, note = weights.record, note + _weights_note(weights.record)
    return {
        "requested": options.ptq,
        "chosen": best[0],
        "target_db": target,
        "chosen_by": "agreement, sqnr_db" if by_answers else "sqnr_db",
        "weight_ranges": options.weight_ranges,
        "rounding": rounding,
        "checked_on": f"{len(x_check)} {split} samples",
        "checked_on_classes": held.classes_select,
        "candidates": candidates,
        "note": note,
    }


def _chosen_weights(keras_model, dataset, options: ConvertOptions):
    """edgeq's weight codes (edgeq.quantize.ptq) when the options ask for other than the converter's."""
    if options.weight_ranges == "minmax" and options.rounding == "nearest" and options.weight_bits == 8:
        return None
    from edgeq.models.load import as_tf_keras
    from edgeq.quantize.ptq import choose_weights

    return choose_weights(
        as_tf_keras(keras_model),
        dataset.calibration_samples(options.calib_samples),
        options.weight_ranges,
        options.rounding,
        options.seed,
        options.weight_bits,
        options.granularity == "per-tensor",
    )


def _weights_note(record: dict) -> str:
    layers = record["layers"]
    note = (
        f"; {record['weight_bits']}-bit weights, {record['weight_ranges']} ranges, rounded by {record['method']} "
        f"(seed {record['seed']}) in {len(layers)} layers"
    )
    if record.get("converter_weights"):
        kept = record["converter_weights"]
        note += f"; {len(kept)} other kernel(s) left to the converter (8-bit, min/max): {', '.join(kept[:4])}"
    if record.get("converter_folded"):
        folded = record["converter_folded"]
        note += (
            f"; the converter folded a scale into {len(folded)} filter(s), which keep its 8-bit codes: "
            f"{', '.join(folded[:4])}"
        )
    if record["method"] == "adaround" and layers:
        before = float(np.mean([la["output_mse_nearest"] for la in layers]))
        after = float(np.mean([la["output_mse"] for la in layers]))
        note += f", mean layer output MSE {before:.3g} -> {after:.3g} vs nearest"
    return note


def _calibration_record(dataset: Dataset, n: int) -> dict:
    """Which train samples calibration drew: how many, and how many classes they cover."""
    from edgeq.data.splits import classes_covered

    indices = dataset.calibration_indices(n)
    return {
        "split": "train",
        "samples": len(indices),
        "classes": classes_covered(dataset.labels("train"), indices),
        "draw": "stratified by class, seed 0",
    }


def _candidate(method: str, cmp, start: float, classes: bool) -> dict:
    """A candidate converted and measured in LiteRT (seconds: since its work began); top-1 agreement
    only where the outputs are classes (a box or a value has no top-1)."""
    return {
        "method": method,
        "sqnr_db": round(cmp.sqnr_db, 3),
        "agreement": round(cmp.agreement, 6) if classes else None,
        "seconds": round(time.perf_counter() - start, 3),
    }


def _described(c: dict) -> str:
    return f"{c['method']} {c['sqnr_db']:.1f} dB" if "sqnr_db" in c else f"{c['method']} failed"
