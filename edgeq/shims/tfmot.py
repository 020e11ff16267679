"""TF-MOT internals (host side): activation ranges over the global batch under tf.distribute.

TF-MOT's activation quantizers update their ranges from the batch a replica sees:
``MovingAverageQuantizer`` (every activation) by an EMA of the batch min/max, and
``AllValuesQuantizer`` (the model's input, ``QuantizeLayer``) by the running min/max.
Split across N replicas, each replica sees 1/N of the global batch: the EMA steps are then
the mean of N per-replica extremes (not the global batch's extreme), and the input range is
a running min/max that only the replica's own share reaches, so replicas disagree with
each other (TF-MOT issue #1068) and with a 1-replica run of the same global batches.

``global_batch_ranges()`` makes both take the min/max of the whole global batch (each
replica's extremes all-gathered across replicas), so every replica applies the same
update a single replica would. TF-MOT calls these functions through its ``quant_ops``
module, and has no public hook for how a range is reduced; that is why this is a shim.
Outside a multi-replica replica context the originals run unchanged.
"""

from __future__ import annotations

import importlib

from edgeq.models.compat import tf

# imported after edgeq.models.compat (which picks the Keras flavour before TensorFlow loads)
quant_ops = importlib.import_module("tensorflow_model_optimization.python.core.quantization.keras.quant_ops")

_ORIGINAL = {"MovingAvgQuantize": quant_ops.MovingAvgQuantize, "AllValuesQuantize": quant_ops.AllValuesQuantize}


def _replicas() -> int:
    context = tf.distribute.get_replica_context()
    if context is None or not tf.distribute.has_strategy():
        return 1
    return int(context.num_replicas_in_sync)


def _global_extremes(inputs, per_channel: bool):
    """min and max of ``inputs`` over the global batch: per tensor, or per last-axis channel."""
    axes = list(range(inputs.shape.rank - 1)) if per_channel else None
    low = tf.math.reduce_min(inputs, axis=axes)
    high = tf.math.reduce_max(inputs, axis=axes)
    context = tf.distribute.get_replica_context()
    low = tf.math.reduce_min(context.all_gather(low[tf.newaxis], axis=0), axis=0)
    high = tf.math.reduce_max(context.all_gather(high[tf.newaxis], axis=0), axis=0)
    return low, high


def _symmetric(low, high, num_bits: int, narrow_range: bool):
    """TF-MOT's symmetric limits (two's complement: the negative side one step longer)."""
    ratio = -1.0 if narrow_range else -((1 << num_bits) - 2) / (1 << num_bits)
    low = tf.math.minimum(low, high / ratio)
    return low, tf.math.maximum(high, low * ratio)


def _moving_avg_quantize(
    inputs,
    min_var,
    max_var,
    per_channel=False,
    ema_decay=0.999,
    name_prefix="MovingAvgQuantize",
    is_training=True,
    num_bits=8,
    narrow_range=False,
    symmetric=False,
):
    rank = inputs.shape.rank
    if not is_training or _replicas() == 1 or (per_channel and rank not in (2, 4)):
        return _ORIGINAL["MovingAvgQuantize"](
            inputs, min_var, max_var, per_channel, ema_decay, name_prefix, is_training, num_bits, narrow_range,
            symmetric,
        )  # fmt: skip
    with tf.name_scope(name_prefix):
        low, high = _global_extremes(inputs, per_channel)
        if symmetric:
            low, high = _symmetric(low, high, num_bits, narrow_range)
        low, high = tf.math.minimum(low, 0.0), tf.math.maximum(high, 0.0)  # TFLite needs 0 in range
        new_min = tf.__internal__.train.assign_moving_average(min_var, low, ema_decay, zero_debias=False)
        new_max = tf.__internal__.train.assign_moving_average(max_var, high, ema_decay, zero_debias=False)
        return quant_ops._FakeQuantWithMinMaxVars(  # noqa: SLF001
            inputs, new_min, new_max, per_channel=per_channel, num_bits=num_bits, narrow_range=narrow_range
        )


def _all_values_quantize(
    inputs,
    min_var,
    max_var,
    name_prefix="AllValuesQuantize",
    is_training=True,
    num_bits=8,
    narrow_range=False,
    symmetric=False,
):
    if not is_training or _replicas() == 1:
        return _ORIGINAL["AllValuesQuantize"](
            inputs, min_var, max_var, name_prefix, is_training, num_bits, narrow_range, symmetric
        )
    with tf.name_scope(name_prefix):
        low, high = _global_extremes(inputs, per_channel=False)
        if symmetric:
            low, high = _symmetric(low, high, num_bits, narrow_range)
        new_min = min_var.assign(tf.math.minimum(tf.math.minimum(min_var, low), 0.0))
        new_max = max_var.assign(tf.math.maximum(tf.math.maximum(max_var, high), 0.0))
        return quant_ops._FakeQuantWithMinMaxVars(  # noqa: SLF001
            inputs, new_min, new_max, per_channel=False, num_bits=num_bits, narrow_range=narrow_range
        )


DESCRIPTION = (
    "global-batch min/max (each replica's extremes all-gathered) in TF-MOT's moving-average and all-values "
    "range updates: edgeq's fix for per-replica ranges (TF-MOT #1068)"
)


def global_batch_ranges(enabled: bool = True) -> None:
    """Install (or, with ``enabled=False``, remove) the global-batch range updates."""
    quant_ops.MovingAvgQuantize = _moving_avg_quantize if enabled else _ORIGINAL["MovingAvgQuantize"]
    quant_ops.AllValuesQuantize = _all_values_quantize if enabled else _ORIGINAL["AllValuesQuantize"]
