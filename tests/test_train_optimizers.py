"""``pdjax train``'s optimizers (:mod:`pdjax.apps.train.optimizers`): ``adamw``, weight
decay, global-norm clipping, learning-rate schedules and optimizers of your own, each
built as the optax chain it stands for; a short run with them; every refusal up front;
a resumed run refuses a changed optimizer."""

import dataclasses
import json
import textwrap

import jax
import numpy as np
import optax
import pytest

from pdjax.apps.cli import main
from pdjax.apps.train import TrainConfig, build_optimizer
from pdjax.apps.train.optimizers import describe, learning_rate, load_optimizer, run_updates
from pdjax.apps.train.resume import _resumable
from pdjax.errors import PipelineError


def _params():
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": np.ones(4, np.float32)}


def _updates(tx, steps=6, scale=5.0):
    """The updates ``tx`` makes over ``steps`` steps of large random gradients."""
    params = _params()
    state = tx.init(params)
    rng = np.random.default_rng(1)
    out = []
    for _ in range(steps):
        grads = jax.tree.map(lambda p: scale * rng.normal(size=p.shape).astype(np.float32), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out


def _same(a, b):
    for ua, ub in zip(_updates(a), _updates(b), strict=True):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9), ua, ub)


def _cfg(**kw):
    return TrainConfig(**{"model": "mlp", "devices": 2, "schedule": "1f1b", **kw})


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (dict(optimizer="adam", learning_rate=0.01), optax.adam(0.01)),
        (dict(optimizer="sgd", learning_rate=0.1), optax.sgd(0.1)),
        (dict(optimizer="momentum", learning_rate=0.1), optax.sgd(0.1, momentum=0.9)),
        (dict(optimizer="adamw", learning_rate=0.01), optax.adamw(0.01, weight_decay=1e-4)),
        (
            dict(optimizer="adamw", learning_rate=0.01, weight_decay=0.3),
            optax.adamw(0.01, weight_decay=0.3),
        ),
        (
            dict(optimizer="adam", learning_rate=0.01, clip_norm=0.5),
            optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.01)),
        ),
    ],
)
def test_each_option_builds_the_optax_chain_it_stands_for(kw, expected):
    _same(build_optimizer(_cfg(**kw), total_updates=100), expected)


def test_clipping_happens_before_the_optimizer():
    """Clipped before sgd, a large gradient moves by ``lr * clip_norm`` at most."""
    tx = build_optimizer(_cfg(optimizer="sgd", learning_rate=0.1, clip_norm=1.0), 10)
    for updates in _updates(tx):
        norm = float(optax.tree.norm(updates))
        assert norm == pytest.approx(0.1, rel=1e-5)


def test_warmup_cosine_schedule_from_the_runs_updates_or_decay_steps():
    cfg = _cfg(
        optimizer="adamw",
        learning_rate=0.01,
        weight_decay=0.05,
        clip_norm=2.0,
        lr_schedule="warmup-cosine",
        warmup_steps=2,
    )
    expected = optax.chain(
        optax.clip_by_global_norm(2.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 0.01, 2, 8, end_value=0.0), weight_decay=0.05
        ),
    )
    _same(build_optimizer(cfg, total_updates=8), expected)
    fixed = dataclasses.replace(cfg, decay_steps=5)
    schedule = learning_rate(fixed, total_updates=5)
    assert [float(schedule(i)) for i in (0, 1, 2, 5)] == pytest.approx([0, 0.005, 0.01, 0])
    assert float(learning_rate(cfg, 8)(8)) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(_cfg(learning_rate=0.3), 8) == 0.3
    assert "warmup-cosine (2 warmup of 8 updates)" in describe(cfg, 8)
    assert "clipped at global norm 2" in describe(cfg, 8)


def test_the_runs_updates_count_steps_or_microbatches():
    assert run_updates(_cfg(epochs=3, batch_size=64, microbatches=4), 1000) == 3 * 15
    assert run_updates(_cfg(schedule="pipedream", epochs=2, microbatches=4), 1000) == 2 * 62
    assert run_updates(_cfg(schedule="dp", epochs=1), 10) == 1


