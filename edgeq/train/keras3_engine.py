"""``edgeq train --qat-engine keras3``: FP32 training and QAT on the Keras 3 model itself.

No translation to tf_keras and no TF-MOT: the Keras 3 model the user gave trains in Keras 3, its QAT
model is ``edgeq.quantize.keras3_qat``'s, and both files stay Keras 3 files (``fp32.keras``,
``qat.keras``) that Keras 3 loads with edgeq's layers registered. ``edgeq convert qat.keras --int8-only``
turns the trained ranges into the int8 file's scales.

What this engine does not do yet is refused in one line that names it and the TF-MOT engine.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

import edgeq.quantize.keras3_qat as keras3_qat
from edgeq.artifacts import provenance, sha256_file, write_json_atomic
from edgeq.errors import UsageError
from edgeq.models.load import FP32_NAME, load_user_model
from edgeq.models.spec import KERAS3
from edgeq.train.outdir import refuse_overwrite

ENGINE = "keras3"
QAT3_NAME = "qat.keras"
CALIBRATION_BATCHES = 4  # batches that start each activation range at the data's before QAT

_NOT_YET = (  # option, its default, what the engine lacks
    ("weight_bits", 8, "--weight-bits other than 8"),
    ("activation_bits", 8, "--activation-bits 16"),
    ("granularity", "per-channel", "--granularity per-tensor"),
    ("activations", "asymmetric", "--activations symmetric"),
    ("qat_bn", "frozen", "--qat-bn batch"),
    ("distill", False, "--distill (label-free distillation)"),
    ("strategy", "default", "--strategy (tf.distribute)"),
    ("augment", None, "--augment"),
    ("input_shape", None, "--input-shape"),
    ("loss", None, "--loss"),
    ("fold_bn", None, "--fold-bn/--no-fold-bn (it always folds BatchNormalization, frozen)"),
)


class NotOnKeras3(UsageError):
    """What the Keras 3 engine does not do (yet): ``--qat-engine auto`` trains with TF-MOT instead, an
    explicit ``--qat-engine keras3`` is refused with it in one line."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}: the Keras 3 QAT engine does not do this yet; use --qat-engine tfmot")
        self.reason = reason


def _refuse_unsupported(config, resume: bool) -> None:
    if resume:
        raise NotOnKeras3("--resume (it does not resume runs yet)")
    for key, default, what in _NOT_YET:
        if getattr(config, key) != default:
            raise NotOnKeras3(what)


def _classifier(model, dataset, config):
    """The single output's spec, a classification; and whether it is softmax probabilities (else logits)."""
    from edgeq.models.load import describe, task_targets

    if len(model.outputs) != 1:
        raise NotOnKeras3(f"{config.model} has {len(model.outputs)} outputs (it trains single-output classifiers)")
    if not dataset.labelled or dataset.num_classes is None or dataset.num_classes < 2:
        raise NotOnKeras3(f"{dataset.source} has no class labels (label-free distillation is not on it)")
    described = describe(model, config.model)
    spec = described.tasks(config.task, task_targets(dataset, described.output_names))[0]
    if spec.kind != "classification":
        raise NotOnKeras3(f"output {spec.name!r} is {spec.kind} (it trains classifiers)")
    last = model.layers[-1]
    activation = getattr(last, "activation", None)
    return spec, getattr(activation, "__name__", "") == "softmax" or type(last).__name__ == "Softmax"


def _compile(model, learning_rate: float, probabilities: bool, clip_norm, clip_value) -> None:
    import keras

    optimizer = keras.optimizers.Adam(learning_rate, clipnorm=clip_norm, clipvalue=clip_value)
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=not probabilities),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )


def _accuracy(model, dataset, split: str) -> float:
    x, y = dataset.split(split)
    if len(x) == 0:
        return float("nan")
    predicted = np.argmax(model.predict(x, batch_size=256, verbose=0), axis=-1)
    return float(np.mean(predicted == np.asarray(y).reshape(-1)))


