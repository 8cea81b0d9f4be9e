"""Settings that would not mean what they say (issue 44, items 4, 9 and 10): learning-rate
settings an optimizer of your own cannot take, a schedule that ends before the run, numbers
float32 holds as 0 or infinity and calibration times whose sums overflow, refused before
any work; a factory called once; a divergence that names what sizes the steps; an
optimizer's own failure named as such; and a mask function that reads the parameters'
names (Hugging Face's ``decay_mask_fn``) given the names of the user's tree."""

import json

import flax
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from reference import mean_update

import pdjax
from pdjax.apps.cli import main
from pdjax.apps.train import TrainConfig, build_optimizer, train
from pdjax.apps.train.optimizers import describe
from pdjax.calibrate import Calibration, LinkMeasure, StageMeasure
from pdjax.errors import CalibrationError, PipelineError, TrainingDiverged
from pdjax.schedules import ScheduleSpec

OPTIMIZERS = """
import optax

INSTANCE = optax.sgd(0.1)

def make(learning_rate):
    print("factory called")
    return optax.adam(learning_rate)

def fixed():
    return optax.sgd(0.2)
"""


@pytest.fixture
def opts(tmp_path):
    path = tmp_path / "opts.py"
    path.write_text(OPTIMIZERS)
    return str(path)


def _cfg(**kw):
    return TrainConfig(**{"model": "mlp", "devices": 2, "schedule": "1f1b", "plan": "even", **kw})


def _train_cli(tmp_path, *extra):
    argv = ["train", "--model", "mlp", "--devices", "2", "--schedule", "1f1b", "--plan",
            "even", "--epochs", "1", "--no-plots", "--progress", "lines",
            "--out", str(tmp_path / "o"), *extra]  # fmt: skip
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own
        return e.code


# -- item 4: settings that do not reach the optimizer ------------------------------------------


def test_an_optax_object_refuses_learning_rate_settings_and_the_summary_says_what_applied(opts):
    instance = f"{opts}:INSTANCE"
    given = dict(learning_rate=0.5, lr_schedule="warmup-cosine", warmup_steps=3)
    with pytest.raises(PipelineError) as e:
        build_optimizer(_cfg(optimizer=instance, **given), total_updates=22)
    # the library names keywords; the command line, flags (the test below)
    for words in ("learning_rate=0.5, lr_schedule='warmup-cosine', warmup_steps=3",
                  "cannot reach it",
                  f"{opts}:make with def make(learning_rate)"):  # fmt: skip
        assert words in str(e.value)
    with pytest.raises(
        PipelineError, match=r"takes no learning_rate, so learning_rate=0\.5 cannot"
    ):
        build_optimizer(_cfg(optimizer=f"{opts}:fixed", learning_rate=0.5), total_updates=22)
    # without them each keeps its own settings, and the summary says so (no "lr 0.001")
    assert build_optimizer(_cfg(optimizer=instance), 22) is not None
    assert describe(_cfg(optimizer=instance), 22) == f"{instance} (its own settings)"
    assert describe(_cfg(optimizer=f"{opts}:fixed", clip_norm=1.0), 22) == (
        f"{opts}:fixed (its own learning rate), clipped at global norm 1"
    )


def test_the_command_refuses_them_before_any_work_and_calls_a_factory_once(tmp_path, opts, capsys):
    extra = ["--optimizer", f"{opts}:INSTANCE", "--lr", "0.5", "--lr-schedule",
             "warmup-cosine", "--warmup-steps", "3"]  # fmt: skip
    assert _train_cli(tmp_path, *extra) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot reach it" in err, err
    assert "--lr 0.5 --lr-schedule warmup-cosine --warmup-steps 3" in err, err
    assert not (tmp_path / "o").exists()
    # a factory: called once in a run (not once per check and once more for the runner)
    assert _train_cli(tmp_path, "--optimizer", f"{opts}:make", "--lr", "0.01") == 0
    assert capsys.readouterr().out.count("factory called") == 1
    (summary,) = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["optimizer"] == f"{opts}:make (lr 0.01)"


# -- item 9: nonsense numbers ------------------------------------------------------------------


