"""`edgeq train`: FP32 training then quantization-aware fine-tuning."""

from __future__ import annotations

import click

from edgeq.train.distribute import STRATEGIES  # light: no TensorFlow until a strategy is set up
from edgeq.ui import table


def _model_options(values: tuple[str, ...]) -> dict:
    from edgeq.errors import UsageError

    options = {}
    for item in values:
        if "=" not in item:
            raise UsageError(f"--model-option {item!r}: write KEY=VALUE, e.g. alpha=0.5")
        key, raw = item.split("=", 1)
        for cast in (int, float):
            try:
                options[key] = cast(raw)
                break
            except ValueError:
                continue
        else:
            options[key] = raw
    return options


@click.command("train")
@click.argument("model")
@click.option("--data", help="digits | synthetic:HxWxC:K[:N] | npz:PATH | images:DIR (default: the recipe's).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output folder.")
@click.option("--epochs", type=click.IntRange(min=0), help="FP32 epochs (default: the recipe's).")
@click.option("--qat-epochs", type=click.IntRange(min=0), help="Quantization-aware epochs (default: the recipe's).")
@click.option("--batch-size", type=click.IntRange(min=1))
@click.option("--lr", "learning_rate", type=float, help="FP32 learning rate.")
@click.option("--qat-lr", "qat_learning_rate", type=float, help="QAT learning rate.")
@click.option("--weight-bits", type=click.IntRange(2, 8), default=8, show_default=True)
@click.option("--activation-bits", type=click.Choice(["8", "16"]), default="8", show_default=True)
@click.option(
    "--granularity", type=click.Choice(["per-channel", "per-tensor"]), default="per-channel", show_default=True
)
@click.option("--activations", type=click.Choice(["asymmetric", "symmetric"]), default="asymmetric", show_default=True)
@click.option("--clip-norm", type=click.FloatRange(min=0, min_open=True), help="Clip each gradient's norm during QAT.")
@click.option("--clip-value", type=click.FloatRange(min=0, min_open=True), help="Clip gradient values during QAT.")
@click.option("--schedule", default="default", show_default=True, help="default | stepped | a JSON/TOML stage file.")
@click.option(
    "--layer-config", type=click.Path(), help="Layer-wise bits / keep-float (JSON or TOML, names or re:REGEX)."
)
@click.option(
    "--fold-bn/--no-fold-bn",
    "fold_bn",
    default=None,
    help="Fold BatchNormalization into the conv/dense before QAT (default: only with per-tensor).",
)
@click.option(
    "--qat-bn",
    "qat_bn",
    type=click.Choice(["frozen", "batch"]),
    default="frozen",
    show_default=True,
    help="QAT fine-tunes with BatchNormalization frozen at the FP32 model's statistics and Dropout off (the "
    "function it deploys), or with batch statistics and dropout, as TF-MOT trains.",
)
@click.option(
    "--init-ranges",
    type=click.Choice(["tfmot", "mse", "percentile", "entropy", "minmax"]),
    default="tfmot",
    show_default=True,
    help=(
        "Start QAT's activation ranges at TF-MOT's [-6, 6] (the input's Rescaling/Normalization still from "
        "data) or from calibration data by this method."
    ),
)
@click.option(
    "-o", "--model-option", "model_options", multiple=True, help="Reference-model option KEY=VALUE (e.g. alpha=0.5)."
)
@click.option(
    "--task",
    metavar="KIND|NAME=KIND,...|FILE.json",
    help="What each output is: classification, binary, multilabel, regression, reconstruction "
    "(default: from its activation and the data).",
)
@click.option(
    "--loss",
    metavar="LOSS|NAME=LOSS,...",
    help="Keras loss per output (default: the model file's compile config, else the task's).",
)
@click.option(
    "--input-shape", metavar="HxWxC", help="Fix the free (None) dimensions of a fully convolutional model's input."
)
@click.option(
    "--distill",
    is_flag=True,
    help="QAT learns the FP32 model's outputs instead of the labels (always when the data has none).",
)
@click.option(
    "--compare-int8/--no-compare-int8",
    default=True,
    show_default=True,
    help="After QAT: convert the FP32 model by PTQ and the QAT model, both --int8-only, and score both on val.",
)
@click.option(
    "--qat-engine",
    type=click.Choice(["auto", "keras3", "tfmot"]),
    default="auto",
    show_default=True,
    help="keras3: edgeq's fake quantization on the Keras 3 model itself, no translation, no TF-MOT "
    "(fp32.keras and qat.keras stay Keras 3 files). tfmot: TF-MOT on tf_keras (a Keras 3 model is "
    "translated). auto: keras3 for a Keras 3 file when it has every option asked for, else tfmot (said why).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--augment", help="Image augmentation while training: flip, crop or flip,crop (seeded by --seed).")
