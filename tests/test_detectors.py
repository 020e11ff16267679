"""SSD and YOLO layouts: anchors, box coders and YOLO tensors decoded against hand-computed boxes,
and a float .tflite detector of each layout through convert, eval (mAP by pycocotools) and profile."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from edgeq.tasks.detection import DetectionSpec, decode
from edgeq.tasks.detectors import SsdAnchors, SsdCoder, YoloFormat, ssd_anchors, ssd_boxes, yolo_decoded

# Two layers on a 32x32 input: 4x4 cells then 2x2, one aspect ratio plus the interpolated scale: 40 anchors.
ANCHORS = {
    "input_size": 32,
    "num_layers": 2,
    "min_scale": 0.2,
    "max_scale": 0.6,
    "strides": [8, 16],
    "aspect_ratios": [1.0],
    "interpolated_scale_aspect_ratio": 1.0,
}
BOX = (0.05, 0.08, 0.55, 0.48)  # the object: (ymin, xmin, ymax, xmax), centre (0.3, 0.28), 0.5 x 0.4
TARGET = 32  # the first anchor of the second layer: centre (0.25, 0.25), 0.6 x 0.6


def _regressors_for(box, anchor) -> list[float]:
    """TF OD API's Faster R-CNN coder (scales 10, 10, 5, 5), y/x/h/w, inverted by hand."""
    cy, cx, h, w = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2, box[2] - box[0], box[3] - box[1]
    ay, ax, ah, aw = anchor
    return [(cy - ay) / ah * 10, (cx - ax) / aw * 10, math.log(h / ah) * 5, math.log(w / aw) * 5]


def test_ssd_anchors_are_the_generators_by_hand():
    anchors = ssd_anchors(SsdAnchors.from_dict(ANCHORS))
    assert anchors.shape == (4 * 4 * 2 + 2 * 2 * 2, 4)
    np.testing.assert_allclose(anchors[0], (0.125, 0.125, 0.2, 0.2))  # layer 0 scale: min_scale
    np.testing.assert_allclose(anchors[1], (0.125, 0.125, math.sqrt(0.2 * 0.6), math.sqrt(0.2 * 0.6)))
    np.testing.assert_allclose(anchors[2], (0.125, 0.375, 0.2, 0.2))  # next cell to the right
    np.testing.assert_allclose(anchors[TARGET], (0.25, 0.25, 0.6, 0.6))  # layer 1 scale: max_scale
    np.testing.assert_allclose(anchors[TARGET + 1], (0.25, 0.25, math.sqrt(0.6), math.sqrt(0.6)))  # next: 1.0
    # MediaPipe's short-range face detector: 128x128, strides 8, 16, 16, 16, fixed anchor size: 896 anchors
    face = SsdAnchors.from_dict(
        {
            "input_size": 128,
            "num_layers": 4,
            "min_scale": 0.1484375,
            "max_scale": 0.75,
            "strides": [8, 16, 16, 16],
            "fixed_anchor_size": True,
        }  # fmt: skip
    )
    face_anchors = ssd_anchors(face)
    assert face_anchors.shape == (16 * 16 * 2 + 8 * 8 * 6, 4)
    assert np.all(face_anchors[:, 2:] == 1.0)
    np.testing.assert_allclose(face_anchors[512], (1 / 16, 1 / 16, 1.0, 1.0))


def test_ssd_boxes_decode_to_the_box_they_encode_in_both_orders():
    anchors = ssd_anchors(SsdAnchors.from_dict(ANCHORS))
    raw = np.zeros((len(anchors), 4))
    raw[TARGET] = _regressors_for(BOX, anchors[TARGET])
    np.testing.assert_allclose(ssd_boxes(raw, anchors, SsdCoder())[TARGET], BOX, atol=1e-9)
    # MediaPipe's coder: x/y/w/h order, linear sizes scaled by the input size, anchors 1 x 1
    mediapipe = SsdCoder(order="xywh", scales=(32.0, 32.0, 32.0, 32.0), exponential=False)
    fixed = np.array([[0.25, 0.25, 1.0, 1.0]])
    cy, cx, h, w = 0.3, 0.28, 0.5, 0.4
    raw = np.array([[(cx - 0.25) * 32, (cy - 0.25) * 32, w * 32, h * 32, 7.0, 7.0]])  # keypoints after the box
    np.testing.assert_allclose(ssd_boxes(raw, fixed, mediapipe)[0], BOX, atol=1e-9)


