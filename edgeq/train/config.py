"""What `edgeq train` is asked (``TrainConfig``), what each stage returns, and the resolved run."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeq.data.sources import load_dataset
from edgeq.data.splits import normal_samples_for_training
from edgeq.errors import DataError, UsageError
from edgeq.models.compat import tf
from edgeq.models.load import as_tf_keras, describe, is_model_path, load_user_model, task_targets, with_input_shape
from edgeq.models.spec import KERAS3
from edgeq.quantize.plan_file import LayerConfig, LayerPrecision
from edgeq.train import distill
from edgeq.train.objectives import check_targets, objectives, with_detection_targets
from edgeq.train.schedule import make_schedule


@dataclass(frozen=True)
class TrainConfig:
    model: str  # reference model name (edgeq/models/recipes/*.toml) or a .keras/.h5/SavedModel path
    out_dir: str
    data: str | None = None  # None: the recipe's data
    epochs: int | None = None  # None: the recipe's
    qat_epochs: int | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    qat_learning_rate: float | None = None
    weight_bits: int = 8
    activation_bits: int = 8
    granularity: str = "per-channel"
    activations: str = "asymmetric"
    clip_norm: float | None = None
    clip_value: float | None = None
    schedule: str = "default"
    layer_config: str | None = None
    fold_bn: bool | None = None  # None: fold when per-tensor (the converter's fold is wrong there)
    init_ranges: str = "tfmot"  # QAT's activation ranges: TF-MOT's [-6, 6] start, or calibration by a method
    # QAT's BatchNormalization and Dropout: "frozen" fine-tunes in inference mode (the FP32 model's BN statistics,
    # no dropout), "batch" trains as TF-MOT does (batch statistics, dropout on)
    qat_bn: str = "frozen"
    model_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    augment: str | None = None  # image augmentation while training: "flip", "crop" or "flip,crop"
    task: str | None = None  # what each output is (--task KIND | NAME=KIND,... | FILE.json); None: inferred
    loss: str | None = None  # --loss LOSS | NAME=LOSS,...; None: the model file's compile config, else the task's
    input_shape: str | None = None  # --input-shape HxWxC: fixes a fully convolutional model's free dimensions
    distill: bool = False  # QAT learns the FP32 model's outputs (always when the data has no labels)
    # tf.distribute (edgeq.train.distribute); these describe this process, not the run, so
    # --resume takes them from the command line, not from the saved options
    # "tfmot": TF-MOT on tf_keras (a Keras 3 model translated); "keras3": edgeq.quantize.keras3_qat on Keras 3 itself;
    # "auto": keras3 for a Keras 3 file when it has every option asked for (edgeq.train.fit._engine)
    qat_engine: str = "auto"
    strategy: str = "default"
    replicas: int | None = None
    workers: str | None = None
    worker_index: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StageResult:
    name: str
    kind: str
    epochs: int
    weight_bits: int
    activation_bits: int
    val_value: float  # the first output's primary metric (accuracy for a classifier): ``metric``
    test_value: float
    seconds: float
    metric: str = "accuracy"


@dataclass(frozen=True)
class TrainResult:
    out_dir: Path
    fp32_model: Path | None
    qat_model: Path | None
    history: Path
    run: Path
    stages: tuple[StageResult, ...]
    resumed_from: tuple[int, int] | None = None  # (stage index, epochs done) when resumed
    float_layers: tuple[str, ...] = ()  # layers the QAT model leaves in float
    ranges: dict | None = None  # quantizer_ranges() of the QAT model
    distribution: dict | None = None  # run.json's "distribution"
    qat_engine: str = "tfmot"  # the engine that trained it
    engine_note: str | None = None  # why that engine


def stage_start_name(stage_index: int) -> str:
    return f"stage{stage_index}_start.keras"


def _fsync_folder(folder: Path) -> None:
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def restore_checkpoint(model, checkpoint_dir: Path, state: dict) -> None:
    """Weights and optimizer state of ``state``'s checkpoint into compiled ``model``.

    The optimizer's slots (Adam's moments) are created on its first step; the checkpoint
    restores them then (deferred restoration), so training continues as if never stopped.
    """
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    status = checkpoint.restore(str(checkpoint_dir / state["checkpoint"]))
    status.assert_existing_objects_matched()


def _resolve(config: TrainConfig):
    """Model, dataset, the effective hyper-parameters (recipe defaults filled in), the
    objectives, and why QAT distils from the FP32 model (None: it learns the labels)."""
    from edgeq.models import zoo

    recipe = None if is_model_path(config.model) else zoo.load_recipe(config.model)
    data_source = config.data or (recipe.data if recipe else None)
    if not data_source:
        raise UsageError(f"{config.model}: give --data (digits, synthetic:HxWxC:K, npz:PATH, images:DIR)")
    user_model = None  # the Keras 3 model the user gave, when they gave one
    if recipe is None:
        model, user_model, dataset = _user_model(config, data_source)
    else:
        model, dataset = _recipe_model(config, recipe, data_source)
    dataset.check_finite()
    described = describe(user_model or model, config.model if recipe is None else None)
    declared = config.task or (recipe.task if recipe else None)
    # a user's file also says what its outputs are in its compile config (a from_logits cross-entropy)
    specs = described.tasks(declared, task_targets(dataset, described.output_names))
    objs = objectives(described, specs, config.loss)
    reason = _why_distil(config, recipe, dataset, data_source, objs)
    if reason is not None:
        distill.check_dataset(dataset, data_source)
    if any(o.spec.kind == "reconstruction" for o in objs):
        dataset = normal_samples_for_training(dataset)
    if reason != distill.NO_LABELS:
        dataset = with_detection_targets(objs, dataset)
        check_targets(objs, dataset)
    return model, dataset, _hyperparameters(config, recipe, reason), recipe, user_model, objs, reason


def _user_model(config: TrainConfig, data_source: str):
    """A model file the user gave (as tf_keras), the Keras 3 model itself when it is one, and its data."""
    model = load_user_model(config.model)
    if config.input_shape:
        model = with_input_shape(model, config.input_shape, config.model)
    described = describe(model, config.model)
    if described.is_qat:
        raise UsageError(f"{config.model} is already quantization-aware; give edgeq train the FP32 model")
    user_model = None
    if described.format == KERAS3:
        user_model, model = model, as_tf_keras(model)
    shapes = described.input_shapes
    free = [n for n, shape in shapes.items() if any(d is None for d in shape)]
    if free:
        raise UsageError(
            f"{config.model}: input {free[0]!r} has free dimensions {tuple(shapes[free[0]])} (a fully "
            "convolutional model): fix them with --input-shape HxWxC"
        )
    dataset = load_dataset(data_source, input_shape=described.input_shape, labels_required=False)
    dataset.check_fits(described.input_shape, where=f"model {config.model}")
    return model, user_model, dataset


def _recipe_model(config: TrainConfig, recipe, data_source: str):
    """A reference model of the zoo, built for the data's shape and classes, and the data."""
    from edgeq.models import zoo

    options = {**recipe.model, **config.model_options}
    shape_hint = None
    if recipe.architecture == "mobilenetv2" and "input_size" in options:
        size = int(options.pop("input_size"))
        shape_hint = (size, size, 3)
    dataset = load_dataset(data_source, input_shape=shape_hint)
    if shape_hint is not None:
        dataset.check_fits(shape_hint, where=f"{config.model} with input_size {shape_hint[0]}")
    try:
        model = zoo.build(recipe.architecture, dataset.input_shape, dataset.num_classes, **options)
    except TypeError as exc:
        raise UsageError(f"{config.model}: bad model option ({exc})") from exc
    except ValueError as exc:
        raise DataError(
            f"{config.model} cannot be built for data {data_source!r} of shape {dataset.input_shape}: "
            f"{str(exc).splitlines()[0]}"
        ) from exc
    return model, dataset


