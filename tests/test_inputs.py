"""One input contract: the same raw or float file gives the same model inputs in every consumer.

digits as users have it: raw pixels 0..16 (uint8) and the float samples the model was
trained on (raw / 16), fed to eval, profile --data, verify, calibration and the device's
reader, against the int8-only model whose manifest records the normalisation.
"""

import numpy as np
import pytest

from edgeq.errors import DataError
from edgeq.runtime.inputs import Normalization, float_samples, model_inputs, quantize_input
from tests.conftest import assert_one_line_error


@pytest.fixture(scope="module")
def digits_files(tmp_path_factory):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    raw = bunch.images.astype(np.uint8)[..., None]  # 0..16
    folder = tmp_path_factory.mktemp("inputs")
    files = {
        "raw": (raw, folder / "raw.npz"),
        "float": ((raw / 16.0).astype(np.float32), folder / "float.npz"),
        "unnormalised": (raw.astype(np.float32), folder / "unnormalised.npz"),  # 0..16 floats: a mistake
    }
    for x, path in files.values():
        np.savez(path, x=x, y=bunch.target)
    return {name: path for name, (_, path) in files.items()}


def test_quantize_rounds_as_litert_itself_does(digits_run, tmp_path):
    """edgeq's quantization of a float input equals the QUANTIZE op of LiteRT's default kernels,
    exact halves included (to even); LiteRT's reference kernel rounds halves away from zero."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert

    out = tmp_path / "float_io.tflite"
    convert(digits_run.fp32_model, out, ConvertOptions(mode="int8", calib="digits"))

    def litert(resolver, values):
        interpreter = Interpreter(
            model_path=str(out), experimental_preserve_all_tensors=True, experimental_op_resolver_type=resolver
        )
        interpreter.allocate_tensors()
        (inp,) = interpreter.get_input_details()
        op = next(op for op in interpreter._get_ops_details() if op["op_name"] == "QUANTIZE")
        detail = interpreter._get_tensor_details(op["outputs"][0], 0)
        got = []
        for sample in values.reshape(-1, *inp["shape"][1:]):
            interpreter.set_tensor(inp["index"], sample[None])
            interpreter.invoke()
            got.append(interpreter.get_tensor(op["outputs"][0]).copy())
        return np.concatenate(got).ravel(), detail["quantization"]

    n = 64  # one 8x8x1 sample
    probe, (scale, zero_point) = litert(OpResolverType.AUTO, np.zeros(n, np.float32))
    halves = (np.arange(-20, 300) + 0.5).astype(np.float32) * np.float32(scale)
    halves = halves[(halves / np.float32(scale)) % 1 == 0.5]
    values = np.concatenate([halves, np.random.default_rng(0).uniform(-0.2, 1.2, 4000).astype(np.float32)])
    values = np.resize(values, (len(values) + n - 1) // n * n)
    assert len(halves) > 50
    ours = quantize_input(values, "int8", scale, zero_point)
    default, _ = litert(OpResolverType.AUTO, values)
    np.testing.assert_array_equal(ours, default)
    reference, _ = litert(OpResolverType.BUILTIN_REF, values)
    differ = ours != reference
    assert differ.any() and np.all(np.isin(values[differ], halves))  # only exact halves round differently


def _inputs_of_every_consumer(model_path, run_qat_model, data_file):
    """The model-input bytes each consumer would feed for ``data_file`` (test split where it splits)."""
    from edgeq.convert.converter import _calibration
    from edgeq.data.sources import load_dataset
    from edgeq.fleet.remote import quantized_inputs
    from edgeq.profile.samples import load_npz
    from edgeq.runtime.inputs import normalization_beside
    from edgeq.runtime.interpreter import TFLiteModel, quantize

    model = TFLiteModel(model_path)
    info = model.input
    shape = tuple(info.shape[1:])
    evaluated = load_dataset(f"npz:{data_file}", shape, normalization=normalization_beside(model_path))
    from edgeq.models.load import describe, load_user_model

    source = describe(load_user_model(run_qat_model), run_qat_model)
    calibration, _ = _calibration(source, f"npz:{data_file}", 64, True, [])
    return {
        "eval": quantize(evaluated.x_test, info),
        "profile --data (host and device)": quantize(
            load_npz(data_file, info, normalization=normalization_beside(model_path)).x, info
        ),
        "verify": quantized_inputs(model, data_file)[model.input_names[0]],
        "calibration": quantize(calibration.x_train, info),
    }


def test_raw_uint8_and_float_files_give_the_same_model_inputs_everywhere(digits_run, digits_int8, digits_files):
    import json

    manifest = json.loads(digits_int8.manifest.read_text())
    assert manifest["normalization"] == {"scale": 1 / 16, "offset": 0.0, "raw_max": 16.0, "raw_dtype": "uint8"}
    assert manifest["input_rounding"] == "nearest, halves to even"
    raw = _inputs_of_every_consumer(digits_int8.path, digits_run.qat_model, digits_files["raw"])
    flt = _inputs_of_every_consumer(digits_int8.path, digits_run.qat_model, digits_files["float"])
    for consumer in raw:
        assert raw[consumer].dtype == np.int8, consumer
        assert raw[consumer].tobytes() == flt[consumer].tobytes(), consumer
    assert raw["eval"].min() == -128 and raw["eval"].max() == 127  # 0 and 16 are the ends of the input range


def test_eval_and_profile_give_the_same_numbers_for_raw_and_float_files(cli, digits_run, digits_int8, digits_files):
    from edgeq.evaluate.run import evaluate
    from edgeq.profile.run import profile_model

    raw = evaluate(digits_int8.path, digits_run.fp32_model, f"npz:{digits_files['raw']}")
    flt = evaluate(digits_int8.path, digits_run.fp32_model, f"npz:{digits_files['float']}")
    assert (raw.value, raw.sqnr_db, raw.agreement) == (flt.value, flt.sqnr_db, flt.agreement)
    assert raw.value > 0.9
    p_raw = profile_model(digits_int8.path, runs=1, warmup=0, data=digits_files["raw"])
    p_flt = profile_model(digits_int8.path, runs=1, warmup=0, data=digits_files["float"])
    assert p_raw.model.scores.value == p_flt.model.scores.value > 0.9


@pytest.mark.parametrize("command", ["eval", "profile", "verify-inputs"])
def test_float_file_in_the_wrong_units_is_one_line_error(cli, digits_run, digits_int8, digits_files, command):
    """0..16 floats for a model trained on 0..1: refused with the fix, never quantized to garbage."""
    bad = digits_files["unnormalised"]
    if command == "eval":
        result = cli("eval", digits_int8.path, "--reference", digits_run.fp32_model, "--data", f"npz:{bad}")
        assert_one_line_error(result, "trained on [0, 1]", "uint8")
    elif command == "profile":
        result = cli("profile", digits_int8.path, "--data", bad, "--runs", "1", "--warmup", "0")
        assert_one_line_error(result, "trained on [0, 1]", "uint8")
    else:
        from edgeq.fleet.remote import quantized_inputs
        from edgeq.runtime.interpreter import TFLiteModel

        with pytest.raises(DataError, match=r"trained on \[0, 1\]"):
            quantized_inputs(TFLiteModel(digits_int8.path), bad)


def test_contract_edges():
    digits = Normalization(scale=1 / 16, raw_max=16)
    with pytest.raises(DataError, match=r"reach 255.*\[0, 16\]"):
        float_samples(np.array([[0, 255]], np.uint8), digits, "x.npz")
    with pytest.raises(DataError, match="NaN or infinity"):
        float_samples(np.array([[0.0, np.nan]], np.float32), digits, "x.npz")
    with pytest.raises(DataError, match="dtype is int8"):  # codes: only where an int8 input reads them
        float_samples(np.array([[1, 2]], np.int8), digits, "x.npz")
    # other integers are float samples stored as integers, checked against the float range
    np.testing.assert_array_equal(float_samples(np.array([[0, 1]], np.int32), digits, "x"), [[0.0, 1.0]])
    # uint8 without a recorded normalisation: 8-bit images, 0..255 -> 0..1
    np.testing.assert_allclose(float_samples(np.array([[0, 255]], np.uint8), None, "x"), [[0.0, 1.0]])
    # int8 codes pass unchanged into an int8 input, and are refused by a uint8 one
    codes = np.array([[-128, 0, 127]], np.int8)
    assert model_inputs(codes, "int8", 0.1, 3, digits, "x").tobytes() == codes.tobytes()
    with pytest.raises(DataError, match="codes of an int8 model input"):
        model_inputs(codes, "uint8", 0.1, 3, digits, "x")


def test_one_npz_means_the_same_on_the_host_and_on_the_device(digits_int8, digits_files, tmp_path):
    """int8 codes of the model's input, float samples stored as int16, one-hot labels and (N, H, W)
    grey images: the host's reader (eval, calibration) and the device's (profile, verify) take
    each file the same way, sample for sample (before, the host read int8 codes as float values
    and crashed on one-hot labels, while the device took both)."""
    from edgeq.data.sources import load_dataset
    from edgeq.profile.samples import load_npz as device_reader
    from edgeq.runtime.inputs import normalization_beside
    from edgeq.runtime.interpreter import TFLiteModel

    model = TFLiteModel(digits_int8.path)
    inp = model.input
    with np.load(digits_files["raw"]) as npz:
        raw, y = npz["x"], npz["y"]
    files = {
        "codes": (quantize_input(raw / np.float32(16), "int8", inp.scale, inp.zero_point), y),
        "int16": ((raw > 8).astype(np.int16), y),
        "onehot": (raw, np.eye(10, dtype=np.float32)[y]),
        "grey": (raw[..., 0], y),
    }
    for name, (x, labels) in files.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, x=x, y=labels)
        host = load_dataset(
            f"npz:{path}",
            input_shape=(8, 8, 1),
            normalization=normalization_beside(digits_int8.path),
            int8_input=(inp.scale, inp.zero_point),
        )
        device = device_reader(path, inp, normalization=normalization_beside(digits_int8.path))
        host_rows = sorted(
            (row.tobytes(), int(label)) for split in ("train", "val", "test") for row, label in zip(*host.split(split))
        )
        device_rows = sorted((row.tobytes(), int(label)) for row, label in zip(device.x, device.y))
        assert host_rows == device_rows, name
