"""Variable-length microbatches (sequence-length buckets): the runtime compiles one
program set per bucket and never again, computes what plain single-device training
computes over the same batches in the same order, and refuses what it cannot run; the
planner and simulator price a mix of buckets as the weighted combination of per-bucket
costs (:mod:`pdjax.partition.choosing.buckets`)."""

from __future__ import annotations

import collections
import types

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import delayed_training, flush_training

from pdjax.apps.data.bpe import IGNORE, bucket_examples, document_examples
from pdjax.errors import DataError, PipelineError, PlanError
from pdjax.models import get_model
from pdjax.partition import (
    StagePlan,
    Topology,
    costs_from_plan,
    evaluate_partition,
    mix_profiles,
    mix_time_per_microbatch,
    plan_buckets,
    plan_pipedream,
    simulate_buckets,
)
from pdjax.pipeline import Pipeline
from pdjax.pipeline.executor.calls import check_layouts
from pdjax.profile import LayerProfile, Profile
from pdjax.schedules import ScheduleSpec, generate
from pdjax.simulator import simulate

# -- compile counting ------------------------------------------------------------------------

_compiled: collections.Counter[str] = collections.Counter()


def _count(event: str, duration: float, **kw: object) -> None:
    if event.endswith("backend_compile_duration"):  # fired on persistent-cache hits too
        _compiled[str(kw.get("fun_name"))] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def _compiles() -> int:
    return sum(_compiled.values())


# -- the model, batches and the loss ---------------------------------------------------------

# Llama tiny with its context raised to the longest bucket (the weights do not depend on it)
SPEC = get_model("llama", "tiny", context=32, seq_len=32)
LENGTHS = [16, 8, 16, 32, 8, 32]  # one call (batch) per entry, tokens per sequence
ROWS, M = 2, 2  # rows per microbatch, microbatches per step


def masked_loss(logits, targets):
    """Mean token cross-entropy over the real targets (``IGNORE`` padding weighs zero)."""
    real = (targets != IGNORE).astype(jnp.float32)
    token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    return jnp.sum(token * real) / jnp.maximum(jnp.sum(real), 1.0)


