"""Offline datasets and batching: shapes, determinism, disjoint splits, resumable order."""

import collections

import numpy as np
import pytest

from pdjax.apps import data
from pdjax.errors import DataError


@pytest.fixture(scope="module")
def dig():
    return data.digits()


@pytest.fixture(scope="module")
def txt():
    return data.text(seq_len=16)


def _rows(x, y):
    return collections.Counter(
        a.tobytes() + b.tobytes() for a, b in zip(x, y.reshape(len(y), -1), strict=True)
    )


def test_digits_shapes_and_scaling(dig):
    assert dig.train_x.shape[1:] == (8, 8, 1) and dig.train_x.dtype == np.float32
    assert dig.train_y.dtype == np.int32 and dig.train_y.shape == (dig.num_train,)
    assert dig.num_train + dig.num_test == 1797 and dig.num_classes == 10
    assert dig.train_x.min() == 0.0 and dig.train_x.max() == 1.0
    flat = data.digits(flatten=True)
    assert flat.train_x.shape == (dig.num_train, 64)
    np.testing.assert_array_equal(flat.train_x, dig.train_x.reshape(-1, 64))
    with pytest.raises(ValueError):  # read-only arrays
        dig.train_x[0, 0, 0, 0] = 1.0


def test_digits_split_is_a_stratified_partition_fixed_by_seed(dig):
    from sklearn.datasets import load_digits

    raw = load_digits()
    full = _rows((raw.images / 16.0).astype(np.float32)[..., None], raw.target.astype(np.int32))
    assert _rows(dig.train_x, dig.train_y) + _rows(dig.test_x, dig.test_y) == full
    per_class = np.bincount(dig.test_y, minlength=10) / np.bincount(raw.target, minlength=10)
    np.testing.assert_allclose(per_class, 0.2, atol=0.01)
    again, other = data.digits(seed=0), data.digits(seed=1)
    np.testing.assert_array_equal(again.test_x, dig.test_x)
    assert not np.array_equal(other.test_x, dig.test_x)
    assert other.num_test == dig.num_test


def test_text_windows_targets_and_vocabulary(txt):
    assert txt.train_x.shape[1] == 16 and txt.train_x.dtype == np.int32
    assert txt.train_y.shape == txt.train_x.shape and txt.test_y.shape == txt.test_x.shape
    np.testing.assert_array_equal(txt.train_y[:, :-1], txt.train_x[:, 1:])
    np.testing.assert_array_equal(txt.test_y[:, :-1], txt.test_x[:, 1:])
    assert txt.vocab_size == txt.info["distinct_chars"] + 1 == len(txt.info["chars"])
    assert 0 < txt.train_x.min() and txt.train_x.max() < txt.vocab_size  # no UNK uncapped
    window = data.decode(txt, txt.train_x[0]) + data.decode(txt, txt.train_y[0, -1:])
    assert window in data._corpus()


def test_text_capped_vocabulary_maps_rare_characters_to_unk(txt):
    small = data.text(seq_len=16, vocab_size=32)
    assert small.vocab_size == 32 and small.train_x.max() < 32
    assert small.info["chars"] == txt.info["chars"][:32]  # most frequent first
    assert (small.train_x == data.UNK).any()
    keep = txt.train_x < 32
    np.testing.assert_array_equal(small.train_x[keep], txt.train_x[keep])
    assert (small.train_x[~keep] == data.UNK).all()
    assert data.text(seq_len=16, vocab_size=200).vocab_size == 200


