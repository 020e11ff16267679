"""Object detection: the built-in source, decoding and NMS, mAP through pycocotools, the zoo detector
from training to an integer-only model judged by mAP, and the detection data layouts users have."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgeq.data.sources import load_dataset
from edgeq.errors import DataError
from edgeq.tasks.detection import (
    Detections,
    DetectionSpec,
    decode,
    decode_centre,
    encode_centre,
    mean_average_precision,
)
from tests.conftest import assert_one_line_error


@pytest.fixture(scope="module")
def shapes():
    return load_dataset("shapes:64:300")


def test_the_shapes_source_draws_real_photos_with_exact_boxes(shapes):
    again = load_dataset("shapes:64:300")
    assert shapes.fingerprint() == again.fingerprint()  # deterministic
    assert shapes.input_shape == (64, 64, 3) and shapes.num_classes == 3
    boxes, classes = shapes.y_train["gt_boxes"], shapes.y_train["gt_classes"]
    real = classes >= 0
    assert real.sum(axis=1).min() >= 1 and real.sum(axis=1).max() <= 4  # 1 to 4 shapes per image
    assert set(np.unique(classes[real])) == {0, 1, 2}
    b = boxes[real]
    assert (b >= 0).all() and (b <= 1).all() and (b[:, 2] > b[:, 0]).all() and (b[:, 3] > b[:, 1]).all()
    sides = b[:, 2] - b[:, 0]
    assert sides.min() > 0.09 and sides.max() < 0.41  # 10% to 40% of the side, squares by construction
    # the photos are real: far more colours than a flat background
    assert len(np.unique(shapes.x_train[0].reshape(-1, 3), axis=0)) > 500


def test_centre_decoding_and_nms_give_the_hand_computed_boxes():
    """On a 4x4 grid: class 0 at two neighbouring cells over one object (NMS keeps the higher), class 1
    at another cell; boxes from (dy, dx, h, w) by hand."""
    scores = np.zeros((4, 4, 2), np.float32)
    boxes = np.zeros((4, 4, 4), np.float32)
    scores[1, 1, 0], boxes[1, 1] = 0.9, (0.5, 0.5, 0.5, 0.5)  # centre (0.375, 0.375), 0.5 x 0.5
    scores[1, 2, 0], boxes[1, 2] = 0.6, (0.5, 0.1, 0.5, 0.5)  # centre (0.375, 0.525): IoU 0.54 with the first
    scores[3, 0, 1], boxes[3, 0] = 0.7, (0.0, 0.5, 0.2, 0.4)  # centre (0.75, 0.125), 0.2 x 0.4
    scores[0, 3, 1] = 0.01  # under the score threshold
    found = decode_centre(boxes, scores)
    np.testing.assert_allclose(found.scores, [0.9, 0.7])
    np.testing.assert_array_equal(found.classes, [0, 1])
    np.testing.assert_allclose(found.boxes[0], [0.125, 0.125, 0.625, 0.625], atol=1e-6)
    np.testing.assert_allclose(found.boxes[1], [0.65, 0.0, 0.85, 0.325], atol=1e-6)  # clipped at 0 on the left
    # encode then decode is the identity on the centre cells
    gt = np.array([[[0.1, 0.2, 0.5, 0.4], [0.6, 0.6, 0.9, 0.95]]], np.float32)
    heat, target = encode_centre(gt, np.array([[2, 0]]), (4, 4), 3)
    back = decode(DetectionSpec("b", "s", "centre", 3), {"b": target[..., :4], "s": heat})[0]
    assert sorted(back.classes.tolist()) == [0, 2]
    np.testing.assert_allclose(back.boxes[np.argsort(back.classes)], gt[0][[1, 0]], atol=1e-6)


def test_map_is_the_coco_evaluators_on_fixed_predictions():
    """Two images, two classes: edgeq's COCO conversion scored by pycocotools equals pycocotools
    on the same boxes written by hand in pixels (and perfect predictions score 1)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt_boxes = np.array([[[0.1, 0.1, 0.5, 0.5], [0.6, 0.2, 0.9, 0.7]], [[0.2, 0.3, 0.8, 0.6], [0, 0, 0, 0]]], "f4")
    gt_classes = np.array([[0, 1], [1, -1]])
    perfect = [Detections(gt_boxes[0], np.array([0.9, 0.8], "f4"), np.array([0, 1])),
               Detections(gt_boxes[1, :1], np.array([0.7], "f4"), np.array([1]))]  # fmt: skip
    assert mean_average_precision(perfect, gt_boxes, gt_classes, (100, 200), 2)["map"] == pytest.approx(1.0)
    shifted = [Detections(gt_boxes[0] + [0.05, 0, 0.05, 0], np.array([0.9, 0.4], "f4"), np.array([0, 1])),
               Detections(np.array([[0.2, 0.3, 0.8, 0.6], [0.1, 0.1, 0.3, 0.3]], "f4"), np.array([0.6, 0.8], "f4"),
                          np.array([1, 1]))]  # fmt: skip
    ours = mean_average_precision(shifted, gt_boxes, gt_classes, (100, 200), 2)
    truth = COCO()
    truth.dataset = {
        "images": [{"id": 1, "height": 100, "width": 200}, {"id": 2, "height": 100, "width": 200}],
        "categories": [{"id": 1}, {"id": 2}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [20, 10, 80, 40], "area": 3200, "iscrowd": 0},
            {"id": 2, "image_id": 1, "category_id": 2, "bbox": [40, 60, 100, 30], "area": 3000, "iscrowd": 0},
            {"id": 3, "image_id": 2, "category_id": 2, "bbox": [60, 20, 60, 60], "area": 3600, "iscrowd": 0},
        ],
    }
    truth.createIndex()
    found = truth.loadRes([
        {"image_id": 1, "category_id": 1, "bbox": [20, 15, 80, 40], "score": 0.9},
        {"image_id": 1, "category_id": 2, "bbox": [40, 65, 100, 30], "score": 0.4},
        {"image_id": 2, "category_id": 2, "bbox": [60, 20, 60, 60], "score": 0.6},
        {"image_id": 2, "category_id": 2, "bbox": [20, 10, 40, 20], "score": 0.8},
    ])  # fmt: skip
    evaluation = COCOeval(truth, found, "bbox")
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    assert ours["map"] == pytest.approx(evaluation.stats[0], abs=1e-9)
    assert ours["map50"] == pytest.approx(evaluation.stats[1], abs=1e-9) and 0 < ours["map"] < ours["map50"] < 1


