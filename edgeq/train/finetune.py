"""How QAT fine-tunes, with labels or from its teacher: one schedule.

- **Inference mode** (``--qat-bn frozen``, the default): every BatchNormalization normalises with
  the FP32 model's moving statistics, which stay as they are (as PyTorch's ``freeze_bn_stats``: its
  gamma and beta still learn where TF-MOT wraps the layer, since the wrapper lists them as its own),
  and every Dropout (EfficientNet's stochastic depth too) is off. The forward pass QAT trains is
  then the function that is converted and deployed. In training mode (``--qat-bn batch``, TF-MOT's
  way) it is another one: a student distilled from a trained EfficientNetB0 learned its teacher's
  answers with batch statistics and dropout, and lost 6.2 pp of test accuracy (76.5% agreement)
  when it ran with its moving statistics; in inference mode, 0.2 pp (88.1%).
- **The best epoch is kept**: after each epoch QAT is judged on val (a distilled model by top-1
  agreement with its teacher, or its output error against the teacher's; a distilled model's
  start included), and the best weights are the stage's result (one labelled epoch: nothing to
  choose between, no judging). A distilled model that matches its teacher on
  val (``MATCHED``) stops there: it has nothing left to learn from it.
"""

from __future__ import annotations

import logging
import math

from edgeq.models.compat import keras

log = logging.getLogger("edgeq")

MATCHED = 0.995  # a distilled classifier's val agreement with its teacher at which QAT stops


def frozen_for_qat(model):
    """Put ``model``'s BatchNormalization layers in inference mode (not trainable: their moving statistics
    stay the FP32 model's) and its Dropout layers off. Returns what undoes it, to call
    before the model is saved or its weights are copied (both read the layers' weight order)."""
    undo = []
    for layer in _layers(model):
        inner = getattr(layer, "layer", layer)  # TF-MOT's QuantizeWrapper holds the layer it quantizes
        if isinstance(inner, keras.layers.BatchNormalization) and layer.trainable:
            layer.trainable = False
            undo.append(lambda layer=layer: setattr(layer, "trainable", True))
        elif isinstance(inner, keras.layers.Dropout) and isinstance(inner.rate, (int, float)) and inner.rate > 0:
            rate, inner.rate = inner.rate, 0.0
            undo.append(lambda inner=inner, rate=rate: setattr(inner, "rate", rate))
    if undo:
        log.info("QAT fine-tunes in inference mode: %d BatchNormalization/Dropout layers frozen", len(undo))

    def restore() -> None:
        for step in undo:
            step()

    return restore


def _layers(model):
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            yield from _layers(layer)
        else:
            yield layer


class KeepBest(keras.callbacks.Callback):
    """Judge on val after each epoch (and before the first); keep the best weights; stop at a match.

    ``judge(model) -> (metric, value)``; ``higher``: whether a larger value is better (None: the
    metric's row says); ``matched``: a value at which training stops (a distilled model's agreement
    with its teacher), or None.
    """

    def __init__(self, judge, higher: bool | None = None, matched: float | None = None, from_start: bool = True):
        super().__init__()
        self.judge, self.higher, self.matched, self.from_start = judge, higher, matched, from_start
        self.best: float | None = None
        self.best_epoch = self.last_epoch = -1
        self.weights = None
        self.trail: list[float] = []

    def _consider(self, epoch: int) -> float:
        name, value = self.judge(self.model)
        if self.higher is None:
            from edgeq.tasks.metrics import metric

            self.higher = metric(name).higher_is_better
        self.trail.append(value)
        self.last_epoch = epoch
        # a later epoch wins a tie: as good on val, and its ranges have seen more batches
        better = self.best is None or (value >= self.best if self.higher else value <= self.best)
        if math.isfinite(value) and better:
            self.best, self.best_epoch, self.weights = value, epoch, self.model.get_weights()
        return value

    def on_train_begin(self, logs=None):
        if self.from_start:
            self._consider(self.params.get("initial_epoch", 0) if self.params else 0)

    def on_epoch_end(self, epoch, logs=None):
        value = self._consider(epoch + 1)
        if logs is not None:
            logs["val_judged"] = value
        if self.matched is not None and math.isfinite(value) and value >= self.matched:
            log.info("QAT matched its teacher on val (%.4f) after epoch %d: stopping", value, epoch + 1)
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.weights is not None and self.best_epoch != self.last_epoch:
            log.info("QAT keeps its weights after epoch %d (val %.4f; after epoch %d, %.4f)", self.best_epoch,
                     self.best, self.last_epoch, self.trail[-1])  # fmt: skip
            self.model.set_weights(self.weights)
