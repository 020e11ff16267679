"""The training run: stages of FP32 and QAT, a checkpoint every epoch, resumable.

Output folder::

    fp32.keras      the FP32 model (end of the last FP32 stage): the reference
    qat.h5          the QAT model (end of the last QAT stage); load with quantize_scope
    history.json    every stage, every epoch
    run.json        versions, options, data hash, results
    checkpoint/     while running: state.json, stageN_start.keras, stageN/ (weights + optimizer state)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgeq.artifacts import atomic_path, provenance, sha256_file, write_json_atomic
from edgeq.data.sources import load_dataset
from edgeq.data.splits import normal_samples_for_training
from edgeq.errors import DataError, TrainingDiverged, TrainingInterrupted, UsageError
from edgeq.models.compat import keras, tf
from edgeq.models.load import (
    FP32_NAME,
    QAT_FLOAT_NAME,
    QAT_NAME,
    as_tf_keras,
    concatenated_outputs,
    copy_weights_into,
    input_shapes,
    is_keras3_model,
    is_model_path,
    keras_outputs_in_order,
    load_user_model,
    output_specs,
    with_input_shape,
)
from edgeq.quantize.plan_file import LayerConfig, LayerPrecision
from edgeq.tasks.table import predicted, score, task
from edgeq.training import distill, distribute, pipeline, schemes
from edgeq.training.objectives import check_targets, compile_for, objectives, target_plan, with_detection_targets
from edgeq.training.observe import initialize_ranges, input_preprocessing
from edgeq.training.schedule import Stage, make_schedule
from edgeq.transforms.fold import fold_batchnorm, needs_fold_before_qat
from edgeq.transforms.tfops import replace_tf_ops

log = logging.getLogger(__name__)


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
    model_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    augment: str | None = None  # image augmentation while training: "flip", "crop" or "flip,crop"
    task: str | None = None  # what each output is (--task KIND | NAME=KIND,... | FILE.json); None: inferred
    loss: str | None = None  # --loss LOSS | NAME=LOSS,...; None: the model file's compile config, else the task's
    input_shape: str | None = None  # --input-shape HxWxC: fixes a fully convolutional model's free dimensions
    distill: bool = False  # QAT learns the FP32 model's outputs (always when the data has no labels)
    # tf.distribute (edgeq.training.distribute); these describe this process, not the run, so
    # --resume takes them from the command line, not from the saved options
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


def _output_is_probability(model) -> bool:
    """Whether the model ends in a softmax (probabilities) rather than logits.

    Sees through TF-MOT's QuantizeWrapper and QuantizeAwareActivation, so a QAT model
    gets the same loss as the float model it came from.
    """
    last = model.layers[-1]
    inner = getattr(last, "layer", last)
    if type(inner).__name__ == "Softmax":
        return True
    activation = getattr(inner, "activation", None)
    activation = getattr(activation, "activation", activation)  # QuantizeAwareActivation wraps the function
    return getattr(activation, "__name__", "") == "softmax"


def synchronize_batchnorm(model) -> list[str]:
    """BatchNormalization with statistics over the global batch (tf_keras' ``synchronized``).

    With one replica a batch's mean and variance are those of the whole batch; split across
    N replicas, each would normalise with 1/N of it, and the same run would train another
    model on 2 workers than on 1. Synchronized, the replicas all-reduce the statistics.
    """
    names = []
    for layer in model.layers:
        inner = getattr(layer, "layer", layer)  # TF-MOT's QuantizeWrapper
        if type(inner).__name__ == "BatchNormalization" and not getattr(inner, "synchronized", True):
            inner.synchronized = True
            inner.fused = False  # tf_keras has no fused kernel for synchronized statistics
            names.append(inner.name)
        elif hasattr(inner, "layers") and inner is not model:
            names.extend(synchronize_batchnorm(inner))
    return names


def quantizer_ranges(qat_model) -> dict:
    """A digest of every quantizer's min/max, and whether this process's replicas agree on them.

    Workers of one multi-worker run print their digest (the chief records it in run.json),
    so that "every replica has the same ranges" is checked, not assumed.
    """
    digest = hashlib.sha256()
    equal, count = True, 0
    for weight in qat_model.weights:
        name = weight.name
        if weight.trainable or not (name.endswith("_min:0") or name.endswith("_max:0")):
            continue
        values = [np.asarray(v.numpy()) for v in getattr(weight, "values", (weight,))]
        equal = equal and all(np.array_equal(values[0], v, equal_nan=True) for v in values[1:])
        digest.update(name.encode() + values[0].astype(np.float32).tobytes())
        count += 1
    return {"variables": count, "sha256": digest.hexdigest(), "equal_across_local_replicas": bool(equal)}


def _compile(model, learning_rate: float, clip_norm=None, clip_value=None, objs=None) -> None:
    """Adam with the run's clipping; one loss per output (``objs``; default: a classifier's)."""
    kwargs = {}
    if clip_norm:
        kwargs["clipnorm"] = float(clip_norm)
    if clip_value:
        kwargs["clipvalue"] = float(clip_value)
    optimizer = keras.optimizers.Adam(learning_rate=learning_rate, **kwargs)
    if objs is not None:
        compile_for(model, objs, optimizer)
        return
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=not _output_is_probability(model))
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])


def _test_hooks(stage_index: int, epochs_done: int) -> None:
    """What tests observe after an epoch's checkpoint is written (nothing unless they ask).

    EDGEQ_TEST_EPOCH_LOG=FILE: append "stage epoch" (fsynced) and say so on stderr, so a
    kill test knows which epochs were complete. EDGEQ_TEST_PAUSE_AFTER_EPOCH=N: after epoch N, say so on stderr
    and wait for a signal; the Ctrl-C test interrupts training at a known point this way,
    instead of polling the checkpoint on a timer that a loaded machine can lose.
    """
    log_file = os.environ.get("EDGEQ_TEST_EPOCH_LOG")
    if log_file:
        with open(log_file, "a") as fh:
            fh.write(f"{stage_index} {epochs_done}\n")
            fh.flush()
            os.fsync(fh.fileno())
        print(f"edgeq: checkpointed stage {stage_index} epoch {epochs_done}", file=sys.stderr, flush=True)
    wanted = os.environ.get("EDGEQ_TEST_PAUSE_AFTER_EPOCH")
    if wanted and int(wanted) == epochs_done and hasattr(signal, "pause"):
        print(f"edgeq: paused after epoch {epochs_done}", file=sys.stderr, flush=True)
        signal.pause()  # SIGINT raises KeyboardInterrupt here, as it would mid-epoch


class _EpochRecorder(keras.callbacks.Callback):
    """Records each epoch and writes the checkpoint, so a crash loses at most one epoch."""

    def __init__(self, run: _Run, stage_index: int, progress_bar):
        super().__init__()
        self.run = run
        self.stage_index = stage_index
        self.bar = progress_bar
        self._start = 0.0
        self.diverged: str | None = None  # where the loss stopped being finite

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)) and self.diverged is None:
            self.diverged = f"epoch {len(self.run.history[self.stage_index]['epochs']) + 1}, batch {batch + 1}"
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.diverged is not None:  # no checkpoint of non-finite weights: the last one stays
            return
        logs = {k: float(v) for k, v in (logs or {}).items()}
        record = {"epoch": epoch + 1, "seconds": round(time.perf_counter() - self._start, 3), **logs}
        self.run.history[self.stage_index]["epochs"].append(record)
        self.run.save_checkpoint(self.model, self.stage_index, epoch + 1)
        if self.run.chief:
            _test_hooks(self.stage_index, epoch + 1)
        if self.bar is not None:
            # the first Keras metric shown (accuracy, mae, ...): "accuracy" or "<output>_accuracy"
            key = next(
                (k for k in logs if not k.startswith("val_") and k != "loss" and not k.endswith("_loss")), "loss"
            )
            short = key.rsplit("_", 1)[-1] if key.endswith(("accuracy", "mae", "mse")) else key
            self.bar.set_postfix_str(
                f"{self.run.stages[self.stage_index].name} {short}={logs.get(key, 0):.3g} "
                f"val={logs.get('val_' + key, 0):.3g}"
            )
            self.bar.update(1)


class _Run:
    """The run's files. Under multi-worker training every worker saves (reading mirrored and
    batch-norm variables takes collectives that all workers must join), but only the chief
    saves into the output folder; the others save into a scratch folder, deleted at the end."""

    def __init__(self, out_dir: Path, stages: list[Stage], config: TrainConfig, chief: bool = True, worker: int = 0):
        self.out_dir = out_dir
        self.chief = chief
        self.scratch = None
        if not chief:  # one per run and worker: a worker killed before it could clean up leaves one, reused next time
            key = hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:12]
            self.scratch = Path(tempfile.gettempdir()) / f"edgeq-worker-{key}-{worker}"
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch.mkdir(parents=True)
        self.ckpt = out_dir / "checkpoint"
        self.stages = stages
        self.config = config
        self.history: list[dict] = [{**s.to_dict(), "epochs": [], "final": None} for s in stages]
        self._manager = None

    def path(self, name: str) -> Path:
        """Where this process saves ``name`` (relative to the output folder)."""
        return self.out_dir / name if self.chief else self.scratch / name

    def save_model(self, model, name: str) -> Path:
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp, warnings.catch_warnings():
            # .h5 is the format TF-MOT reloads its wrappers from; Keras' "legacy format" notice is not news
            warnings.filterwarnings("ignore", message=".*HDF5 file.*")
            model.save(str(tmp))
        return path

    def finish(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def save_checkpoint(self, model, stage_index: int, epochs_done: int) -> None:
        """Weights and optimizer state (tf.train.CheckpointManager), then state.json that points at them.

        The manager keeps the last two checkpoints, so the one state.json names exists at any
        moment a crash can happen: before, during or after either write.
        """
        if self._manager is None or self._manager[0] != (stage_index, id(model)):
            checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
            directory = self.path(f"checkpoint/stage{stage_index}")
            self._manager = ((stage_index, id(model)), tf.train.CheckpointManager(checkpoint, str(directory), 2))
        saved = Path(self._manager[1].save(checkpoint_number=epochs_done))
        if not self.chief:
            return
        _fsync_folder(saved.parent)
        self._write_state(stage_index, epochs_done, str(saved.relative_to(self.ckpt)))
        write_json_atomic(self.out_dir / "history.json", {"stages": self.history})

    def save_stage_start(self, float_model, stage_index: int) -> None:
        """The model a stage starts from; then state.json; then the earlier stages' files go."""
        self.save_model(float_model, f"checkpoint/{stage_start_name(stage_index)}")
        self._manager = None
        if not self.chief:
            return
        self._write_state(stage_index, 0, None)
        for old in range(stage_index):
            shutil.rmtree(self.ckpt / f"stage{old}", ignore_errors=True)
            (self.ckpt / stage_start_name(old)).unlink(missing_ok=True)
        shutil.rmtree(self.ckpt / f"stage{stage_index}", ignore_errors=True)

    def _write_state(self, stage_index: int, epochs_done: int, checkpoint: str | None) -> None:
        write_json_atomic(
            self.ckpt / "state.json",
            {
                "stage": stage_index,
                "epochs_done": epochs_done,
                "checkpoint": checkpoint,
                "history": self.history,
                "config": self.config.to_dict(),
            },
        )


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

    recipe = None
    if not is_model_path(config.model):
        recipe = zoo.load_recipe(config.model)
    data_source = config.data or (recipe.data if recipe else None)
    if not data_source:
        raise UsageError(f"{config.model}: give --data (digits, synthetic:HxWxC:K, npz:PATH, images:DIR)")
    user_model = None  # the Keras 3 model the user gave, when they gave one
    if recipe is None:
        model = load_user_model(config.model)
        if config.input_shape:
            model = with_input_shape(model, config.input_shape, config.model)
        if is_keras3_model(model):
            user_model, model = model, as_tf_keras(model)
        if schemes.is_qat_model(model):
            raise UsageError(f"{config.model} is already quantization-aware; give edgeq train the FP32 model")
        shapes = input_shapes(model)
        free = [n for n, shape in shapes.items() if any(d is None for d in shape)]
        if free:
            raise UsageError(
                f"{config.model}: input {free[0]!r} has free dimensions {tuple(shapes[free[0]])} (a fully "
                "convolutional model): fix them with --input-shape HxWxC"
            )
        input_shape = next(iter(shapes.values())) if len(shapes) == 1 else shapes
        dataset = load_dataset(data_source, input_shape=input_shape, labels_required=False)
        dataset.check_fits(input_shape, where=f"model {config.model}")
    else:
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
    dataset.check_finite()
    declared = config.task or (recipe.task if recipe else None)
    # a user's file also says what its outputs are in its compile config (a from_logits cross-entropy)
    specs = output_specs(model, declared, config.model if recipe is None else None, dataset)
    objs = objectives(model, specs, config.model if recipe is None else None, config.loss)
    reason = "--distill" if config.distill else None
    if not dataset.labelled and not any(o.spec.kind == "reconstruction" for o in objs):
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
        reason = distill.NO_LABELS
    if reason is not None:
        distill.check_dataset(dataset, data_source)
    if any(o.spec.kind == "reconstruction" for o in objs):
        dataset = normal_samples_for_training(dataset)
    if reason != distill.NO_LABELS:
        dataset = with_detection_targets(objs, dataset)
        check_targets(objs, dataset)
    hp = {
        "epochs": config.epochs
        if config.epochs is not None
        else (0 if reason == distill.NO_LABELS else (recipe.epochs if recipe else 10)),
        "qat_epochs": config.qat_epochs if config.qat_epochs is not None else (recipe.qat_epochs if recipe else 3),
        "batch_size": config.batch_size or (recipe.batch_size if recipe else 32),
        "learning_rate": config.learning_rate or (recipe.learning_rate if recipe else 1e-3),
        "qat_learning_rate": config.qat_learning_rate or (recipe.qat_learning_rate if recipe else 1e-4),
        "seed": config.seed,
        "op_determinism": True,
    }
    return model, dataset, hp, recipe, user_model, objs, reason