def test_coco_json_and_object_detection_tfrecords_read_the_same_boxes(shapes, tmp_path):
    from PIL import Image

    from edgeq.models.compat import tf

    x, y = shapes.split("test")
    images = (x[:12] * 255).round().astype(np.uint8)
    boxes, classes = y["gt_boxes"][:12], y["gt_classes"][:12]
    coco = {"images": [], "annotations": [], "categories": [{"id": 7, "name": "circle"}, {"id": 8, "name": "square"},
                                                             {"id": 9, "name": "triangle"}]}  # fmt: skip
    with tf.io.TFRecordWriter(str(tmp_path / "od.tfrecord")) as writer:
        for i, img in enumerate(images):
            Image.fromarray(img).save(tmp_path / f"{i}.png")
            coco["images"].append({"id": 100 + i, "file_name": f"{i}.png", "width": 64, "height": 64})
            real = classes[i] >= 0
            for box, cls in zip(boxes[i][real], classes[i][real]):
                ymin, xmin, ymax, xmax = (box * 64).tolist()
                bbox = [xmin, ymin, xmax - xmin, ymax - ymin]
                annotation = {"id": len(coco["annotations"]) + 1, "image_id": 100 + i, "iscrowd": 0, "bbox": bbox}
                coco["annotations"].append({**annotation, "category_id": int(cls) + 7})
            encoded = (tmp_path / f"{i}.png").read_bytes()
            labels = (classes[i][real] + 1).tolist()  # the Object Detection API counts classes from 1
            feature = {
                "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
                "image/object/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=labels)),
            }
            for k, key in enumerate(("ymin", "xmin", "ymax", "xmax")):
                values = boxes[i][real][:, k].tolist()
                feature[f"image/object/bbox/{key}"] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    (tmp_path / "ann.json").write_text(json.dumps(coco))
    for source in (f"coco:{tmp_path / 'ann.json'}", f"tfrecord:{tmp_path / 'od.tfrecord'}"):
        d = load_dataset(source, input_shape=(64, 64, 3))
        assert d.num_classes == 3
        got = {}
        for split in ("train", "val", "test"):
            xs, ys = d.split(split)
            for img, b, c in zip(xs, ys["gt_boxes"], ys["gt_classes"]):
                got[(img * 255).round().astype(np.uint8).tobytes()] = (b[c >= 0], c[c >= 0])
        for i in range(12):
            b, c = got[images[i].tobytes()]
            real = classes[i] >= 0
            np.testing.assert_allclose(b, boxes[i][real], atol=1e-5, err_msg=source)
            np.testing.assert_array_equal(c, classes[i][real])
    assert load_dataset(f"coco:{tmp_path / 'ann.json'}", input_shape=(64, 64, 3)).class_names == (
        "circle", "square", "triangle")  # fmt: skip


