"""``edgeq train --qat-engine keras3``: FP32 training and QAT on the Keras 3 model itself.

No translation to tf_keras and no TF-MOT: the Keras 3 model the user gave trains in Keras 3, its QAT
model is ``edgeq.quantize.keras3_qat``'s, and both files stay Keras 3 files (``fp32.keras``,
``qat.keras``) that Keras 3 loads with edgeq's layers registered. ``edgeq convert qat.keras --int8-only``
turns the trained ranges into the int8 file's scales.

What this engine does not do yet is refused in one line that names it and the TF-MOT engine.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import numpy as np

import edgeq.quantize.keras3_qat as keras3_qat
from edgeq.artifacts import provenance, sha256_file, write_json_atomic
from edgeq.errors import UsageError
from edgeq.models.load import FP32_NAME, load_user_model
from edgeq.models.spec import KERAS3

ENGINE = "keras3"
QAT3_NAME = "qat.keras"
CALIBRATION_BATCHES = 4  # batches that start each activation range at the data's before QAT

_NOT_YET = (  # option, its default, what the engine lacks
    ("schedule", "default", "--schedule (stepped quantization)"),
    ("layer_config", None, "--layer-config (layer-wise plans)"),
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


def _refuse_unsupported(config, resume: bool) -> None:
    if resume:
        raise UsageError("--resume: the Keras 3 QAT engine does not resume runs yet; use --qat-engine tfmot")
    for key, default, what in _NOT_YET:
        if getattr(config, key) != default:
            raise UsageError(f"{what}: the Keras 3 QAT engine does not have it yet; use --qat-engine tfmot")


def _classifier(model, dataset, path: str) -> bool:
    """Whether the single output is softmax probabilities (else logits); other tasks are refused."""
    if len(model.outputs) != 1 or dataset.num_classes is None or dataset.num_classes < 2:
        raise UsageError(
            f"{path}: the Keras 3 QAT engine trains single-output classifiers on labelled data yet; "
            "use --qat-engine tfmot"
        )
    last = model.layers[-1]
    activation = getattr(last, "activation", None)
    return getattr(activation, "__name__", "") == "softmax" or type(last).__name__ == "Softmax"


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


def _checked(config, resume: bool, force: bool):
    """The Keras 3 model and its labelled data, and whether it outputs probabilities; refusals first."""
    from edgeq.data.sources import load_dataset
    from edgeq.models.keras3 import keras_flavour_of_file

    _refuse_unsupported(config, resume)
    out_dir = Path(config.out_dir)
    if (out_dir / "run.json").is_file() and not force:
        raise UsageError(f"{out_dir} already holds a finished run: choose another --out, or overwrite with --force")
    if not Path(config.model).exists():
        raise UsageError(f"{config.model}: the Keras 3 QAT engine trains a Keras 3 model file (.keras)")
    if keras_flavour_of_file(config.model) != KERAS3:
        raise UsageError(
            f"{config.model}: not a Keras 3 file; the Keras 3 QAT engine trains Keras 3 models (--qat-engine tfmot "
            "trains tf_keras ones)"
        )
    model = load_user_model(config.model)
    if keras3_qat.is_keras3_qat(model):
        raise UsageError(f"{config.model} is already quantization-aware; give edgeq train the FP32 model")
    if not config.data:
        raise UsageError(f"{config.model}: give --data (digits, synthetic:HxWxC:K, npz:PATH, images:DIR)")
    shape = tuple(model.inputs[0].shape[1:])
    dataset = load_dataset(config.data, input_shape=shape, labels_required=True)
    dataset.check_fits(shape, where=f"model {config.model}")
    dataset.check_finite()
    probabilities = _classifier(model, dataset, config.model)
    keras3_qat.check_quantizable(model)  # before any epoch: a layer it cannot quantize loses no training
    return model, dataset, probabilities


def _qat(model, dataset, hp: dict, probabilities: bool, config):
    """The QAT model: ranges started on training batches, fitted, the best epoch on val kept."""
    qat = keras3_qat.quantize_model(model)
    x_train, _ = dataset.split("train")
    size = hp["batch_size"]
    first = min(len(x_train), size * CALIBRATION_BATCHES)
    keras3_qat.calibrate(qat, [x_train[k : k + size] for k in range(0, first, size)])
    _compile(qat, hp["qat_learning_rate"], probabilities, config.clip_norm, config.clip_value)
    keep = _KeepBest(qat, dataset)
    fitted = _fit(qat, dataset, hp, hp["qat_epochs"], keep)
    keep.restore(qat)
    return qat, fitted, keep


def _record(config, hp: dict, dataset, stages, ranges: dict, paths: dict, seconds: float) -> dict:
    """run.json, in the keys convert, eval and report read (data, normalization, results, artifacts)."""
    described = dataset.describe()
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
            "float_layers": [],
        },
        "schedule": [{"name": s.name, "kind": s.kind, "epochs": s.epochs} for s in stages],
        "data": described,
        "normalization": dataset.normalization.to_dict(),
        "input_shape": described["input_shape"],
        "num_classes": dataset.num_classes,
        "outputs": [],
        "results": [s.__dict__ for s in stages],
        "train_seconds": round(seconds, 3),
        "keras": {"given": KERAS3, **{name: KERAS3 for name in paths}},
        "artifacts": {name: sha256_file(path) for name, path in paths.items()},
        "provenance": provenance(),
    }


def train_keras3(config, resume: bool = False, force: bool = False, progress: bool = False):
    """FP32 epochs, then QAT epochs with keep-best on val, all in Keras 3; the run's files and run.json."""
    import keras

    from edgeq.train.config import StageResult, TrainResult, _hyperparameters

    model, dataset, probabilities = _checked(config, resume, force)
    hp = _hyperparameters(config, None, None)
    keras.utils.set_random_seed(config.seed)
    started = time.perf_counter()
    stages: list[StageResult] = []
    history: dict = {}
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if hp["epochs"]:
        t0 = time.perf_counter()
        _compile(model, hp["learning_rate"], probabilities, None, None)
        history["fp32"] = _fit(model, dataset, hp, hp["epochs"], None)
        stages.append(StageResult("fp32", "fp32", hp["epochs"], 32, 32, _accuracy(model, dataset, "val"),
                                  _accuracy(model, dataset, "test"), round(time.perf_counter() - t0, 3)))  # fmt: skip
    paths = {FP32_NAME: out_dir / FP32_NAME}
    model.save(paths[FP32_NAME])
    ranges: dict = {}
    if hp["qat_epochs"]:
        t0 = time.perf_counter()
        qat, history["qat"], keep = _qat(model, dataset, hp, probabilities, config)
        stages.append(StageResult("qat", "qat", hp["qat_epochs"], 8, 8, _accuracy(qat, dataset, "val"),
                                  _accuracy(qat, dataset, "test"), round(time.perf_counter() - t0, 3)))  # fmt: skip
        paths[QAT3_NAME] = out_dir / QAT3_NAME
        qat.save(paths[QAT3_NAME])
        ranges = keras3_qat.ranges(qat)
        history["qat_keep_best"] = {"best_epoch": keep.best_epoch, "epochs": keep.history}
    history_path = out_dir / "history.json"
    history_path.write_text(json.dumps(history, indent=1, default=float))
    run_path = out_dir / "run.json"
    write_json_atomic(run_path, _record(config, hp, dataset, stages, ranges, paths, time.perf_counter() - started))
    return TrainResult(out_dir, paths[FP32_NAME], paths.get(QAT3_NAME), history_path, run_path, tuple(stages),
                       ranges=ranges or None)  # fmt: skip
