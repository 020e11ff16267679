"""What each output of a model trains towards: its loss, its Keras metric, its targets.

The task table (edgeq.tasks.table) says what an output is; this module turns that into a Keras
compile (a loss and a metric per output, in the model's output order, so that TF-MOT's
renamed QAT layers still match), honours the loss a user's model file was compiled with,
and says which array each output learns from: its targets, or for an autoencoder its input.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from edgeq.errors import DataError, UsageError
from edgeq.models.compat import keras, tf
from edgeq.models.spec import ModelSpec
from edgeq.tasks.table import OutputSpec, task

log = logging.getLogger(__name__)


def masked_l1(y_true, y_pred):
    """L1 between a box head and its targets where the target's last channel (the mask) is 1:
    only the cells that hold an object's centre learn a box (edgeq.tasks.detection.encode_centre)."""
    mask = y_true[..., -1:]
    error = tf.abs(y_true[..., :-1] - y_pred) * mask
    return tf.reduce_sum(error) / tf.maximum(tf.reduce_sum(mask), 1.0)


def focal():
    """Per-class sigmoid focal loss for a centre heatmap: most cells hold no object."""
    return keras.losses.BinaryFocalCrossentropy(gamma=2.0, apply_class_balancing=True, alpha=0.75)


@dataclass(frozen=True)
class Objective:
    """One output's training: the spec, the Keras loss (a name or object), its weight, where its loss came from."""

    spec: OutputSpec
    loss: object
    weight: float = 1.0
    source: str = "task"  # "task" | "model file" | "--loss"

    def to_dict(self) -> dict:
        loss = self.loss if isinstance(self.loss, str) else type(self.loss).__name__
        return {**self.spec.to_dict(), "loss": loss, "loss_weight": self.weight, "loss_source": self.source}


def _loss_object(entry, from_logits: bool):
    """A Keras (tf_keras) loss from a config entry: a name, or a serialized loss of either Keras."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict):
        name = entry.get("class_name") or entry.get("registered_name")
        config = entry.get("config") or {}
        if isinstance(config, str):  # Keras 3 serializes a function loss as {"config": "mse", ...}
            return config
        try:
            return keras.losses.get({"class_name": name, "config": {k: v for k, v in config.items() if k != "fn"}})
        except (ValueError, TypeError):
            return keras.losses.get(name)
    raise ValueError(f"unreadable loss {entry!r}")


def _per_output(value, names: list[str]) -> list | None:
    """A compile-config entry (one for all, a list in output order, a dict by name) per output."""
    if value is None:
        return None
    if isinstance(value, dict) and not ("class_name" in value or "module" in value):
        return [value.get(n) for n in names]
    if isinstance(value, (list, tuple)):
        return list(value) if len(value) == len(names) else None
    return [value] * len(names)


def _default_loss(spec: OutputSpec, probability: bool):
    kind = spec.kind
    if kind == "detection_boxes":
        return masked_l1
    if kind == "detection_scores":
        return focal()
    if kind == "classification":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=not probability)
    if kind in ("binary", "multilabel"):
        return keras.losses.BinaryCrossentropy(from_logits=not probability)
    return task(kind).loss


def objectives(described: ModelSpec, specs: list[OutputSpec], loss_option: str | None = None) -> list[Objective]:
    """Each output's loss: ``--loss`` wins, then the model file's compile config, then the task table's."""
    activations = described.activations
    names = [s.name for s in specs]
    given = _parse_loss_option(loss_option, names)
    compiled = described.compile_config
    losses = _per_output(compiled.get("loss"), names) or [None] * len(names)
    weights = _per_output(compiled.get("loss_weights"), names) or [1.0] * len(names)
    result = []
    for spec, from_file, weight in zip(specs, losses, weights):
        probability = activations.get(spec.name) in ("softmax", "sigmoid")
        if spec.name in given:
            result.append(Objective(spec, given[spec.name], 1.0, "--loss"))
            continue
        if from_file is not None:
            try:
                loss = _loss_object(from_file, not probability)
                result.append(Objective(spec, loss, float(weight if weight is not None else 1.0), "model file"))
                continue
            except ValueError as exc:
                log.warning("%s: the loss in the model file (%s) is not usable (%s): the task's instead", spec.name,
                            from_file, exc)  # fmt: skip
        result.append(Objective(spec, _default_loss(spec, probability)))
    return result


def _parse_loss_option(text: str | None, names: list[str]) -> dict[str, str]:
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(names, text.strip())
    out = {}
    for item in text.split(","):
        name, _, loss = item.partition("=")
        if name.strip() not in names:
            raise UsageError(f"--loss names output {name.strip()!r}; the model's outputs are {', '.join(names)}")
        out[name.strip()] = loss.strip()
    return out