def _factory(tmp_path, body, name="opt.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_an_optimizer_of_your_own_gets_the_learning_rate(tmp_path):
    path = _factory(
        tmp_path,
        """
        import optax

        def make(learning_rate):
            return optax.chain(optax.scale_by_rms(), optax.scale_by_learning_rate(learning_rate))

        def fixed():
            return optax.sgd(0.5)

        ready = optax.sgd(0.25)
        """,
    )
    expected = optax.chain(optax.scale_by_rms(), optax.scale_by_learning_rate(0.02))
    _same(build_optimizer(_cfg(optimizer=f"{path}:make", learning_rate=0.02), 10), expected)
    clipped = _cfg(optimizer=f"{path}:make", learning_rate=0.02, clip_norm=1.0)
    _same(build_optimizer(clipped, 10), optax.chain(optax.clip_by_global_norm(1.0), expected))
    _same(build_optimizer(_cfg(optimizer=f"{path}:fixed"), 10), optax.sgd(0.5))
    _same(load_optimizer(f"{path}:ready", 1.0), optax.sgd(0.25))
    scheduled = _cfg(optimizer=f"{path}:make", lr_schedule="warmup-cosine", warmup_steps=1)
    build_optimizer(scheduled, 10)  # given the schedule
    with pytest.raises(PipelineError, match="takes no learning_rate"):
        build_optimizer(dataclasses.replace(scheduled, optimizer=f"{path}:fixed"), 10)


@pytest.mark.parametrize(
    ("body", "attr", "words"),
    [
        ("import optax\n", "missing", ["has no attribute 'missing'"]),
        ("def f(learning_rate):\n    return 3\n", "f", ["gave a int", "GradientTransformation"]),
        ("def f():\n    raise ValueError('no\\nmore')\n", "f", ["failed: ValueError: no"]),
        ("def f(a, learning_rate):\n    pass\n", "f", ["cannot call it", "defaults"]),
        ("raise RuntimeError('at import')\n", "f", ["importing", "RuntimeError: at import"]),
        ("def f(:\n", "f", ["syntax error"]),
    ],
)
def test_a_broken_optimizer_of_your_own_is_one_line(tmp_path, body, attr, words):
    path = _factory(tmp_path, body, name=f"broken_{abs(hash(body))}.py")
    with pytest.raises(PipelineError) as e:
        load_optimizer(f"{path}:{attr}", 0.1)
    assert "\n" not in str(e.value) and f"optimizer='{path}:{attr}'" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_a_module_not_on_the_path_is_named():
    with pytest.raises(PipelineError, match="no module 'no_such_pkg' on the path"):
        load_optimizer("no_such_pkg.mod:fn", 0.1)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(optimizer="adamx"), ["unknown optimizer 'adamx'", "package.module:fn"]),
        (dict(optimizer="mod:"), ["with both parts"]),
        (dict(optimizer=":fn"), ["with both parts"]),
        (dict(optimizer="adam", weight_decay=0.1), ["weight_decay is", "adamw"]),
        (dict(optimizer="adamw", weight_decay=-1.0), ["weight_decay must be >= 0"]),
        (dict(clip_norm=0.0), ["clip_norm must be > 0"]),
        (dict(clip_norm=float("nan")), ["clip_norm must be > 0"]),
        (dict(lr_schedule="cosine"), ["unknown lr_schedule 'cosine'"]),
        (dict(warmup_steps=3), ["warmup_steps is", "warmup-cosine"]),
        (dict(decay_steps=30), ["decay_steps is", "warmup-cosine"]),
        (dict(lr_schedule="warmup-cosine", warmup_steps=-1), ["warmup_steps must be >= 0"]),
        (
            dict(lr_schedule="warmup-cosine", warmup_steps=10, decay_steps=10),
            ["more than warmup_steps=10"],
        ),
    ],
)
def test_bad_combinations_are_refused(kw, words):
    with pytest.raises(PipelineError) as e:
        _cfg(**kw)
    for w in words:
        assert w in str(e.value)


