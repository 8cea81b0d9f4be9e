"""Greedy generation through a pipeline's stages (``Pipeline.generate``) against greedy
decoding with the whole model applied on one device, token for token."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pdjax
from pdjax.errors import PipelineError
from pdjax.models import get_model
from pdjax.pipeline import Pipeline

CONTEXT = 16  # the tiny llama's context


@functools.cache
def _setup():
    """The tiny llama (untrained: random weights give varied argmaxes) over 2 stages, and
    its state."""
    spec = get_model("llama", "tiny")
    pipe = Pipeline(spec.layers, pdjax.even_stages(len(spec.layers), 2), spec.loss, optax.sgd(0.1))
    state = pipe.init(jax.random.key(0), spec.sample_input(2, jax.random.key(1)))
    return spec, pipe, state


@functools.cache
def _apply(layers):
    """The whole model's eval forward, jitted once per model (the tests share its
    compilations of each length)."""
    return jax.jit(lambda v, x: layers.apply(v, x, train=False)[0])


def _reference(spec, variables, prompts, new, context=None):
    """Greedy decoding with ``spec.layers.apply`` on one device: the whole sequence so
    far (its last ``context`` tokens) each step, no padding."""
    device = jax.devices()[0]
    variables = jax.device_put(jax.tree.map(np.asarray, variables), device)
    apply = _apply(spec.layers)
    seq = np.asarray(prompts, np.int32)
    for _ in range(new):
        window = seq if context is None else seq[:, -context:]
        logits = np.asarray(apply(variables, jnp.asarray(window)))
        seq = np.concatenate([seq, logits[:, -1].argmax(-1)[:, None].astype(np.int32)], 1)
    return seq


def _prompts(b, t, seed=0):
    return np.random.default_rng(seed).integers(0, 64, (b, t)).astype(np.int32)


def test_generate_matches_one_device_greedy():
    spec, pipe, state = _setup()
    prompts = _prompts(2, 13)
    got = pipe.generate(state, prompts, 4)
    want = _reference(spec, pipe.variables(state), prompts, 4)
    assert got.shape == (2, 17) and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert len(set(got[:, 13:].ravel().tolist())) > 1  # not one token repeated: a real test


def test_generate_slides_past_the_context():
    """With ``context=``, past the model's 16 tokens the window keeps the last 16."""
    spec, pipe, state = _setup()
    prompts = _prompts(2, 15, seed=1)
    got = pipe.generate(state, prompts, 4, context=CONTEXT)  # windows of 15, 16, 16, 16
    want = _reference(spec, pipe.variables(state), prompts, 4, context=CONTEXT)
    np.testing.assert_array_equal(got, want)
    assert got.shape == (2, 19)


def test_generate_refusals():
    _, pipe, state = _setup()
    with pytest.raises(PipelineError, match="prompts of one length, got lengths \\[2, 3\\]"):
        pipe.generate(state, [[1, 2, 3], [4, 5]], 2)
    with pytest.raises(PipelineError, match="2-D array of integer token ids"):
        pipe.generate(state, np.zeros((2, 3), np.float32), 2)
    with pytest.raises(PipelineError, match="max_new_tokens must be an integer >= 0"):
        pipe.generate(state, _prompts(1, 3), -1)
    # 6 new tokens after 12 feed windows of 17 (the last token is read off the 17 before
    # it), past the model's context of 16: said before any work, with the fix
    with pytest.raises(PipelineError, match=r"windows of 17 tokens.*pass context="):
        pipe.generate(state, _prompts(1, 12), 6)
    np.testing.assert_array_equal(pipe.generate(state, _prompts(2, 3), 0), _prompts(2, 3))


def test_generate_refuses_ids_past_the_vocabulary():
    """Ids past the model's vocabulary (the width of its logits, 64) would be read off
    the embedding clamped or filled: refused before any work, as ids of the wrong type
    or rank are, with or without new tokens."""
    _, pipe, state = _setup()
    for new in (3, 0):
        with pytest.raises(PipelineError, match=r"\[0, 64\).*got 100 at prompt 0, position 0"):
            pipe.generate(state, [[100, 5000, 2**30]], new)
    with pytest.raises(PipelineError, match=r"\[0, 64\).*got 64 at prompt 1, position 2"):
        pipe.generate(state, [[1, 2, 3], [4, 5, 64]], 1, context=CONTEXT)
    for bad in ([1, 2, 3], [[[1, 2]]], [[1.0, 2.0]], [[True, False]]):
        with pytest.raises(PipelineError, match="2-D array of integer token ids"):
            pipe.generate(state, bad, 1)
    assert pipe.generate(state, [[63, 0]], 1).shape == (1, 3)  # the last id is one