def _save_fp32(run: _Run, float_model, user_model) -> None:
    """fp32.keras in the user's Keras: a Keras 3 input gets its own model back, trained."""
    if user_model is not None:
        copy_weights_into(float_model, user_model)
        float_model = user_model
    run.save_model(float_model, FP32_NAME)


def _accuracy(model, dataset, split: str, batch_size: int = 256) -> float:
    """Top-1 accuracy on a split, streamed (and, under tf.distribute, shared across replicas)."""
    if dataset.count(split) == 0:
        return float("nan")
    data = pipeline.split_dataset(dataset, split, batch_size)
    return float(model.evaluate(data, verbose=0, return_dict=True)["accuracy"])


def _detection_map50(model, dataset, split: str, objs, batch_size: int) -> float:
    """A detector's COCO mAP@0.5 on a split (decoded and NMS'd as edgeq.tasks.detection does for the .tflite)."""
    from edgeq.tasks.detection import decode, detection_spec_of, mean_average_precision

    if dataset.count(split) == 0:
        return float("nan")
    x, y = dataset.split(split)
    names = [o.spec.name for o in objs]
    outputs = dict(zip(names, keras_outputs_in_order(model, x, batch_size)))
    spec = detection_spec_of([o.spec for o in objs])
    found = mean_average_precision(
        decode(spec, outputs), y["gt_boxes"], y["gt_classes"], tuple(dataset.input_shape[:2]), spec.classes
    )
    return found["map50"]


