"""What a .tflite file holds, from the flatbuffer (no TensorFlow); its XNNPACK partitions from an interpreter."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeq import __version__
from edgeq.errors import ModelLoadError, RuntimeBackendError
from edgeq.runtime.delegation import DelegateStructure
from edgeq.runtime.edgetpu import EdgeTPUReport, check_edgetpu
from edgeq.runtime.flatbuffer import (
    ModelDesc,
    OpSummary,
    TensorDesc,
    bytes_by_dtype,
    is_integer_only,
    op_precision,
    op_summary,
    read_tflite,
    tensors_by_dtype,
)

SCHEMA = "edgeq.inspect/1"


@dataclass(frozen=True)
class OpView:
    index: int
    op_type: str
    precision: str  # int8 | int16 | float | other
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    fused_activation: str


@dataclass(frozen=True)
class SignatureView:
    key: str
    inputs: dict[str, str]  # signature name -> tensor name
    outputs: dict[str, str]


@dataclass(frozen=True)
class InspectReport:
    schema: str
    edgeq_version: str
    path: str
    size_bytes: int
    sha256: str
    schema_version: int
    subgraphs: int
    signatures: tuple[SignatureView, ...]
    inputs: tuple[TensorDesc, ...]  # as the file describes them (runtime.flatbuffer)
    outputs: tuple[TensorDesc, ...]
    ops: tuple[OpView, ...]
    op_summary: OpSummary
    custom_ops: tuple[str, ...]
    tensors_by_dtype: dict[str, int]
    bytes_by_dtype: dict[str, int]
    integer_only: bool
    edgetpu: EdgeTPUReport
    # XNNPACK's partitions of the file as profile loads it; None where no interpreter can load it here
    delegate: DelegateStructure | None = None


def describe(desc: ModelDesc) -> InspectReport:
    sg = desc.main
    ops = []
    for op in sg.operators:
        ins, outs = desc.op_dtypes(op)
        ops.append(OpView(op.index, op.op_type, op_precision(desc, op), tuple(ins), tuple(outs), op.fused_activation))
    signatures = []
    for sig in desc.signatures:
        tensors = desc.subgraphs[sig.subgraph].tensors if 0 <= sig.subgraph < len(desc.subgraphs) else ()

        def name(i: int, tensors=tensors) -> str:
            return tensors[i].name if 0 <= i < len(tensors) else f"#{i}"

        signatures.append(
            SignatureView(
                sig.key,
                {k: name(v) for k, v in sig.inputs.items()},
                {k: name(v) for k, v in sig.outputs.items()},
            )
        )
    return InspectReport(
        schema=SCHEMA,
        edgeq_version=__version__,
        path=desc.path or "",
        size_bytes=desc.size_bytes,
        sha256=desc.sha256,
        schema_version=desc.schema_version,
        subgraphs=len(desc.subgraphs),
        signatures=tuple(signatures),
        inputs=tuple(sg.tensors[i] for i in sg.inputs),
        outputs=tuple(sg.tensors[i] for i in sg.outputs),
        ops=tuple(ops),
        op_summary=op_summary(desc),
        custom_ops=tuple(desc.custom_ops()),
        tensors_by_dtype=tensors_by_dtype(desc),
        bytes_by_dtype=bytes_by_dtype(desc),
        integer_only=is_integer_only(desc),
        edgetpu=check_edgetpu(desc),
    )


def inspect_tflite(path: str | Path) -> InspectReport:
    """Read, verify and describe the .tflite file at ``path``, with its delegate structure where an
    interpreter is installed and can load it (a custom op it lacks, an Edge TPU file: not)."""
    report = describe(read_tflite(path))
    from edgeq.runtime.delegation import structure_of

    try:
        structure = structure_of(Path(path).read_bytes())
    except (ModelLoadError, RuntimeBackendError):
        return report
    return dataclasses.replace(report, delegate=structure)


def inspect_to_dict(report: InspectReport) -> dict[str, Any]:
    data = dataclasses.asdict(report)
    data["delegate"] = report.delegate.to_dict() if report.delegate is not None else None
    first = report.edgetpu.first_fallback
    data["edgetpu"]["mapped_share"] = round(report.edgetpu.mapped_share, 4)
    data["edgetpu"]["first_fallback"] = (
        None if first is None else {"index": first.index, "op_type": first.op_type, "reasons": list(first.reasons)}
    )
    return data