def _why_distil(config: TrainConfig, recipe, dataset, data_source: str, objs) -> str | None:
    """Why QAT learns from the FP32 model's outputs (--distill, or data without labels); None: from labels."""
    if dataset.labelled or any(o.spec.kind == "reconstruction" for o in objs):
        return "--distill" if config.distill else None
    if recipe is not None:
        raise DataError(
            f"data {data_source!r} has no labels, and {config.model} is a reference model that learns from "
            "them; give a trained model (.keras/.h5/SavedModel) to quantize it by distillation"
        )
    if config.epochs:
        raise UsageError(
            f"data {data_source!r} has no labels, so there is no FP32 training: give --epochs 0 (QAT then "
            "learns the model's own outputs)"
        )
    return distill.NO_LABELS


def _hyperparameters(config: TrainConfig, recipe, reason: str | None) -> dict:
    """The effective hyper-parameters: the options given, else the recipe's, else edgeq's defaults."""
    if config.epochs is not None:
        epochs = config.epochs
    else:
        epochs = 0 if reason == distill.NO_LABELS else (recipe.epochs if recipe else 10)
    return {
        "epochs": epochs,
        "qat_epochs": config.qat_epochs if config.qat_epochs is not None else (recipe.qat_epochs if recipe else 3),
        "batch_size": config.batch_size or (recipe.batch_size if recipe else 32),
        "learning_rate": config.learning_rate or (recipe.learning_rate if recipe else 1e-3),
        "qat_learning_rate": config.qat_learning_rate or (recipe.qat_learning_rate if recipe else 1e-4),
        "seed": config.seed,
        "op_determinism": True,
    }


