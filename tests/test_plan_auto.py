"""``plan_auto``: the schedule, microbatches, stages and per-stage recomputation chosen
together, checked against a brute-force search ranked by the same simulator."""

import itertools
import math

import numpy as np
import pytest

from pdjax.errors import PlanError, ScheduleError
from pdjax.partition import Topology, auto_choice, evaluate_partition, plan_auto
from pdjax.partition.choosing.auto import evaluate_candidate
from pdjax.profile import LayerProfile, Profile

SCHEDULES = ["gpipe", "1f1b", "zb-h1"]


def random_profile(rng, L):
    return Profile.chain(
        [
            LayerProfile(
                f"l{i}",
                forward_seconds=float(rng.uniform(0.5, 3)) * 1e-3,
                backward_seconds=float(rng.uniform(1, 6)) * 1e-3,
                param_bytes=int(rng.integers(1, 50)) * 10**6,
                output_bytes=int(rng.integers(1, 20)) * 10**5,
                residual_bytes=int(rng.integers(1, 40)) * 10**6,
            )
            for i in range(L)
        ],
        batch_size=8,
    )


def brute_force(profile, topology, *, schedules, counts, B, limit):
    """Every partition into one stage per device, schedule, M and recomputation set,
    simulated; the fastest that fits: ``(seconds per sample, description)``."""
    P, L = topology.num_devices, len(profile.layers)
    best = (math.inf, None)
    for cuts in itertools.combinations(range(1, L), P - 1):
        bounds = [0, *cuts, L]
        stages = [(bounds[i], bounds[i + 1] - 1, 1) for i in range(P)]
        for name in schedules:
            for M in counts:
                plan = evaluate_partition(
                    profile,
                    topology,
                    stages,
                    schedule=name,
                    num_microbatches=M,
                    microbatch_size=B // M,
                    replication="split",
                )
                for remat in itertools.product([False, True], repeat=P):
                    try:
                        t, peaks = evaluate_candidate(plan, profile, name, remat=remat)
                    except (PlanError, ScheduleError):
                        continue
                    if max(peaks) <= limit and t < best[0]:
                        best = (t, (name, M, stages, remat))
    return best


def _case(seed):
    rng = np.random.default_rng(seed)
    L, P = int(rng.integers(4, 8)), int(rng.integers(2, 4))
    limit = float(rng.uniform(0.3e9, 1.5e9))
    return random_profile(rng, L), Topology.flat(P, 1e9, memory_per_device=limit), limit


@pytest.mark.parametrize("seed", range(10))
def test_plan_auto_equals_brute_force_on_small_cases(seed):
    profile, topology, limit = _case(seed)
    P = topology.num_devices
    B, counts = 8 * P, [P, 2 * P]
    want, how = brute_force(profile, topology, schedules=SCHEDULES, counts=counts, B=B, limit=limit)
    if math.isinf(want):
        with pytest.raises(PlanError, match="no configuration fits"):
            plan_auto(profile, topology, batch_size=B, schedules=SCHEDULES, microbatches=counts)
        return
    plan = plan_auto(
        profile, topology, batch_size=B, schedules=SCHEDULES, microbatches=counts, straight=True
    )
    got = auto_choice(plan)
    assert got["time_per_sample"] == pytest.approx(want, rel=1e-12), (got, how)
    assert got["fits"] and got["peak_memory"] <= limit
    # the plan is the chosen configuration
    assert plan.schedule.kind == got["schedule"] and plan.num_microbatches == got["microbatches"]
    assert [list(s) for s in got["stages"]] == [
        [st.first_layer, st.last_layer, st.replicas] for st in plan.stages
    ]
    # the DP's partitions improved boundary by boundary come close without enumerating
    quick = plan_auto(
        profile,
        topology,
        batch_size=B,
        schedules=SCHEDULES,
        microbatches=counts,
        straight=True,
        exhaustive=0,
    )
    assert auto_choice(quick)["time_per_sample"] <= want * 1.02


def replicated_profile(rng, L):
    """Small weights (cheap all-reduces) and one heavy layer: replicating a stage pays."""
    heavy = int(rng.integers(0, L))
    return Profile.chain(
        [
            LayerProfile(
                f"l{i}",
                forward_seconds=float(rng.uniform(0.5, 3))
                * 1e-3
                * (float(rng.uniform(3, 8)) if i == heavy else 1),
                backward_seconds=float(rng.uniform(1, 6)) * 1e-3 * (3 if i == heavy else 1),
                param_bytes=int(rng.integers(1, 50)) * 10 ** int(rng.integers(4, 8)),
                output_bytes=int(rng.integers(1, 20)) * 10**5,
                residual_bytes=int(rng.integers(1, 40)) * 10**6,
            )
            for i in range(L)
        ],
        batch_size=8,
    )


