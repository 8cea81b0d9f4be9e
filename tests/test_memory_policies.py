"""Per-stage memory policies (``remat=``): every policy trains exactly as plain sequential
training does, keeps what it says, is refused where it cannot run, and the profiler and
planner price it."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from reference import flush_training

from pdjax import _memory_policy as mp
from pdjax.errors import PipelineError, PlanError
from pdjax.models import get_model
from pdjax.partition import Topology, auto_choice, evaluate_partition, plan_auto
from pdjax.partition.choosing.auto import evaluate_candidate
from pdjax.pipeline import Pipeline, even_stages
from pdjax.pipeline.stage import Stage
from pdjax.profile import LayerProfile, PolicyCost, Profile, profile
from pdjax.schedules import ScheduleSpec


def _train(spec, schedule, remat, M=2, steps=1, mb=2, seed=0):
    """Trains llama-tiny on a stage per policy of ``remat``: the pipeline, its final
    state, losses, initial variables, microbatches and optimizer."""
    key = jax.random.key(seed)
    n = mb * M * steps
    x, y = spec.sample_input(n, key), spec.sample_target(n, key)
    optimizer = optax.adam(1e-2)
    pipe = Pipeline(
        spec.layers,
        even_stages(len(spec.layers), len(remat)),
        spec.loss,
        optimizer,
        schedule=ScheduleSpec(schedule, microbatches=M, remat=remat),
    )
    state = pipe.init(jax.random.key(3), jax.tree.map(lambda a: a[:mb], x))
    variables = pipe.variables(state)
    losses = []
    for t in range(steps):
        batch = jax.tree.map(lambda a, t=t: a[t * mb * M : (t + 1) * mb * M], (x, y))
        state, metrics = pipe.step(state, batch)
        losses += [float(v) for v in metrics.losses]
    mbs = [jax.tree.map(lambda a, k=k: a[k * mb : (k + 1) * mb], (x, y)) for k in range(M * steps)]
    return pipe, state, losses, variables, mbs, optimizer


# every policy: gpipe keeps each stage's residuals from F to B; 1f1b's last stage runs
# F and B as one program (its policy applies inside it)
@pytest.mark.parametrize(
    ("schedule", "remat"),
    [("1f1b", ("offload", "dots")), ("gpipe", ("dots", "dots-no-batch", "full"))],
)
def test_every_policy_trains_like_plain_sequential_training(schedule, remat):
    spec = get_model("llama", "tiny")  # dropout: the recomputed parts draw the same masks
    pipe, state, losses, variables, mbs, optimizer = _train(spec, schedule, remat)
    assert pipe.remat == remat
    ref_params, _, ref_losses = flush_training(
        spec.layers, spec.loss, optimizer, variables, mbs, M=2, rng=state.rng
    )
    np.testing.assert_allclose(losses, [float(v) for v in ref_losses], rtol=1e-6)
    got = [v["params"] for v in pipe.variables(state)]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, ref_params
    )
    # the named policies keep residuals (no recompute flag); "full" recomputes
    for s, policy in enumerate(remat):
        names = pipe.stages[s].trace_counts
        assert any("recompute" in n for n in names) == (policy == "full"), names
    if remat[0] == "offload":  # its forward's residuals: some in the host's memory
        st, (x, _) = pipe.stages[0], mbs[0]
        w, ms = state.params[0], state.model_state[0]
        _, _, kept = st.program("F")(w, ms, st.place_batch(x), jax.random.key(2))
        kinds = {a.sharding.memory_kind for a in jax.tree.leaves(kept)}
        assert kinds == {"device", "pinned_host"}, kinds


def _kept(stage, variables, x, key, tgt):
    """``(device bytes, host bytes)`` of what ``stage``'s forward keeps, traced only."""
    found = []

    def probe(w, st, x, key, tgt):
        _, _, pbs, (wv, xv) = stage.forward_vjp(w, st, x, key, tgt)
        kept = stage.keep(wv, xv, pbs)
        found.append(mp.residual_split(jax.tree.leaves(kept), []))
        return kept

    params = [v["params"] for v in variables]
    state = [{k: a for k, a in v.items() if k != "params"} for v in variables]
    jax.eval_shape(probe, params, state, x, key, tgt)
    return found[0]