def _layer_plan(config: TrainConfig, layer_names: list[str]) -> dict[str, LayerPrecision]:
    """--layer-config resolved: the layers whose precision differs from the model's."""
    if not config.layer_config:
        return {}
    default = LayerPrecision(config.weight_bits, config.activation_bits)
    resolved = LayerConfig.load(config.layer_config).resolve(layer_names, default)
    layer_plan = {name: p for name, p in resolved.items() if p != default}
    mixed = sorted(n for n, p in layer_plan.items() if not p.keep_float and p.activation_bits != config.activation_bits)
    if mixed:
        raise UsageError(
            f"{config.layer_config}: activation bits differ per layer ({', '.join(mixed[:6])}"
            f"{' ...' if len(mixed) > 6 else ''}), which no TFLite conversion can deploy (16-bit activations "
            "are a whole-model mode, 16x8): set activation bits for the whole model with --activation-bits, "
            "and per layer only weight bits or float"
        )
    return layer_plan


def _checked_schedule(config: TrainConfig, model, dataset, hp: dict, augment, dry_run: bool):
    """The stages, quantization settings and quantizable layers, refused early where they cannot work.

    With ``dry_run`` the quantization wrapping is tried once: a model TF-MOT cannot take
    fails now, in seconds and with the layer names, never after the FP32 epochs.
    """
    if augment and len(dataset.input_shape) != 3:
        raise UsageError(
            f"--augment {config.augment} is for images (H, W, C); {dataset.source} has samples of shape "
            f"{dataset.input_shape}"
        )
    stages = make_schedule(config.schedule, hp["epochs"], hp["qat_epochs"], config.weight_bits, config.activation_bits)
    if not stages:
        raise UsageError("nothing to train: --epochs and --qat-epochs are both 0")
    from edgeq.train import schemes  # TF-MOT's configs: the Keras 3 engine never reaches this

    layer_plan = _layer_plan(config, [layer.name for layer in model.layers])
    settings = schemes.QuantSettings(
        config.weight_bits, config.activation_bits, config.granularity, config.activations, layer_plan
    )
    if dry_run and any(s.kind == "qat" for s in stages):
        schemes.build_qat_model(model, settings)
    return stages, settings, schemes.quantizable_layer_names(model)