def test_the_zoo_detector_trains_converts_integer_only_and_is_judged_by_map(cli, detector, tmp_path):
    folder, data = detector
    run = json.loads((folder / "run" / "run.json").read_text())
    assert [o["task"] for o in run["outputs"]] == ["detection_boxes", "detection_scores"]
    assert [r["metric"] for r in run["results"]] == ["map50", "map50"]
    manifest = json.loads((folder / "det_int8.manifest.json").read_text())
    assert manifest["verification"]["integer_only"]
    assert manifest["detection"]["layout"] == "centre" and manifest["detection"]["classes"] == 3
    assert manifest["detection"]["class_names"] == ["circle", "square", "triangle"]
    assert {o["dtype"] for o in manifest["outputs"]} == {"int8"}  # boxes and scores: each its own scale
    scales = {o["name"]: o["scale"] for o in manifest["outputs"]}
    assert scales["boxes"] > 0 and scales["scores"] > 0
    result = cli("eval", folder / "det_int8.tflite", "--reference", folder / "run" / "fp32.keras", "--data", data,
                 "--json", tmp_path / "e.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    found = json.loads((tmp_path / "e.json").read_text())["detection"]
    assert found["images"] == 60 and found["objects"] > 60 and 0 <= found["map"] <= found["map50"] <= 1
    assert found["worse_by"] == pytest.approx((found["reference_map50"] - found["map50"]) * 100, abs=1e-3)
    verdict = found["verdict"]  # mAP@0.5 resampled over images: the interval is of the paired change
    assert (verdict["metric"], verdict["change_unit"], verdict["n"]) == ("map50", "points", 60)
    low, high = verdict["interval95"]
    assert low <= verdict["worse_by"] <= high and high > low
    assert "detection mAP@0.5" in result.stdout and "detection: mAP@0.5" in result.stdout and "95% CI" in result.stdout
    # a budget the model cannot meet fails in mAP points, with n and the interval
    gated = cli("eval", folder / "det_int8.tflite", "--reference", folder / "run" / "fp32.keras", "--data", data,
                "--max-drop", "-101")  # fmt: skip
    assert gated.exit_code == 4 and "mAP@0.5 " in gated.stderr and "points: FAIL" in gated.stderr, gated.stderr
    assert "n=60" in gated.stderr and "95% CI" in gated.stderr
    page = tmp_path / "r.html"
    assert cli("report", tmp_path / "e.json", folder / "det_int8.tflite", "--out", page).exit_code == 0
    assert "detection: mAP@0.5" in page.read_text() and "detection (centre)" in page.read_text()
    # analyze ranks layers by one output's metric: a detector (two heads, judged together by mAP) is refused
    analyzed = cli("analyze", "sensitivity", folder / "run" / "fp32.keras", "--data", data)
    assert_one_line_error(analyzed, "2 output(s)", "eval judge each output")


def test_edgetpu_conversion_of_the_detector_maps_every_op(cli, detector, tmp_path):
    folder, _ = detector
    out = tmp_path / "det_edgetpu.tflite"
    result = cli("convert", folder / "run" / "qat.h5", "--int8-only", "--io-type", "uint8", "--edgetpu", "--out", out)
    assert result.exit_code == 0, result.output
    edgetpu = json.loads(out.with_name("det_edgetpu.manifest.json").read_text())["edgetpu"]
    assert edgetpu["compatible"] and edgetpu["ops_mappable"] == edgetpu["ops_checked"]


def test_a_model_that_ends_in_nms_is_named_for_int8_only_and_kept_float_in_int8(cli, tmp_path):
    from edgeq.models.compat import keras

    image = keras.Input((8, 8, 3), batch_size=1, name="image")
    h = keras.layers.Conv2D(4, 3, padding="same", name="c")(image)
    boxes = keras.layers.Reshape((64, 4), name="boxes")(keras.layers.Conv2D(4, 1, name="bc")(h))
    scores = keras.layers.Reshape((64,), name="scores")(keras.layers.Conv2D(1, 1, activation="sigmoid", name="sc")(h))

    keras.Model(image, keras.layers.Lambda(_nms, name="nms")([boxes, scores])).save(tmp_path / "nms.h5")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).uniform(0, 1, (40, 8, 8, 3)).astype("f4"))
    args = ("convert", tmp_path / "nms.h5", "--ptq", "converter", "--calib", f"npz:{tmp_path / 'd.npz'}")
    refused = cli(*args, "--int8-only")
    assert refused.exit_code != 0 and "ends in NON_MAX_SUPPRESSION" in refused.stderr
    assert "box and score heads as two outputs" in refused.stderr
    assert cli(*args, "--int8", "--out", tmp_path / "f.tflite").exit_code == 0
    from edgeq.runtime.interpreter import TFLiteModel

    ops = {op.op_name: op for op in TFLiteModel(tmp_path / "f.tflite").ops()}
    assert any(name.startswith("NON_MAX_SUPPRESSION") for name in ops)