def _first_qat(stages: list[Stage]) -> Stage:
    return next(s for s in stages if s.kind == "qat")


def _teacher(float_model, out_dir: Path, fresh: bool, dataset, objs, batch_size: int):
    """Distillation's targets: the FP32 model's outputs on every split (the model in memory when it
    is still the FP32 one, else fp32.keras), with each output's distillation loss and target plan."""
    teacher = float_model if fresh else load_user_model(out_dir / FP32_NAME)
    names = [o.spec.name for o in objs]
    log.info("distillation: QAT learns the outputs of the FP32 model (%s)", ", ".join(names))
    return distill.teacher_dataset(teacher, dataset, names, batch_size), distill.objectives(objs, float_model), names


def start_ranges(init_ranges: str, float_model, objs) -> tuple[str | None, set[str] | None]:
    """Which activation ranges QAT starts from the data, and by which method (None: TF-MOT's start).

    ``--init-ranges METHOD``: every range, by METHOD. The default (``tfmot``) keeps TF-MOT's [-6, 6]
    start, which fits a classifier's normalised activations, except: the input's preprocessing
    (Rescaling/Normalization: [-6, 6] can quantize it to zeros), and in a model with value outputs
    (regression, reconstruction) every range, by min/max: there the target's scale runs through the
    hidden layers, and a diabetes regressor's QAT RMSE went from 52 to 67 clipped at 6.
    """
    if init_ranges != "tfmot":
        return init_ranges, None
    if any(o.spec.kind in ("regression", "reconstruction") for o in objs):
        return "minmax", None
    preprocessing = input_preprocessing(float_model)
    return ("minmax", preprocessing) if preprocessing else (None, None)


