"""Property tests of the precision engine (numpy only)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from edgeq.numerics import QuantSpec, compute_params, dequantize, fake_quantize, pack_int4, quantize, unpack_int4

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