def _nms(heads):
    """A model's own post-processing: the 5 best boxes' scores after TensorFlow's NMS."""
    from edgeq.models.compat import tf

    boxes, scores = heads
    kept = tf.image.non_max_suppression(boxes[0], scores[0], 5)
    return tf.gather(scores[0], kept)[None]


def test_resampled_map50_is_pycocotools_map50_on_the_images_as_given():
    """The bootstrap reweights pycocotools' own matches: on every image once it is pycocotools' mAP@0.5,
    and an image drawn twice counts twice (its objects and detections both)."""
    from edgeq.tasks.detection import Detections, ResampledMap50, mean_average_precision

    rng = np.random.default_rng(4)
    gt_boxes = np.full((30, 3, 4), 0.0, np.float32)
    gt_classes = np.full((30, 3), -1, np.int64)
    found = []
    for i in range(30):
        k = rng.integers(1, 4)
        tops = rng.uniform(0, 0.6, (k, 2))
        gt_boxes[i, :k] = np.concatenate([tops, tops + rng.uniform(0.2, 0.4, (k, 2))], axis=1)
        gt_classes[i, :k] = rng.integers(0, 2, k)
        jitter = gt_boxes[i, :k] + rng.normal(0, 0.03, (k, 4))
        extra = rng.uniform(0, 1, (2, 4))
        found.append(Detections(np.concatenate([jitter, np.sort(extra, axis=1)]).astype(np.float32),
                                rng.uniform(0.1, 1.0, k + 2), np.concatenate([gt_classes[i, :k], [0, 1]])))  # fmt: skip
    resampled = ResampledMap50(found, gt_boxes, gt_classes, (64, 64), 2)
    assert resampled() == pytest.approx(
        mean_average_precision(found, gt_boxes, gt_classes, (64, 64), 2)["map50"], abs=1e-9
    )
    twice = np.concatenate([np.arange(30), np.arange(30)])
    assert resampled(twice) == pytest.approx(resampled(), abs=0.02)  # the same images twice: the same curve
    drawn = rng.integers(0, 30, 30)
    doubled = [found[i] for i in drawn]
    assert resampled(drawn) == pytest.approx(
        mean_average_precision(doubled, gt_boxes[drawn], gt_classes[drawn], (64, 64), 2)["map50"], abs=1e-9
    )


def test_coco_images_without_objects_load_and_broken_entries_are_named(tmp_path):
    """What the fuzzer found first: a COCO set whose images hold at most one object each, one of them
    none (only a crowd box), was refused as 'labels must be class indices >= 0' (its padded
    gt_classes were taken for class ids); and a broken entry raised a KeyError from the loader."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz

    (tmp_path / "ann.json").write_bytes(fuzz._coco_seed())
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(fuzz._png(i))
    d = load_dataset(f"coco:{tmp_path / 'ann.json'}", input_shape=(16, 16, 3))
    rows = np.concatenate([d.split(s)[1]["gt_classes"] for s in ("train", "val", "test")])
    assert sorted(rows[:, 0].tolist()) == [-1, 0, 1] and d.class_names == ("cat", "dog")
    record = json.loads(fuzz._coco_seed())
    del record["annotations"][0]["bbox"]
    (tmp_path / "ann.json").write_text(json.dumps(record))
    with pytest.raises(DataError, match="not a COCO annotation file.*bbox"):
        load_dataset(f"coco:{tmp_path / 'ann.json'}", input_shape=(16, 16, 3))
