"""``edgeq inspect``: ops, dtypes, quantization and Edge TPU checks of a .tflite file."""

from __future__ import annotations

import click

from edgeq.ui import human_bytes, table, write_json_output


def _quant(scale: tuple[float, ...], zero_point: tuple[int, ...]) -> str:
    if not scale:
        return "-"
    if len(scale) == 1:
        return f"scale {scale[0]:.6g} zp {zero_point[0] if zero_point else 0}"
    return f"per-channel ({len(scale)} scales)"


def render(report, show_ops: bool = True) -> str:
    from edgeq.runtime.edgetpu import COMPILER_VERSION

    lines = [
        f"model          {report.path}  {human_bytes(report.size_bytes)}  sha256 {report.sha256[:12]}",
        f"schema         v{report.schema_version}, {report.subgraphs} subgraph(s)",
    ]
    for sig in report.signatures:
        lines.append(f"signature      {sig.key}: ({', '.join(sig.inputs)}) -> ({', '.join(sig.outputs)})")
    if not report.signatures:
        lines.append("signature      none")
    lines.append("")
    rows = [
        [kind, t.name, str(list(t.shape)), t.dtype, _quant(t.scale, t.zero_point)]
        for kind, tensors in (("input", report.inputs), ("output", report.outputs))
        for t in tensors
    ]
    lines += [table(["", "tensor", "shape", "dtype", "quantization"], rows, numbers=True), ""]
    if show_ops:
        rows = [
            [
                str(op.index),
                op.op_type,
                op.precision,
                ",".join(op.input_dtypes),
                ",".join(op.output_dtypes),
                op.fused_activation if op.fused_activation != "NONE" else "",
            ]
            for op in report.ops
        ]
        lines += [table(["#", "op", "precision", "inputs", "outputs", "fused"], rows, numbers=True), ""]
    summary = report.op_summary
    by_type = ", ".join(f"{name} x{count}" for name, count in summary.by_type.items())
    sixteen = f"int16 {100 * summary.int16_share:.0f}%, " if summary.int16_ops else ""
    lines.append(
        f"ops            {summary.total} (int8 {100 * summary.int8_share:.0f}%, {sixteen}"
        f"float {100 * summary.float_share:.0f}%): {by_type}"
    )
    if report.custom_ops:
        lines.append(f"custom ops     {', '.join(report.custom_ops)}")
    lines.append("tensors        " + ", ".join(f"{dtype} {count}" for dtype, count in report.tensors_by_dtype.items()))
    lines.append(
        "weights        "
        + (", ".join(f"{dtype} {human_bytes(n)}" for dtype, n in report.bytes_by_dtype.items()) or "none")
    )
    lines.append(f"integer-only   {'yes' if report.integer_only else 'no'}")
    if report.delegate is not None:
        lines.append(f"delegate       {report.delegate.summary()} (1 thread, as profile loads it)")
    tpu = report.edgetpu
    if tpu.compiled:
        lines.append(f"edge tpu       compiled for the Edge TPU ({tpu.compiled_ops} edgetpu-custom-op)")
    if tpu.refused_versions:
        lines.append(
            f"edge tpu       edgetpu_compiler {COMPILER_VERSION} would refuse the file (nothing mapped): "
            f"{'; '.join(tpu.refused_versions)}; convert with an older TensorFlow, or run it on the CPU"
        )
    if tpu.compatible:
        lines.append(f"edge tpu       compatible: all {tpu.ops_checked} ops can be mapped")
    elif tpu.first_fallback is not None:
        first = tpu.first_fallback
        lines.append(
            f"edge tpu       not fully compatible: {tpu.ops_mappable} of {tpu.ops_checked} ops "
            f"({tpu.ops_mappable / max(tpu.ops_checked, 1):.0%}) would be mapped; "
            f"op {first.index} {first.op_type} falls back to the CPU ({'; '.join(first.reasons)}), "
            "and every op after it"
        )
    elif not tpu.compiled:
        lines.append("edge tpu       no ops")
    return "\n".join(lines)


@click.command("inspect")
@click.argument("model", metavar="MODEL.tflite")
@click.option("--json", "json_out", metavar="OUT", help="Write the full description as JSON here.")
@click.option("--ops/--no-ops", "show_ops", default=True, help="List every op (default) or only the summary.")
def inspect(model: str, json_out: str | None, show_ops: bool) -> None:
    """Signature, tensors, ops, dtypes, XNNPACK partitions and Edge TPU compatibility of MODEL.tflite."""
    from edgeq.runtime.inspect import inspect_tflite, inspect_to_dict

    report = inspect_tflite(model)
    click.echo(render(report, show_ops=show_ops))
    if json_out:
        write_json_output(inspect_to_dict(report), json_out)