def _batch(length: int, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens, the last few positions of every row padded as a bucket pads them."""
    rng = np.random.default_rng(seed)
    x = rng.integers(2, SPEC.num_classes, (rows, length)).astype(np.int32)
    y = rng.integers(2, SPEC.num_classes, (rows, length)).astype(np.int32)
    y[:, length - 3 :] = IGNORE
    return x, y


def _plan(P: int) -> list[StagePlan]:
    bounds = {2: [(0, 1), (2, 3)], 4: [(0, 0), (1, 1), (2, 2), (3, 3)]}[P]
    return [StagePlan(a, b, (s,)) for s, (a, b) in enumerate(bounds)]


def _bounds(P: int) -> list[tuple[int, int]]:
    return [(sp.first_layer, sp.last_layer + 1) for sp in _plan(P)]


def _close(got, want):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
        got,
        want,
    )


# -- the runtime -----------------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "P"), [("1f1b", 2), ("gpipe", 4)])
def test_flush_stream_of_buckets_compiles_once_per_bucket_and_equals_sequential(schedule, P):
    optimizer = optax.sgd(0.5)
    pipe = Pipeline(
        SPEC.layers,
        _plan(P),
        masked_loss,
        optimizer,
        schedule=ScheduleSpec(schedule, microbatches=M),
    )
    batches = [_batch(n, M * ROWS, seed) for seed, n in enumerate(LENGTHS)]
    state = pipe.init(jax.random.key(0), batches[0][0][:ROWS])
    variables, rng = jax.device_get(pipe.variables(state)), state.rng
    compiled, losses = [], []
    for batch in batches:
        before = _compiles()
        state, metrics = pipe.step(state, batch)
        losses += [float(v) for v in metrics.losses]  # waits for the call
        compiled.append(_compiles() - before)
    seen: set[int] = set()
    for n, c in zip(LENGTHS, compiled, strict=True):
        if n in seen:  # flat after the first call of each bucket
            assert c == 0, (LENGTHS, compiled)
        else:  # the counter sees this bucket's programs
            assert c > 0, (LENGTHS, compiled)
        seen.add(n)
    # the same microbatches in the same order, one device, plain jax + optax
    microbatches = [mb for batch in batches for mb in pipe.split_batch(batch)]
    want, want_losses = _sequential(optimizer, variables, rng, microbatches)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _close([p for stage in state.params for p in stage], want)


_SEQUENTIAL: dict = {}


def _sequential(optimizer, variables, rng, microbatches):
    """Sequential training's params and losses (reference.flush_training), computed once:
    every plan starts from the same variables and key (checked), so it is shared."""
    if "run" in _SEQUENTIAL:
        start, key, run = _SEQUENTIAL["start"], _SEQUENTIAL["key"], _SEQUENTIAL["run"]
        jax.tree.map(np.testing.assert_array_equal, variables, start)
        np.testing.assert_array_equal(jax.random.key_data(rng), key)
        return run
    params, _, losses = flush_training(
        SPEC.layers, masked_loss, optimizer, variables, microbatches, M=M, rng=rng
    )
    _SEQUENTIAL.update(
        start=variables,
        key=jax.random.key_data(rng),
        run=(params, [float(v) for v in losses]),
    )
    return _SEQUENTIAL["run"]


def test_pipedream_runs_a_stream_mixing_lengths_as_the_delayed_recurrence():
    # one call whose microbatches have two lengths: each runs the programs compiled for
    # its shape, with the weight version the schedule names (semantics.md, pipedream)
    P, optimizer, lengths = 2, optax.sgd(0.5), [32, 16, 16, 32, 16]
    pipe = Pipeline(
        SPEC.layers, _plan(P), masked_loss, optimizer, schedule=ScheduleSpec("pipedream")
    )
    stream = [_batch(n, ROWS, 10 + k) for k, n in enumerate(lengths)]
    state = pipe.init(jax.random.key(1), stream[0][0])
    variables, rng = jax.device_get(pipe.variables(state)), state.rng
    state, _ = pipe.run(state, stream)
    want = delayed_training(
        SPEC.layers,
        masked_loss,
        optimizer,
        variables,
        stream,
        bounds=_bounds(P),
        version_of=lambda s, k: max(0, k - (P - s) + 1),
        rng=rng,
    )
    _close([list(p) for p in state.params], want)
    assert state.updates == (len(lengths),) * P
    before = _compiles()
    state, metrics = pipe.run(state, stream)
    jax.block_until_ready(metrics.losses)
    assert _compiles() == before  # the same mix again: nothing new


def test_round_robin_group_of_mixed_lengths_is_refused_before_any_work():
    plan = [StagePlan(0, 1, (0, 1), replication="round-robin"), StagePlan(2, 3, (2,))]
    pipe = Pipeline(
        SPEC.layers, plan, masked_loss, optax.sgd(0.1), schedule=ScheduleSpec("pipedream")
    )
    state = pipe.init(jax.random.key(2), _batch(16, ROWS, 0)[0])
    before = jax.device_get(state.params)
    mixed = [_batch(16, ROWS, 0), _batch(32, ROWS, 1)]
    with pytest.raises(PipelineError, match=r"round-robin.*each group of 2 shares one bucket"):
        pipe.run(state, mixed)
    _close(state.params, before)  # not consumed: nothing ran


def test_across_processes_a_call_mixing_lengths_is_refused():
    # the receiving process binds a call's transfers to its first microbatch's shapes
    stage_set = types.SimpleNamespace(multiprocess=True, stages=())
    alike = [_batch(32, ROWS, 0), _batch(32, ROWS, 1)]
    check_layouts(stage_set, alike)  # one bucket per call: fine
    with pytest.raises(PipelineError, match=r"microbatch 1 .* run one call per bucket"):
        check_layouts(stage_set, [*alike[:1], _batch(64, ROWS, 2)])


def test_sequence_longer_than_the_largest_bucket_is_a_data_error():
    lengths = (8, 16)
    ok = bucket_examples([np.arange(17), np.arange(3)], lengths, pad_id=1)
    assert [len(b.inputs) for b in ok.buckets] == [1, 1]
    with pytest.raises(DataError, match=r"example 1 has 17 positions.*add a bucket of at least 17"):
        bucket_examples([np.arange(5), np.arange(18)], lengths, pad_id=1)
    with pytest.raises(DataError, match="pass split_long=True or add a bucket"):
        document_examples([np.arange(16)], 0, 16, split_long=False)


# -- pricing per bucket ----------------------------------------------------------------------


def _profile(seconds, out=0, residual=0, params=0):
    """A chain of layers with these forward + backward seconds (a third forward)."""
    return Profile.chain(
        [
            LayerProfile(
                f"l{i}",
                forward_seconds=t / 3,
                backward_seconds=2 * t / 3,
                param_bytes=params,
                output_bytes=out * (i + 1),
                residual_bytes=residual * (i + 1),
                input_bytes=out * i,
            )
            for i, t in enumerate(seconds)
        ],
        batch_size=4,
    )


def test_mixed_profile_is_the_weighted_mean_of_times_and_the_largest_bytes():
    short, long = _profile([1, 2, 3], out=10, residual=7), _profile([4, 4, 8], out=40, residual=5)
    mixed = mix_profiles({32: short, 128: long}, {32: 6, 128: 2})
    for i, layer in enumerate(mixed.layers):
        want_f = 0.75 * short.layers[i].forward_seconds + 0.25 * long.layers[i].forward_seconds
        want_b = 0.75 * short.layers[i].backward_seconds + 0.25 * long.layers[i].backward_seconds
        assert layer.forward_seconds == pytest.approx(want_f)
        assert layer.backward_seconds == pytest.approx(want_b)
        assert layer.output_bytes == 40 * (i + 1) and layer.input_bytes == 40 * i
        assert layer.residual_bytes == 7 * (i + 1)  # the short bucket's is larger here
    assert mixed.meta["buckets"] == "32:0.75,128:0.25"
    with pytest.raises(PlanError, match="bucket lengths"):
        mix_profiles({32: short, 128: long}, {32: 1})
    with pytest.raises(PlanError, match="frequency"):
        mix_profiles({32: short, 128: long}, {32: 1, 128: -1})
    with pytest.raises(PlanError, match="parameter bytes"):
        mix_profiles({32: short, 128: _profile([1, 1, 1], params=8)}, {32: 1, 128: 1})


def test_plan_for_a_mix_is_the_brute_force_best_and_differs_from_the_long_only_plan():
    # a short bucket whose last layer is heavy, a long one whose first is (attention's
    # quadratic share grows with the length): the best two-stage cut depends on the mix
    profiles = {32: _profile([1, 1, 1, 3]), 128: _profile([3, 1, 1, 1])}
    topology = Topology.flat(2, 1e12)
    options = dict(schedule="1f1b", num_microbatches=4, straight=True)
    for frequencies in ({32: 3, 128: 1}, {32: 1, 128: 3}):
        plan = plan_buckets(profiles, frequencies, topology, **options)
        total = sum(frequencies.values())

        def mix_time(cut, frequencies=frequencies, total=total):
            # straight, free transfers: each bucket's period is its slowest stage
            return sum(
                f / total * max(sum(seconds[: cut + 1]), sum(seconds[cut + 1 :]))
                for n, f in frequencies.items()
                for seconds in [[layer.seconds for layer in profiles[n].layers]]
            )

        best = min(range(3), key=mix_time)
        assert [(st.first_layer, st.last_layer) for st in plan.stages] == [(0, best), (best + 1, 3)]
        assert plan.time_per_microbatch == pytest.approx(mix_time(best))
        assert plan.options["buckets"]["lengths"] == [32, 128]
        assert mix_time_per_microbatch(plan, profiles, frequencies) == pytest.approx(mix_time(best))
    long_only = plan_pipedream(profiles[128], topology, **options)
    mostly_short = plan_buckets(profiles, {32: 3, 128: 1}, topology, **options)
    assert long_only.stages[0].last_layer == 0 and mostly_short.stages[0].last_layer == 2


def test_simulated_stream_prices_each_microbatch_by_its_bucket():
    short, long = _profile([1, 1, 1, 1]), _profile([4, 4, 4, 4])
    profiles = {32: short, 128: long}
    plan = evaluate_partition(
        long, Topology.flat(2, 1e12), [(0, 1, 1), (2, 3, 1)], schedule="1f1b", num_microbatches=2
    )
    # 1f1b, P = M = 2, one bucket per step, free transfers and updates: each step takes
    # (M + P - 1) (F + B) of its bucket, F + B = 2 layers' seconds per stage
    sim = simulate_buckets(plan, profiles, [32, 32, 128, 128])
    assert sim.makespan == pytest.approx(3 * 2 * 1 + 3 * 2 * 4)
    # equal buckets: the plain simulation
    same = simulate_buckets(plan, profiles, [128, 128])
    plain = simulate(generate("1f1b", 2, 2), costs_from_plan(plan, long))
    assert same.makespan == pytest.approx(plain.makespan)
    # a stream mixing buckets lies between all short and all long
    mixed = simulate_buckets(plan, profiles, [32, 128] * 4, schedule="pipedream")
    lo = simulate_buckets(plan, profiles, [32] * 8, schedule="pipedream")
    hi = simulate_buckets(plan, profiles, [128] * 8, schedule="pipedream")
    assert lo.makespan < mixed.makespan < hi.makespan
    with pytest.raises(PlanError, match="whole steps"):
        simulate_buckets(plan, profiles, [32, 32, 128])
    with pytest.raises(PlanError, match="without a profile"):
        simulate_buckets(plan, profiles, [64, 64])


def test_bucket_weights_normalise_any_finite_frequencies_and_refuse_the_rest():
    from pdjax.partition.choosing.buckets import bucket_weights

    assert bucket_weights({64: 1e308, 32: 1e308}) == {32: 0.5, 64: 0.5}  # no overflow
    assert bucket_weights({32: 3 * 10**300, 64: 10**300}) == {32: 0.75, 64: 0.25}
    assert bucket_weights({32: 5e-324, 64: 0}) == {32: 1.0, 64: 0.0}
    for bad in (10**400, float("inf"), float("nan"), -1, "3", None, True):
        with pytest.raises(PlanError, match=r"bucket 32's frequency .* not a finite number"):
            bucket_weights({32: bad, 64: 1})
    with pytest.raises(PlanError, match="must be a mapping"):
        bucket_weights([(32, 1)])


def test_plan_buckets_refuses_an_unknown_option_naming_the_accepted_ones():
    profiles = {32: _profile([1, 1]), 64: _profile([2, 2])}
    with pytest.raises(
        TypeError,
        match=r"plan_buckets\(\) got unexpected keyword argument\(s\) bogus; .*"
        r"schedule, .*num_microbatches",
    ):
        plan_buckets(profiles, {32: 1, 64: 1}, Topology.flat(2, 1e12), bogus=3)