def test_yolo_tensors_decode_in_either_orientation_and_with_objectness():
    fmt = YoloFormat(classes=2, input_size=(32, 32))
    rows = np.zeros((8, 6))
    rows[3] = (16, 12, 8, 6, 0.01, 0.9)  # cx, cy, w, h in pixels, then class scores
    expected = ((12 - 3) / 32, (16 - 4) / 32, (12 + 3) / 32, (16 + 4) / 32)
    for tensor in (rows, rows.T):  # (N, 4 + K) and ultralytics v8's (4 + K, N)
        boxes, scores = yolo_decoded(tensor, fmt)
        np.testing.assert_allclose(boxes[3], expected)
        assert scores.shape == (8, 2) and scores[3, 1] == 0.9
    v5 = YoloFormat(classes=2, objectness=True, normalized=True)
    boxes, scores = yolo_decoded(np.array([[0.5, 0.5, 0.2, 0.4, 0.5, 0.2, 0.8]]), v5)
    np.testing.assert_allclose(boxes[0], (0.3, 0.4, 0.7, 0.6))
    np.testing.assert_allclose(scores[0], (0.1, 0.4))  # class score times objectness
    spec = DetectionSpec.from_dict({"boxes": "out", "layout": "yolo", "classes": 2, "yolo": {"input_size": 32}})
    (found,) = decode(spec, {"out": rows.T[None]})
    np.testing.assert_allclose(found.boxes[0], expected, atol=1e-6)
    assert int(found.classes[0]) == 1


# ------------------------------------------------------------------ float .tflite detectors, end to end


def _constant_model(keras, outputs: dict):
    """A Keras model whose named outputs are the given arrays, nearly whatever the image (32x32x3): each
    head's bias, plus a kernel small enough (1e-3) to move no box, large enough to quantize (a zero
    kernel has no int8 scale)."""
    inputs = keras.Input((32, 32, 3), name="image")
    flat = keras.layers.Flatten()(keras.layers.AveragePooling2D(32)(inputs))
    heads = []
    for name, values in outputs.items():
        dense = keras.layers.Dense(values.size, kernel_initializer="zeros", name=f"{name}_dense")
        head = dense(flat)
        kernel = np.random.default_rng(1).uniform(-1e-3, 1e-3, (3, values.size)).astype(np.float32)
        dense.set_weights([kernel, values.reshape(-1).astype(np.float32)])
        heads.append(keras.layers.Reshape(values.shape, name=name)(head))
    return keras.Model(inputs, heads)


@pytest.fixture(scope="module")
def detector_files(tmp_path_factory):
    """An SSD-layout and a YOLO-layout float .tflite whose heads always find BOX, the task files that
    declare them, and 40 images with BOX as their one object (class 0)."""
    from edgeq.models.compat import keras
    from edgeq.shims.tflite import keras_converter

    folder = tmp_path_factory.mktemp("detectors")
    anchors = ssd_anchors(SsdAnchors.from_dict(ANCHORS))
    regressors = np.zeros((len(anchors), 4))
    regressors[TARGET] = _regressors_for(BOX, anchors[TARGET])
    logits = np.full((len(anchors), 1), -6.0)
    logits[TARGET] = 6.0
    yolo = np.zeros((5, 8))  # (4 + 1 class, 8 candidates): ultralytics' orientation, pixels
    cy, cx = (BOX[0] + BOX[2]) / 2 * 32, (BOX[1] + BOX[3]) / 2 * 32
    yolo[:, 5] = (cx, cy, (BOX[3] - BOX[1]) * 32, (BOX[2] - BOX[0]) * 32, 0.9)
    files = {}
    for name, outputs, detection in (
        ("ssd", {"regressors": regressors, "classificators": logits},
         {"layout": "ssd", "boxes": "regressors", "scores": "classificators", "classes": 1, "anchors": ANCHORS}),
        ("yolo", {"output0": yolo}, {"layout": "yolo", "boxes": "output0", "classes": 1, "yolo": {"input_size": 32}}),
    ):  # fmt: skip
        # batch 1, fixed, as downloaded detectors are (a free batch computes Reshape targets in float)
        (folder / f"{name}.tflite").write_bytes(keras_converter(_constant_model(keras, outputs), True).convert())
        (folder / f"{name}.json").write_text(json.dumps({"detection": detection}))
        files[name] = folder / f"{name}.tflite", folder / f"{name}.json"
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (40, 32, 32, 3)).astype(np.float32)
    np.savez(folder / "boxes.npz", x=x, gt_boxes=np.tile(np.float32(BOX), (40, 1, 1)), gt_classes=np.zeros((40, 1)))
    return files, folder / "boxes.npz"


