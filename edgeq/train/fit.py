"""``train``: the QAT engine chosen for the model, then its FP32 epochs and QAT stages.

Two engines train: ``train.keras3_engine`` (fake quantization on the Keras 3 model itself, no
tf_keras and no TF-MOT imported) and ``train.tfmot_engine`` (TF-MOT on tf_keras; a Keras 3 model is
translated). ``--qat-engine auto``, the default, takes the Keras 3 engine for a Keras 3 model file
whenever it has every option asked for, and TF-MOT otherwise, saying why in the result's note.
"""

from __future__ import annotations

from dataclasses import replace

from edgeq.errors import UsageError
from edgeq.train.config import TrainConfig, TrainResult

__all__ = ["TrainConfig", "TrainResult", "train", "ENGINES"]

ENGINES = ("auto", "keras3", "tfmot")


def train(config: TrainConfig, resume: bool = False, force: bool = False, progress: bool = False) -> TrainResult:
    """FP32 training then QAT, writing models, history and run record to out_dir.

    The engine is ``config.qat_engine``; ``auto`` resolves it (``_engine``). Under ``config.strategy``
    (edgeq.train.distribute) every TF-MOT stage runs in the strategy's scope; in a multi-worker run
    each worker calls this with the same options, and only the chief writes into out_dir.
    """
    if config.qat_engine not in ENGINES:
        raise UsageError(f"--qat-engine {config.qat_engine}: choose one of {', '.join(ENGINES)}")
    engine, prepared, note = _engine(config, resume, force)
    config = replace(config, qat_engine=engine)
    if engine == "keras3":
        from edgeq.train.keras3_engine import train_keras3

        result = train_keras3(config, resume=resume, force=force, progress=progress, prepared=prepared)
    else:
        from edgeq.train.tfmot_engine import train_tfmot

        result = train_tfmot(config, resume=resume, force=force, progress=progress)
    return replace(result, qat_engine=engine, engine_note=note)


def _engine(config: TrainConfig, resume: bool, force: bool):
    """(engine, the Keras 3 engine's checked inputs or None, why) for this run."""
    if config.qat_engine == "tfmot":
        return "tfmot", None, "chosen with --qat-engine tfmot"
    from edgeq.train.keras3_engine import NotOnKeras3, prepare

    if config.qat_engine == "keras3":
        return "keras3", prepare(config, resume, force), "chosen with --qat-engine keras3"
    try:
        return "keras3", prepare(config, resume, force), "a Keras 3 model: trained in Keras 3 itself"
    except NotOnKeras3 as why:
        return "tfmot", None, f"not the Keras 3 engine: {why.reason}"