class _KeepBest:
    """Keep-best on val accuracy: the weights of the best epoch go back into the model at the end."""

    def __init__(self, model, dataset):
        import keras

        engine = self

        class Callback(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                value = _accuracy(model, dataset, "val")
                engine.history.append({"epoch": epoch + 1, "val_accuracy": value, **(logs or {})})
                if value > engine.best:
                    engine.best, engine.best_epoch, engine.weights = value, epoch + 1, model.get_weights()

        self.best, self.best_epoch, self.weights, self.history = -1.0, 0, None, []
        self.callback = Callback()

    def restore(self, model) -> None:
        if self.weights is not None:
            model.set_weights(self.weights)


def _fit(model, dataset, hp: dict, epochs: int, keep: _KeepBest | None):
    from edgeq.train import pipeline

    batch = hp["batch_size"]
    train = pipeline.split_dataset(dataset, "train", batch, training=True, seed=hp["seed"], epochs=(0, epochs))
    steps = pipeline.steps_per_epoch(dataset, "train", batch)
    with warnings.catch_warnings():  # Keras's notes on tf.data input are not the user's business
        warnings.simplefilter("ignore")
        history = model.fit(
            train, epochs=epochs, steps_per_epoch=steps, verbose=0, callbacks=[keep.callback] if keep else []
        )
    return {k: [float(v) for v in values] for k, values in history.history.items()}


def prepare(config, resume: bool = False, force: bool = False):
    """The Keras 3 model, its labelled data and whether it outputs probabilities, checked before any epoch.

    What the engine lacks raises ``NotOnKeras3`` (options first, then the file, the model, the data);
    what neither engine could train raises ``UsageError``.
    """
    from edgeq.data.sources import load_dataset
    from edgeq.models.keras3 import keras_flavour_of_file
    from edgeq.models.load import is_model_path
    from edgeq.train.config import _hyperparameters

    _refuse_unsupported(config, resume)
    if not is_model_path(config.model) or not Path(config.model).exists():
        raise NotOnKeras3(f"{config.model} is a reference model, built in tf_keras (it trains Keras 3 files)")
    if keras_flavour_of_file(config.model) != KERAS3:
        raise NotOnKeras3(f"{config.model} is not a Keras 3 file (it trains Keras 3 models; TF-MOT trains tf_keras)")
    model = load_user_model(config.model)  # on the TensorFlow backend (models.load refuses another)
    if keras3_qat.is_keras3_qat(model):
        raise UsageError(f"{config.model} is already quantization-aware; give edgeq train the FP32 model")
    if len(model.inputs) != 1:
        raise NotOnKeras3(f"{config.model} has {len(model.inputs)} inputs (it trains single-input models)")
    why = keras3_qat.unquantizable(model)  # before any epoch: no training is lost
    if why:
        raise NotOnKeras3(why)
    if not config.data:
        raise NotOnKeras3(f"{config.model} without --data (it needs the data given)")
    shape = tuple(model.inputs[0].shape[1:])
    dataset = load_dataset(config.data, input_shape=shape, labels_required=False)
    output, probabilities = _classifier(model, dataset, config)
    dataset.check_fits(shape, where=f"model {config.model}")
    dataset.check_finite()
    hp = _hyperparameters(config, None, None)
    stages, float_layers = _stages_and_plan(config, model, hp)
    if (Path(config.out_dir) / "run.json").is_file():  # no checkpoints here: only a finished run to keep
        refuse_overwrite(config.out_dir, False, force)
    return Prepared(model, dataset, output, probabilities, hp, stages, float_layers)


class Prepared(NamedTuple):
    model: object
    dataset: object
    output: object  # its OutputSpec (a classification)
    probabilities: bool  # the output is softmax probabilities (else logits)
    hp: dict  # the effective hyper-parameters (train.config._hyperparameters)
    stages: list  # edgeq.train.schedule.Stage, FP32 first
    float_layers: frozenset  # Conv2D/DepthwiseConv2D/Dense layers a layer-wise plan keeps float (no fake quantization)


def _stages_and_plan(config, model, hp: dict) -> tuple[list, frozenset]:
    """The schedule's stages and the layers --layer-config keeps float; what the engine lacks is NotOnKeras3."""
    from edgeq.quantize.plan_file import LayerConfig, LayerPrecision
    from edgeq.train.schedule import make_schedule

    stages = make_schedule(config.schedule, hp["epochs"], hp["qat_epochs"], 8, 8)
    if not stages:
        raise UsageError("nothing to train: --epochs and --qat-epochs are both 0")
    for before, stage in zip(stages, stages[1:]):
        if before.kind == "qat" and stage.kind == "fp32":
            raise NotOnKeras3(f"stage {stage.name!r}: FP32 after QAT (it trains FP32 stages first)")
    for stage in stages:
        if stage.kind == "qat" and (stage.weight_bits, stage.activation_bits) != (8, 8):
            raise NotOnKeras3(
                f"stage {stage.name!r} at w{stage.weight_bits}a{stage.activation_bits} (it trains 8 bits)"
            )
    if not config.layer_config:
        return stages, frozenset()
    names = [layer.name for layer in model.layers]
    resolved = LayerConfig.load(config.layer_config).resolve(names, LayerPrecision(8, 8))
    fused = keras3_qat.fused_ops(model)
    float_layers = set()
    for name, precision in resolved.items():
        if precision == LayerPrecision(8, 8):
            continue
        if not precision.keep_float:
            raise NotOnKeras3(f"{config.layer_config}: layer {name!r} at w{precision.weight_bits}a"
                              f"{precision.activation_bits} (it keeps a layer float or at 8 bits)")  # fmt: skip
        if name not in fused:
            raise NotOnKeras3(f"{config.layer_config}: keep_float on {name!r} ({type(model.get_layer(name)).__name__}; "
                              "it keeps Conv2D, DepthwiseConv2D and Dense layers float)")  # fmt: skip
        float_layers.add(name)
    return stages, frozenset(float_layers)


def _qat_model(model, dataset, hp: dict):
    """The QAT model, every range started on training batches (a unit a stage leaves float observes too)."""
    qat = keras3_qat.quantize_model(model)
    x_train, _ = dataset.split("train")
    size = hp["batch_size"]
    first = min(len(x_train), size * CALIBRATION_BATCHES)
    keras3_qat.calibrate(qat, [x_train[k : k + size] for k in range(0, first, size)])
    return qat


def _quantized_units(qat, stage) -> set[str]:
    """A stage's units: the first share of them from the input (``layer_fraction``, as TF-MOT's stepped)."""
    units = keras3_qat.units(qat)
    return set(units[: max(1, math.ceil(stage.layer_fraction * len(units)))])


def _qat_stage(qat, stage, prepared: Prepared, hp: dict, config):
    """One QAT stage: its units on (not the plan's float layers), fitted, its best epoch kept."""
    keras3_qat.set_quantized(qat, _quantized_units(qat, stage) - prepared.float_layers)
    _compile(qat, hp["qat_learning_rate"], prepared.probabilities, config.clip_norm, config.clip_value)
    keep = _KeepBest(qat, prepared.dataset)
    fitted = _fit(qat, prepared.dataset, hp, stage.epochs, keep)
    keep.restore(qat)
    return fitted, keep


def _record(config, hp: dict, prepared: Prepared, results, qat, paths: dict, seconds: float) -> dict:
    """run.json, in the keys convert, eval and report read (data, normalization, results, artifacts)."""
    described = prepared.dataset.describe()
    ranges = keras3_qat.ranges(qat) if qat is not None else {}
    return {
        "kind": "edgeq.train",
        "complete": True,
        "config": {**config.to_dict(), "qat_engine": ENGINE},
        "recipe": None,
        "hyperparameters": hp,
        "quantization": {
            "engine": ENGINE,
            "weight_bits": 8,
            "activation_bits": 8,
            "granularity": "per-channel (Dense: per-tensor)",
            "activations": "asymmetric",
            "batchnorm_folded_before_qat": True,
            "batchnorm_during_qat": "frozen",
            "initial_activation_ranges": {"method": f"min/max of {CALIBRATION_BATCHES} training batches"},
            "final_ranges": ranges,
            "float_layers": sorted(prepared.float_layers),
        },
        "schedule": [s.to_dict() for s in prepared.stages],
        "data": described,
        "normalization": prepared.dataset.normalization.to_dict(),
        "input_shape": described["input_shape"],
        "num_classes": prepared.dataset.num_classes,
        "outputs": [
            {
                **prepared.output.to_dict(),
                "loss": "sparse_categorical_crossentropy",
                "loss_weight": 1.0,
                "loss_source": "task",
            }
        ],  # fmt: skip
        "results": [r.__dict__ for r in results],
        "train_seconds": round(seconds, 3),
        "keras": {"given": KERAS3, **{name: KERAS3 for name in paths}},
        "artifacts": {name: sha256_file(path) for name, path in paths.items()},
        "provenance": provenance(),
    }


def train_keras3(config, resume: bool = False, force: bool = False, progress: bool = False, prepared=None):
    """The schedule's FP32 stages, then its QAT stages with keep-best on val, all in Keras 3; the run's
    files and run.json. ``prepared`` is what ``prepare`` returned, where the caller has checked already."""
    import keras

    from edgeq.train.config import StageResult, TrainResult

    prepared = prepared or prepare(config, resume, force)
    model, dataset, hp = prepared.model, prepared.dataset, prepared.hp
    keras.utils.set_random_seed(config.seed)
    started = time.perf_counter()
    results: list[StageResult] = []
    history: dict = {}
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {FP32_NAME: out_dir / FP32_NAME}
    qat = None
    for stage in prepared.stages:
        t0 = time.perf_counter()
        if stage.kind == "fp32":
            _compile(model, hp["learning_rate"], prepared.probabilities, None, None)
            history[stage.name] = _fit(model, dataset, hp, stage.epochs, None)
            judged, bits = model, 32
        else:
            if qat is None:
                model.save(paths[FP32_NAME])  # the FP32 stages are done
                qat = _qat_model(model, dataset, hp)
            history[stage.name], keep = _qat_stage(qat, stage, prepared, hp, config)
            history[f"{stage.name}_keep_best"] = {"best_epoch": keep.best_epoch, "epochs": keep.history}
            judged, bits = qat, 8
        results.append(StageResult(stage.name, stage.kind, stage.epochs, bits, bits, _accuracy(judged, dataset, "val"),
                                   _accuracy(judged, dataset, "test"), round(time.perf_counter() - t0, 3)))  # fmt: skip
    if qat is None:
        model.save(paths[FP32_NAME])
    else:
        paths[QAT3_NAME] = out_dir / QAT3_NAME
        qat.save(paths[QAT3_NAME])
    history_path = out_dir / "history.json"
    history_path.write_text(json.dumps(history, indent=1, default=float))
    run_path = out_dir / "run.json"
    record = _record(config, hp, prepared, results, qat, paths, time.perf_counter() - started)
    write_json_atomic(run_path, record)
    return TrainResult(out_dir, paths[FP32_NAME], paths.get(QAT3_NAME), history_path, run_path, tuple(results),
                       float_layers=tuple(sorted(prepared.float_layers)),
                       ranges=record["quantization"]["final_ranges"] or None)  # fmt: skip