def _soft(targets) -> bool:
    """Targets that are a teacher's probabilities or logits, not 0/1 labels."""
    t = None if targets is None else np.asarray(targets)
    return t is not None and np.issubdtype(t.dtype, np.floating) and not np.all(np.isin(t, (0.0, 1.0)))


def _stage_metric(
    model, dataset, split: str, objs, plan, batch_size: int = 256, by_keras: bool = True
) -> tuple[str, float]:
    """The first output's primary metric on a split: a classifier's accuracy through Keras (shared
    across replicas), any other task's through edgeq.tasks.table on the split's predictions."""
    first = objs[0].spec
    if len(objs) == 1 and first.kind == "classification" and by_keras:
        return "accuracy", _accuracy(model, dataset, split, batch_size)
    if any(o.spec.kind == "detection_boxes" for o in objs):
        return "map50", _detection_map50(model, dataset, split, objs, batch_size)
    metric = task(first.kind).primary or "mse"
    if dataset.count(split) == 0:
        return metric, float("nan")
    x, _ = dataset.split(split)
    outputs = keras_outputs_in_order(model, x, batch_size)
    targets = x if plan[0] == "input" else dataset.targets(split, plan[0])
    teachers = first.kind == "classification" and targets is not None and np.ndim(targets) > 1
    if (teachers and np.shape(targets)[-1] > 1) or (first.kind in ("binary", "multilabel") and _soft(targets)):
        targets = predicted(first, targets)  # a teacher's scores or probabilities: its answers
    if first.kind == "reconstruction":
        targets = dataset.targets(split) if dataset.labelled else None
    scores = score(first, outputs[0], targets, x if not isinstance(x, dict) else None)
    if metric not in scores:  # an autoencoder on a split without anomalies: its reconstruction error
        metric = "reconstruction_mse" if "reconstruction_mse" in scores else metric
    return metric, float(scores.get(metric, float("nan")))