def test_a_warmup_the_run_does_not_outlast_is_refused():
    cfg = _cfg(lr_schedule="warmup-cosine", warmup_steps=100, epochs=1)
    with pytest.raises(PipelineError, match="makes 50 optimizer updates in its 1 epoch,"):
        build_optimizer(cfg, total_updates=50)
    build_optimizer(dataclasses.replace(cfg, decay_steps=101), total_updates=50)


def test_an_older_checkpoints_settings_have_the_defaults():
    ours = dataclasses.asdict(_cfg())
    old = {k: v for k, v in ours.items() if k not in ("weight_decay", "clip_norm", "min_stages")}
    assert _resumable(old) == _resumable(ours)
    assert _resumable(dataclasses.asdict(_cfg(optimizer="adamw"))) != _resumable(ours)


def _train(tmp_path, *extra, out="o"):
    argv = ["train", "--model", "mlp", "--devices", "2", "--schedule", "1f1b", "--plan",
            "even", "--epochs", "2", "--no-plots", "--progress", "lines",
            "--out", str(tmp_path / out), *extra]  # fmt: skip
    return main(argv)


def test_a_short_run_with_adamw_clipping_and_warmup_cosine(tmp_path, capsys):
    extra = ["--optimizer", "adamw", "--weight-decay", "0.01", "--clip-norm", "1",
             "--lr-schedule", "warmup-cosine", "--warmup-steps", "5", "--lr", "0.01"]  # fmt: skip
    assert _train(tmp_path, *extra) == 0
    (summary,) = json.loads((tmp_path / "o" / "summary.json").read_text())
    cfg = summary["config"]
    assert (cfg["optimizer"], cfg["weight_decay"], cfg["clip_norm"]) == ("adamw", 0.01, 1.0)
    assert (cfg["lr_schedule"], cfg["warmup_steps"], cfg["decay_steps"]) == (
        "warmup-cosine",
        5,
        None,
    )
    assert summary["optimizer"].startswith("adamw (lr 0.01, weight decay 0.01), warmup-cosine")
    losses = [h["train_loss"] for h in summary["history"]]
    assert len(losses) == 2 and losses[1] < losses[0]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--optimizer", "sgd", "--weight-decay", "0.1"], ["--weight-decay", "adamw"]),
        (["--warmup-steps", "3"], ["--warmup-steps", "warmup-cosine"]),
        (["--decay-steps", "3"], ["--decay-steps", "warmup-cosine"]),
        (["--optimizer", "nope"], ["unknown optimizer 'nope'"]),
        (["--optimizer", "no_such_pkg:fn"], ["--optimizer 'no_such_pkg:fn'", "no module"]),
        (["--clip-norm", "0"], ["--clip-norm must be > 0"]),
        (["--weight-decay", "-1"], ["--weight-decay must be >= 0"]),
        (["--lr-schedule", "warmup-cosine", "--warmup-steps", "1000000"], ["--decay-steps"]),
        (["--lr-schedule", "warmup-cosine", "--warmup-steps", "9", "--decay-steps", "9"],
         ["more than --warmup-steps 9"]),
    ],
)  # fmt: skip
def test_the_cli_refuses_each_before_any_work(tmp_path, capsys, extra, words):
    try:
        rc = _train(tmp_path, *extra)
    except SystemExit as e:  # argparse's own
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err
    assert not (tmp_path / "o").exists()


def test_a_resumed_run_refuses_a_changed_optimizer(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    assert _train(tmp_path, "--epochs", "1", "--checkpoint-dir", ckpt) == 0
    rc = _train(tmp_path, "--optimizer", "adamw", "--checkpoint-dir", ckpt)
    err = capsys.readouterr().err
    assert rc == 2 and "differs in ['optimizer']" in err, err
    rc = _train(tmp_path, "--clip-norm", "1", "--checkpoint-dir", ckpt)
    err = capsys.readouterr().err
    assert rc == 2 and "differs in ['clip_norm']" in err, err