def test_text_split_is_by_whole_blocks_and_fixed_by_seed(txt):
    blocks = txt.info["test_blocks"]
    assert len(blocks) == 10 == len(set(blocks))
    assert txt.num_test * 9 == txt.num_train  # equal windows per block, 10 of 100 held out
    # Every window lies inside one block of its own split (tables repeat, so windows are
    # located by every occurrence of their text in the corpus).
    corpus = data._corpus()
    size = len(corpus) // 100

    def blocks_of(window):
        found, o = set(), corpus.find(window)
        while o >= 0:
            if (o + len(window) - 1) // size == o // size:
                found.add(o // size)
            o = corpus.find(window, o + 1)
        return found

    for split, rows in ((set(blocks), txt.test_x[::3]), (None, txt.train_x[::20])):
        for row in rows:
            found = blocks_of(data.decode(txt, row))
            assert found & split if split else found - set(blocks)
    again, other = data.text(seq_len=16), data.text(seq_len=16, seed=1)
    np.testing.assert_array_equal(again.test_x, txt.test_x)
    assert other.info["test_blocks"] != blocks


def test_batches_cover_each_sample_at_most_once_and_depend_on_seed_and_epoch():
    x, y = np.arange(103), np.arange(103) * 2
    got = list(data.batches(x, y, 10, seed=3, epoch=1))
    assert len(got) == data.num_batches(103, 10) == 10
    seen = np.concatenate([bx for bx, _ in got])
    assert len(set(seen.tolist())) == 100
    assert all(bx.shape == (10,) and (by == 2 * bx).all() for bx, by in got)
    same = np.concatenate([bx for bx, _ in data.batches(x, y, 10, seed=3, epoch=1)])
    np.testing.assert_array_equal(seen, same)
    for seed, epoch in [(3, 2), (4, 1)]:
        other = np.concatenate([bx for bx, _ in data.batches(x, y, 10, seed=seed, epoch=epoch)])
        assert not np.array_equal(seen, other)
    full = list(data.batches(x, y, 10, seed=3, epoch=1, drop_last=False))
    assert len(full) == 11 and len(full[-1][0]) == 3
    assert sorted(np.concatenate([bx for bx, _ in full]).tolist()) == list(range(103))


def test_start_resumes_exactly_where_skipping_would():
    x, y = np.arange(50), np.arange(50)
    whole = list(data.batches(x, y, 8, seed=0, epoch=2))
    for start in (0, 3, 6):
        resumed = list(data.batches(x, y, 8, seed=0, epoch=2, start=start))
        assert len(resumed) == len(whole) - start
        for (a, _), (b, _) in zip(resumed, whole[start:], strict=True):
            np.testing.assert_array_equal(a, b)
    stream = [bx for e in range(3) for bx, _ in data.batches(x, y, 8, seed=0, epoch=e)]
    epoch, start = data.resume_point(10, 50, 8)
    assert (epoch, start) == (1, 4)
    first = next(data.batches(x, y, 8, seed=0, epoch=epoch, start=start))[0]
    np.testing.assert_array_equal(first, stream[10])


def test_eval_batches_cover_the_set_in_order_with_a_mask(dig):
    got = list(dig.test_batches(64))
    assert len(got) == -(-dig.num_test // 64)
    assert all(bx.shape == (64, 8, 8, 1) and mask.shape == (64,) for bx, _, mask in got)
    xs = np.concatenate([bx[mask] for bx, _, mask in got])
    ys = np.concatenate([by[mask] for _, by, mask in got])
    np.testing.assert_array_equal(xs, dig.test_x)
    np.testing.assert_array_equal(ys, dig.test_y)
    assert int(sum(mask.sum() for *_, mask in got)) == dig.num_test


def test_bad_requests_fail_at_the_call():
    x = np.arange(10)
    with pytest.raises(DataError, match="batch_size"):
        data.batches(x, x, 0, seed=0, epoch=0)
    with pytest.raises(DataError, match="start"):
        data.batches(x, x, 4, seed=0, epoch=0, start=3)
    with pytest.raises(DataError, match="non-negative"):
        data.batches(x, x, 4, seed=-1, epoch=0)
    with pytest.raises(DataError, match="differ"):
        data.eval_batches(x, x[:5], 4)
    with pytest.raises(DataError, match="test_fraction"):
        data.digits(test_fraction=1.0)
    with pytest.raises(DataError, match="vocab_size"):
        data.text(vocab_size=1)
    with pytest.raises(DataError, match="decode"):
        data.decode(data.digits(), np.zeros(3, np.int32))


# -- .npz datasets of your own ---------------------------------------------------------------


def _npz(tmp_path, name="d.npz", **overrides):
    rng = np.random.default_rng(0)
    arrays = dict(
        x_train=rng.normal(size=(20, 6)),  # float64: read as float32
        y_train=(np.arange(20) % 3).astype(np.int64),  # int64: read as int32
        x_test=rng.normal(size=(5, 6)),
        y_test=np.arange(5) % 3,
    )
    arrays.update(overrides)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def test_load_npz_reads_the_four_arrays_in_32_bits(tmp_path):
    path = _npz(tmp_path, extra=np.ones(3))
    ds = data.load_npz(path)
    assert ds.name == "d.npz" and ds.info["path"] == str(path.resolve())
    assert (ds.num_train, ds.num_test, ds.num_classes) == (20, 5, 3)
    assert ds.train_x.dtype == np.float32 and ds.train_y.dtype == np.int32
    assert ds.info["ignored"] == ("extra",)
    with np.load(path) as raw:
        np.testing.assert_array_equal(ds.test_x, raw["x_test"].astype(np.float32))
        np.testing.assert_array_equal(ds.train_y, raw["y_train"])
    x, y = next(ds.train_batches(4, seed=0, epoch=0))
    assert x.shape == (4, 6) and y.shape == (4,)
    assert data.load_npz(_npz(tmp_path, "n.npz", num_classes=np.int64(7))).num_classes == 7
    floats = data.load_npz(_npz(tmp_path, "f.npz", y_train=np.ones(20), y_test=np.ones(5)))
    assert floats.num_classes == 0 and floats.train_y.dtype == np.float32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(y_test=None), r"has no y_test \(it holds x_train, y_train, x_test\)"),
        (dict(x_train=None, y_train=None), r"has no x_train, y_train"),
        (dict(y_train=np.zeros(19, np.int32)), r"x_train has 20 rows but y_train has 19"),
        (dict(x_test=np.zeros((5, 7))), r"x_train has rows of shape \(6,\) but x_test \(7,\)"),
        (dict(x_test=np.zeros((0, 6)), y_test=np.zeros(0)), r"x_test and y_test are empty"),
        (dict(y_train=np.array(["a"] * 20)), r"y_train is a <U1\[20\] array"),
        (dict(x_train=np.float64(1.0)), r"x_train is a float64\[\] array"),
        (dict(num_classes=np.int64(2)), r"num_classes must be one integer >= 3"),
    ],
)
def test_load_npz_names_the_file_and_the_arrays_that_are_wrong(tmp_path, overrides, message):
    path = _npz(tmp_path, **overrides)
    with pytest.raises(DataError, match=message) as e:
        data.load_npz(path)
    assert str(path) in str(e.value)