def test_generate_needs_logits():
    """A model whose outputs are not ``[B, T, V]`` logits is refused naming its shapes."""
    layers = pdjax.sequential(nn.Embed(8, 4), lambda x: x.mean(1))
    pipe = Pipeline(
        layers, pdjax.even_stages(2, 1), lambda y, t: ((y - t) ** 2).mean(), optax.sgd(0.1)
    )
    state = pipe.init(jax.random.key(0), np.zeros((2, 3), np.int32))
    with pytest.raises(PipelineError, match=r"causal language model.*float32\[2, 4\]"):
        pipe.generate(state, np.zeros((2, 3), np.int32), 1)


def _generate_cli(argv, capsys):
    """``pdjax generate ARGV``: its parser and run (the command, as ``pdjax.apps.cli``
    registers it), the text it printed."""
    import argparse

    from pdjax.apps.commands import generate

    parser = argparse.ArgumentParser(prog="pdjax", allow_abbrev=False)
    generate.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_generate_command_continues_a_train_checkpoint(tmp_path, capsys, caplog):
    """A checkpoint as ``pdjax train`` writes it (its settings and data identity beside the
    state of a 2-stage 1f1b pipeline on ``text``) is continued by ``pdjax generate`` (on
    one stage) as one-device greedy decoding of its weights continues it, through the
    dataset's characters."""
    import dataclasses

    from pdjax.apps.commands.generate import tokenizer_of
    from pdjax.apps.train import TrainConfig
    from pdjax.apps.train.model_data import build
    from pdjax.apps.train.resume import data_identity
    from pdjax.apps.train.runner import make_runner
    from pdjax.runners import Checkpointer

    cfg = TrainConfig(
        model="llama", dataset="text", schedule="1f1b", devices=2, plan="even", epochs=1
    )
    spec, ds = build(cfg)
    runner, _ = make_runner(cfg, spec, ds.train_x[:1])
    fresh = runner.init(jax.random.key(cfg.seed), np.asarray(ds.train_x[:8]))
    # weights no fresh pipeline of the run's seed has: a restore that kept its template
    # would decode otherwise
    noise = jax.random.key(7)
    params = tuple(
        jax.tree.map(lambda a: a + 0.5 * jax.random.normal(noise, a.shape, a.dtype), p)
        for p in fresh.params
    )
    state = fresh._replace(params=params)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        extra = {"config": dataclasses.asdict(cfg), "history": [], "run_id": "t"}
        ckpt.save(1, state, {**extra, "data": data_identity(ds)})
    encode, decode = tokenizer_of(ds)
    prompt = "import sys\ndef"  # 14 characters: the window slides past 16
    tokens = np.tile(encode(prompt)[None], (2, 1))  # the shapes of the tests above
    want = _reference(spec, runner.variables(state), tokens, 4, context=16)
    untrained = _reference(spec, runner.variables(fresh), tokens, 4, context=16)
    assert not np.array_equal(want, untrained)  # the check below can tell them apart
    assert decode(want[0, : len(prompt)]) == prompt
    text = prompt + decode(want[0, len(prompt) :]) + "\n"
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--prompt", prompt, "--max-new-tokens"]
    # restored from the run's 2 stages into 1 (moved layer by layer)
    with caplog.at_level("WARNING", logger="pdjax"):
        assert _generate_cli([*argv, "4", "--devices", "1"], capsys) == text
    # by default the tokens within the context came through the key/value cache (the rest,
    # past it, without: said once); without it (every token rerunning the window), the same
    assert any("tokens before them use it" in r.getMessage() for r in caplog.records)
    assert _generate_cli([*argv, "4", "--devices", "1", "--no-cache"], capsys) == text
    # refused before any work: no folder, a checkpoint without pdjax train's settings
    with pytest.raises(PipelineError, match="no such directory"):
        _generate_cli(["--checkpoint", str(tmp_path / "none"), "--prompt", "a"], capsys)
    with Checkpointer(tmp_path / "bare") as ckpt:
        ckpt.save(1, state)
    with pytest.raises(PipelineError, match="holds no pdjax train settings"):
        _generate_cli(["--checkpoint", str(tmp_path / "bare"), "--prompt", "a"], capsys)