def train(config: TrainConfig, resume: bool = False, force: bool = False, progress: bool = False) -> TrainResult:
    """FP32 training then QAT stages, writing models, history and run record to out_dir.

    Under ``config.strategy`` (edgeq.training.distribute) every stage runs in the strategy's
    scope; in a multi-worker run each worker calls this with the same options, and only
    the chief writes into out_dir.
    """
    dist = distribute.setup(config.strategy, config.replicas, config.workers, config.worker_index)
    from edgeq.shims.tfmot import global_batch_ranges

    global_batch_ranges(dist.replicas > 1)  # what one replica would see, on every replica
    try:
        with dist.strategy.scope():
            return _train(config, dist, resume, force, progress and dist.chief)
    finally:
        global_batch_ranges(False)


def _resumed_state(config: TrainConfig, dist, resume: bool, force: bool) -> tuple[TrainConfig, dict | None]:
    """The config to train with and the checkpoint state (None: a fresh run); refuses to overwrite."""
    out_dir = Path(config.out_dir)
    state_file = out_dir / "checkpoint" / "state.json"
    if resume:
        if not state_file.is_file():
            raise UsageError(f"{out_dir}: nothing to resume (no checkpoint/state.json); run without --resume")
        state = json.loads(state_file.read_text())
        cluster = {k: getattr(config, k) for k in ("strategy", "replicas", "workers", "worker_index")}
        log.info("resuming %s at stage %d after %d epochs", out_dir, state["stage"], state["epochs_done"])
        return replace(TrainConfig(**state["config"]), **cluster), state
    if dist.chief and state_file.is_file() and not force:
        raise UsageError(f"{out_dir} holds an unfinished run: continue it with --resume, or start over with --force")
    if dist.chief and (out_dir / "run.json").is_file() and not force:
        raise UsageError(f"{out_dir} already holds a finished run: choose another --out, or overwrite with --force")
    return config, None


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


def _fit_stage(stage_model, stage, index, initial_epoch, train_data, steps, fit_set, fit_plan, hp, run, bar) -> None:
    """Fit one stage from ``initial_epoch``; a NaN/inf loss stops it with what to try."""
    config = run.config
    val_data = (
        pipeline.split_dataset(fit_set, "val", hp["batch_size"], targets=fit_plan) if fit_set.count("val") else None
    )
    recorder = _EpochRecorder(run, index, bar)
    stage_model.fit(
        train_data,
        validation_data=val_data,
        epochs=stage.epochs,
        initial_epoch=initial_epoch,
        steps_per_epoch=steps,
        verbose=0,
        callbacks=[recorder],
    )
    if recorder.diverged is not None:
        kept = "fp32.keras is saved, and " if (run.out_dir / FP32_NAME).exists() else ""
        hint = "--init-ranges tfmot or " if stage.kind == "qat" and config.init_ranges != "tfmot" else ""
        lr = "--qat-lr" if stage.kind == "qat" else "--lr"
        clip = " or --clip-norm 1.0" if stage.kind == "qat" else ""
        raise TrainingDiverged(
            f"stage {stage.name} diverged: the loss became NaN or infinite in {recorder.diverged}; "
            f"{kept}checkpoint/ holds the last finite epoch. Try {hint}a lower {lr}{clip}"
        )


def _judge_stage(stage_model, stage, judged, objs, by_keras: bool, labelled: bool, seconds: float) -> StageResult:
    """The stage's val and test metric on ``judged`` (dataset, targets plan)."""
    metric, val_acc = _stage_metric(stage_model, judged[0], "val", objs, judged[1], by_keras=by_keras)
    _, test_acc = _stage_metric(stage_model, judged[0], "test", objs, judged[1], by_keras=by_keras)
    if not labelled:  # no labels: judged against the FP32 model's outputs
        metric = "agreement" if metric == "accuracy" else f"{metric}_vs_fp32"
    return StageResult(
        stage.name, stage.kind, stage.epochs, stage.weight_bits, stage.activation_bits,
        val_acc, test_acc, round(seconds, 3), metric,
    )  # fmt: skip


