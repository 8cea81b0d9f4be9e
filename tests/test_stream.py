"""Streamed input (:mod:`pdjax.apps.data.stream`) and the training loop on it: the order,
the input state a checkpoint keeps, a run killed mid-epoch and resumed against the same
run uninterrupted (bit for bit), bounded calls, and the refusals."""

import jax
import numpy as np
import pytest

from pdjax.apps import data
from pdjax.apps.data.stream import TrainStream, eval_chunks, split_identity
from pdjax.apps.train import TrainConfig, train
from pdjax.apps.train.planning import epoch_microbatches
from pdjax.errors import DataError, PipelineError
from pdjax.runners import Checkpointer


def _pairs(n=23, width=3):
    x = np.arange(n * width, dtype=np.int32).reshape(n, width)
    return x, x[:, 0] // width


def _stream(x, y, size=4, seed=0, state=None, identity=None):
    return TrainStream(x, y, size, seed=seed, identity=identity or {"d": 1}, state=state)


def test_each_pass_is_a_permutation_and_microbatches_run_across_passes():
    x, y = _pairs()
    s = _stream(x, y, size=4)
    got = np.concatenate([b[1] for b in s.take(23)])  # 92 samples: 4 passes
    s.close()
    passes = got.reshape(4, 23)
    for p in passes:
        assert sorted(p) == list(range(23))
    assert len({tuple(p) for p in passes}) == 4  # a new order each pass
    first = _stream(x, y, size=4, seed=1)
    assert not np.array_equal(np.concatenate([b[1] for b in first.take(6)]), got[:24])
    first.close()
    bx, by = _stream(x, y).take(1)[0]
    np.testing.assert_array_equal(bx[:, 0] // 3, by)  # rows stay paired


def test_a_stream_made_from_a_state_continues_with_the_next_microbatch():
    x, y = _pairs()
    whole = _stream(x, y)
    want = [b[1] for b in whole.take(17)]
    part = _stream(x, y)
    part.take(9)
    state = part.state()
    assert state["position"] == 9
    again = _stream(x, y, state=state)
    got = [b[1] for b in again.take(8)]
    for a, b in zip(want[9:], got, strict=True):
        np.testing.assert_array_equal(a, b)
    skipped = _stream(x, y)
    skipped.skip(9)
    np.testing.assert_array_equal(skipped.take(1)[0][1], want[9])
    for s in (whole, part, again, skipped):
        s.close()


@pytest.mark.parametrize(
    ("change", "word"),
    [({"seed": 1}, "seed"), ({"size": 5}, "size"), ({"identity": {"d": 2}}, "identity")],
)
def test_an_input_state_of_other_data_is_refused(change, word):
    x, y = _pairs()
    s = _stream(x, y)
    s.take(2)
    state = s.state()
    s.close()
    kw = {"seed": 0, "size": 4, "identity": {"d": 1}} | change
    with pytest.raises(DataError, match=rf"input state .* of other data \({word}"):
        TrainStream(x, y, kw["size"], seed=kw["seed"], identity=kw["identity"], state=state)


def test_eval_chunks_cover_the_split_in_order_a_chunk_at_a_time():
    x, y = _pairs(23)
    chunks = list(eval_chunks(x, y, 4, 2))
    assert [len(c) for c in chunks] == [2, 2, 2]
    rows = np.concatenate([b[1] for c in chunks for b in c])
    np.testing.assert_array_equal(rows, y)
    assert len(chunks[-1][-1][0]) == 3  # the last batch is the rest


def test_the_identity_follows_the_content():
    ds = data.digits()
    other = data.digits(seed=1)
    assert split_identity(ds) == split_identity(data.digits())
    assert split_identity(ds) != split_identity(other)


# -- the training loop on the stream ----------------------------------------------------------


def _cfg(**kw):
    base = dict(
        model="mlp",
        schedule="pipedream",
        devices=2,
        plan="even",
        epochs=3,
        epoch_steps=20,
        call_steps=3,
        batch_size=32,
        microbatches=2,
        learning_rate=3e-3,
    )
    return TrainConfig(**{**base, **kw})


class _Killed(Exception):
    pass


def test_a_run_killed_mid_epoch_resumes_with_the_same_batches_and_losses(tmp_path, monkeypatch):
    """Epochs of 40 microbatches (a pass over digits is 89): the run is killed at
    microbatch 55, in the middle of epoch 2, and resumed from the checkpoint of epoch 1:
    every epoch's losses, the weights and the microbatches fed after the resume equal the
    uninterrupted run's, across the pass boundary at 89."""
    cfg = _cfg()
    n = epoch_microbatches(cfg, data.digits(flatten=True).num_train)
    assert n == 40
    fed: dict[str, list[np.ndarray]] = {"whole": [], "resumed": []}
    good = TrainStream.take
    box = {"log": "whole", "kill_at": None}

    def take(self, count):
        if box["kill_at"] is not None and self.position + count > box["kill_at"]:
            raise _Killed
        got = good(self, count)
        fed[box["log"]].extend((self.position - count + i, x) for i, (x, _) in enumerate(got))
        return got

    monkeypatch.setattr(TrainStream, "take", take)
    whole = train(cfg, warmup=False)
    box.update(log="killed", kill_at=55)
    fed["killed"] = []
    with pytest.raises(_Killed):
        train(cfg, checkpoint_dir=tmp_path, warmup=False)
    assert Checkpointer(tmp_path).all_steps() == [1]
    box.update(log="resumed", kill_at=None)
    resumed = train(cfg, checkpoint_dir=tmp_path, warmup=False)
    assert resumed.resumed_epoch == 1
    assert [r.train_loss for r in resumed.history] == [r.train_loss for r in whole.history]
    assert [r.test_loss for r in resumed.history] == [r.test_loss for r in whole.history]
    for a, b in zip(
        jax.tree.leaves(whole.state.params), jax.tree.leaves(resumed.state.params), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    after = dict(fed["whole"])
    assert [k for k, _ in fed["resumed"]] == list(range(40, 120))  # from epoch 2's first
    for k, x in fed["resumed"]:
        np.testing.assert_array_equal(x, after[k])


def test_a_resume_on_other_data_is_refused_before_any_work(tmp_path, monkeypatch):
    cfg = _cfg(epochs=1, epoch_steps=2)
    train(cfg, checkpoint_dir=tmp_path, warmup=False)
    real = data.digits

    def shifted(seed=0, test_fraction=0.2, *, flatten=False):  # other samples, same name
        ds = real(seed=seed, test_fraction=test_fraction, flatten=flatten)
        return data.Dataset(
            ds.name, ds.train_x[::-1].copy(), ds.train_y[::-1].copy(), ds.test_x, ds.test_y, 10
        )

    monkeypatch.setattr(data, "digits", shifted)
    ran = []
    monkeypatch.setattr(TrainStream, "take", lambda *a: ran.append(a))
    with pytest.raises(DataError, match="input state saved with the run is of other data"):
        train(_cfg(epochs=2, epoch_steps=2), checkpoint_dir=tmp_path, warmup=False)
    assert not ran


def test_calls_are_bounded_and_an_epoch_takes_its_steps(monkeypatch):
    from pdjax.pipeline import Pipeline

    lengths = []
    real = Pipeline.run

    def run(self, state, microbatches, **kw):
        lengths.append(len(microbatches))
        return real(self, state, microbatches, **kw)

    monkeypatch.setattr(Pipeline, "run", run)
    result = train(_cfg(schedule="1f1b", epochs=2, epoch_steps=7, call_steps=3), warmup=False)
    assert lengths == [6, 6, 2, 6, 6, 2]  # 7 steps of 2 microbatches, 3 steps a call
    assert [r.updates for r in result.history] == [7, 14]


def test_bad_stream_settings_are_refused():
    with pytest.raises(PipelineError, match="epoch_steps must be an integer >= 1"):
        _cfg(epoch_steps=0)
    with pytest.raises(PipelineError, match="call_steps must be an integer >= 1"):
        _cfg(call_steps=-1)
    with pytest.raises(PipelineError, match=r"validation.* splits a token file"):
        _cfg(validation="0.2")
    x, y = _pairs(5)
    with pytest.raises(DataError, match="microbatches of 6 samples from a split of 5"):
        _stream(x, y, size=6)


# -- a token file ------------------------------------------------------------------------------


def _token_cfg(path, **kw):
    base = dict(
        model="llama",
        config="tiny",
        dataset=f"tokens:{path}",
        schedule="1f1b",
        devices=2,
        plan="even",
        epochs=3,
        epoch_steps=3,
        call_steps=2,
        batch_size=8,
        microbatches=2,
        seq_len=16,
    )
    return TrainConfig(**{**base, **kw})


def test_a_token_file_run_killed_mid_epoch_resumes_bit_identically(tmp_path, monkeypatch):
    """Llama tiny on a small token file (windows of 16 tokens, 10% validation): killed in
    epoch 3's second call, resumed from epoch 2's checkpoint, it ends with the losses and
    weights of the run that was never interrupted."""
    from pdjax.apps.data.tokens import write_random_tokens

    path = tmp_path / "t.bin"
    write_random_tokens(path, 4000, 64, seed=3)
    cfg = _token_cfg(path)
    whole = train(cfg, warmup=False)
    good = TrainStream.take

    def take(self, count):
        if self.position >= 2 * 6 + 4:  # epochs are 6 microbatches: epoch 3's second call
            raise _Killed
        return good(self, count)

    monkeypatch.setattr(TrainStream, "take", take)
    with pytest.raises(_Killed):
        train(cfg, checkpoint_dir=tmp_path / "ckpt", warmup=False)
    assert Checkpointer(tmp_path / "ckpt").all_steps() == [1, 2]
    extra = Checkpointer(tmp_path / "ckpt").extra(2)["input"]
    assert extra["position"] == 12 and extra["identity"]["file"]["bytes"] == 8000
    monkeypatch.setattr(TrainStream, "take", good)
    resumed = train(cfg, checkpoint_dir=tmp_path / "ckpt", warmup=False)
    assert resumed.resumed_epoch == 2
    assert [r.train_loss for r in resumed.history] == [r.train_loss for r in whole.history]
    assert [r.test_loss for r in resumed.history] == [r.test_loss for r in whole.history]
    for a, b in zip(
        jax.tree.leaves(whole.state.params), jax.tree.leaves(resumed.state.params), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    # the same name, other tokens: the saved input state is refused before any work
    path.unlink()
    path.with_name("t.bin.json").unlink()
    write_random_tokens(path, 4000, 64, seed=4)
    with pytest.raises(DataError, match="input state saved with the run is of other data"):
        train(_token_cfg(path, epochs=4), checkpoint_dir=tmp_path / "ckpt", warmup=False)


def test_pdjax_train_on_a_token_file_from_the_command_line(tmp_path, capsys):
    from pdjax.apps.cli import main
    from pdjax.apps.data.tokens import write_random_tokens

    path = tmp_path / "t.bin"
    val = tmp_path / "v.bin"
    write_random_tokens(path, 3000, 100, seed=1)
    write_random_tokens(val, 500, 100, seed=2)
    args = ["train", "--model", "llama", "--config", "tiny", "--dataset", f"tokens:{path}",
            "--validation", str(val), "--schedule", "gpipe", "--devices", "2", "--plan", "even",
            "--epochs", "1", "--epoch-steps", "2", "--batch-size", "8", "--microbatches", "2",
            "--seq-len", "16", "--out", str(tmp_path / "out"), "--no-plots"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out.lower() or "loss" in out.lower()
    # a validation split of a dataset with its own: refused, before any work
    assert main(["train", "--dataset", "digits", "--validation", "0.2", "--epochs", "1"]) != 0
    assert "--validation splits a token file" in capsys.readouterr().err


def test_a_token_files_microbatch_is_read_once_per_window_and_equals_the_views(tmp_path):
    from pdjax.apps.data.stream import _Read
    from pdjax.apps.data.tokens import token_dataset, write_random_tokens

    path = tmp_path / "t.bin"
    write_random_tokens(path, 3000, 50, seed=5)
    ds = token_dataset(path, 16)
    idx = np.array([7, 0, 101, 7])
    x, y = _Read(ds.train_x, ds.train_y)(idx)
    np.testing.assert_array_equal(x, ds.train_x[idx])
    np.testing.assert_array_equal(y, ds.train_y[idx])
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    x, y = _Read(ds.train_x, ds.test_y)(np.array([1, 2]))  # not a shifted pair: read apart
    np.testing.assert_array_equal(y, ds.test_y[np.array([1, 2])])
