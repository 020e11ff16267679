"""TF-MOT's QAT engine: FP32 training, then the QAT stages on tf_keras, resumable, with the run's record.

A Keras 3 model is translated to tf_keras for it (``models.translate``). ``edgeq.train.fit.train``
chooses this engine or the Keras 3 one (``train.keras3_engine``).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edgeq.artifacts import provenance, sha256_file, write_json_atomic
from edgeq.errors import TrainingInterrupted, UsageError
from edgeq.models.compat import keras, tf
from edgeq.models.load import (
    FP32_NAME,
    QAT_FLOAT_NAME,
    QAT_NAME,
    concatenated_outputs,
    copy_weights_into,
    load_user_model,
)
from edgeq.train import distill, distribute, pipeline, schemes
from edgeq.train.config import (
    StageResult,
    TrainConfig,
    TrainResult,
    _checked_schedule,
    _resolve,
    restore_checkpoint,
    stage_start_name,
)
from edgeq.train.finetune import frozen_for_qat
from edgeq.train.objectives import target_plan
from edgeq.train.outdir import refuse_overwrite, state_file
from edgeq.train.stages import (
    _compile,
    _first_qat,
    _fit_and_judge,
    _float_model_for_qat,
    _progress_bar,
    _qat_stage_model,
    _Run,
    _teacher,
    quantizer_ranges,
    synchronize_batchnorm,
)
from edgeq.transforms.fold import needs_fold_before_qat

log = logging.getLogger(__name__)


def _save_fp32(run: _Run, float_model, user_model) -> None:
    """fp32.keras in the user's Keras: a Keras 3 input gets its own model back, trained."""
    if user_model is not None:
        copy_weights_into(float_model, user_model)
        float_model = user_model
    run.save_model(float_model, FP32_NAME)


def train_tfmot(config: TrainConfig, resume: bool = False, force: bool = False, progress: bool = False) -> TrainResult:
    """FP32 training then QAT stages through TF-MOT, writing models, history and run record to out_dir.

    Under ``config.strategy`` (edgeq.train.distribute) every stage runs in the strategy's
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
    if resume or dist.chief:
        refuse_overwrite(out_dir, resume, force)
    if resume:
        state = json.loads(state_file(out_dir).read_text())
        cluster = {k: getattr(config, k) for k in ("strategy", "replicas", "workers", "worker_index")}
        log.info("resuming %s at stage %d after %d epochs", out_dir, state["stage"], state["epochs_done"])
        return replace(TrainConfig(**state["config"]), **cluster), state
    return config, None


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
            "batchnorm_during_qat": config.qat_bn,
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


def _clear_run(out_dir: Path) -> None:
    """--force: the earlier run's models, records and checkpoints go before training starts."""
    for name in (FP32_NAME, QAT_NAME, QAT_FLOAT_NAME, "run.json", "history.json"):
        if (out_dir / name).exists():
            (out_dir / name).unlink()
    shutil.rmtree(out_dir / "checkpoint", ignore_errors=True)


@dataclass
class _Job:
    """What every stage of one training run reads: the run's settings, data and schedule."""

    config: TrainConfig
    dist: Any
    run: Any
    stages: list
    dataset: Any
    plan: Any
    objs: list
    hp: dict
    augment: Any
    settings: Any
    quantizable: Any
    distill_reason: str | None
    fold_bn: bool
    user_model: Any
    bar: Any
    state: dict | None


@dataclass
class _Carried:
    """What the stage loop carries from one stage to the next."""

    float_model: Any
    folded: bool
    teacher: tuple | None = None  # distillation: (dataset with the FP32 model's outputs as targets, objectives, plan)
    qat_model: Any = None
    initialized: dict[str, int] = field(default_factory=dict)  # stage -> activation ranges set from calibration
    results: list[StageResult] = field(default_factory=list)


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
    fold_bn = config.fold_bn
    if fold_bn is None:  # per-tensor: the converter's own fold is wrong there; Dense/Conv1D + BN: TF-MOT has none
        fold_bn = config.granularity == "per-tensor" or bool(needs_fold_before_qat(model))
    job = _Job(config, dist, run, stages, dataset, plan, objs, hp, augment, settings, quantizable, distill_reason,
               fold_bn, user_model, bar, state)  # fmt: skip
    # A resumed run restarts from checkpoint/stageN_start.keras, folded already if it was.
    carried = _Carried(
        model, state is not None and not any(type(la).__name__ == "BatchNormalization" for la in model.layers)
    )
    started = time.perf_counter()
    try:
        for index in range(start_stage, len(stages)):
            _run_stage(job, carried, index, start_epoch if index == start_stage else 0)
    except KeyboardInterrupt as exc:
        raise TrainingInterrupted(
            f"training interrupted; completed epochs are saved in {out_dir}/checkpoint: "
            f"continue with edgeq train {config.model} --out {out_dir} --resume"
        ) from exc
    finally:
        if bar is not None:
            bar.close()
    resumed = (start_stage, start_epoch) if state is not None else None
    return _finish(job, carried, recipe, resumed, started)