def _float_model_for_qat(float_model, index: int, fold: bool, run):
    """The float model a QAT stage wraps, saved as the stage's start when it changed.

    The layers edgeq rewrites before wrapping (TF ops, SeparableConv2D) are rewritten in the
    float model too, so QAT's weights map back onto it; with ``fold`` BN is folded first.
    """
    rewritten, _ = replace_tf_ops(float_model)
    if rewritten is not float_model:
        float_model = rewritten
        run.save_stage_start(float_model, index)
    if fold:
        float_model = fold_batchnorm(float_model)
        run.save_stage_start(float_model, index)
    return float_model


def _qat_stage_model(float_model, stage, initial_epoch: int, config, settings, quantizable, dataset, objs):
    """A QAT stage's wrapped model (its share of the layers, its bits) with its starting ranges.

    With TF-MOT's start, the input's preprocessing (Rescaling, Normalization) still gets its
    exact range from data: [-6, 6] can quantize it to all zeros. Returns (model, how many
    activation ranges were set from calibration).
    """
    n = max(1, math.ceil(stage.layer_fraction * len(quantizable)))
    only = set(quantizable[:n]) if stage.layer_fraction < 1.0 else None
    stage_settings = replace(settings, weight_bits=stage.weight_bits, activation_bits=stage.activation_bits)
    stage_model = schemes.build_qat_model(float_model, stage_settings, only_layers=only)
    method, only = start_ranges(config.init_ranges, float_model, objs)
    set_here = 0
    if initial_epoch == 0 and method is not None:
        set_here = initialize_ranges(
            stage_model,
            float_model,
            dataset.calibration_samples(min(256, dataset.count("train"))),
            method,
            stage.activation_bits,
            symmetric=config.activations == "symmetric",
            only=only,
        )
    return stage_model, set_here


def _run_record(config: TrainConfig, dist, out_dir: Path, f: dict) -> dict:
    """run.json: what was trained, how, with which quantization, and what each stage measured.

    ``f``: the run's facts (recipe, hp, settings, fold_bn, qat_model, initialized, ranges, stages,
    dataset, objs, teacher, distill_reason, results, resumed, started, augment, user_model, qat_path).
    """
    dataset = f["dataset"]
    described = dataset.describe()
    return {
        "kind": "edgeq.train",
        "complete": True,
        "config": config.to_dict(),
        "recipe": f["recipe"].name if f["recipe"] else None,
        "hyperparameters": f["hp"],
        "quantization": {
            **f["settings"].to_dict(),
            "batchnorm_folded_before_qat": bool(f["fold_bn"]),
            "float_layers": schemes.float_layers(f["qat_model"]) if f["qat_model"] is not None else [],
            "initial_activation_ranges": {"method": config.init_ranges, "set_per_stage": f["initialized"]},
            "final_ranges": f["ranges"],
        },
        "schedule": [s.to_dict() for s in f["stages"]],
        "data": described,
        "normalization": dataset.normalization.to_dict(),
        "input_shape": described["input_shape"],
        "num_classes": dataset.num_classes,
        # what each output is and what it trained with: convert, eval and profile read the tasks here
        "outputs": [o.to_dict() for o in f["objs"]],
        "distillation": distill.describe(f["teacher"][1], f["distill_reason"]) if f["teacher"] else None,
        "results": [asdict(r) for r in f["results"]],
        "resumed_from": list(f["resumed"]) if f["resumed"] else None,
        "train_seconds": round(time.perf_counter() - f["started"], 3),
        "distribution": {
            **dist.describe(),
            "global_batch_size": f["hp"]["batch_size"],
            "batchnorm": "statistics over the global batch (synchronized)" if dist.replicas > 1 else "per batch",
        },
        "augment": list(f["augment"]),
        # Which Keras wrote each file: QAT needs tf_keras; fp32.keras is in the Keras given.
        "keras": {
            "given": "keras3" if f["user_model"] is not None else "tf_keras",
            FP32_NAME: "keras3" if f["user_model"] is not None else "tf_keras",
            **({QAT_NAME: "tf_keras", QAT_FLOAT_NAME: "tf_keras"} if f["qat_path"] else {}),
        },
        "artifacts": {
            FP32_NAME: sha256_file(out_dir / FP32_NAME),
            **({QAT_NAME: sha256_file(f["qat_path"])} if f["qat_path"] else {}),
            **({QAT_FLOAT_NAME: sha256_file(out_dir / QAT_FLOAT_NAME)} if f["qat_path"] else {}),
        },
        "provenance": provenance(),
    }


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
    layer_plan = _layer_plan(config, [layer.name for layer in model.layers])
    settings = schemes.QuantSettings(
        config.weight_bits, config.activation_bits, config.granularity, config.activations, layer_plan
    )
    if dry_run and any(s.kind == "qat" for s in stages):
        schemes.build_qat_model(model, settings)
    return stages, settings, schemes.quantizable_layer_names(model)


