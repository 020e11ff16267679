from pathlib import Path

import numpy as np
import pytest

from edgeq.data.sources import load_dataset
from edgeq.errors import DataError


def test_digits_is_real_and_split_is_fixed_and_stratified():
    a, b = load_dataset("digits"), load_dataset("digits")
    assert a.input_shape == (8, 8, 1) and a.num_classes == 10
    assert len(a.x_train) + len(a.x_val) + len(a.x_test) == 1797
    assert a.fingerprint() == b.fingerprint()
    assert set(np.unique(a.y_test)) == set(range(10))  # every class in test
    assert a.x_train.min() >= 0.0 and a.x_train.max() <= 1.0  # 0..16 scaled by 1/16
    assert a.normalization.scale == pytest.approx(1 / 16)


def test_calibration_samples_come_from_train_never_test():
    d = load_dataset("digits")
    cal = d.calibration_samples(200)
    assert cal.shape == (200, 8, 8, 1)
    train_rows = {r.tobytes() for r in d.x_train}
    assert all(r.tobytes() in train_rows for r in cal)
    batches = list(d.representative_dataset(5)())
    assert len(batches) == 5 and batches[0][0].shape == (1, 8, 8, 1)


def test_synthetic_is_deterministic_for_any_shape():
    a = load_dataset("synthetic:12x7x2:4")
    b = load_dataset("synthetic:12x7x2:4")
    assert a.input_shape == (12, 7, 2) and a.num_classes == 4
    assert np.array_equal(a.x_train, b.x_train)
    assert load_dataset("synthetic:12x7x2:4:90").describe()["train"] < a.describe()["train"]


def test_npz_source_and_its_errors(tmp_path):
    rng = np.random.default_rng(0)
    good = tmp_path / "d.npz"
    np.savez(good, x=rng.integers(0, 255, (60, 8, 8, 1), dtype=np.uint8), y=np.arange(60) % 3)
    d = load_dataset(f"npz:{good}")
    assert d.num_classes == 3 and d.normalization.scale == pytest.approx(1 / 255)
    assert d.x_train.max() <= 1.0

    empty = tmp_path / "empty.npz"
    np.savez(empty, x=np.zeros((0, 8, 8, 1), np.float32), y=np.zeros(0, np.int64))
    with pytest.raises(DataError, match="empty"):
        load_dataset(str(empty))
    nolabels = tmp_path / "nolabels.npz"
    np.savez(nolabels, x=np.zeros((10, 8, 8, 1), np.float32))
    with pytest.raises(DataError, match="no labels"):
        load_dataset(str(nolabels))
    assert len(load_dataset(str(nolabels), labels_required=False).x_train) > 0
    notnpz = tmp_path / "bad.npz"
    notnpz.write_text("hello")
    with pytest.raises(DataError, match="not a readable .npz"):
        load_dataset(str(notnpz))
    with pytest.raises(DataError, match="no such"):
        load_dataset(str(tmp_path / "missing.npz"))


def test_image_folder_is_resized_to_the_model_input(tmp_path):
    from PIL import Image

    for cls, value in (("cat", 30), ("dog", 220)):
        (tmp_path / cls).mkdir()
        for i in range(6):
            Image.fromarray(np.full((20, 30, 3), value + i, np.uint8)).save(tmp_path / cls / f"{i}.png")
    d = load_dataset(f"images:{tmp_path}", input_shape=(16, 16, 3))
    assert d.input_shape == (16, 16, 3) and d.class_names == ("cat", "dog")
    assert d.x_test.max() <= 1.0


def test_shape_that_does_not_fit_names_both_shapes():
    d = load_dataset("digits")
    with pytest.raises(DataError, match=r"\(8, 8, 1\).*\(32, 32, 3\)"):
        d.check_fits((32, 32, 3), where="model m.keras")


def test_unknown_source_says_what_is_possible():
    with pytest.raises(DataError, match="synthetic:HxWxC:K"):
        load_dataset("cifar10")


def _image_folder(root, per_class=9, size=(12, 10)):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("a", "b", "c"):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


