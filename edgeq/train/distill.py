"""Label-free QAT: the FP32 model is the teacher, the QAT model learns its outputs.

Most users hold a pretrained model and unlabelled data, not the original training set. QAT
then learns, per output, what the FP32 model answers on the same samples: the KL divergence
to its class probabilities (a softmax head), the cross-entropy to its probabilities (a
sigmoid head) and the squared error to its values (regression, boxes, reconstructions).
The teacher's outputs are computed once, from ``fp32.keras``, so a resumed run and every
stage of a stepped schedule learn the same targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from edgeq.errors import DataError, UsageError
from edgeq.models.compat import keras, tf
from edgeq.train.objectives import Objective

SPLITS = ("train", "val", "test")
NO_LABELS = "the data has no labels"


def softmax_kl(y_true, y_pred):
    """KL divergence between the softmax of teacher and student logits (a logits classifier)."""
    return keras.losses.kl_divergence(tf.nn.softmax(y_true), tf.nn.softmax(y_pred))


def distill_loss(spec, probability: bool):
    """The loss that makes an output match its teacher's: KL on class probabilities, the
    cross-entropy to soft targets on sigmoid outputs, the squared error on values."""
    if spec.kind == "classification" and (int(np.prod(spec.shape)) or 1) > 1:
        return keras.losses.KLDivergence() if probability else softmax_kl
    if spec.kind in ("binary", "multilabel", "detection_scores") or (spec.kind == "classification" and probability):
        return keras.losses.BinaryCrossentropy(from_logits=not probability)
    return "mse"


def loss_name(loss) -> str:
    if isinstance(loss, str):
        return loss
    return getattr(loss, "__name__", None) or type(loss).__name__


def objectives(objs: list[Objective], activations: Mapping[str, str | None]) -> list[Objective]:
    """Each output's distillation objective (the task stays: convert and eval read it); ``activations``:
    the teacher's final activation per output (its ModelSpec's)."""
    return [
        Objective(o.spec, distill_loss(o.spec, activations.get(o.spec.name) in ("softmax", "sigmoid")), 1.0, "distill")
        for o in objs
    ]


def check_dataset(dataset, source: str) -> None:
    """Distillation holds the teacher's outputs beside the samples: in-memory data only."""
    from edgeq.data.splits import Dataset

    if not isinstance(dataset, Dataset):
        raise UsageError(
            f"--distill needs data held in memory (digits, npz:, synthetic:); {source!r} streams from files: "
            "save it as an .npz of x (no y needed) and pass npz:PATH"
        )


def teacher_dataset(teacher, dataset, names: list[str], batch_size: int = 256):
    """``dataset`` with every split's targets replaced by the teacher's outputs, by output name."""
    from edgeq.models.load import keras_outputs_in_order

    updates = {}
    for split in SPLITS:
        x = getattr(dataset, f"x_{split}")
        if dataset.count(split) == 0:
            updates[f"y_{split}"] = {name: np.zeros((0,), np.float32) for name in names}
            continue
        outputs = keras_outputs_in_order(teacher, x, batch_size)
        if len(outputs) != len(names):
            raise DataError(f"the teacher (fp32.keras) gives {len(outputs)} outputs, the QAT model {len(names)}")
        updates[f"y_{split}"] = {name: np.asarray(v, np.float32) for name, v in zip(names, outputs)}
    return replace(dataset, labelled=True, **updates)


def describe(objs: list[Objective], reason: str) -> dict:
    """run.json's record of a distilled QAT: why, from what, and each output's loss."""
    return {
        "teacher": "fp32.keras",
        "reason": reason,
        "losses": {o.spec.name: loss_name(o.loss) for o in objs},
    }
