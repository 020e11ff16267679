"""The conversion's manifest and its commit: the .tflite and its JSON land together or not at all."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from edgeq.artifacts import provenance, sha256_bytes, sha256_file, write_bytes_atomic, write_json_atomic
from edgeq.convert.edgetpu import _edgetpu
from edgeq.convert.options import ConversionResult, ModeSpec
from edgeq.convert.plans import _plan_wide_layers
from edgeq.convert.search import _calibration_record
from edgeq.convert.verify import _detection_record, _num_classes
from edgeq.errors import ModelLoadError
from edgeq.runtime.flatbuffer import precision_counts, verify_tflite
from edgeq.runtime.inputs import ROUNDING as INPUT_ROUNDING
from edgeq.runtime.inputs import Normalization, manifest_beside

log = logging.getLogger(__name__)


def _manifest(out, flatbuffer, tflite, spec, options, outputs, dataset, data_spec, verification, notes, run) -> dict:
    """What the model's manifest records: the contract a device reads, how it was made, what was verified.

    ``run``: the conversion's own facts (``source``, its ModelSpec; ``is_qat``, ``ptq``, ``seconds``, ``model``).
    """
    source_path, is_qat, ptq_record, seconds = run["source"].path, run["is_qat"], run["ptq"], run["seconds"]
    keras_model, plan, granularity = run["model"], options.plan, options.granularity
    equalize, io_type, calib_samples = options.equalize, options.io_type, options.calib_samples
    op_counts = dict(Counter(op.op_name for op in tflite.ops()))
    normalization = dataset.normalization if dataset is not None else run["source"].normalization or Normalization()
    manifest = {
        "kind": "edgeq.convert",
        "model": out.name,
        "mode": spec.mode.value,
        "mode_help": spec.help,
        "sha256": sha256_bytes(flatbuffer),
        "size_bytes": len(flatbuffer),
        "input": asdict(tflite.input),
        "output": asdict(tflite.output_named(outputs[0].name)),
        # every tensor by its name (the Keras model's = the .tflite signature's), with what it means
        "inputs": [{**asdict(t), "name": n, "tensor": t.name} for n, t in zip(tflite.input_names, tflite.inputs)],
        "outputs": [
            {
                **o.to_dict(),
                **{k: v for k, v in asdict(tflite.output_named(o.name)).items() if k != "name"},
                "tensor": tflite.output_named(o.name).name,
            }
            for o in outputs
        ],  # fmt: skip
        "normalization": normalization.to_dict(),
        # the input contract (edgeq.runtime.inputs): float sample = raw * scale + offset; the model's
        # integer input = clamp(round(float sample / input scale) + zero point), rounded like TFLite
        "input_rounding": INPUT_ROUNDING,
        "num_classes": _num_classes(outputs),
        # a detector: which heads, in which layout, decoded and NMS'd outside the int8 graph (edgeq.tasks.detection)
        "detection": _detection_record(outputs, dataset, options.task),
        "source": {
            "path": str(source_path) if source_path else None,
            "sha256": sha256_file(source_path) if source_path else None,
            "qat": is_qat,
        },
        "options": {
            "granularity": granularity,
            "int4_granularity": options.int4_granularity if spec.backend == "aeq" else None,
            "equalize": equalize,
            "plan": str(plan) if plan else None,
            "io_type": io_type if spec.integer_io else "float32",
            "calib": data_spec,
            "calib_samples": calib_samples if spec.calibrate else 0,
            "ptq": options.ptq if spec.calibrate and not is_qat else None,
            "weight_bits": options.weight_bits,
        },
        "calibration_data_sha256": dataset.fingerprint() if dataset is not None else None,
        "calibration_samples": _calibration_record(dataset, calib_samples) if spec.calibrate else None,
        "ptq": ptq_record,
        "ops": op_counts,
        # ops by what they compute in (QUANTIZE ops counted by their output): int8, int16 (16x8), float
        "precision": precision_counts(verify_tflite(flatbuffer, "the converted model")),
        # a Keras model's layers at 16 bits by its plan; a .tflite's ops (convert.from_tflite gives them)
        "wide_layers": run.get("wide") or (_plan_wide_layers(keras_model, plan) if plan and keras_model else []),
        "verification": asdict(verification),
        # XNNPACK's partitions and the ops it leaves out: what decides int8 speed on every CPU
        "delegate": _delegate_record(flatbuffer, notes),
        # a float .tflite's graph passes before quantization (edgeq.quantize.float_passes): pass -> ops changed
        "float_passes": run.get("passes"),
        # outputs convert split into their concatenated parts (each its own int8 scale), read back joined
        # (edgeq.runtime.interpreter.with_joins): output, parts, axis
        "joined_outputs": run.get("joined_outputs") or [],
        "convert_seconds": round(seconds, 3),
        "notes": notes,
        "provenance": provenance(),
    }
    return manifest


# What would take an op XNNPACK leaves out at int8 back into the delegate.
_OUTSIDE_HELP = {
    "RELU": "a standalone RELU is taken only fused: export it fused into the op before it",
    "RELU6": "a standalone RELU6 is taken only fused: export it fused into the op before it",
    "PRELU": "no int8 PRELU kernel: convert the float .tflite (edgeq writes PRELU as MUL/ADD)",
    "HARD_SWISH": "no int8 HARD_SWISH kernel: convert without --edgetpu (edgeq writes it as ADD/MUL)",
    "QUANTIZE": "a float op sits between two int8 ones (--int8-only says which), or parts at other scales are "
    "rescaled for a CONCATENATION (a .tflite's output: convert without --no-split-outputs)",
    "DEQUANTIZE": "a float op sits between two int8 ones: --int8-only says which",
}


def _delegate_record(flatbuffer: bytes, notes: list[str]) -> dict | None:
    """The converted file's XNNPACK structure; a note when ops fall outside it, with what would help."""
    from edgeq.runtime.delegation import structure_of

    try:
        structure = structure_of(flatbuffer)
    except ModelLoadError as exc:  # e.g. an Edge TPU file: its custom op is not on this CPU
        log.debug("delegate structure not read: %s", exc)
        return None
    if not structure.whole:
        helps = sorted({_OUTSIDE_HELP[op] for op in structure.outside if op in _OUTSIDE_HELP})
        notes.append(
            f"{structure.summary()}: each op outside runs on LiteRT's reference kernels and splits the graph "
            f"(on x86 about 5x slower than XNNPACK's int8, on a Pi 4 about 1.3x){'; ' if helps else ''}"
            + "; ".join(helps)
        )
    return structure.to_dict()


