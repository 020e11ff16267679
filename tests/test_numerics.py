"""Property tests of the precision engine (numpy only)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from edgeq.quantize.numerics import (
    QuantSpec,
    compute_params,
    dequantize,
    fake_quantize,
    pack_int4,
    quantize,
    sqnr_db,
    unpack_int4,
)

finite = st.floats(-100, 100, allow_nan=False, allow_infinity=False, width=32)
tensors = arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 6)), elements=finite)
specs = st.builds(
    QuantSpec,
    bits=st.integers(2, 8),
    symmetric=st.booleans(),
    narrow_range=st.booleans(),
    axis=st.sampled_from([None, 0, 1, -1]),
)


@given(tensors, specs)
@settings(max_examples=200, deadline=None)
def test_nearest_rounding_error_is_at_most_half_a_step_inside_the_range(x, spec):
    params = compute_params(x, spec)
    q = quantize(x, params)
    assert q.min() >= spec.qmin and q.max() <= spec.qmax
    err = np.abs(dequantize(q, params) - x)
    assert np.all(err <= params.scale / 2 * (1 + 1e-4) + 1e-5)


@given(st.floats(-3, 3, allow_nan=False), st.integers(2, 8))
@settings(max_examples=50, deadline=None)
def test_stochastic_rounding_is_unbiased(value, bits):
    spec = QuantSpec(bits=bits, symmetric=True, rounding="stochastic")
    params = compute_params(np.array([-4.0, 4.0]), QuantSpec(bits=bits, symmetric=True))
    params = type(params)(params.scale, params.zero_point, spec)
    x = np.full(20000, value)
    mean = dequantize(quantize(x, params, np.random.default_rng(0)), params).mean()
    assert abs(mean - value) <= 0.03 * params.scale.item() * 2 ** (bits - 1) / 4 + 4 * params.scale.item() / np.sqrt(
        20000
    )
    nearest = dequantize(quantize(x, type(params)(params.scale, params.zero_point, QuantSpec(bits=bits))), params)
    assert np.unique(nearest).size == 1  # deterministic: one value for one input


@given(arrays(np.int8, st.integers(0, 65), elements=st.integers(-8, 7)))
def test_int4_pack_then_unpack_is_the_identity(q):
    packed = pack_int4(q)
    assert packed.size == (q.size + 1) // 2
    assert np.array_equal(unpack_int4(packed, q.size), q)


@given(
    arrays(np.float32, st.tuples(st.integers(2, 8), st.integers(1, 5)), elements=finite),
    st.integers(2, 8),
    st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_per_channel_error_is_within_the_per_tensor_bound(x, bits, symmetric):
    """Every channel's step is at most the tensor's, so its worst error is too."""
    tensor_params = compute_params(x, QuantSpec(bits=bits, symmetric=symmetric))
    per_channel = fake_quantize(x, QuantSpec(bits=bits, symmetric=symmetric, axis=0))
    assert np.max(np.abs(per_channel - x)) <= tensor_params.scale.item() / 2 * (1 + 1e-4) + 1e-5


def test_per_channel_mse_is_lower_on_weights_with_unequal_channel_ranges():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 3, 16, 32)) * rng.uniform(0.05, 2.0, size=32)  # output channels on the last axis
    for bits in (4, 8):
        for symmetric in (True, False):
            t = fake_quantize(w, QuantSpec(bits=bits, symmetric=symmetric))
            c = fake_quantize(w, QuantSpec(bits=bits, symmetric=symmetric, axis=-1))
            assert np.mean((c - w) ** 2) < np.mean((t - w) ** 2)


def test_int4_symmetric_takes_at_most_16_levels_and_narrow_range_15():
    x = np.random.default_rng(0).normal(size=(64, 9))
    assert np.unique(quantize(x, compute_params(x, QuantSpec(bits=4)))).size <= 16
    assert np.unique(quantize(x, compute_params(x, QuantSpec(bits=4, narrow_range=True)))).size <= 15


def test_stochastic_rounding_is_seeded():
    x = np.random.default_rng(1).normal(size=100)
    spec = QuantSpec(bits=4, rounding="stochastic")
    assert np.array_equal(fake_quantize(x, spec, seed=3), fake_quantize(x, spec, seed=3))
    assert not np.array_equal(fake_quantize(x, spec, seed=3), fake_quantize(x, spec, seed=4))


def test_int4_weight_copy_of_a_depthwise_conv_is_per_channel():
    """Each of the (C, multiplier) channels gets its own 4-bit scale, not one per multiplier column."""
    import edgeq.models.compat  # noqa: F401  (the Keras flavour first)
    from edgeq.models.compat import keras
    from edgeq.transforms.int4 import int4_weight_copy

    inputs = keras.Input((6, 6, 4))
    model = keras.Model(inputs, keras.layers.DepthwiseConv2D(3, name="dw")(inputs))
    kernel = np.random.default_rng(0).normal(0, 1, size=(3, 3, 4, 1)).astype("float32")
    kernel[..., 0, 0] *= 100.0  # one channel far larger than the others
    model.get_layer("dw").set_weights([kernel, np.zeros(4, "float32")])
    copy = int4_weight_copy(model, ["dw"]).get_layer("dw").get_weights()[0]
    for c in range(4):
        levels = np.unique(np.round(copy[..., c, 0] / (np.abs(kernel[..., c, 0]).max() / 7)))
        assert len(levels) >= 5, c  # per tensor, the small channels would all collapse to 0


def test_sensitivity_reports_the_mean_channel_sqnr_and_the_worst_channel():
    from edgeq.quantize.calibration import _channel_sqnr, _mean_channel_sqnr, _worst_channel_sqnr

    rng = np.random.default_rng(0)
    f = rng.normal(0, 1, size=(256, 4))
    noise = np.array([0.001, 0.01, 0.1, 1.0])  # per-channel SQNR about 60, 40, 20 and 0 dB
    q = f + rng.normal(0, 1, size=f.shape) * noise
    per_channel = [sqnr_db(f[:, c], q[:, c]) for c in range(4)]  # the SQNR convert and eval print
    assert _mean_channel_sqnr(f, q, 1.0, 0.0) == pytest.approx(np.mean(per_channel))
    assert _channel_sqnr(f, q, 1.0, 0.0) == pytest.approx(np.median(per_channel))  # the ranking, documented so
    assert _worst_channel_sqnr(f, q, 1.0, 0.0) == pytest.approx(min(per_channel)) and min(per_channel) < 2.0


def test_one_sqnr_for_a_tensor_whatever_measures_it():
    """analyze's per-channel SQNR of a one-channel tensor is convert's and eval's SQNR of it: one
    definition (signal energy over noise energy), an offset counts as signal, nothing is capped."""
    from edgeq.quantize.calibration import _channel_sqnr

    rng = np.random.default_rng(1)
    f = 5.0 + rng.normal(0, 1, size=(512, 1))  # a channel with an offset
    q = f + rng.normal(0, 0.05, size=f.shape)
    assert _channel_sqnr(f, q, 1.0, 0.0) == pytest.approx(sqnr_db(f, q))
    assert _channel_sqnr(f, f, 1.0, 0.0) == sqnr_db(f, f) == float("inf")  # lossless: not 100 dB
    dead = np.concatenate([f, np.zeros_like(f)], axis=1)  # an all-zero channel carries nothing to lose
    assert _channel_sqnr(dead, np.concatenate([q, np.zeros_like(q)], axis=1), 1.0, 0.0) == pytest.approx(sqnr_db(f, q))


def test_bias_correction_leaves_the_layers_a_plan_keeps_float():
    import edgeq.models.compat  # noqa: F401  (the Keras flavour first)
    from edgeq.models.compat import keras
    from edgeq.transforms.bias_correction import correct_biases

    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    outputs = keras.layers.Dense(3, name="head")(keras.layers.Flatten()(x))
    model = keras.Model(inputs, outputs)
    before = {name: model.get_layer(name).get_weights()[1].copy() for name in ("conv", "head")}
    x = np.random.default_rng(0).uniform(0.5, 1.0, size=(32, 6, 6, 2)).astype("float32")
    shifts = correct_biases(model, x, per_tensor=True, keep=frozenset({"head"}))
    assert [s.layer for s in shifts] == ["conv"]
    np.testing.assert_array_equal(model.get_layer("head").get_weights()[1], before["head"])
    assert np.any(model.get_layer("conv").get_weights()[1] != before["conv"])


def test_bn_folding_leaves_a_shared_layer_alone_and_folds_the_rest():
    import edgeq.models.compat  # noqa: F401  (the Keras flavour first)
    from edgeq.models.compat import keras
    from edgeq.transforms.fold import fold_batchnorm

    L = keras.layers
    a, b = keras.Input((6, 6, 2)), keras.Input((6, 6, 2))
    shared = L.Conv2D(2, 3, padding="same", name="shared")
    twice = L.BatchNormalization(name="bn_twice")  # one BN applied to two tensors
    x, y = twice(shared(a)), twice(shared(b))
    z = L.BatchNormalization(name="bn_own")(L.Conv2D(2, 3, padding="same", name="own")(a))
    model = keras.Model([a, b], L.Add()([x, y, z]))
    rng = np.random.default_rng(0)
    for bn in ("bn_twice", "bn_own"):
        layer = model.get_layer(bn)
        layer.set_weights([rng.uniform(0.5, 2, 2), rng.normal(0, 1, 2), rng.normal(0, 1, 2), rng.uniform(0.5, 2, 2)])
    folded = fold_batchnorm(model)  # used to raise a bare ValueError on the shared conv
    names = [la.name for la in folded.layers]
    assert "bn_own" not in names and "bn_twice" in names
    inputs = [rng.normal(0, 1, size=(4, 6, 6, 2)).astype("float32") for _ in range(2)]
    np.testing.assert_allclose(folded.predict(inputs, verbose=0), model.predict(inputs, verbose=0), atol=1e-5)