def _run_stage(job: _Job, carried: _Carried, index: int, initial_epoch: int) -> None:
    """One stage of the schedule: its model (QAT-wrapped for a QAT stage), compiled, fitted, judged, saved."""
    config, run, stages, objs, hp = job.config, job.run, job.stages, job.objs, job.hp
    stage = stages[index]
    if initial_epoch == 0:
        run.save_stage_start(carried.float_model, index)
    if stage.kind == "qat" and job.distill_reason and carried.teacher is None:
        first = index == stages.index(_first_qat(stages)) and initial_epoch == 0
        carried.teacher = _teacher(carried.float_model, run.out_dir, first, job.dataset, objs, hp["batch_size"])
    if stage.kind == "qat" and initial_epoch == 0:
        fold = job.fold_bn and not carried.folded
        carried.float_model = _float_model_for_qat(carried.float_model, index, fold, run)
        carried.folded = carried.folded or fold
    if stage.kind == "fp32":
        stage_model = carried.float_model
    else:
        stage_model, set_here = _qat_stage_model(
            carried.float_model, stage, initial_epoch, config, job.settings, job.quantizable, job.dataset, objs
        )
        if set_here:
            carried.initialized[stage.name] = set_here
    if job.dist.replicas > 1:
        synchronize_batchnorm(stage_model)
    thaw = lambda: None  # noqa: E731
    if stage.kind == "fp32":
        _compile(stage_model, hp["learning_rate"], objs=objs)
    else:
        stage_objs = carried.teacher[1] if carried.teacher else objs
        if config.qat_bn == "frozen":  # fine-tune the function that deploys (edgeq.train.finetune)
            thaw = frozen_for_qat(stage_model)
        _compile(stage_model, hp["qat_learning_rate"], config.clip_norm, config.clip_value, stage_objs)
    if initial_epoch > 0:
        restore_checkpoint(stage_model, run.out_dir / "checkpoint", job.state)
    data = (job.dataset, job.plan, carried.teacher)
    try:
        result = _fit_and_judge(
            stage_model, stage, index, initial_epoch, data, objs, config, hp, job.augment, run, job.bar
        )
    finally:
        thaw()  # the saved model and the weights copied back keep their layers' configuration
    carried.results.append(result)
    run.history[index]["final"] = {
        "val_value": result.val_value,
        "test_value": result.test_value,
        "metric": result.metric,
    }
    log.info("stage %s: val %s %.4f test %.4f", stage.name, result.metric, result.val_value, result.test_value)
    if stage.kind == "fp32":
        _save_fp32(run, carried.float_model, job.user_model)
    else:
        schemes.copy_float_weights(stage_model, carried.float_model)
        carried.qat_model = stage_model


def _finish(job: _Job, carried: _Carried, recipe, resumed, started: float) -> TrainResult:
    """The trained models saved, the history and run record written (by the chief), the checkpoints gone."""
    run, dist, config = job.run, job.dist, job.config
    out_dir, qat_model, results = run.out_dir, carried.qat_model, carried.results
    qat_path = None
    if qat_model is not None:
        qat_path = run.save_model(qat_model, QAT_NAME)
        run.save_model(carried.float_model, QAT_FLOAT_NAME)
    ranges = quantizer_ranges(qat_model) if qat_model is not None else None
    if not dist.chief:
        run.finish()
        return TrainResult(
            out_dir, None, None, out_dir / "history.json", out_dir / "run.json", tuple(results), ranges=ranges
        )
    write_json_atomic(out_dir / "history.json", {"stages": run.history})
    facts = dict(
        recipe=recipe, hp=job.hp, settings=job.settings, fold_bn=job.fold_bn, qat_model=qat_model,
        initialized=carried.initialized, ranges=ranges, stages=job.stages, dataset=job.dataset, objs=job.objs,
        teacher=carried.teacher, distill_reason=job.distill_reason, results=results, resumed=resumed,
        started=started, augment=job.augment, user_model=job.user_model, qat_path=qat_path,
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
        resumed_from=resumed,
        float_layers=tuple(record["quantization"]["float_layers"]),
        ranges=ranges,
        distribution=record["distribution"],
    )