def configurations(L, W):
    """Every list of ``(first_layer, last_layer, replicas)`` stages: contiguous layers,
    at most ``W`` devices in all (idle devices allowed)."""
    for k in range(1, min(L, W) + 1):
        for cuts in itertools.combinations(range(1, L), k - 1):
            bounds = [0, *cuts, L]
            for reps in itertools.product(range(1, W + 1), repeat=k):
                if sum(reps) <= W:
                    yield [(bounds[i], bounds[i + 1] - 1, reps[i]) for i in range(k)]


def every_configuration(profile, topology, schedules, counts, B, extras=(0, 1, 2)):
    """Every (stages and replicas, schedule, M, recomputation set, pipedream's depth)
    simulated: ``(seconds per sample, peak bytes, description)`` each. A replicated stage
    splits each microbatch over its devices (the runtime needs the split even), under
    ``pipedream`` takes whole microbatches round-robin (plan_auto's replication there)."""
    out = []
    for stages in configurations(len(profile.layers), topology.num_devices):
        for name in schedules:
            mode = "round-robin" if name == "pipedream" else "split"
            for M in counts:
                if mode == "split" and any((B // M) % r for _, _, r in stages):
                    continue
                plan = evaluate_partition(
                    profile,
                    topology,
                    stages,
                    schedule=name,
                    num_microbatches=M,
                    microbatch_size=B // M,
                    replication=mode,
                )
                for e in extras if name == "pipedream" else (0,):
                    for remat in itertools.product([False, True], repeat=len(stages)):
                        try:
                            t, peaks = evaluate_candidate(
                                plan, profile, name, remat=remat, extra_in_flight=e, batch_size=B
                            )
                        except (PlanError, ScheduleError):
                            continue
                        out.append((t, max(peaks), (name, M, stages, remat, e)))
    return out


FLUSH = ["gpipe", "1f1b", "zb-h1", "zb-h2"]


@pytest.mark.parametrize(
    "seed, W, schedules", [(6, 3, FLUSH), (3, 4, FLUSH), (1, 3, ["pipedream", "2bw"])]
)
def test_plan_auto_equals_brute_force_with_replication(seed, W, schedules):
    """Stages, replicas, schedule, M, recomputation and in-flight depth enumerated and
    simulated; with no memory limit, just under the free winner's peak, and at a quarter of
    the configurations' peaks, plan_auto finds the fastest that fits on all the devices.
    Leaving devices idle (which plan_auto does not search) can be a little faster: here
    by 0.024% (seed 3: 1 + 2 devices, one bubble fewer than 1 + 1 + 2)."""
    rng = np.random.default_rng(seed)
    L = int(rng.integers(4, 6)) if W == 3 else 4  # 4 on 4: 1328 configurations already
    profile, topology = replicated_profile(rng, L), Topology.flat(W, 1e10)
    B, counts = 8 * W, [W, 2 * W]
    points = every_configuration(profile, topology, schedules, counts, B)
    free = min(points, key=lambda p: p[0])
    assert any(r > 1 for _, _, r in free[2][2]), free  # replication is what wins here
    peaks = sorted(p[1] for p in points)
    for limit in (None, free[1] * 0.999, peaks[len(peaks) // 4] * 1.0001):
        fits = [p for p in points if limit is None or p[1] <= limit]
        want = min((p for p in fits if sum(r for _, _, r in p[2][2]) == W), key=lambda p: p[0])
        idle = min(fits, key=lambda p: p[0])
        plan = plan_auto(
            profile,
            topology,
            batch_size=B,
            schedules=schedules,
            microbatches=counts,
            memory_limit=limit,
            allow_stale="pipedream" in schedules,
        )
        got = auto_choice(plan)
        assert got["time_per_sample"] == pytest.approx(want[0], rel=1e-9), (limit, got, want)
        assert got["time_per_sample"] <= idle[0] * 1.001, (limit, got, idle)
        assert limit is None or got["peak_memory"] <= limit
        assert [[st.first_layer, st.last_layer, st.replicas] for st in plan.stages] == got["stages"]


@pytest.mark.parametrize("exhaustive", [0, 10**6], ids=["dynamic-program", "enumerated"])
def test_the_plan_states_the_callers_memory_limit(exhaustive):
    """Without a limit the plan says none (not the dynamic program's internal stand-in),
    and with one it states that one, whichever search found the plan."""
    profile, _, _ = _case(0)
    for limit in (None, 2e9):
        topology = Topology.flat(3, 1e9, memory_per_device=limit)
        plan = plan_auto(profile, topology, batch_size=24, exhaustive=exhaustive)
        assert plan.memory_limit == limit == auto_choice(plan)["memory_limit"]
        assert plan.fits_memory


def test_recomputation_is_chosen_only_where_memory_needs_it():
    rng = np.random.default_rng(7)
    profile = random_profile(rng, 6)
    free = plan_auto(profile, Topology.flat(3, 1e9), batch_size=24, schedules=["gpipe"])
    assert not any(auto_choice(free)["remat"])
    peak = auto_choice(free)["peak_memory"]
    tight = plan_auto(
        profile,
        Topology.flat(3, 1e9),
        batch_size=24,
        schedules=["gpipe"],
        microbatches=[free.num_microbatches],
        memory_limit=peak * 0.8,
    )
    chosen = auto_choice(tight)
    assert chosen["peak_memory"] <= peak * 0.8
    assert chosen["remat"] == [False, False, True]  # only the stage over the limit
    assert chosen["time_per_sample"] > auto_choice(free)["time_per_sample"]
    # a limit below every configuration: the error gives the smallest peak found, which
    # then fits
    with pytest.raises(PlanError, match="the smallest peak memory found is") as e:
        plan_auto(
            profile,
            Topology.flat(3, 1e9),
            batch_size=24,
            schedules=["gpipe"],
            microbatches=[12],
            memory_limit=peak * 0.4,
        )
    smallest = float(str(e.value).split("found is ")[1].split()[0])
    plan = plan_auto(
        profile,
        Topology.flat(3, 1e9),
        batch_size=24,
        schedules=["gpipe"],
        microbatches=[12],
        memory_limit=smallest * 1.001,
    )
    assert all(auto_choice(plan)["remat"])


def test_every_schedule_is_recorded_with_its_best_or_why_none():
    profile, topology, _ = _case(3)
    plan = plan_auto(profile, topology, batch_size=16, allow_stale=True, straight=True)
    names = {plan.schedule.kind, *plan.options["alternatives"]}
    assert {"gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw"} <= names
    for alt in plan.options["alternatives"].values():
        assert "none" in alt or alt["time_per_sample"] >= auto_choice(plan)["time_per_sample"]
    plan.to_json()  # the record is JSON


def test_stale_schedules_need_permission_and_bad_options_are_refused():
    profile, topology, _ = _case(1)
    with pytest.raises(PlanError, match="allow_stale"):
        plan_auto(profile, topology, schedules=["pipedream"])
    with pytest.raises(PlanError, match="unknown schedules"):
        plan_auto(profile, topology, schedules=["zigzag"])
    with pytest.raises(PlanError, match="do not divide"):
        plan_auto(profile, topology, batch_size=10, microbatches=[3])


def test_a_limit_nothing_fits_names_the_smallest_that_would():
    profile, topology, _ = _case(2)
    match = r"no configuration fits 1000 bytes .* smallest peak memory"
    with pytest.raises(PlanError, match=match):
        plan_auto(profile, topology, memory_limit=1000.0, batch_size=16)


def _chain(L=4, f=1e-3, b=2e-3):
    layers = [
        LayerProfile(f"l{i}", forward_seconds=f, backward_seconds=b, output_bytes=10)
        for i in range(L)
    ]
    return Profile.chain(layers, batch_size=8)


def test_host_costs_bound_a_candidate_by_the_driver_and_the_shared_pool():
    from pdjax.partition import HostCosts
    from pdjax.schedules import generate

    profile, topology = _chain(), Topology.flat(2, 1e15)
    M, size = 4, 8
    plan = evaluate_partition(
        profile,
        topology,
        [(0, 1, 1), (2, 3, 1)],
        schedule="1f1b",
        num_microbatches=M,
        microbatch_size=size,
    )
    alone, _ = evaluate_candidate(plan, profile, "1f1b")
    # the driver: every action of the step, one after another on one thread
    actions = sum(len(g) for g in generate("1f1b", 2, M).actions)
    spa = 1.0  # far above any compute, so this bound decides
    seconds, _ = evaluate_candidate(plan, profile, "1f1b", host=HostCosts(spa))
    assert seconds == pytest.approx(actions * spa / (M * size))
    # the shared pool: every stage's forward and backward of every microbatch (2 layers of
    # 1 + 2 ms each per stage), done at most `concurrency` at a time
    work = M * 2 * (2 * (1e-3 + 2e-3))
    seconds, _ = evaluate_candidate(plan, profile, "1f1b", host=HostCosts(0.0, 1.0))
    assert seconds == pytest.approx(max(alone, work / (M * size)), rel=1e-6)
    assert work / (M * size) > alone  # one core is slower than two devices
    seconds, _ = evaluate_candidate(plan, profile, "1f1b", host=HostCosts(0.0, 64.0))
    assert seconds == pytest.approx(alone)
    for bad in (dict(seconds_per_action=-1.0), dict(concurrency=0.0), dict(concurrency=math.nan)):
        with pytest.raises(PlanError):
            HostCosts(**bad)


def test_a_costly_driver_makes_plan_auto_take_fewer_microbatches():
    from pdjax.partition import HostCosts

    profile, topology = _chain(L=6), Topology.flat(3, 1e15)
    kwargs = dict(batch_size=48, schedules=["1f1b"], straight=True)
    fast = plan_auto(profile, topology, **kwargs)
    slow = plan_auto(profile, topology, host=HostCosts(seconds_per_action=5e-3), **kwargs)
    assert auto_choice(slow)["microbatches"] < auto_choice(fast)["microbatches"]
    assert auto_choice(slow)["host"] == {
        "seconds_per_action": 5e-3,
        "concurrency": None,
        "devices_per_replica": 1,
    }
    assert "host" not in auto_choice(fast)