def test_the_profile_prices_what_the_runtime_keeps():
    """Per block, the residual bytes the profiler measures for each policy are what a
    one-block stage's forward keeps (device and host), and the policies keep less; the
    last layer's, with the loss's residuals (``loss_fn=``), what the last stage keeps."""
    spec = get_model("llama", "tiny")
    x = spec.sample_input(4, jax.random.key(0))
    tgt = spec.sample_target(4, jax.random.key(0))
    prof = profile(spec.layers, x, memory_policies=True, loss_fn=spec.loss, targets=tgt)
    block = prof.layers[1]
    assert block.name == "block0"
    variables = jax.eval_shape(spec.layers.init, jax.random.key(0), x)
    dev = jax.devices()[0]
    bounds = spec.layers.boundary_specs(list(variables), x)  # the layers' inputs
    for policy in ("none", "dots", "dots-no-batch", "offload"):
        stage = Stage(1, spec.layers.layers[1:2], 1, [dev], optax.sgd(0.1), remat=policy)
        device, host = _kept(stage, variables[1:2], bounds[1], jax.random.key(1), tgt)
        cost = block.policy(policy)
        # the key the runtime's dropout draws from is an argument there: 8 bytes more
        assert device - cost.residual_bytes in (0, 8), (policy, device, cost)
        assert host == cost.host_bytes, (policy, host, cost)
        # the last stage: the head and the loss, whose residuals the profile adds to the head's
        head = Stage(3, spec.layers.layers[3:], 3, [dev], optax.sgd(0.1), spec.loss, remat=policy)
        device, _ = _kept(head, variables[3:], bounds[3], jax.random.key(1), tgt)
        assert device == prof.layers[3].policy(policy).residual_bytes, (policy, device)
    none, dots, nb, off = (block.policy(p) for p in ("none", "dots", "dots-no-batch", "offload"))
    assert none.residual_bytes > dots.residual_bytes > nb.residual_bytes > off.residual_bytes
    assert off.host_bytes == nb.residual_bytes - off.residual_bytes > 0
    assert 0 < dots.recompute < nb.recompute == off.recompute < 1
    # JSON keeps them; a profile without them writes and hashes as before
    again = Profile.from_json(prof.to_json())
    assert again == prof and again.content_hash() == prof.content_hash()
    plain = dataclasses.replace(
        prof, layers=tuple(dataclasses.replace(la, policies=()) for la in prof.layers)
    )
    assert "policies" not in plain.to_json()


class _NoHostMemory:
    """A device without a pinned host memory (as some platforms have)."""

    def __init__(self, device):
        self.device = device

    def addressable_memories(self):
        return [m for m in self.device.addressable_memories() if m.kind != "pinned_host"]

    def __str__(self):
        return "a device without pinned_host"


def test_bad_policies_are_refused_before_any_work():
    spec = get_model("llama", "tiny")

    def make(remat):
        return Pipeline(
            spec.layers,
            even_stages(len(spec.layers), 2),
            spec.loss,
            optax.sgd(0.1),
            schedule=ScheduleSpec("1f1b", remat=remat),
        )

    with pytest.raises(PipelineError, match="memory policy"):
        make("selective")
    with pytest.raises(PipelineError, match="3 flags for 2 stages"):
        make(("dots", "none", "full"))
    with pytest.raises(PipelineError, match="one bool per stage"):
        make(("dots", 1))
    assert make(True).remat == ("full", "full")  # the old bool still means recompute
    assert make((False, "dots")).remat == ("none", "dots")
    # offload needs a pinned host memory: refused, never replaced by another policy
    with pytest.raises(PipelineError, match=r"'offload' .*pinned_host.*choose"):
        mp.check_available("offload", [_NoHostMemory(jax.devices()[0])], PipelineError)
    mp.check_available("offload", jax.devices()[:1], PipelineError)  # CPU has one here
    mp.check_available("dots", [_NoHostMemory(jax.devices()[0])], PipelineError)


