"""One training stage (FP32 or a QAT step): compile, fit with checkpoints, judge on val and test."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np

from edgeq.artifacts import atomic_path, write_json_atomic
from edgeq.errors import TrainingDiverged
from edgeq.models.compat import keras, tf
from edgeq.models.load import (
    FP32_NAME,
    describe,
    keras_outputs_in_order,
    load_user_model,
)
from edgeq.tasks.table import predicted, score, task
from edgeq.train import distill, pipeline, schemes
from edgeq.train.config import StageResult, TrainConfig, _fsync_folder, stage_start_name
from edgeq.train.objectives import compile_for
from edgeq.train.observe import initialize_ranges, input_preprocessing
from edgeq.train.schedule import Stage
from edgeq.transforms.fold import fold_batchnorm
from edgeq.transforms.tfops import replace_tf_ops

log = logging.getLogger(__name__)


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
    return (
        distill.teacher_dataset(teacher, dataset, names, batch_size),
        distill.objectives(objs, describe(float_model).activations),
        names,
    )


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


def _fit_stage(
    stage_model, stage, index, initial_epoch, train_data, steps, fit_set, fit_plan, hp, run, bar, keep=None
) -> None:
    """Fit one stage from ``initial_epoch``; a NaN/inf loss stops it with what to try. ``keep``: a
    finetune.KeepBest that judges each epoch and leaves the best weights in the model."""
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
        callbacks=([keep] if keep is not None else []) + [recorder],  # keep's val_judged reaches the history
    )
    if keep is not None and keep.best_epoch >= 0:
        run.history[index]["kept_epoch"] = keep.best_epoch
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
        keep = _keep_best(stage, data, objs, run, initial_epoch) if stage.kind == "qat" else None
        _fit_stage(stage_model, stage, index, initial_epoch, fit, steps, fit_set, fit_plan, hp, run, bar, keep)
    judged = (dataset, plan) if plan is not None else (teacher[0], teacher[2])
    by_keras = not (teacher and stage.kind == "qat")  # a distilled model has no Keras accuracy metric
    return _judge_stage(stage_model, stage, judged, objs, by_keras, plan is not None, time.perf_counter() - t0)


def _keep_best(stage, data: tuple, objs, run, initial_epoch: int = 0):
    """QAT's judge on val after each epoch (finetune.KeepBest): a distilled model against its teacher's
    outputs (top-1 agreement for a classifier, which stops it once matched), from its start on; else the
    task metric, from the first epoch (the start is TF-MOT's uncalibrated ranges: nothing to keep).
    None where val is empty, where one labelled epoch is left (nothing to choose between), or across
    workers (each would judge alone, out of step with the others)."""
    from edgeq.train.finetune import MATCHED, KeepBest

    dataset, plan, teacher = data
    if dataset.count("val") == 0 or run.config.strategy == "multi-worker":
        return None
    if not teacher and stage.epochs - initial_epoch <= 1:
        return None
    judged, targets = (teacher[0], teacher[2]) if teacher else (dataset, plan)
    classifier = objs[0].spec.kind == "classification" and len(objs) == 1

    def judge(model):
        return _stage_metric(model, judged, "val", objs, targets, by_keras=not teacher)

    return KeepBest(judge, matched=MATCHED if teacher and classifier else None, from_start=bool(teacher))


def _progress_bar(stages, start_stage: int, start_epoch: int):
    """One bar over every stage's epochs, starting where a resumed run stands."""
    from tqdm.auto import tqdm

    total = sum(s.epochs for s in stages)
    done = sum(s.epochs for s in stages[:start_stage]) + start_epoch
    return tqdm(total=total, initial=done, unit="epoch", desc="train", dynamic_ncols=True)