def compile_for(model, objs: list[Objective], optimizer) -> None:
    """Compile ``model`` (float or its QAT form: outputs in the same order) with one loss per output."""
    losses = [o.loss for o in objs]
    # a distilled output learns the teacher's scores: a class metric would read them as labels
    metrics = [
        [task(o.spec.kind).keras_metric] if task(o.spec.kind).keras_metric and o.source != "distill" else []
        for o in objs
    ]
    if len(objs) == 1:
        model.compile(optimizer=optimizer, loss=losses[0], metrics=metrics[0])
        return
    model.compile(optimizer=optimizer, loss=losses, loss_weights=[o.weight for o in objs], metrics=metrics)


def target_plan(objs: list[Objective], dataset) -> list[str | None]:
    """Where each output's training targets come from: "input" (an autoencoder), an output name
    (``y_<name>``), or None (the data's one ``y``)."""
    plan = []
    y = dataset.y_train
    for o in objs:
        if o.spec.kind == "reconstruction":
            if isinstance(dataset.x_train, dict):
                raise UsageError(f"output {o.spec.name!r} reconstructs its input, but the model has several inputs")
            plan.append("input")
        elif isinstance(y, dict):
            if o.spec.name not in y:
                raise DataError(
                    f"data {dataset.source!r} has no targets for output {o.spec.name!r} (it has "
                    f"{', '.join('y_' + k for k in y)}): save them as y_{o.spec.name}"
                )
            plan.append(o.spec.name)
        elif not dataset.labelled:
            raise DataError(
                f"data {dataset.source!r} has no labels for output {o.spec.name!r} ({o.spec.kind}): save them as 'y'"
            )
        else:
            if len(objs) > 1:
                raise DataError(
                    f"data {dataset.source!r} has one 'y' for a model with {len(objs)} outputs: save y_<output name> "
                    f"for each of {', '.join(x.spec.name for x in objs)}"
                )
            plan.append(None)
    return plan


def with_detection_targets(objs: list[Objective], dataset):
    """A detection dataset (gt_boxes, gt_classes) with each head's training targets added, by output
    name: the score head's centre heatmap and the box head's (dy, dx, h, w, mask), on its grid."""
    from dataclasses import replace

    from edgeq.tasks.detection import encode_centre

    kinds = {o.spec.kind: o.spec for o in objs}
    if "detection_boxes" not in kinds:
        return dataset
    boxes, scores = kinds["detection_boxes"], kinds["detection_scores"]
    y = dataset.y_train
    if not isinstance(y, dict) or "gt_boxes" not in y:
        raise DataError(
            f"data {dataset.source!r} has no detection ground truth: give gt_boxes (N, M, 4) normalised "
            "(ymin, xmin, ymax, xmax) and gt_classes (N, M), -1 for unused rows (e.g. --data shapes)"
        )
    if len(boxes.shape) != 3:
        raise UsageError(f"edgeq trains the centre layout (S, S, 4) box heads; {boxes.name!r} is {boxes.shape}")
    grid, classes = tuple(boxes.shape[:2]), int(scores.shape[-1])
    updates = {}
    for split in ("train", "val", "test"):
        truth = getattr(dataset, f"y_{split}")
        heat, target = encode_centre(truth["gt_boxes"], truth["gt_classes"], grid, classes)
        updates[f"y_{split}"] = {**truth, scores.name: heat, boxes.name: target}
    return replace(dataset, **updates)


def check_targets(objs: list[Objective], dataset) -> None:
    """Each output's targets fit it: class ids below its class count, float targets of its shape."""
    for o, where in zip(objs, target_plan(objs, dataset)):
        if where == "input":
            shape = tuple(dataset.input_shape)
            if tuple(o.spec.shape) != shape:
                raise DataError(
                    f"output {o.spec.name!r} reconstructs the input, but its shape {tuple(o.spec.shape)} is not the "
                    f"input's {shape}"
                )
            continue
        y = dataset.y_train if where is None else dataset.y_train[where]
        y = np.asarray(y)
        kind = o.spec.kind
        if kind.startswith("detection"):
            continue  # made for the head by with_detection_targets
        if kind == "classification":
            classes = int(np.prod(o.spec.shape))
            if not np.issubdtype(y.dtype, np.integer):
                raise DataError(f"output {o.spec.name!r} is a classifier, but its targets are float; give class ids")
            if where is None and dataset.num_classes and dataset.num_classes != classes:
                raise DataError(
                    f"data {dataset.source!r} has {dataset.num_classes} classes but the model outputs {classes}: "
                    "use matching data or a model with that many outputs"
                )
            if y.size and int(y.max()) >= classes:
                raise DataError(
                    f"data {dataset.source!r} has {int(y.max()) + 1} classes but the model's output "
                    f"{o.spec.name!r} has {classes}: use matching data or a model with that many outputs"
                )
        elif kind in ("regression", "multilabel", "binary"):
            per_sample = int(np.prod(y.shape[1:])) if y.ndim > 1 else 1
            if per_sample != int(np.prod(o.spec.shape) or 1):
                raise DataError(
                    f"output {o.spec.name!r} gives {int(np.prod(o.spec.shape))} value(s) per sample, its targets "
                    f"{per_sample}: save targets of the output's shape {tuple(o.spec.shape)}"
                )
