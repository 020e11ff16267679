"""Each QAT option a user can switch on, measured on the real digits model."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from edgeq.convert.options import ConvertOptions
from edgeq.convert.run import convert
from edgeq.data.sources import load_dataset
from edgeq.models.compat import keras, tf
from edgeq.models.load import load_keras_model
from edgeq.runtime.interpreter import TFLiteModel
from edgeq.train.config import TrainConfig
from edgeq.train.fit import train
from edgeq.train.stages import _compile
from tests.conftest import assert_one_line_error


@pytest.fixture(scope="module")
def w4_run(digits_run, tmp_path_factory):
    """4-bit-weight QAT fine-tuned from the trained FP32 digits model."""
    out = tmp_path_factory.mktemp("w4") / "run"
    return train(
        TrainConfig(
            model=str(digits_run.fp32_model), data="digits", out_dir=str(out), epochs=0, qat_epochs=4, weight_bits=4
        )
    )


def _per_channel_levels(kernel, lo, hi, bits):
    q = tf.quantization.fake_quant_with_min_max_vars_per_channel(
        tf.reshape(kernel, (-1, kernel.shape[-1])), lo, hi, num_bits=bits, narrow_range=True
    ).numpy()
    return max(len(np.unique(q[:, c])) for c in range(q.shape[-1]))


def test_4bit_weights_qat_is_within_2_points_of_fp32_on_keras_and_tflite(digits_run, w4_run, tmp_path):
    d = load_dataset("digits")
    fp32_acc = digits_run.stages[0].test_value
    qat = load_keras_model(w4_run.qat_model)
    keras_acc = float(np.mean(qat.predict(d.x_test, verbose=0).argmax(1) == d.y_test))
    assert keras_acc >= fp32_acc - 0.02
    tfl = convert(w4_run.qat_model, tmp_path / "w4.tflite", ConvertOptions(mode="int8-only"))
    tflite_acc = float(np.mean(TFLiteModel(tfl.path).predict(d.x_test).argmax(1) == d.y_test))
    assert tflite_acc >= fp32_acc - 0.02
    assert tfl.verification.integer_only


def test_4bit_weights_take_at_most_16_levels_per_channel(w4_run, tmp_path):
    qat = load_keras_model(w4_run.qat_model)
    wrapper = qat.get_layer("quant_conv2")
    weights = {w.name.split("/")[-1].split(":")[0]: w for w in wrapper.weights}
    assert _per_channel_levels(weights["kernel"], weights["kernel_min"], weights["kernel_max"], 4) <= 16
    # ... and in the exported TFLite file, every output channel of every conv kernel.
    tfl = convert(w4_run.qat_model, tmp_path / "w4.tflite", ConvertOptions(mode="int8-only"))
    model = TFLiteModel(tfl.path, use_default_delegates=False)
    checked = 0
    for detail in model.interpreter.get_tensor_details():
        if detail["dtype"] == np.int8 and len(detail["shape"]) == 4 and detail["shape"][0] > 1:
            w = model.interpreter.get_tensor(detail["index"])
            assert max(len(np.unique(w[c])) for c in range(w.shape[0])) <= 16, detail["name"]
            checked += 1
    assert checked == 3
    # The 8-bit model of the same architecture uses more levels: the check can fail.
    assert _per_channel_levels(weights["kernel"], weights["kernel_min"], weights["kernel_max"], 8) > 16


def test_stepped_schedule_runs_and_reports_each_stage(cli, digits_run, tmp_path):
    out = tmp_path / "stepped"
    result = cli(
        "train",
        digits_run.fp32_model,
        "--data",
        "digits",
        "--epochs",
        "0",
        "--qat-epochs",
        "2",
        "--weight-bits",
        "4",
        "--schedule",
        "stepped",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    assert "qat-w8a8" in result.stdout and "qat-w4a8" in result.stdout
    history = json.loads((out / "history.json").read_text())
    stages = history["stages"]
    assert [(s["name"], s["weight_bits"]) for s in stages] == [("qat-w8a8", 8), ("qat-w4a8", 4)]
    for stage in stages:
        assert len(stage["epochs"]) == 1 and stage["final"]["test_value"] > 0.9


def test_stepped_8bit_quantizes_layer_groups_from_the_input(digits_run, finetune, tmp_path):
    from edgeq.train import schemes

    model = load_keras_model(digits_run.fp32_model)
    names = schemes.quantizable_layer_names(model)
    first_half = set(names[: (len(names) + 1) // 2])
    partial = schemes.build_qat_model(model, schemes.QuantSettings(), only_layers=first_half)
    wrapped = {layer.name for layer in partial.layers if layer.name.startswith("quant_")}
    assert "quant_conv1" in wrapped and "quant_bn1" in wrapped
    assert "quant_conv3" not in wrapped and "quant_logits" not in wrapped
    result = finetune(tmp_path / "s8", qat_epochs=2, schedule="stepped")
    assert [s.name for s in result.stages] == ["qat-input-half", "qat-w8a8"]


def test_per_tensor_symmetric_qat_exports_one_scale_per_weight_and_zero_points_of_zero(digits_run, finetune, tmp_path):
    run = finetune(tmp_path / "pt", qat_epochs=2, granularity="per-tensor", activations="symmetric")
    assert run.stages[-1].test_value > 0.9
    assert json.loads(run.run.read_text())["quantization"]["batchnorm_folded_before_qat"]
    tfl = convert(run.qat_model, tmp_path / "pt.tflite", ConvertOptions(mode="int8-only"))
    # Folding first keeps the per-tensor model faithful (the converter's own fold is not).
    assert tfl.verification.agreement >= 0.98
    model = TFLiteModel(tfl.path, use_default_delegates=False)
    conv_weights = [
        d
        for d in model.interpreter.get_tensor_details()
        if d["dtype"] == np.int8 and len(d["shape"]) == 4 and d["shape"][0] > 1
    ]
    assert conv_weights and all(len(d["quantization_parameters"]["scales"]) == 1 for d in conv_weights)
    conv_outputs = [op for op in model.interpreter._get_ops_details() if op["op_name"] == "CONV_2D"]
    for op in conv_outputs:
        detail = model.interpreter._get_tensor_details(op["outputs"][0], 0)
        assert detail["quantization_parameters"]["zero_points"][0] == 0


def test_batchnorm_folding_is_exact_in_fp32_and_leaves_no_bn(digits_run):
    from edgeq.transforms.fold import fold_batchnorm

    model = load_keras_model(digits_run.fp32_model)
    folded = fold_batchnorm(model)
    assert not [la for la in folded.layers if type(la).__name__ == "BatchNormalization"]
    assert len(folded.layers) == len(model.layers) - 3
    x = load_dataset("digits").x_test[:64]
    a, b = model.predict(x, verbose=0), folded.predict(x, verbose=0)
    assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(a))


def test_per_channel_asymmetric_default_differs(digits_int8):
    model = TFLiteModel(digits_int8.path, use_default_delegates=False)
    conv_weights = [
        d
        for d in model.interpreter.get_tensor_details()
        if d["dtype"] == np.int8 and len(d["shape"]) == 4 and d["shape"][0] > 1
    ]
    assert all(len(d["quantization_parameters"]["scales"]) == d["shape"][0] for d in conv_weights)
    assert model.input.zero_point == -128  # inputs in [0, 1]: the asymmetric range starts at the bottom


def test_gradient_clipping_reaches_the_optimizer_and_the_run_record(digits_run, finetune, tmp_path):
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
    _compile(model, 1e-3, clip_norm=0.5, clip_value=None)
    assert model.optimizer.clipnorm == 0.5
    run = finetune(tmp_path / "clip", qat_epochs=1, clip_norm=1.0, clip_value=0.1)
    config = json.loads(run.run.read_text())["config"]
    assert config["clip_norm"] == 1.0 and config["clip_value"] == 0.1


def test_layer_config_keeps_layers_float_and_sets_bits_by_name_or_regex(cli, digits_run, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"conv3": "float", "re:conv[12]": {"weight_bits": 4}}}))
    out = tmp_path / "lw"
    result = cli(
        "train",
        digits_run.fp32_model,
        "--data",
        "digits",
        "--epochs",
        "0",
        "--qat-epochs",
        "1",
        "--layer-config",
        plan,
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    qat = load_keras_model(out / "qat.h5")
    names = {layer.name for layer in qat.layers}
    assert {"conv3", "bn3"} <= names and "quant_conv3" not in names  # float, BN with it
    assert "quant_conv1" in names and "quant_logits" in names
    quant = json.loads((out / "run.json").read_text())["quantization"]["layers"]
    assert quant == {
        "conv1": {"weight_bits": 4, "activation_bits": 8},
        "conv2": {"weight_bits": 4, "activation_bits": 8},
        "conv3": {"keep_float": True},
    }


def test_per_layer_16bit_activations_are_refused_until_they_can_deploy(cli, digits_run, tmp_path):
    plan = tmp_path / "a16.json"
    plan.write_text(json.dumps({"layers": {"conv2": {"weight_bits": 8, "activation_bits": 16}}}))
    out = tmp_path / "a16"
    result = cli("train", digits_run.fp32_model, "--data", "digits", "--layer-config", plan, "--out", out)
    assert_one_line_error(result, "conv2", "--activation-bits")
    assert not out.exists()


def test_layer_config_naming_a_missing_layer_lists_the_real_names(cli, digits_run, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"conv9": "float"}}))
    result = cli(
        "train",
        digits_run.fp32_model,
        "--data",
        "digits",
        "--epochs",
        "0",
        "--qat-epochs",
        "1",
        "--layer-config",
        plan,
        "--out",
        tmp_path / "x",
    )
    assert_one_line_error(result, "conv9", "conv1, bn1, relu1")


def _save_layernorm_model(path):
    L = keras.layers
    inputs = L.Input((8, 8, 1))
    h = L.Conv2D(8, 3, use_bias=False, name="conv")(inputs)
    h = L.Flatten(name="flat")(h)
    h = L.LayerNormalization(name="norm")(h)
    outputs = L.Dense(10, activation="softmax", name="head")(h)
    keras.Model(inputs, outputs).save(path)


def test_unsupported_layer_is_named_with_its_class_and_the_way_out(cli, tmp_path):
    model = tmp_path / "ln.keras"
    _save_layernorm_model(model)
    out = tmp_path / "run"
    result = cli("train", model, "--data", "digits", "--epochs", "1", "--qat-epochs", "1", "--out", out)
    assert_one_line_error(result, "'norm'", "LayerNormalization", "--layer-config")
    assert not (out / "qat.h5").exists() and not (out / "run.json").exists()
    plan = tmp_path / "plan.json"
    plan.write_text('{"layers": {"norm": "float"}}')
    ok = cli(
        "train",
        model,
        "--data",
        "digits",
        "--epochs",
        "1",
        "--qat-epochs",
        "1",
        "--out",
        out,
        "--layer-config",
        plan,
        "--force",
    )
    assert ok.exit_code == 0, ok.output
    assert (out / "qat.h5").is_file()


def test_ctrl_c_loses_at_most_one_epoch_and_resume_finishes_the_run(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "edgeq",
        "train",
        "digits-cnn",
        "--data",
        "digits",
        "--epochs",
        "6",
        "--qat-epochs",
        "1",
        "--no-compare-int8",
        "--out",
        str(out),
    ]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    # Training stops after epoch 3's checkpoint and says so: the test waits for that line
    # (a blocking read, no timer), then interrupts it as a user's Ctrl-C would.
    paused = {**env, "EDGEQ_TEST_PAUSE_AFTER_EPOCH": "3"}
    # A shell's background job (`make test &`, nohup, CI runners) starts with SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler: give the child SIGINT's default back,
    # as a terminal would, or it never sees the Ctrl-C and the test waits forever.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=paused,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    state = out / "checkpoint" / "state.json"
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "paused after epoch 3" in line:
            break
    else:
        pytest.fail(f"training ended without pausing: {''.join(seen)[-2000:]}")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate()
    assert proc.returncode == 130, stderr
    assert "--resume" in stderr and "Traceback" not in stderr
    saved = json.loads(state.read_text())
    assert saved["stage"] == 0 and saved["epochs_done"] == 3  # nothing lost, exactly where it stopped
    assert not (out / "run.json").exists() and not (out / "qat.h5").exists()

    refused = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "--resume" in refused.stderr  # never silently overwritten

    # as a user runs it (no TF_CPP_MIN_LOG_LEVEL): the terminal shows edgeq's words only
    user_env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=user_env)
    assert resumed.returncode == 0, resumed.stderr
    noise = [line for line in resumed.stderr.splitlines() if re.match(r"[EWIF]\d{4} ", line) or "Warning" in line]
    assert not noise, noise  # TensorFlow's C++ log lines and Keras' Python warnings stay hidden without -v
    history = json.loads((out / "history.json").read_text())
    epochs = [e["epoch"] for e in history["stages"][0]["epochs"]]
    assert epochs == list(range(1, 7))  # every epoch once: nothing lost, nothing repeated
    # ... and the resumed run trained what the uninterrupted one trains: epoch 4 on saw its own
    # shuffles, not epoch 1's again (op determinism, the same seed), bit for bit
    # (the FP32 stage is what is compared: the uninterrupted run stops there, --qat-epochs 0)
    alone = [*cmd[:-1], str(tmp_path / "straight")]
    alone[alone.index("--qat-epochs") + 1] = "0"
    straight = subprocess.run(alone, capture_output=True, text=True, env=env)
    assert straight.returncode == 0, straight.stderr
    a = keras.models.load_model(tmp_path / "straight" / "fp32.keras").get_weights()
    b = keras.models.load_model(out / "fp32.keras").get_weights()
    for wa, wb in zip(a, b):
        np.testing.assert_array_equal(wa, wb)
    run = json.loads((out / "run.json").read_text())
    assert run["resumed_from"][0] == 0 and run["resumed_from"][1] >= saved["epochs_done"]
    assert run["results"][0]["test_value"] >= 0.9  # it trained, across the interruption


def test_conv_followed_by_relu_layer_keeps_4bit_weight_quantization(tmp_path):
    """TF-MOT alone would train these weights in float (its ReLU transform drops them)."""
    from edgeq.train import schemes

    L = keras.layers
    inputs = L.Input((8, 8, 1))
    h = L.ReLU(name="relu_a")(L.Conv2D(16, 3, padding="same", name="conv_a")(inputs))
    h = L.ReLU(name="relu_b")(L.Conv2D(16, 3, padding="same", name="conv_b")(h))
    outputs = L.Dense(10, activation="softmax", name="head")(L.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    path = tmp_path / "nobn.keras"
    model.save(path)
    qat = schemes.build_qat_model(model, schemes.QuantSettings(weight_bits=4))
    for name in ("quant_conv_a", "quant_conv_b"):
        assert any(w.name.endswith("kernel_min:0") for w in qat.get_layer(name).weights), name
    run = train(
        TrainConfig(model=str(path), data="digits", out_dir=str(tmp_path / "r"), epochs=1, qat_epochs=1, weight_bits=4)
    )
    tfl = convert(run.qat_model, tmp_path / "nobn.tflite", ConvertOptions(mode="int8-only"))
    tm = TFLiteModel(tfl.path, use_default_delegates=False)
    kernels = [
        tm.interpreter.get_tensor(d["index"])
        for d in tm.interpreter.get_tensor_details()
        if d["dtype"] == np.int8 and len(d["shape"]) == 4 and d["shape"][0] > 1
    ]
    assert len(kernels) == 2
    for w in kernels:
        assert max(len(np.unique(w[c])) for c in range(w.shape[0])) <= 16


def test_qat_stage_keeps_the_float_models_loss(digits_run):
    """A QAT model ends in a wrapper: its softmax must still be seen (no softmax applied twice)."""
    from edgeq.train import schemes

    model = load_keras_model(digits_run.fp32_model)
    qat = schemes.build_qat_model(model, schemes.QuantSettings(weight_bits=4))
    _compile(qat, 1e-4)
    assert qat.loss.get_config()["from_logits"] is False
    logits_model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(3)])
    _compile(logits_model, 1e-3)
    assert logits_model.loss.get_config()["from_logits"] is True


def test_qat_only_run_keeps_the_given_model_as_its_fp32_reference(digits_run, finetune, tmp_path):
    run = finetune(tmp_path / "q", qat_epochs=1)
    given = load_keras_model(digits_run.fp32_model).get_weights()
    saved = load_keras_model(run.fp32_model).get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(given, saved))
    tuned = load_keras_model(run.out_dir / "qat_float.keras").get_weights()
    assert not all(np.array_equal(a, b) for a, b in zip(given, tuned))  # QAT did change the float weights


def test_16bit_activation_qat_converts_to_int16x8_through_its_fine_tuned_float_model(cli, finetune, tmp_path):
    run = finetune(tmp_path / "a16", qat_epochs=1, activation_bits=16)
    refused = cli("convert", run.qat_model, "--int8-only", "--out", tmp_path / "x.tflite")
    assert_one_line_error(refused, "16-bit activations", "--int16x8")
    result = convert(run.qat_model, tmp_path / "a16.tflite", ConvertOptions(mode="int16x8"))
    assert any("qat_float.keras" in note for note in result.notes)
    from edgeq.runtime.flatbuffer import read_tflite, tensors_by_dtype

    assert tensors_by_dtype(read_tflite(result.path)).get("int16", 0) > 0
    d = load_dataset("digits")
    acc = float(np.mean(TFLiteModel(result.path).predict(d.x_test).argmax(1) == d.y_test))
    assert acc >= run.stages[-1].test_value - 0.01


@pytest.mark.slow  # 38 s: seed determinism runs in make test-all; make test keeps the Ctrl-C resume's bit-equality
def test_same_seed_gives_identical_weights_and_tflite(tmp_path):
    """--seed N with op determinism: the same run twice writes the same fp32.keras weights and int8 bytes."""
    import hashlib

    runs, digests = [], []
    for name, seed, qat in (("a", 7, 1), ("b", 7, 1), ("c", 8, 0)):
        run = train(
            TrainConfig(
                model="digits-cnn", data="digits", out_dir=str(tmp_path / name), epochs=1, qat_epochs=qat, seed=seed
            )
        )
        runs.append(load_keras_model(run.fp32_model).get_weights())
        if qat:
            out = convert(run.qat_model, tmp_path / f"{name}.tflite", ConvertOptions(mode="int8-only"))
            digests.append(hashlib.sha256(out.path.read_bytes()).hexdigest())
        assert json.loads((tmp_path / name / "run.json").read_text())["hyperparameters"]["seed"] == seed
    assert all(np.array_equal(x, y) for x, y in zip(runs[0], runs[1]))
    assert digests[0] == digests[1]
    assert not all(
        np.array_equal(x, y) for x, y in zip(runs[0], runs[2])
    )  # another seed, other weights: the test can tell


def _progress_of(state_file):
    """(stage, epochs done) that state.json records, or None before the first one."""
    if not state_file.is_file():
        return None
    state = json.loads(state_file.read_text())  # never half-written: a kill leaves the old or the new file
    return int(state["stage"]), int(state["epochs_done"])


# make test's resume is the Ctrl-C test's (an interrupt at an epoch's end, the recipe's accuracy after
# --resume); kills that land anywhere run with EDGEQ_SLOW=1 (the suite's 10 minutes on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize("kills", [2, 20])
def test_sigkill_at_random_moments_then_resume_finishes_losing_at_most_one_epoch(tmp_path, kills):
    """SIGKILL anywhere (imports, an epoch, a checkpoint write, a stage change, the final files):
    each --resume starts at or after the last epoch whose checkpoint completed, and the run ends
    with every epoch trained once. A kill comes after a random number of checkpointed epochs
    (read from the run's stderr, no timer) plus a random fraction of a second, so it lands
    anywhere; what is asserted holds wherever it lands. 2 and 20 kills, with EDGEQ_SLOW=1
    (the Ctrl-C test checks that a resumed run still reaches the recipe's accuracy)."""
    import time

    # A run long enough for every kill to land in it: each kill lets at most `most` epochs be
    # checkpointed, plus less than one more in flight (the delay is a fraction of an epoch's time).
    epochs, most = (64, 2) if kills == 20 else (8, 2)
    out, epoch_log = tmp_path / "run", tmp_path / "epochs.log"
    cmd = [sys.executable, "-m", "edgeq", "train", "digits-cnn", "--data", "digits", "--no-compare-int8"]
    cmd += ["--epochs", str(epochs), "--qat-epochs", "2", "--out", str(out)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "EDGEQ_TEST_EPOCH_LOG": str(epoch_log)}
    state_file = out / "checkpoint" / "state.json"
    rng = np.random.default_rng(11)
    landed = []
    for _ in range(kills):
        if (out / "run.json").is_file():
            break
        args = cmd + (["--resume"] if state_file.is_file() else ["--force"])
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        wait_for = int(rng.integers(1, most + 1))  # checkpointed epochs to let pass
        seen, stamps = 0, []
        while seen < wait_for:
            line = proc.stderr.readline()
            if not line:
                break  # the run ended first
            if "edgeq: checkpointed" in line:
                seen += 1
                stamps.append(time.monotonic())
        epoch_s = stamps[-1] - stamps[-2] if len(stamps) > 1 else 0.2
        time.sleep(float(rng.uniform(0.0, epoch_s)))  # where in the next epoch (or write) the kill lands
        proc.kill()
        proc.communicate()
        assert proc.returncode in (0, -signal.SIGKILL)
        completed = []
        if epoch_log.is_file():
            completed = [tuple(map(int, line.split())) for line in epoch_log.read_text().splitlines() if line]
        progress = _progress_of(state_file)
        landed.append((completed[-1] if completed else None, progress))
        if completed and not (out / "run.json").is_file():
            # every epoch whose checkpoint completed is there to resume from: only the one in flight is lost
            assert progress is not None and progress >= completed[-1], (completed[-1], progress)
    if not (out / "run.json").is_file():
        args = cmd + (["--resume"] if state_file.is_file() else ["--force"])
        finished = subprocess.run(args, capture_output=True, text=True, env=env)
        assert finished.returncode == 0, finished.stderr
    history = json.loads((out / "history.json").read_text())
    assert [[e["epoch"] for e in s["epochs"]] for s in history["stages"]] == [list(range(1, epochs + 1)), [1, 2]]
    run = json.loads((out / "run.json").read_text())
    assert run["resumed_from"] is not None or not any(c for c, _ in landed), landed
    assert not (out / "checkpoint").exists()
    assert landed and all(c is not None for c, _ in landed), landed  # each kill landed after training began
    assert len(landed) == kills, landed  # every kill landed before the run could finish
    print(f"{len(landed)} kills; resumed from {[p for _, p in landed]}")


def test_resume_restores_the_optimizer_state(tmp_path):
    """Adam's step count and moments come back from the checkpoint, not from zero."""
    from edgeq.models import zoo
    from edgeq.train.config import restore_checkpoint
    from edgeq.train.schedule import make_schedule
    from edgeq.train.stages import _Run

    d = load_dataset("digits")
    model = zoo.build("digits-cnn", d.input_shape, 10)
    _compile(model, 1e-3)
    model.fit(d.x_train[:256], d.y_train[:256], epochs=1, batch_size=32, verbose=0)
    run = _Run(tmp_path, make_schedule("default", 2, 0, 8, 8), TrainConfig(model="digits-cnn", out_dir="x"))
    run.save_checkpoint(model, 0, 1)
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())

    fresh = zoo.build("digits-cnn", d.input_shape, 10)
    _compile(fresh, 1e-3)
    restore_checkpoint(fresh, tmp_path / "checkpoint", state)
    fresh.optimizer.build(fresh.trainable_variables)  # slots are created, and restored, here
    assert int(fresh.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 8
    before, after = model.optimizer.variables, fresh.optimizer.variables
    assert len(before) == len(after) > 2 * len(model.trainable_variables)  # iterations, and m and v per weight
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert any(np.any(b.numpy() != 0) for b in before[1:])  # the moments are not zeros that match trivially
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_diverging_stage_stops_with_one_line_and_keeps_the_last_finite_checkpoint(cli, tmp_path):
    """exp(exp(100 x)) overflows on the first batch: the loss is NaN, so the stage stops there
    (not after its epochs), no checkpoint of NaN weights is written, and the error says what to try."""
    from edgeq.models.compat import keras

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Flatten()(inputs)
    h = keras.layers.Dense(
        10, activation="exponential", kernel_initializer=keras.initializers.Constant(100.0), name="exp_dense"
    )(h)
    model = keras.Model(inputs, keras.layers.Activation("exponential")(h))
    model.save(tmp_path / "explodes.h5")
    out = tmp_path / "run"
    args = ("train", tmp_path / "explodes.h5", "--data", "digits", "--out", out, "--epochs", "3")
    qat = cli(*args)
    # the QAT dry run names the layer TF-MOT would have failed on with a bare ValueError
    assert_one_line_error(qat, "'exp_dense' (Dense with activation 'exponential', which TF-MOT's QAT does not take)")
    result = cli(*args, "--qat-epochs", "0")
    assert_one_line_error(result, "stage fp32 diverged", "epoch 1, batch 1", "a lower --lr")
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert (state["stage"], state["epochs_done"], state["checkpoint"]) == (0, 0, None)  # the stage's start
    assert not (out / "fp32.keras").exists() and not (out / "run.json").exists()


@pytest.mark.slow  # make test checks the same bit-equality after the Ctrl-C test's resume
def test_a_resumed_run_trains_what_the_uninterrupted_run_trains(tmp_path):
    """Killed after epoch 1 and resumed, the run sees epoch 2's and 3's shuffles, not epoch 1's
    again: its weights equal the uninterrupted run's, bit for bit (op determinism, --seed)."""
    cmd = [sys.executable, "-m", "edgeq", "train", "digits-cnn", "--data", "digits", "--seed", "5", "--no-compare-int8"]
    cmd += ["--epochs", "3", "--qat-epochs", "0", "--batch-size", "64"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    straight = subprocess.run(cmd + ["--out", str(tmp_path / "straight")], capture_output=True, text=True, env=env)
    assert straight.returncode == 0, straight.stderr
    out = tmp_path / "resumed"
    proc = subprocess.Popen(
        cmd + ["--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "EDGEQ_TEST_PAUSE_AFTER_EPOCH": "1"},
    )
    for line in proc.stderr:  # waits on the run itself, not on a timer
        if "paused after epoch 1" in line:
            break
    proc.kill()
    proc.communicate()
    resumed = subprocess.run(cmd + ["--out", str(out), "--resume"], capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "run.json").read_text())["resumed_from"] == [0, 1]
    a = keras.models.load_model(tmp_path / "straight" / "fp32.keras").get_weights()
    b = keras.models.load_model(out / "fp32.keras").get_weights()
    for wa, wb in zip(a, b):
        np.testing.assert_array_equal(wa, wb)