def test_load_npz_refuses_what_is_not_an_npz_of_plain_arrays(tmp_path):
    with pytest.raises(DataError, match=r"does not exist; an \.npz dataset is written with"):
        data.load_npz(tmp_path / "missing.npz")
    with pytest.raises(DataError, match="is a folder"):
        data.load_npz(tmp_path)
    (tmp_path / "text.npz").write_text("not numpy")
    with pytest.raises(DataError, match="cannot read dataset file"):
        data.load_npz(tmp_path / "text.npz")
    np.save(tmp_path / "one.npy", np.ones(3))
    with pytest.raises(DataError, match=r"holds a single array \(.npy\)"):
        data.load_npz(tmp_path / "one.npy")
    objects = np.empty(20, object)
    np.savez(tmp_path / "obj.npz", x_train=objects, y_train=objects, x_test=objects, y_test=objects)
    with pytest.raises(DataError, match="pickled"):
        data.load_npz(tmp_path / "obj.npz")


def test_fit_to_sample_checks_shapes_dtypes_and_labels(tmp_path):
    ds = data.load_npz(_npz(tmp_path))
    sample = (np.zeros((2, 6), np.float32), np.zeros((2,), np.int32))
    assert data.fit_to_sample(ds, sample) is ds  # fits as it is
    fitted = data.fit_to_sample(ds, sample, num_classes=10)
    assert fitted.num_classes == 10
    bf16 = data.fit_to_sample(ds, (sample[0].astype("bfloat16"), sample[1].astype(np.int8)))
    assert bf16.train_x.dtype.name == "bfloat16" and bf16.test_y.dtype == np.int8
    with pytest.raises(DataError, match=r"x_train has rows of shape \(6,\).*\(8, 8, 1\)"):
        data.fit_to_sample(ds, (np.zeros((2, 8, 8, 1), np.float32), sample[1]))
    with pytest.raises(DataError, match=r"y_train holds labels 0\.\.2 but the model has 2 classes"):
        data.fit_to_sample(ds, sample, num_classes=2)
    with pytest.raises(DataError, match=r"y_train holds float32 values.*store y_train and y_test"):
        floats = data.load_npz(_npz(tmp_path, "f.npz", y_train=np.ones(20), y_test=np.ones(5)))
        data.fit_to_sample(floats, sample)
    ints = data.load_npz(_npz(tmp_path, "i.npz", x_train=np.ones((20, 6), np.uint8)))
    assert data.fit_to_sample(ints, sample).train_x.dtype == np.float32  # int -> float: fine
    with pytest.raises(DataError, match="has 2 arrays as x"):
        data.fit_to_sample(ds, ((sample[0], sample[0]), sample[1]))