@pytest.mark.parametrize("layout", ["ssd", "yolo"])
def test_a_downloaded_detectors_layout_converts_and_is_judged_by_map(cli, detector_files, tmp_path, layout):
    from edgeq.runtime.inputs import manifest_beside

    files, data = detector_files
    model, task = files[layout]
    out = tmp_path / "q.tflite"
    result = cli("convert", model, "--int8-only", "--calib", f"npz:{data}", "--task", task, "--out", out)
    assert result.exit_code == 0, result.output
    recorded = json.loads(manifest_beside(out).read_text())["detection"]
    assert recorded["layout"] == layout and recorded["decoder"]  # a device decodes with what is recorded
    result = cli("eval", out, "--reference", model, "--data", f"npz:{data}", "--max-drop", "5",
                 "--json", tmp_path / "e.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    detection = json.loads((tmp_path / "e.json").read_text())["detection"]
    assert detection["reference_map50"] == pytest.approx(1.0) and detection["map50"] == pytest.approx(1.0)
    assert detection["images"] == 8 and detection["verdict"]["passed"]  # the test split of 40
    result = cli("profile", out, "--data", data, "--runs", "2", "--json", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    found = json.loads((tmp_path / "p.json").read_text())["model"]["scores"]["detection"]
    assert found["layout"] == layout and found["map50"] == pytest.approx(1.0)


def test_a_bad_detector_declaration_is_refused_in_one_line(cli, detector_files, tmp_path):
    from tests.conftest import assert_one_line_error

    files, data = detector_files
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"detection": {"layout": "ssd", "boxes": "regressors", "scores": "classificators"}}))
    assert_one_line_error(
        cli("convert", files["ssd"][0], "--int8-only", "--calib", f"npz:{data}", "--task", bad), "anchor config"
    )
    bad.write_text(json.dumps({"detection": {"layout": "retina", "boxes": "regressors"}}))
    assert_one_line_error(
        cli("convert", files["ssd"][0], "--int8-only", "--calib", f"npz:{data}", "--task", bad), "unknown detection"
    )


def test_faces_on_real_photos_export_to_coco_and_tfrecord_and_read_back_the_same(cli, tmp_path):
    """The faces source (a real portrait from matplotlib pasted on scikit-learn's photos, exact boxes)
    exported as COCO JSON and as Object Detection API TFRecords: edgeq's coco: and tfrecord: sources
    read back the same images and boxes."""
    from edgeq.data.sources import load_dataset

    faces = load_dataset("faces:64:30")
    x, y = faces.split("test")
    assert faces.class_names == ("face",) and (y["gt_classes"] == 0).any()
    boxes = y["gt_boxes"][y["gt_classes"] >= 0]
    sides = boxes[:, 2] - boxes[:, 0]
    assert sides.min() >= 0.2 - 1 / 64 and sides.max() <= 0.6 + 1 / 64  # 20% to 60% of the side, in whole pixels
    for fmt, out, source in (
        ("coco", tmp_path / "faces.json", f"coco:{tmp_path / 'faces.json'}"),
        ("tfrecord", tmp_path / "faces.tfrecord", f"tfrecord:{tmp_path / 'faces.tfrecord'}"),
    ):
        result = cli("data", "export", "faces:64:30", "--split", "test", "--format", fmt, "--out", out)
        assert result.exit_code == 0, result.output
        back = load_dataset(source, input_shape=(64, 64, 3))
        assert back.count("train") + back.count("val") + back.count("test") == len(x)
        read = np.concatenate([back.split(s)[1]["gt_boxes"] for s in ("train", "val", "test")])
        kept = np.concatenate([back.split(s)[1]["gt_classes"] for s in ("train", "val", "test")])
        np.testing.assert_allclose(np.sort(read[kept >= 0], axis=0), np.sort(boxes, axis=0), atol=1e-4)
        pixels = np.concatenate([back.split(s)[0] for s in ("train", "val", "test")])
        np.testing.assert_allclose(np.sort(pixels.sum(axis=(1, 2, 3))), np.sort(x.sum(axis=(1, 2, 3))), rtol=1e-5)