def test_a_schedule_that_ends_before_the_run_is_refused_with_its_numbers():
    cfg = _cfg(lr_schedule="warmup-cosine", warmup_steps=1, decay_steps=2, epochs=3)
    with pytest.raises(PipelineError) as e:
        build_optimizer(cfg, total_updates=66)
    for words in ("decay_steps=2", "learning rate of 0 at update 2", "66 optimizer updates",
                  "its last 64 would not train", "decay_steps=66 or more"):  # fmt: skip
        assert words in str(e.value)
    build_optimizer(cfg, total_updates=2)  # a run the schedule lasts


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(learning_rate=1e-320), ["learning_rate=1e-320", "smallest normal", "where it is 0"]),
        (dict(clip_norm=1e-300), ["clip_norm=1e-300", "clipped to 0"]),
        (dict(optimizer="adamw", weight_decay=1e-40), ["weight_decay=1e-40", "subnormal"]),
        (dict(learning_rate=1e39), ["learning_rate=1e+39", "infinite"]),
    ],
)
def test_numbers_that_float32_holds_as_zero_or_infinity_are_refused(kw, words):
    with pytest.raises(PipelineError) as e:
        _cfg(**kw)
    for w in words:
        assert w in str(e.value)


def _calibration_json():
    points = {"sizes": (4096, 65536), "seconds": (1e-4, 6e-4)}
    cal = Calibration(
        model={"layers": ["a", "b"], "param_bytes": [4096, 4096]},
        microbatch_size=4,
        devices=(0, 1),
        stages=(StageMeasure(0, 0, 1, "split", 0.01, 0.02, 0.004, rows=4),),
        links=(LinkMeasure(0, 1, latency=1e-4, bandwidth=1e8, **points),),
    )
    return json.loads(json.dumps(cal.to_json()))


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        (("stages", 0, "forward"), 1e308, r"stages\[0\]\.forward: 1e\+308 s is not a time"),
        (("stages", 0, "update"), 1e7, r"stages\[0\]\.update: 1e\+07 s"),
        (("links", 0, "latency"), 1e308, r"links\[0\]\.latency: 1e\+308 s"),
        (("links", 0, "seconds", 1), 1e300, r"links\[0\]\.seconds\[1\]: 1e\+300 s"),
        (("links", 0, "bandwidth"), 1e-300, r"links\[0\]\.bandwidth: must be at least 1"),
        (("profile_ratio",), 1e308, r"profile_ratio: must be at most 1e\+06"),
    ],
)
def test_calibration_times_whose_sums_overflow_are_refused(where, value, field):
    data = _calibration_json()
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    with pytest.raises(CalibrationError, match=field):
        Calibration.from_json(data, "cal.json")


# -- item 10: messages that blame the wrong thing ----------------------------------------------


def test_a_divergence_names_every_setting_that_sizes_the_steps():
    cfg = _cfg(optimizer="adamw", weight_decay=1e6, epochs=1, batch_size=32, microbatches=2)
    with pytest.raises(TrainingDiverged) as e:
        train(cfg, warmup=False)
    message = str(e.value)
    assert "learning_rate=0.001 and weight_decay=1e+06, any of which may be too large" in message
    assert "Lower" not in message and "--" not in message


def _dense_pipeline(optimizer):
    layers = pdjax.sequential(nn.Dense(4), nn.relu, nn.Dense(3))
    return pdjax.Pipeline(
        layers,
        pdjax.even_stages(3, 2),
        optax.l2_loss,
        optimizer,
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )


def test_an_optimizer_whose_init_fails_is_named_not_taken_for_coupling():
    def init(params):
        raise ValueError("no state for you")

    broken = optax.GradientTransformation(init, optax.sgd(0.1).update)
    pipe = _dense_pipeline(broken)
    with pytest.raises(PipelineError) as e:
        pipe.init(jax.random.key(0), np.ones((2, 5), np.float32))
    message = str(e.value)
    assert "init(params) raised ValueError: no state for you" in message, message
    assert "couples" not in message
    assert isinstance(e.value.__cause__, ValueError)


# -- item 10: a mask function reads the user's names -----------------------------------------


class Block(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(2 * self.dim, name="fc")(h))
        return x + nn.Dense(self.dim, name="proj")(h)


class TiedLM(nn.Module):
    """A GPT-like model whose output head is its token embedding (``attend``)."""

    vocab: int = 16
    dim: int = 8

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.dim, name="wte")
        x = embed(tokens)
        for i in range(2):
            x = Block(self.dim, name=f"h_{i}")(x)
        return embed.attend(nn.LayerNorm(name="final_norm")(x))


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _hf_decay_mask(seen: set[tuple[str, ...]]):
    """Hugging Face's ``decay_mask_fn`` (no decay on biases and norms), which reads the
    parameters' names; the names it was given are added to ``seen``."""

    def decay_mask_fn(params):
        flat = flax.traverse_util.flatten_dict(params)
        seen.update(flat)
        return flax.traverse_util.unflatten_dict(
            {k: k[-1] != "bias" and "norm" not in "".join(k).lower() for k in flat}
        )

    return decay_mask_fn