def test_image_folder_is_listed_now_and_decoded_only_when_read(tmp_path):
    from PIL import Image

    root = _image_folder(tmp_path / "imgs")
    d = load_dataset(f"images:{root}", input_shape=(8, 8, 3))
    assert not d._decoded  # listing decoded nothing
    assert (d.count("train"), d.count("val"), d.count("test")) == (d.y_train.size, d.y_val.size, d.y_test.size)
    picked = d.calibration_samples(4)
    assert picked.shape == (4, 8, 8, 3) and "train" not in d._decoded  # 4 images decoded, not the split
    first = d.refs("test")[0]
    with Image.open(first) as img:
        expected = d.normalization.apply(np.asarray(img.convert("RGB").resize((8, 8))))
    np.testing.assert_array_equal(d.x_test[0], expected)
    # the recorded hash is the hash of the decoded samples, read in chunks
    chunked = d.fingerprint()
    from edgeq.data.splits import Dataset

    eager = Dataset(d.source, d.x_train, d.y_train, d.x_val, d.y_val, d.x_test, d.y_test, 3, d.normalization)
    assert chunked == eager.fingerprint()


def test_an_unreadable_file_in_an_image_folder_fails_at_listing(tmp_path):
    root = _image_folder(tmp_path / "imgs")
    (root / "b" / "broken.png").write_text("not a png")
    with pytest.raises(DataError, match=r"broken\.png: not a readable image"):
        load_dataset(f"images:{root}", input_shape=(8, 8, 3))


def test_tfrecord_source_reads_the_images_an_image_folder_holds(tmp_path):
    """The same images as TFRecords (image/encoded + image/class/label): same split, same pixels."""
    from edgeq.models.compat import tf

    root = _image_folder(tmp_path / "imgs")
    folder = load_dataset(f"images:{root}", input_shape=(8, 8, 3))
    paths = folder.refs("train") + folder.refs("val") + folder.refs("test")
    labels = np.concatenate([folder.y_train, folder.y_val, folder.y_test])
    order = np.argsort(paths, kind="stable")  # the folder's listing order: class, then file
    shards = [tmp_path / "rec-0.tfrecord", tmp_path / "rec-1.tfrecord"]
    for shard, part in zip(shards, np.array_split(order, 2)):
        with tf.io.TFRecordWriter(str(shard)) as writer:
            for k in part:
                encoded = Path(paths[k]).read_bytes()
                feature = {
                    "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
                    "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(labels[k])])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    records = load_dataset(f"tfrecord:{tmp_path}/rec-*.tfrecord", input_shape=(8, 8, 3))
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(records.split(split)[0], folder.split(split)[0])
        np.testing.assert_array_equal(records.split(split)[1], folder.split(split)[1])
    from edgeq.data.splits import Dataset

    eager = Dataset(records.source, *(a for s in ("train", "val", "test") for a in records.split(s)), 3)
    assert records.fingerprint() == eager.fingerprint()  # the hash streams the records once, in order
    with pytest.raises(DataError, match="no file matches"):
        load_dataset(f"tfrecord:{tmp_path}/none-*.tfrecord", input_shape=(8, 8, 3))
    (tmp_path / "bad.tfrecord").write_bytes(b"garbage that is no record")
    with pytest.raises(DataError, match=r"bad\.tfrecord: not a TFRecord"):
        load_dataset(f"tfrecord:{tmp_path}/bad.tfrecord", input_shape=(8, 8, 3))


def test_training_stream_is_the_split_shuffled_and_augmented_by_seed(tmp_path):
    from edgeq.train.pipeline import parse_augment, split_dataset

    root = _image_folder(tmp_path / "imgs")
    d = load_dataset(f"images:{root}", input_shape=(8, 8, 3))

    def epoch(**kw):
        xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in split_dataset(d, "train", 4, **kw)])
        return np.concatenate(xs), np.concatenate(ys)

    plain_x, plain_y = epoch()
    np.testing.assert_array_equal(plain_x, d.x_train)  # evaluation order: the split as it is
    shuffled_x, shuffled_y = epoch(training=True, seed=1)
    assert sorted(shuffled_y.tolist()) == sorted(plain_y.tolist()) and not np.array_equal(shuffled_x, plain_x)
    np.testing.assert_array_equal(epoch(training=True, seed=1)[0], shuffled_x)  # same seed, same order
    flips = parse_augment("flip,crop")
    augmented, _ = epoch(training=True, seed=1, augment=flips)
    again, _ = epoch(training=True, seed=1, augment=flips)
    np.testing.assert_array_equal(augmented, again)
    assert not np.array_equal(augmented, shuffled_x) and augmented.shape == shuffled_x.shape
    with pytest.raises(Exception, match="unknown rotate"):
        parse_augment("flip,rotate")