def test_a_tflite_whose_boxes_and_scores_share_one_output_is_told_so(cli, tmp_path):
    """YOLO exports concatenate pixel boxes (0..640) and scores (0..1) into one tensor: one int8 scale
    for both rounds the scores away. convert splits it by default; with --no-split-outputs it names the
    output, the op and the ranges."""
    from edgeq.models.compat import keras
    from edgeq.runtime.inputs import manifest_beside
    from edgeq.shims.tflite import keras_converter

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3), name="image")
    flat = keras.layers.Flatten()(inputs)
    boxes = keras.layers.Rescaling(640.0)(keras.layers.Dense(4, activation="sigmoid")(flat))
    scores = keras.layers.Dense(2, activation="sigmoid")(flat)
    joined = keras.layers.Concatenate(name="output0")([boxes, scores])
    model = tmp_path / "yolo_like.tflite"
    model.write_bytes(keras_converter(keras.Model(inputs, joined), True).convert())
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).uniform(0, 1, (60, 8, 8, 3)).astype(np.float32))
    out = tmp_path / "q.tflite"
    result = cli("convert", model, "--int8-only", "--calib", f"npz:{tmp_path / 'x.npz'}", "--out", out,
                 "--min-sqnr", "0")  # fmt: skip
    assert result.exit_code == 0, result.output
    notes = json.loads(manifest_beside(out).read_text())["notes"]
    assert any("split into its 2 concatenated parts" in n and "--no-split-outputs" in n for n in notes), notes
    kept = cli("convert", model, "--int8-only", "--no-split-outputs", "--calib", f"npz:{tmp_path / 'x.npz'}",
               "--out", out, "--min-sqnr", "0")  # fmt: skip
    assert kept.exit_code == 0, kept.output
    assert "concatenates tensors whose ranges differ" in kept.output and "'output0'" in kept.output, kept.output


def test_split_outputs_gives_yolos_boxes_and_scores_their_own_scales_and_still_decodes(cli, tmp_path):
    """convert --split-outputs: the concatenated output becomes its two parts (each its own int8
    scale); eval against the unsplit float file splits it the same way; a yolo detector declared on
    the two parts decodes them together (mAP 1.0 on images whose one box is the model's)."""
    from edgeq.models.compat import keras
    from edgeq.runtime.inputs import manifest_beside
    from edgeq.runtime.interpreter import TFLiteModel
    from edgeq.shims.tflite import keras_converter

    boxes = np.zeros((4, 8))
    cy, cx = (BOX[0] + BOX[2]) / 2 * 32, (BOX[1] + BOX[3]) / 2 * 32
    boxes[:, 5] = (cx, cy, (BOX[3] - BOX[1]) * 32, (BOX[2] - BOX[0]) * 32)
    scores = np.full((1, 8), 0.01)
    scores[0, 5] = 0.9
    heads = _constant_model(keras, {"boxes": boxes, "scores": scores})
    joined = keras.Model(heads.inputs, keras.layers.Concatenate(axis=1, name="output0")(heads.outputs))
    model = tmp_path / "yolo_concat.tflite"
    model.write_bytes(keras_converter(joined, True).convert())
    rng = np.random.default_rng(0)
    data = tmp_path / "boxes.npz"
    np.savez(data, x=rng.uniform(0, 1, (40, 32, 32, 3)).astype(np.float32),
             gt_boxes=np.tile(np.float32(BOX), (40, 1, 1)), gt_classes=np.zeros((40, 1)))  # fmt: skip
    out = tmp_path / "q.tflite"
    result = cli("convert", model, "--int8-only", "--split-outputs", "--calib", f"npz:{data}", "--out", out)
    assert result.exit_code == 0, result.output
    q = TFLiteModel(out)
    by_shape = {tuple(q.output_named(n).shape[1:]): n for n in q.output_names}
    assert set(by_shape) == {(4, 8), (1, 8)}
    assert len({q.output_named(n).scale for n in q.output_names}) == 2  # each part its own scale
    assert any("--split-outputs" in n for n in json.loads(manifest_beside(out).read_text())["notes"])
    task = tmp_path / "yolo.json"
    task.write_text(json.dumps({"detection": {"layout": "yolo", "boxes": by_shape[4, 8], "scores": by_shape[1, 8],
                                              "classes": 1, "yolo": {"input_size": 32}}}))  # fmt: skip
    result = cli("eval", out, "--reference", model, "--data", f"npz:{data}", "--task", task,
                 "--json", tmp_path / "e.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "e.json").read_text())
    assert "split into their parts" in record["matching"]
    assert record["detection"]["map50"] == pytest.approx(1.0)
    assert record["detection"]["reference_map50"] == pytest.approx(1.0)