def test_a_mask_function_gets_the_users_names_and_trains_as_the_sequential_reference():
    """Hugging Face's weight-decay mask on a split model with a tied embedding: its names
    are the model's, the optimizer acts per leaf (no coupling), and two steps of a 3-stage
    pipeline equal two steps of the whole model with the same optimizer."""
    seen: set[tuple[str, ...]] = set()
    decay_mask_fn = _hf_decay_mask(seen)

    optimizer = optax.adamw(1e-3, weight_decay=0.1, mask=decay_mask_fn)
    model = TiedLM()
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        x = rng.integers(0, 16, (8, 6)).astype(np.int32)
        batches.append((x, np.roll(x, -1, axis=1)))
    layers = pdjax.split_model(model, batches[0][0][:4])
    assert layers.tied  # the embedding, read by the first layer and the last
    pipe = pdjax.Pipeline(
        layers,
        pdjax.even_stages(3, 3),
        _xent,
        optimizer,
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
    state = pipe.init(jax.random.key(1), batches[0][0][:4])
    assert not pipe.coupled
    params = layers.model_variables(pipe.variables(state))["params"]
    names = set(flax.traverse_util.flatten_dict(params))
    assert seen and seen <= names and ("wte", "embedding") in seen

    grad = jax.jit(jax.grad(lambda p, x, y: _xent(model.apply({"params": p}, x), y)))
    update = mean_update(optimizer)
    opt_state = optimizer.init(params)
    for x, y in batches:
        state, _ = pipe.step(state, (x, y))
        grads = [grad(params, x[k : k + 4], y[k : k + 4]) for k in (0, 4)]
        params, opt_state = update(grads, opt_state, params)
    piped = layers.model_variables(pipe.variables(state))["params"]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
        piped,
        params,
    )


def test_a_mask_function_with_global_norm_clipping_gets_the_users_names_too():
    """Clipped by the global norm, the stages exchange it through a phantom leaf, which the
    mask function sees as one more name beside the stage's own."""
    seen = set()

    def decay_mask_fn(params):
        flat = flax.traverse_util.flatten_dict(params)
        seen.update(flat)
        return flax.traverse_util.unflatten_dict({k: k[-1] != "bias" for k in flat})

    optimizer = optax.chain(
        optax.clip_by_global_norm(1e-3), optax.adamw(1e-3, weight_decay=0.1, mask=decay_mask_fn)
    )
    x = np.random.default_rng(1).integers(0, 16, (4, 6)).astype(np.int32)
    layers = pdjax.split_model(TiedLM(), x)
    pipe = pdjax.Pipeline(
        layers,
        pdjax.even_stages(3, 3),
        _xent,
        optimizer,
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
    state = pipe.init(jax.random.key(1), x[:2])
    assert pipe.coupled
    names = set(flax.traverse_util.flatten_dict(layers.model_variables(pipe.variables(state))))
    assert {("params", *k) for k in seen - {("pdjax_phantom",)}} <= names
    assert ("pdjax_phantom",) in seen


class UntiedLM(nn.Module):
    """TiedLM with a head of its own (data parallelism refuses tied parameters)."""

    vocab: int = 16
    dim: int = 8

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim, name="wte")(tokens)
        for i in range(2):
            x = Block(self.dim, name=f"h_{i}")(x)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="final_norm")(x))


def test_data_parallelism_gives_a_mask_function_the_users_names_too():
    """The data-parallel runner holds split_model's parameters as a per-layer list too: the
    mask function reads the model's names there as well, and a step equals the user's own
    update of the whole model."""
    seen: set[tuple[str, ...]] = set()
    decay_mask_fn = _hf_decay_mask(seen)

    optimizer = optax.adamw(1e-3, weight_decay=0.1, mask=decay_mask_fn)
    model = UntiedLM()
    x = np.random.default_rng(2).integers(0, 16, (8, 6)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    layers = pdjax.split_model(model, x)
    dp = pdjax.DataParallel(layers, _xent, optimizer, devices=jax.devices()[:2])
    state = dp.init(jax.random.key(1), x)
    params = layers.model_variables([{"params": p} for p in state.params])["params"]
    assert ("wte", "embedding") in seen and seen == set(flax.traverse_util.flatten_dict(params))

    @jax.jit
    def user_step(p):  # the user's own update of the whole model, one program
        grad = jax.grad(lambda q: _xent(model.apply({"params": q}, x), y))(p)
        updates, _ = optimizer.update(grad, optimizer.init(p), p)
        return optax.apply_updates(p, updates)

    want = user_step(params)
    state, _ = dp.step(state, (x, y))
    got = layers.model_variables([{"params": p} for p in state.params])["params"]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
        got,
        want,
    )
