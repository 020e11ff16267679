import numpy as np
import pytest

from edgeq.data import load_dataset
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