def _commit(out: Path, flatbuffer: bytes, manifest: dict, notes: list[str], edgetpu: bool) -> None:
    """Write a verified conversion's files together: all of them, or none.

    Everything (model, manifest, and with --edgetpu the compiler's model and log) is written
    and fsynced in a hidden folder beside ``out`` first; a failure there (the compiler's
    included) leaves nothing behind. Then each file is renamed into place, the model last:
    a model on disk always has its companions beside it.
    """
    import os
    import tempfile

    from edgeq.artifacts import fsync_path

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as folder:
        stage = Path(folder)
        staged = stage / out.name
        write_bytes_atomic(staged, flatbuffer)
        if edgetpu:
            report = _edgetpu(staged, flatbuffer, notes)
            compiler = report.get("compiler")
            if compiler:  # name the files where they will be, not where they were made
                for key in ("output", "log"):
                    if compiler.get(key):
                        compiler[key] = str(out.parent / Path(compiler[key]).name)
            manifest["edgetpu"] = report
            manifest["notes"] = notes
        write_json_atomic(stage / manifest_beside(out).name, manifest)
        companions = sorted(p for p in stage.iterdir() if p.name != out.name and not p.name.startswith("."))
        for path in companions:
            fsync_path(path)
        for path in companions:
            os.replace(path, out.parent / path.name)
        os.replace(staged, out)
        fsync_path(out.parent)


def conversion_result(
    out: Path, flatbuffer: bytes, manifest: dict, spec: ModeSpec, seconds: float, verification, is_qat, notes
):
    """What ``convert`` returns: the written model, its manifest, and what its verification found."""
    return ConversionResult(
        path=out,
        manifest=manifest_beside(out),
        mode=spec.mode.value,
        size_bytes=len(flatbuffer),
        seconds=round(seconds, 3),
        sha256=manifest["sha256"],
        input=manifest["input"],
        output=manifest["output"],
        outputs=tuple(manifest["outputs"]),
        ops=manifest["ops"],
        verification=verification,
        source_is_qat=is_qat,
        notes=tuple(notes),
        edgetpu=manifest.get("edgetpu"),
    )