def _clear_run(out_dir: Path) -> None:
    """--force: the earlier run's models, records and checkpoints go before training starts."""
    for name in (FP32_NAME, QAT_NAME, QAT_FLOAT_NAME, "run.json", "history.json"):
        if (out_dir / name).exists():
            (out_dir / name).unlink()
    shutil.rmtree(out_dir / "checkpoint", ignore_errors=True)


def _fit_and_judge(
    stage_model, stage, index: int, initial_epoch: int, data: tuple, objs, config, hp: dict, augment, run, bar
) -> StageResult:
    """Train one stage from ``initial_epoch`` and measure it. ``data``: (dataset, its targets plan,
    the distillation teacher or None); a distilled QAT stage trains on the teacher's outputs."""
    dataset, plan, teacher = data
    t0 = time.perf_counter()
    fit_set, fit_plan = (teacher[0], teacher[2]) if teacher and stage.kind == "qat" else (dataset, plan)
    if initial_epoch < stage.epochs:
        epochs = (initial_epoch, stage.epochs)
        batches = dict(training=True, seed=config.seed, augment=augment, epochs=epochs, targets=fit_plan)
        fit = pipeline.split_dataset(fit_set, "train", hp["batch_size"], **batches)
        steps = pipeline.steps_per_epoch(dataset, "train", hp["batch_size"])
        _fit_stage(stage_model, stage, index, initial_epoch, fit, steps, fit_set, fit_plan, hp, run, bar)
    judged = (dataset, plan) if plan is not None else (teacher[0], teacher[2])
    by_keras = not (teacher and stage.kind == "qat")  # a distilled model has no Keras accuracy metric
    return _judge_stage(stage_model, stage, judged, objs, by_keras, plan is not None, time.perf_counter() - t0)


def _progress_bar(stages, start_stage: int, start_epoch: int):
    """One bar over every stage's epochs, starting where a resumed run stands."""
    from tqdm.auto import tqdm

    total = sum(s.epochs for s in stages)
    done = sum(s.epochs for s in stages[:start_stage]) + start_epoch
    return tqdm(total=total, initial=done, unit="epoch", desc="train", dynamic_ncols=True)


