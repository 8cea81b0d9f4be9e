"""Planning for a stream of sequence-length buckets: each microbatch priced by its bucket.

A language model trained on bucketed batches (:func:`pdjax.apps.data.bpe.text_bpe_buckets`)
runs microbatches of a few sequence lengths, each with its own compute, activation and
memory costs. Profile the model once per bucket length (:func:`profile_buckets`: the same
rows, one sample per length), then:

- :func:`mix_profiles` combines the profiles into the one the planner reads: per layer,
  the frequency-weighted mean of every time and FLOP count (the mean time of a
  microbatch of the mix), and the **largest** of every byte count over the buckets (a
  device must hold the longest bucket's activations whenever one comes), so a plan from
  it fits memory for every bucket. Transfers are then priced at the largest bucket's
  bytes too: a bound, not the mean (the planner reads one output size per layer for
  both what crosses a cut and what a stage holds).
- :func:`plan_buckets` plans: PipeDream's dynamic program on the mixed profile and on
  each bucket's own profile proposes partitions, and the one with the least **mix
  time** wins: :func:`mix_time_per_microbatch`, the frequency-weighted mean of the
  partition's time per microbatch priced on each bucket's profile (what a stream of
  one-bucket calls takes: each call runs at its bucket's period). The dynamic program
  minimises the slowest stage of the mean costs, which is not the mean of the per-bucket
  slowest stages, hence the re-ranking; a partition no proposal reaches is not found (a
  best of candidates, not a proven optimum).
- :func:`simulate_buckets` plays the plan's schedule with each microbatch priced by its
  bucket (:func:`pdjax.simulator.simulate`'s ``microbatch_costs``): one bucket per step
  for the flush schedules (each call of one bucket), or any order of microbatches for a
  streaming schedule.

>>> from pdjax.profile import LayerProfile, Profile
>>> def prof(t):
...     layers = [LayerProfile(f"l{i}", forward_seconds=t, backward_seconds=2 * t,
...                            param_bytes=100, output_bytes=int(1000 * t)) for i in range(4)]
...     return Profile.chain(layers, batch_size=4)
>>> mixed = mix_profiles({32: prof(1.0), 64: prof(2.0)}, {32: 3, 64: 1})
>>> mixed.layers[0].forward_seconds, mixed.layers[0].output_bytes
(1.25, 2000)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pdjax.errors import PlanError
from pdjax.partition.choosing.simulator_costs import costs_from_plan
from pdjax.partition.search.partitioners import evaluate_partition
from pdjax.partition.search.pipedream import plan_pipedream
from pdjax.plan.plan import Plan
from pdjax.plan.topology import Topology
from pdjax.profile import LayerProfile, PolicyCost, Profile, profile
from pdjax.profile.profile import COST_FIELDS
from pdjax.schedules import generate, semantics
from pdjax.simulator import Simulation, simulate

__all__ = [
    "bucket_weights",
    "mix_profiles",
    "mix_time_per_microbatch",
    "plan_buckets",
    "profile_buckets",
    "simulate_buckets",
]

# plan_pipedream's options after the profile and the topology: what plan_buckets passes on
_PLANNER_OPTIONS = tuple(
    name
    for name, p in inspect.signature(plan_pipedream).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)

# per-layer fields: averaged with the frequencies (times, counts) or the largest (bytes)
_MAX = ("state_bytes", "input_bytes", "output_bytes", "residual_bytes", "peak_bytes")


def bucket_weights(frequencies: Mapping[int, float]) -> dict[int, float]:
    """The frequencies (counts or shares of microbatches per bucket length) as shares
    that sum to 1, by ascending length. Any finite frequencies normalise (divided by the
    largest first, so that ``1e308`` twice is an even split, not an overflow).

    Raises:
      PlanError: no bucket (or not a mapping), a length that is not a positive integer,
        or a frequency that is negative, not a finite number (an int too large for a
        float included), or all of them zero.
    """
    if not isinstance(frequencies, Mapping):
        raise PlanError(
            f"frequencies must be a mapping {{length: microbatches}}, got "
            f"{type(frequencies).__name__}"
        )
    if not frequencies:
        raise PlanError("frequencies name no bucket: give {length: microbatches} per bucket")
    values: dict[int, float] = {}
    for n, f in frequencies.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanError(f"bucket length {n!r} is not a positive integer")
        value = _finite(f)
        if value is None or value < 0:
            raise PlanError(f"bucket {n}'s frequency {f!r} is not a finite number >= 0")
        values[n] = value
    largest = max(values.values())
    if largest <= 0:
        raise PlanError("every bucket's frequency is zero: at least one must be positive")
    scaled = {n: values[n] / largest for n in sorted(values)}  # in [0, 1]: the sum fits
    total = math.fsum(scaled.values())
    return {n: v / total for n, v in scaled.items()}


def _finite(f: Any) -> float | None:
    """``f`` as a float, or None if it is not a real number or is not finite as one."""
    if isinstance(f, bool) or not isinstance(f, int | float):
        return None
    try:
        value = float(f)
    except OverflowError:  # an int beyond the floats
        return None
    return value if math.isfinite(value) else None


def profile_buckets(
    layers: Any, samples: Mapping[int, Any], **profile_options: Any
) -> dict[int, Profile]:
    """Profiles ``layers`` (a :class:`~pdjax.layers.LayerSequence`) once per bucket:
    ``samples[length]`` is one batch of inputs of that sequence length (arrays or
    ``jax.ShapeDtypeStruct``), all with the same rows. ``profile_options`` go to
    :func:`pdjax.profile.profile` (``measure=True``, ``device_model=``, ...).

    Raises:
      PlanError: no sample, or samples of other batch sizes (the planner compares their
        times per microbatch).
    """
    if not samples:
        raise PlanError("profile_buckets needs one sample per bucket length, got none")
    out = {int(n): profile(layers, samples[n], **profile_options) for n in sorted(samples)}
    sizes = {n: p.batch_size for n, p in out.items()}
    if len(set(sizes.values())) > 1:
        raise PlanError(f"the bucket samples have other batch sizes {sizes}: give equal rows")
    return out


def _check_alike(profiles: Mapping[int, Profile], weights: Mapping[int, float]) -> Profile:
    """Refuses profiles that are not one model's at several lengths; returns the longest's."""
    if set(profiles) != set(weights):
        raise PlanError(
            f"the profiles are for bucket lengths {sorted(profiles)} but the frequencies name "
            f"{sorted(weights)}: give one profile per bucket"
        )
    ordered = [profiles[n] for n in sorted(profiles)]
    first = ordered[-1]
    for n, p in zip(sorted(profiles), ordered, strict=True):
        if len(p.layers) != len(first.layers) or p.edges != first.edges:
            raise PlanError(f"bucket {n}'s profile has other layers or edges than the others")
        if p.batch_size != first.batch_size:
            raise PlanError(
                f"bucket {n}'s profile has batch size {p.batch_size}, another has "
                f"{first.batch_size}: profile every bucket on the same rows"
            )
        for a, b in zip(p.layers, first.layers, strict=True):
            if a.name != b.name or a.param_bytes != b.param_bytes:
                raise PlanError(
                    f"bucket {n}'s layer {a.name!r} differs from the others' (name or "
                    "parameter bytes): the buckets must profile one model"
                )
    return first


def _mean(values: Sequence[float | None], shares: Sequence[float]) -> float | None:
    if any(v is None for v in values):
        return None
    return math.fsum(float(v) * w for v, w in zip(values, shares, strict=True))  # type: ignore[arg-type]


def _mixed_policies(
    layers: Sequence[LayerProfile], shares: Sequence[float]
) -> tuple[PolicyCost, ...]:
    """Each memory policy profiled in every bucket: the largest bytes, the mean share
    recomputed."""
    out = []
    for pc in layers[-1].policies:
        per = [next((q for q in layer.policies if q.policy == pc.policy), None) for layer in layers]
        if any(q is None for q in per):
            continue
        out.append(
            PolicyCost(
                pc.policy,
                residual_bytes=max(q.residual_bytes for q in per if q is not None),
                host_bytes=max(q.host_bytes for q in per if q is not None),
                recompute=math.fsum(
                    q.recompute * w for q, w in zip(per, shares, strict=True) if q is not None
                ),
            )
        )
    return tuple(out)


def mix_profiles(profiles: Mapping[int, Profile], frequencies: Mapping[int, float]) -> Profile:
    """One profile for a mix of buckets (see the module): per layer, the
    frequency-weighted mean of times and FLOP and access counts (None where a bucket has
    none), the largest of the byte counts; the longest bucket's names and shapes.

    Raises:
      PlanError: bad frequencies, or profiles that are not one model's on the same rows.
    """
    weights = bucket_weights(frequencies)
    longest = _check_alike(profiles, weights)
    lengths = sorted(profiles)
    shares = [weights[n] for n in lengths]
    layers = []
    for i, base in enumerate(longest.layers):
        per = [profiles[n].layers[i] for n in lengths]
        fields: dict[str, Any] = {
            f: _mean([getattr(p, f) for p in per], shares) for f in COST_FIELDS
        }
        for f in _MAX:
            values = [getattr(p, f) for p in per]
            fields[f] = None if any(v is None for v in values) else max(values)
        fields["policies"] = _mixed_policies(per, shares)
        layers.append(dataclasses.replace(base, **fields))
    mix = ",".join(f"{n}:{weights[n]:.6g}" for n in lengths)
    return dataclasses.replace(longest, layers=tuple(layers), meta={**longest.meta, "buckets": mix})


def _partition(plan: Plan) -> list[tuple[int, int, int]]:
    return [(st.first_layer, st.last_layer, st.replicas) for st in plan.stages]


def _priced(plan: Plan, prof: Profile, optimizer_state_factor: float) -> Plan:
    """``plan``'s partition priced on ``prof`` with the plan's own settings."""
    return evaluate_partition(
        prof,
        plan.topology,
        _partition(plan),
        cost_model=plan.cost_model,
        schedule=plan.schedule.kind,
        num_microbatches=plan.num_microbatches,
        microbatch_size=plan.microbatch_size,
        optimizer_state_factor=optimizer_state_factor,
        memory_limit=plan.memory_limit,
        replication=plan.replication,
    )


def mix_time_per_microbatch(
    plan: Plan,
    profiles: Mapping[int, Profile],
    frequencies: Mapping[int, float],
    *,
    optimizer_state_factor: float = 2.0,
) -> float:
    """The plan's seconds per microbatch over the mix: its partition priced on each
    bucket's profile (:func:`~pdjax.partition.evaluate_partition`, the plan's cost model,
    schedule and microbatches), weighted by the frequencies. Each bucket's term is what
    a call of that bucket takes per microbatch, so this is a stream of one-bucket calls'
    time divided by its microbatches.

    Raises:
      PlanError: as :func:`mix_profiles` does.
    """
    weights = bucket_weights(frequencies)
    _check_alike(profiles, weights)
    return math.fsum(
        w * _priced(plan, profiles[n], optimizer_state_factor).time_per_microbatch
        for n, w in weights.items()
    )


def plan_buckets(
    profiles: Mapping[int, Profile],
    frequencies: Mapping[int, float],
    topology: Topology,
    **planner_options: Any,
) -> Plan:
    """A plan for a stream of buckets (see the module): :func:`plan_pipedream` on the
    mixed profile and on each bucket's profile proposes partitions; the one of least
    :func:`mix_time_per_microbatch` among those that fit memory for every bucket wins.

    ``planner_options`` go to :func:`~pdjax.partition.plan_pipedream` (``schedule``,
    ``num_microbatches``, ``straight``, ``memory_limit``, ...). The plan returned is
    priced on the mixed profile (its memory is the largest bucket's), with
    ``time_per_microbatch`` the mix time and ``options["buckets"]`` holding
    ``{"lengths", "weights", "time_per_microbatch"}`` (the last per bucket).

    Raises:
      TypeError: an option :func:`~pdjax.partition.plan_pipedream` does not take (the
        message lists those it takes), before any planning.
      PlanError: as :func:`mix_profiles` and :func:`plan_pipedream` do (the mixed profile
        fitting no configuration under the memory limit).
    """
    unknown = sorted(set(planner_options) - set(_PLANNER_OPTIONS))
    if unknown:
        raise TypeError(
            f"plan_buckets() got unexpected keyword argument(s) {', '.join(unknown)}; it "
            f"takes plan_pipedream's options: {', '.join(_PLANNER_OPTIONS)}"
        )
    weights = bucket_weights(frequencies)
    _check_alike(profiles, weights)
    factor = planner_options.get("optimizer_state_factor", 2.0)
    mixed = mix_profiles(profiles, frequencies)
    proposals = [plan_pipedream(mixed, topology, **planner_options)]
    for n in weights:
        try:
            proposals.append(plan_pipedream(profiles[n], topology, **planner_options))
        except PlanError:  # a bucket alone may plan where the mix does not fit: skip it
            continue
    best: tuple[float, Plan, dict[int, float]] | None = None
    seen = set()
    for proposal in proposals:
        key = tuple(_partition(proposal))
        if key in seen:
            continue
        seen.add(key)
        priced = {n: _priced(proposal, profiles[n], factor) for n in weights}
        if not all(p.fits_memory for p in priced.values()):
            continue
        per = {n: p.time_per_microbatch for n, p in priced.items()}
        t = math.fsum(weights[n] * per[n] for n in weights)
        if best is None or t < best[0]:
            best = (t, proposal, per)
    assert best is not None  # the mixed profile's plan fits every bucket (largest bytes)
    t, chosen, per = best
    on_mix = _priced(chosen, mixed, factor)
    buckets = {
        "lengths": list(weights),
        "weights": list(weights.values()),
        "time_per_microbatch": [per[n] for n in weights],
    }
    return dataclasses.replace(
        on_mix,
        partitioner=chosen.partitioner,
        time_per_microbatch=t,
        options={**chosen.options, **on_mix.options, "buckets": buckets},
    )


def simulate_buckets(
    plan: Plan,
    profiles: Mapping[int, Profile],
    order: Sequence[int],
    *,
    schedule: str | None = None,
    **schedule_options: Any,
) -> Simulation:
    """Plays the plan's schedule (or ``schedule``) over microbatches whose bucket lengths
    are ``order`` (one entry per microbatch, in the order they enter), each priced by its
    bucket's profile (:func:`~pdjax.partition.costs_from_plan`); updates, transfers and
    memory by the longest bucket's (a bound). A flush schedule runs whole steps of
    ``plan.num_microbatches``; give each step one bucket, as the runtime runs one call
    per bucket. ``schedule_options`` go to :func:`pdjax.schedules.generate`.

    Raises:
      PlanError: a length in ``order`` with no profile, or a flush schedule whose ``order``
        is not whole steps.
    """
    name = plan.schedule.kind if schedule is None else schedule
    missing = sorted(set(order) - set(profiles))
    if not order or missing:
        raise PlanError(
            f"order must name a profiled bucket per microbatch; {missing or 'none'} given "
            f"without a profile (profiled: {sorted(profiles)})"
        )
    costs = {n: costs_from_plan(plan, profiles[n]) for n in sorted(set(order))}
    longest = costs_from_plan(plan, profiles[max(profiles)])
    M, N = plan.num_microbatches, len(order)
    streams = semantics(name).streams
    if not streams and N % M:
        raise PlanError(f"{name} runs whole steps of {M} microbatches; order has {N}")
    sched = generate(
        name,
        plan.num_stages,
        M,
        stream=N if streams else None,
        steps=1 if streams else N // M,
        replicas=plan.replicas,
        replication=plan.replication,
        **schedule_options,
    )
    return simulate(sched, longest, microbatch_costs=[costs[n] for n in order])
