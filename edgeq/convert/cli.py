"""`edgeq convert`: Keras -> verified TFLite, one flag per mode of the mode table."""

from __future__ import annotations

import click

from edgeq.ui import Heartbeat, table

# Mode flags are spelled here from the same names as edgeq.convert.options.MODES (a test checks
# that the two agree), so that `edgeq convert --help` does not import TensorFlow.
MODE_FLAGS = {
    "fp32": "float32 TFLite, no quantization",
    "fp16": "float16 weights, float compute",
    "dynamic": "dynamic-range: int8 weights, float activations",
    "int8": "full integer with float I/O (float fallback allowed)",
    "int8-only": "integer-only: TFLITE_BUILTINS_INT8, int8 I/O, refuses float ops",
    "int16x8": "16-bit activations, 8-bit weights",
    "int4-weights": "INT4 weight-only (LiteRT Quantizer), float compute",
    "int4-dynamic": "INT4 weights, dynamic-range activations (LiteRT Quantizer)",
}


def _mode_options(func):
    for name, help_text in reversed(list(MODE_FLAGS.items())):
        func = click.option(f"--{name}", "mode", flag_value=name, help=help_text)(func)
    return func


@click.command("convert")
@click.argument("model", type=click.Path())
@_mode_options
@click.option("--out", type=click.Path(dir_okay=False), help="Output .tflite (default: MODEL_<mode>.tflite).")
@click.option("--calib", help="Representative data for PTQ: digits | synthetic:... | npz:PATH | images:DIR.")
@click.option("--calib-samples", type=click.IntRange(min=1), default=200, show_default=True)
@click.option(
    "--granularity",
    type=click.Choice(["per-channel", "per-tensor"]),
    default="per-channel",
    show_default=True,
    help="Weight quantization granularity for PTQ.",
)
@click.option(
    "--io-type",
    type=click.Choice(["int8", "uint8"]),
    default="int8",
    show_default=True,
    help="Input/output type with --int8-only (uint8 for Coral).",
)
@click.option(
    "--min-sqnr",
    metavar="DB|NAME=DB,...",
    help="Verification threshold in dB, for every output or per output name (default: per mode).",
)
@click.option(
    "--input-shape",
    metavar="HxWxC|NAME=HxWxC,...",
    help="Fix the free (None) dimensions of a fully convolutional model's input(s), e.g. 240x320x3.",
)
@click.option(
    "--input-range",
    metavar="LO:HI",
    help="For a float .tflite: the float range its input takes 8-bit images (0..255) to, e.g. -1:1 for MediaPipe's "
    "models, 0:1, 0:255. Recorded in the manifest: eval and profile read raw images in these units.",
)
@click.option(
    "--split-outputs/--no-split-outputs",
    default=None,
    help="For a float .tflite: an output that concatenates tensors (YOLO's boxes and scores) becomes those "
    "tensors, each an output with its own int8 scale (declare them as a yolo detector's boxes and scores). "
    "By default only outputs whose parts' ranges differ over 16x are split, and read back as one output.",
)
@click.option(
    "--task",
    metavar="KIND|NAME=KIND,...|FILE.json",
    help="What each output is: classification, binary, multilabel, regression, reconstruction, segmentation, "
    "landmarks or other (default: from the output's activation and the data). A float .tflite's mask, points "
    "or presence score without labels is judged by its task against the float file.",
)
@click.option(
    "--int4-granularity",
    type=click.Choice(["channel", "block32", "block64", "block128", "block256"]),
    default="channel",
    show_default=True,
    help="Weight granularity for --int4-weights/--int4-dynamic: per channel or blockwise.",
)
@click.option(
    "--ptq",
    type=click.Choice(["auto", "converter", "minmax", "percentile", "mse", "entropy"]),
    default="auto",
    show_default=True,
    help="Integer PTQ ranges: the converter's min/max, or edgeq's (auto: the converter's, then edgeq's "
    "best by simulation, best SQNR on held-out data).",
)
@click.option(
    "--weight-ranges",
    type=click.Choice(["minmax", "mse"]),
    default="minmax",
    show_default=True,
    help="Per-channel weight ranges of edgeq's PTQ.",
)
@click.option(
    "--rounding",
    type=click.Choice(["nearest", "stochastic", "adaround"]),
    default="nearest",
    show_default=True,
    help="Weight rounding of edgeq's PTQ: nearest, stochastic (seeded) or AdaRound (learned per layer).",
)
@click.option(
    "--ptq-target",
    type=float,
    metavar="DB",
    help="--ptq auto keeps the converter's ranges when they reach this SQNR (default: the verification "
    "threshold); a high value always scores edgeq's methods too and keeps the best.",
)
@click.option(
    "--max-drop",
    type=float,
    help="Verify each output that has a task metric by it, on the labelled held-out samples, instead of by "
    "SQNR: at most this much worse than the source model (points of accuracy or AUC, percent of RMSE), with n "
    "and a paired 95% interval. A classifier is judged by its answers, not by the SQNR of its logits.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of stochastic rounding and AdaRound.")