def _priced_profile(policies=True):
    """4 equal layers, each keeping 4000 bytes of residuals (a batch of 8); "dots" keeps
    2000 and recomputes 10% of the forward, "dots-no-batch" 1000 and 30%."""
    costs = (PolicyCost("dots", 2000, 0, 0.1), PolicyCost("dots-no-batch", 1000, 0, 0.3))
    layers = [
        LayerProfile(
            f"l{i}",
            forward_seconds=1.0,
            backward_seconds=2.0,
            param_bytes=100,
            input_bytes=500,
            output_bytes=500,
            residual_bytes=4000,
            policies=costs if policies else (),
        )
        for i in range(4)
    ]
    return Profile.chain(layers, batch_size=8)


def test_the_simulator_charges_each_policy_its_stash_and_recomputation():
    prof = _priced_profile()
    topo = Topology.flat(2, 1e12)
    plan = evaluate_partition(
        prof, topo, [(0, 1, 1), (2, 3, 1)], schedule="1f1b", num_microbatches=4, microbatch_size=2
    )
    t0, none = evaluate_candidate(plan, prof, "1f1b", remat=("none", "none"))
    t1, dots = evaluate_candidate(plan, prof, "1f1b", remat=("dots", "none"))
    t2, nb = evaluate_candidate(plan, prof, "1f1b", remat=("dots-no-batch", "none"))
    # stage 0 holds 2 microbatches in flight under 1f1b (P = 2); per microbatch of 2 of the
    # profile's 8 samples, 2 layers keep (4000 - kept) / 4 bytes less each
    assert none[0] - dots[0] == pytest.approx(2 * 2 * 2000 / 4)
    assert none[0] - nb[0] == pytest.approx(2 * 2 * 3000 / 4)
    assert dots[1] == none[1] == nb[1]
    assert t0 < t1 < t2  # recomputing 10%, then 30%, of stage 0's forward
    # bools still mean what they did: True is full recomputation
    assert evaluate_candidate(plan, prof, "1f1b", remat=(True, False)) == evaluate_candidate(
        plan, prof, "1f1b", remat=("full", "none")
    )
    with pytest.raises(PlanError, match="does not price memory policy 'dots'"):
        evaluate_candidate(plan, _priced_profile(False), "1f1b", remat=("dots", "none"))


def test_plan_auto_takes_the_cheapest_policy_that_fits():
    prof = _priced_profile()
    kw = dict(batch_size=8, schedules=["1f1b"], microbatches=[4], straight=True)
    free = plan_auto(prof, Topology.flat(2, 1e12), **kw)
    assert auto_choice(free)["policies"] == ["none", "none"]
    assert free.schedule.remat == ("none", "none")
    peak = auto_choice(free)["group_peak_memory"][0]
    chosen = {}
    # stage 0 keeps 2 microbatches of 2 layers of (500 + 4000) / 4 bytes: "dots" saves
    # 2 * 2 * 2000 / 4, "dots-no-batch" 3000, "full" all 4500 (the first stage's input is
    # the call's, placed up front)
    for want, limit in (
        ("dots", peak - 2000),
        ("dots-no-batch", peak - 3000),
        ("full", peak - 3001),
    ):
        plan = plan_auto(prof, Topology.flat(2, 1e12, memory_per_device=limit), **kw)
        auto = auto_choice(plan)
        chosen[want] = auto["policies"]
        assert auto["policies"][0] == want, (limit, auto)
        assert plan.schedule.remat[0] == want
        assert auto["remat"][0] is True and auto["peak_memory"] <= limit
    assert chosen["dots"][1] == "none"  # the last stage fits as it is
    # only full recomputation where the profile prices no policy; a named one refused
    plan = plan_auto(
        _priced_profile(False), Topology.flat(2, 1e12, memory_per_device=peak - 999), **kw
    )
    assert auto_choice(plan)["policies"][0] == "full"
    with pytest.raises(PlanError, match="does not price memory policies"):
        plan_auto(_priced_profile(False), Topology.flat(2, 1e12), remat=["dots"], **kw)