def _train(config: TrainConfig, dist, resume: bool, force: bool, progress: bool) -> TrainResult:
    out_dir = Path(config.out_dir)
    config, state = _resumed_state(config, dist, resume, force)
    if config.weight_bits not in range(2, 9):
        raise UsageError(f"--weight-bits must be between 2 and 8, got {config.weight_bits}")
    augment = pipeline.parse_augment(config.augment)
    # --seed N and TensorFlow's deterministic kernels: the same command gives the same weights
    keras.utils.set_random_seed(config.seed)
    tf.config.experimental.enable_op_determinism()
    model, dataset, hp, recipe, user_model, objs, distill_reason = _resolve(config)
    plan = None if distill_reason == distill.NO_LABELS else target_plan(objs, dataset)
    teacher = None  # distillation: (the dataset with the FP32 model's outputs as targets, objectives, plan)
    if dist.chief:
        for warning in concatenated_outputs(model, dataset.calibration_samples(min(64, dataset.count("train")))):
            log.warning("%s", warning)
    stages, settings, quantizable = _checked_schedule(config, model, dataset, hp, augment, dry_run=state is None)
    if dist.chief:
        out_dir.mkdir(parents=True, exist_ok=True)
    run = _Run(out_dir, stages, config, chief=dist.chief, worker=dist.worker_index)
    start_stage, start_epoch = 0, 0
    if state is not None:
        run.history = state["history"]
        start_stage, start_epoch = int(state["stage"]), int(state["epochs_done"])
        model = load_user_model(out_dir / "checkpoint" / stage_start_name(start_stage))
    elif force and dist.chief:
        _clear_run(out_dir)

    bar = _progress_bar(stages, start_stage, start_epoch) if progress else None
    if not any(s.kind == "fp32" for s in stages) and not (out_dir / FP32_NAME).exists():
        # QAT-only schedule: the model as given is the FP32 reference. Saved now, because QAT
        # copies its fine-tuned weights back into this very model object.
        _save_fp32(run, model, user_model)
    float_model = model
    fold_bn = config.fold_bn
    if fold_bn is None:  # per-tensor: the converter's own fold is wrong there; Dense/Conv1D + BN: TF-MOT has none
        fold_bn = config.granularity == "per-tensor" or bool(needs_fold_before_qat(model))
    # A resumed run restarts from checkpoint/stageN_start.keras, folded already if it was.
    folded = state is not None and not any(type(la).__name__ == "BatchNormalization" for la in model.layers)
    qat_model = None
    initialized: dict[str, int] = {}  # stage -> activation ranges set from calibration
    results: list[StageResult] = []
    started = time.perf_counter()
    try:
        for index in range(start_stage, len(stages)):
            stage = stages[index]
            initial_epoch = start_epoch if index == start_stage else 0
            if initial_epoch == 0:
                run.save_stage_start(float_model, index)
            if stage.kind == "qat" and distill_reason and teacher is None:
                teacher = _teacher(float_model, out_dir, index == stages.index(_first_qat(stages)) and
                                   initial_epoch == 0, dataset, objs, hp["batch_size"])  # fmt: skip
            if stage.kind == "qat" and initial_epoch == 0:
                fold = fold_bn and not folded
                float_model = _float_model_for_qat(float_model, index, fold, run)
                folded = folded or fold
            if stage.kind == "fp32":
                stage_model = float_model
            else:
                stage_model, set_here = _qat_stage_model(
                    float_model, stage, initial_epoch, config, settings, quantizable, dataset, objs
                )
                if set_here:
                    initialized[stage.name] = set_here
            if dist.replicas > 1:
                synchronize_batchnorm(stage_model)
            if stage.kind == "fp32":
                _compile(stage_model, hp["learning_rate"], objs=objs)
            else:
                stage_objs = teacher[1] if teacher else objs
                _compile(stage_model, hp["qat_learning_rate"], config.clip_norm, config.clip_value, stage_objs)
            if initial_epoch > 0:
                restore_checkpoint(stage_model, out_dir / "checkpoint", state)
            result = _fit_and_judge(
                stage_model, stage, index, initial_epoch, (dataset, plan, teacher), objs, config, hp, augment, run, bar
            )
            results.append(result)
            run.history[index]["final"] = {
                "val_value": result.val_value, "test_value": result.test_value, "metric": result.metric
            }  # fmt: skip
            log.info("stage %s: val %s %.4f test %.4f", stage.name, result.metric, result.val_value, result.test_value)
            if stage.kind == "fp32":
                _save_fp32(run, float_model, user_model)
            else:
                schemes.copy_float_weights(stage_model, float_model)
                qat_model = stage_model
    except KeyboardInterrupt as exc:
        raise TrainingInterrupted(
            f"training interrupted; completed epochs are saved in {out_dir}/checkpoint: "
            f"continue with edgeq train {config.model} --out {out_dir} --resume"
        ) from exc
    finally:
        if bar is not None:
            bar.close()

    qat_path = None
    if qat_model is not None:
        qat_path = run.save_model(qat_model, QAT_NAME)
        run.save_model(float_model, QAT_FLOAT_NAME)
    ranges = quantizer_ranges(qat_model) if qat_model is not None else None
    if not dist.chief:
        run.finish()
        return TrainResult(
            out_dir, None, None, out_dir / "history.json", out_dir / "run.json", tuple(results), ranges=ranges
        )
    write_json_atomic(out_dir / "history.json", {"stages": run.history})
    facts = dict(
        recipe=recipe, hp=hp, settings=settings, fold_bn=fold_bn, qat_model=qat_model, initialized=initialized,
        ranges=ranges, stages=stages, dataset=dataset, objs=objs, teacher=teacher, distill_reason=distill_reason,
        results=results, resumed=(start_stage, start_epoch) if state is not None else None, started=started,
        augment=augment, user_model=user_model, qat_path=qat_path,
    )  # fmt: skip
    record = _run_record(config, dist, out_dir, facts)
    write_json_atomic(out_dir / "run.json", record)
    shutil.rmtree(out_dir / "checkpoint", ignore_errors=True)
    return TrainResult(
        out_dir=out_dir,
        fp32_model=out_dir / FP32_NAME,
        qat_model=qat_path,
        history=out_dir / "history.json",
        run=out_dir / "run.json",
        stages=tuple(results),
        resumed_from=(start_stage, start_epoch) if state is not None else None,
        float_layers=tuple(record["quantization"]["float_layers"]),
        ranges=ranges,
        distribution=record["distribution"],
    )