@click.option(
    "--weight-bits",
    type=click.Choice(["4", "8"]),
    default="8",
    show_default=True,
    help="4: W4A8, per-channel 4-bit weight codes ([-7, 7]) inside int8 kernels, rounded by --rounding "
    "(nearest or adaround); the activations stay int8.",
)
@click.option("--equalize", is_flag=True, help="Cross-layer equalization before PTQ (BN folded first).")
@click.option("--bias-correct", is_flag=True, help="Shift biases by the expected weight-quantization error (PTQ).")
@click.option(
    "--plan",
    type=click.Path(),
    help="Layer-wise plan from `edgeq analyze plan`: its layers stay float (--int8), or with --fallback int16 "
    "get 16-bit activations in an integer-only model (--int8-only, the default for such a plan).",
)
@click.option(
    "--edgetpu", is_flag=True, help="Coral: static batch 1, Edge TPU check, and edgetpu_compiler if it is on PATH."
)
@click.option("--json", "json_out", is_flag=True, help="Print the result as JSON.")
def convert(
    model,
    mode,
    out,
    calib,
    calib_samples,
    granularity,
    io_type,
    min_sqnr,
    int4_granularity,
    equalize,
    bias_correct,
    plan,
    edgetpu,
    json_out,
    ptq,
    weight_ranges,
    rounding,
    ptq_target,
    seed,
    weight_bits,
    input_shape,
    input_range,
    split_outputs,
    task,
    max_drop,
):
    """Convert MODEL (.keras/.h5/SavedModel; a QAT model needs no calibration) to TFLite,
    then load it in LiteRT and verify it against MODEL before writing it. A float .tflite from any
    framework converts to --int8-only or --int16x8 with --calib (LiteRT Quantizer, edgeq's ranges)."""
    import json
    from dataclasses import asdict

    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert as run_convert

    options = ConvertOptions(
        mode=mode or ("int8" if plan and not _wide_plan(plan) else "int8-only"),
        calib=calib,
        calib_samples=calib_samples,
        granularity=granularity,
        io_type=io_type,
        min_sqnr_db=min_sqnr,
        edgetpu=edgetpu,
        equalize=equalize,
        plan=plan,
        int4_granularity=int4_granularity,
        bias_correct=bias_correct,
        ptq=ptq,
        weight_ranges=weight_ranges,
        rounding=rounding,
        seed=seed,
        weight_bits=int(weight_bits),
        ptq_target_db=ptq_target,
        input_shape=input_shape,
        input_range=input_range,
        split_outputs=split_outputs,
        task=task,
        max_drop=max_drop,
    )
    with Heartbeat(f"convert {model}"):  # a --ptq search or a big model: a line every 30 s in a log
        result = run_convert(model, out, options)
    if json_out:
        click.echo(json.dumps({**asdict(result), "path": str(result.path), "manifest": str(result.manifest)}, indent=2))
        return
    _print_result(result)


def _print_result(result) -> None:
    """The result as a table for people, then the task metric verdicts, notes and where the manifest went."""
    from edgeq.tasks.verdicts import Verdict

    v = result.verification
    rows = []
    for o in v.outputs or ({"name": "", "agreement": v.agreement, "sqnr_db": v.sqnr_db, "passed": v.passed},):
        agreement = o.get("agreement")
        dtype = next((t["dtype"] for t in result.outputs if t["name"] == o["name"]), result.output["dtype"])
        rows.append(
            (
                result.path if not rows else "",
                result.mode if not rows else "",
                f"{result.size_bytes / 1024:.1f} KiB" if not rows else "",
                result.input["dtype"] if not rows else "",
                f"{o['name']} ({o.get('task', '')}) {dtype}" if len(v.outputs) > 1 else dtype,
                v.integer_only if not rows else "",
                "-" if agreement is None else f"{agreement:.2%}",
                f"{o['sqnr_db']:.1f}",
                o["passed"],
            )
        )
    click.echo(
        table(["model", "mode", "size", "input", "output", "integer-only", "agreement", "SQNR dB", "verified"], rows)
    )
    click.echo(f"verified on {v.samples} {v.data}")
    for o in v.outputs:
        if o.get("verdict"):  # the task metric on the labelled verification samples, with n and interval
            click.echo(f"task metric: {Verdict.from_dict(o['verdict']).line()}")
    for note in result.notes:
        click.echo(f"note: {note}")
    click.echo(f"manifest: {result.manifest}")


def _wide_plan(plan) -> bool:
    """Whether ``plan`` is an int16-fallback plan (16-bit layers in an integer-only model)."""
    import json
    from pathlib import Path

    try:
        return json.loads(Path(plan).read_text()).get("fallback") == "int16"
    except (OSError, ValueError, AttributeError):
        return False  # convert names what is wrong with the file
