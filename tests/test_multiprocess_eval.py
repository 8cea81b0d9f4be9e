"""Evaluation, prediction and greedy generation of a pipeline across processes: 2
processes x 2 CPU devices (``pdjax.distributed.launch_local`` on 127.0.0.1) compute what
the same pipeline computes in one process on 4 devices.

One launch runs every scenario (each worker saves its results); the tests compare them
with this process's runs of the same plans and weights.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import jax
import numpy as np
import optax

from pdjax.schedules import ScheduleSpec

ROOT = Path(__file__).resolve().parent.parent
ROWS = (8, 8, 5)  # the evaluation batches: the last one's rows split over no stage of 2
#: Stage 1 replicated on devices 1 and 2, one in each process: activations cross processes
#: into it and out of it, split by rows or (the batch of 5 rows) whole. (Between
#: one-device stages of two processes, as in the llama run, values cross whole.)
PLANS = ("span",)


def _accuracy(outputs, targets):
    """An evaluation-only metric (one function object: the programs compile once)."""
    return {"acc": (outputs.argmax(-1) == targets).mean()}


def _mlp(plan: str):
    """The tiny MLP on 4 devices (the same in every process: init from one key), and its
    evaluation batches; ``plan`` "span" (see :data:`PLANS`) or 4 one-device stages."""
    from pdjax.models import get_model
    from pdjax.partition import StagePlan
    from pdjax.pipeline import Pipeline, even_stages

    spec = get_model("mlp", "tiny")
    if plan == "span":
        stages = [StagePlan(0, 0, (0,)), StagePlan(1, 1, (1, 2)), StagePlan(2, 3, (3,))]
    else:
        stages = even_stages(len(spec.layers), 4)
    pipe = Pipeline(
        spec.layers,
        stages,
        spec.loss,
        optax.sgd(0.1),
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
    x, y = spec.sample_batch(sum(ROWS), jax.random.key(5))
    bounds = np.cumsum((0, *ROWS))
    batches = [(x[a:b], y[a:b]) for a, b in itertools.pairwise(bounds)]
    state = pipe.init(jax.random.key(3), x[:4])
    return spec, pipe, state, batches, (x, y)


def _token_lm():
    """A small token model over 4 one-device stages (embedding, dense, tanh, logits: cheap
    to compile, where the tiny llama's init costs seconds per process), and its prompts.
    Its positions do not mix, which these transfers do not depend on; the llama's causal
    attention is decoded through the stages in tests/test_generate.py."""
    import flax.linen as nn
    import jax.numpy as jnp

    from pdjax.layers import sequential
    from pdjax.pipeline import Pipeline, even_stages

    def loss(logits, targets):
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    layers = sequential(nn.Embed(64, 16), nn.Dense(16), jnp.tanh, nn.Dense(64))
    pipe = Pipeline(layers, even_stages(4, 4), loss, optax.sgd(0.1))
    prompts = np.random.default_rng(0).integers(0, 64, (2, 5)).astype(np.int32)
    state = pipe.init(jax.random.key(0), prompts)
    return pipe, state, prompts


def _results(pipe, state, batches, x) -> tuple[dict, np.ndarray | None]:
    """evaluate (with aux metrics) and predict (in batches of 6 rows)."""
    got = pipe.evaluate(state, batches, metrics=_accuracy)
    out = pipe.predict(state, x, batch_size=6)
    return got, None if out is None else np.asarray(out)


def _dataset(xy):
    """``pdjax train``'s dataset whose test split is the evaluation batches' rows."""
    from pdjax.apps.data.dataset import Dataset

    x, y = (np.asarray(a) for a in xy)
    return Dataset("eval", x, y, x, y, 10)


def _worker(out_dir: str) -> None:
    from pdjax.distributed import config_from_env, initialize

    initialize(config_from_env())
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_threefry_partitionable", False)  # as tests/conftest.py
    pid = jax.process_index()
    saved: dict[str, object] = {}
    arrays: dict[str, np.ndarray] = {}
    from pdjax.apps.train import evaluate_runner

    for plan in PLANS:
        spec, pipe, state, batches, xy = _mlp(plan)
        assert pipe.multiprocess
        got, out = _results(pipe, state, batches, xy[0])
        # pdjax train's evaluation: through the stages, 8 rows a batch
        saved[f"{plan}-runner"] = evaluate_runner(spec, pipe, state, _dataset(xy), 8)
        saved[plan] = got
        saved[f"{plan}-predict-none"] = out is None
        if out is not None:
            arrays[f"{plan}-predict"] = out
    pipe, state, prompts = _token_lm()
    arrays["generate"] = pipe.generate(state, prompts, 6)
    Path(out_dir, f"eval-{pid}.json").write_text(json.dumps(saved))
    np.savez(Path(out_dir, f"eval-{pid}.npz"), **arrays)


def _launch(out: Path) -> Path:
    """One launch of 2 processes x 2 CPU devices writing their results to ``out``."""
    from pdjax.distributed import launch_local

    env = {"PYTHONPATH": str(ROOT), "PDJAX_HEARTBEAT_TIMEOUT": "5"}
    launch_local([__file__, str(out)], 2, timeout=120, env=env, cpu_devices=2)
    return out


def _saved(folder: Path, pid: int) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(folder / f"eval-{pid}.npz") as f:
        arrays = {k: f[k] for k in f.files}
    return json.loads((folder / f"eval-{pid}.json").read_text()), arrays


def _check_evaluate_and_predict(results, plan: str) -> None:
    """Both processes return the same evaluation as one process (to rtol 1e-6: the same
    programs on the same parts, so in practice bit for bit); the outputs of predict are on
    the last stage's process (1), and process 0 gets None."""
    _, pipe, state, batches, xy = _mlp(plan)
    assert not pipe.multiprocess
    want, want_out = _results(pipe, state, batches, xy[0])
    assert set(want) == {"loss", "samples", "acc"} and want["samples"] == sum(ROWS)
    for saved, _ in results:
        assert set(saved[plan]) == set(want)
        for k, v in want.items():
            np.testing.assert_allclose(saved[plan][k], v, rtol=1e-6, err_msg=k)
    assert results[0][0][plan] == results[1][0][plan]  # the same dict on every process
    assert results[0][0][f"{plan}-predict-none"] and not results[1][0][f"{plan}-predict-none"]
    np.testing.assert_allclose(results[1][1][f"{plan}-predict"], want_out, rtol=1e-6)


def _check_train_evaluation(results) -> None:
    """``pdjax train``'s evaluation (``evaluate_runner``) of a pipeline across processes
    runs through its stages and gives every process the loss and accuracy of the gathered
    weights evaluated on one device (an independent program: rtol 1e-5)."""
    from pdjax.apps.train import evaluate

    spec, pipe, state, _, xy = _mlp("span")
    want = evaluate(spec, pipe.variables(state), _dataset(xy), 8)
    assert 0 < want[1] < 1  # an accuracy that can be wrong either way
    for saved, _ in results:
        np.testing.assert_allclose(saved["span-runner"], want, rtol=1e-5)


def _check_generate(results) -> None:
    """Greedy generation over 4 stages in 2 processes gives every process the tokens one
    process gives (which tests/test_generate.py checks against one-device decoding)."""
    pipe, state, prompts = _token_lm()
    want = pipe.generate(state, prompts, 6)
    assert len(set(want[:, 5:].ravel().tolist())) > 1
    for _, arrays in results:
        np.testing.assert_array_equal(arrays["generate"], want)


def test_forward_calls_across_processes(tmp_path):
    """One launch (one test, so that no two test workers launch it) checked for
    evaluate and predict, ``pdjax train``'s evaluation, and generation (see the checks)."""
    folder = _launch(tmp_path)
    results = [_saved(folder, pid) for pid in (0, 1)]
    for plan in PLANS:
        _check_evaluate_and_predict(results, plan)
    _check_train_evaluation(results)
    _check_generate(results)


if __name__ == "__main__":
    _worker(sys.argv[1])  # then JAX's exit barrier: process 0 serves the others till then