def _label_sorted_npz(path, classes=10, per_class=100):
    """An .npz saved class by class, as people save them: y = 0,0,...,1,1,...,9."""
    rng = np.random.default_rng(3)
    y = np.repeat(np.arange(classes), per_class)
    x = rng.uniform(0, 1, (len(y), 4, 4, 1)).astype(np.float32) + y[:, None, None, None] * 0.01
    np.savez(path, x=x, y=y)
    return path


def test_verification_and_calibration_samples_cover_every_class_of_a_sorted_source(tmp_path):
    """Splits keep file/label order, so the first N samples of a class-sorted source's val split
    are its first classes (2 of 10 here, before the fix); held-out and calibration samples are
    drawn stratified by class, and the --ptq choice gets its own, disjoint ones."""
    from PIL import Image

    d = load_dataset(f"npz:{_label_sorted_npz(tmp_path / 'sorted.npz')}")
    assert len(np.unique(d.y_val[:20])) == 2  # what index order gives
    val_rows = {r.tobytes(): int(c) for r, c in zip(d.x_val, d.y_val)}
    x, split = d.verification_samples(20)
    assert split == "val" and len({val_rows[r.tobytes()] for r in x}) == 10
    held = d.held_out(20)
    assert len(held.x) == 20 and held.classes == held.classes_in_split == 10
    # a choice between candidates and the verification after it: disjoint samples, both stratified
    both = d.held_out(40, select=40)
    assert len(both.x) == len(both.x_select) == 40 and both.classes == both.classes_select == 10
    assert not {r.tobytes() for r in both.x} & {r.tobytes() for r in both.x_select}
    # ten calibration samples: one of each class (a uniform draw of ten rarely covers all ten)
    train_rows = {r.tobytes(): int(c) for r, c in zip(d.x_train, d.y_train)}
    assert sorted(train_rows[r.tobytes()] for r in d.calibration_samples(10)) == list(range(10))

    root = tmp_path / "folder"  # an image folder lists class by class
    for cls in range(10):
        (root / f"c{cls}").mkdir(parents=True)
        for i in range(20):
            Image.fromarray(np.full((4, 4, 3), cls * 20 + i, np.uint8)).save(root / f"c{cls}" / f"{i}.png")
    images = load_dataset(f"images:{root}", input_shape=(4, 4, 3))
    assert len(np.unique(images.labels("val")[:10])) < 10
    part = images.held_out(10)
    assert part.classes == 10 and len(part.x) == 10
    assert sorted(int(v) // 20 for v in (part.x[:, 0, 0, 0] * 255).round()) == list(range(10))


def test_tfrecord_with_float_targets_feeds_a_regressor(tmp_path):
    """image/target (floats) instead of a class label: regression targets, through to training batches."""
    from PIL import Image

    from edgeq.models.compat import tf
    from edgeq.train.pipeline import split_dataset

    rng = np.random.default_rng(0)
    path = tmp_path / "reg.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(30):
            img = tmp_path / f"{i}.png"
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(img)
            feature = {
                "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[img.read_bytes()])),
                "image/target": tf.train.Feature(float_list=tf.train.FloatList(value=[i * 0.5, -i])),
            }
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    d = load_dataset(f"tfrecord:{path}", input_shape=(8, 8, 3))
    assert d.num_classes == 0 and d.describe()["targets"] == "float targets [2]"
    y = np.concatenate([d.y_train, d.y_val, d.y_test])
    assert y.dtype == np.float32 and sorted(y[:, 0].tolist()) == [i * 0.5 for i in range(30)]
    batch_x, batch_y = next(iter(split_dataset(d, "train", 4, training=True)))
    assert batch_x.shape == (4, 8, 8, 3) and batch_y.shape == (4, 2) and batch_y.dtype == tf.float32