@click.option(
    "--strategy",
    type=click.Choice(STRATEGIES),
    default="default",
    show_default=True,
    help="tf.distribute: one device, every local GPU (mirrored), or one process per worker (multi-worker).",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    help="mirrored: how many local devices (with no GPU: that many logical CPU devices).",
)
@click.option("--workers", help="multi-worker without TF_CONFIG: every worker's host:port, comma-separated.")
@click.option("--worker-index", type=click.IntRange(min=0), help="multi-worker: this worker's place in --workers.")
@click.option("--resume", is_flag=True, help="Continue the unfinished run in --out (its saved options are used).")
@click.option("--force", is_flag=True, help="Overwrite a run already in --out.")
def train(model, out_dir, resume, force, model_options, activation_bits, compare_int8, **options):
    """Train MODEL (a reference name such as digits-cnn, or a .keras/.h5/SavedModel path):
    FP32 first, then quantization-aware fine-tuning (Keras 3 itself, or TF-MOT: --qat-engine).
    A checkpoint is written every epoch; Ctrl-C loses at most one epoch (--resume).
    --batch-size is the global batch: under --strategy it is split across replicas."""
    import os

    if options["strategy"] != "default":
        # the strategy sets up devices / collectives before TensorFlow's runtime starts
        os.environ["EDGEQ_DEFER_RUNTIME"] = "1"
    elif not resume:  # the run's chief: refuse an --out it would overwrite before TensorFlow loads
        from edgeq.train.outdir import refuse_overwrite  # (--resume: the engine says whether it resumes)

        refuse_overwrite(out_dir, False, force)
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train as run_training

    config = TrainConfig(
        model=model,
        out_dir=out_dir,
        activation_bits=int(activation_bits),
        model_options=_model_options(model_options),
        **options,
    )
    result = run_training(config, resume=resume, force=force, progress=True)
    if result.fp32_model is None:  # a multi-worker run's other workers: the chief reports
        digest = f"; quantizer ranges sha256 {result.ranges['sha256']}" if result.ranges else ""
        click.echo(f"worker done: the chief wrote the run to {result.out_dir}{digest}")
        return
    metric = result.stages[0].metric if result.stages else "accuracy"

    def shown(value: float) -> str:
        if value != value:  # NaN: e.g. an anomaly AUC on a split with normal samples only
            return "-"
        return f"{value:.2%}" if metric in ("accuracy", "agreement") else f"{value:.4g}"

    rows = [
        (
            s.name,
            s.kind,
            s.epochs,
            f"w{s.weight_bits}a{s.activation_bits}" if s.kind == "qat" else "fp32",
            shown(s.val_value),
            shown(s.test_value),
            f"{s.seconds:.1f}",
        )
        for s in result.stages
    ]
    short = "acc" if metric == "accuracy" else metric
    click.echo(table(["stage", "kind", "epochs", "precision", f"val {short}", f"test {short}", "seconds"], rows))
    if result.engine_note:
        click.echo(f"QAT engine: {result.qat_engine} ({result.engine_note})")
    if result.distribution and result.distribution.get("cross_replica_ranges"):
        click.echo(f"ranges under {result.distribution['strategy']}: {result.distribution['cross_replica_ranges']}")
    if result.float_layers:
        click.echo(f"left float in QAT: {', '.join(result.float_layers)}")
    if result.qat_model and compare_int8:  # the run is complete and recorded; this only adds to it
        from edgeq.analyze.qat_gain import compare_run, summary

        comparison = compare_run(result.out_dir)
        if comparison is not None:
            click.echo(summary(comparison))
    click.echo(f"FP32 model: {result.fp32_model}")
    if result.qat_model:
        click.echo(f"QAT model:  {result.qat_model}  (next: edgeq convert {result.qat_model} --int8-only)")
    click.echo(f"history: {result.history}   run record: {result.run}")
