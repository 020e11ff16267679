"""`convert --edgetpu`: the Edge TPU compiler run on the integer model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgeq.runtime.flatbuffer import verify_tflite


def _edgetpu(path: Path, flatbuffer: bytes, notes: list[str]) -> dict:
    """Edge TPU compatibility from the flatbuffer; edgetpu_compiler's verdict when it is here."""
    from edgeq.runtime.edgetpu import COMPILER_VERSION, check_edgetpu, find_edgetpu_compiler, run_edgetpu_compiler

    report = check_edgetpu(verify_tflite(flatbuffer, str(path)))
    first = report.first_fallback
    result: dict[str, Any] = {
        "compatible": report.compatible,
        "ops_checked": report.ops_checked,
        "ops_mappable": report.ops_mappable,
        "mapped_share": round(report.mapped_share, 4),
        "refused_versions": list(report.refused_versions),
        "first_fallback": None
        if first is None
        else {"index": first.index, "op": first.op_type, "reasons": list(first.reasons)},
        "compiler": None,
    }
    if report.refused_versions:
        notes.append(
            f"Edge TPU: edgetpu_compiler {COMPILER_VERSION} refuses operator versions in this file "
            f"({'; '.join(report.refused_versions)}): it would compile nothing; the CPU model stays usable"
        )
    if first is not None:
        notes.append(
            f"Edge TPU: op {first.index} ({first.op_type}) would fall back to the CPU: {'; '.join(first.reasons)}"
        )
    if find_edgetpu_compiler() is None:
        notes.append(
            "edgetpu_compiler is not on PATH (it runs on x86-64 Debian/Ubuntu; see deploy/CORAL.md): "
            f"compile there with `edgetpu_compiler {path.name}`"
        )
        return result
    compiled = run_edgetpu_compiler(path, path.parent)
    result["compiler"] = {
        "output": compiled.output_path,
        "log": compiled.log_path,
        "version": compiled.compiler_version,
        "ops_mapped": compiled.ops_mapped,
        "ops_not_mapped": compiled.ops_not_mapped,
    }
    notes.append(
        f"edgetpu_compiler: {compiled.ops_mapped} ops mapped to the Edge TPU, "
        f"{compiled.ops_not_mapped} not mapped -> {compiled.output_path}"
    )
    return result
