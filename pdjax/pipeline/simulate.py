"""Plays a schedule against per-stage costs: step time, bubble fraction, peak memory.

The cost model (DESIGN.md's ``pdjax`` model):

- a device group runs its actions in order, one at a time; an action starts when the group
  is free and its inputs have arrived, and takes its stage's ``forward``, ``backward``
  (``= input_grad + weight_grad``), ``input_grad``, ``weight_grad`` seconds; costs are per
  replica (a stage on ``r`` devices already counts compute / ``r``), which is what one
  action costs when the group *splits* each microbatch across its devices. A group that
  replicates *round-robin* (``Schedule.replication``) runs ``n = r`` microbatches at once,
  one per device, in each action (``Schedule.covers``): the action takes ``n`` times the
  per-replica cost, the whole microbatch's compute on one device;
- ``U`` takes ``update`` seconds plus, for a stage on ``r > 1`` devices, a ring all-reduce of
  its weight gradients, ``2 (r - 1) / r * param_bytes / allreduce_bandwidth``, or, where
  ``PipelineCosts.allreduce_seconds`` gives the stage a number (a measured all-reduce), that
  many seconds instead of the ring formula; the schedule has one ``U`` per update, so the
  all-reduce is paid once per step for flush schedules and ``2bw``, and under ``pipedream``
  once per microbatch at a split stage and once per group of ``r`` microbatches at a
  round-robin one;
- an activation crossing the cut after stage ``s`` takes ``activation_bytes /
  link_bandwidth[s] + link_latency[s]`` seconds when the two stages are on different device
  groups, and its gradient, coming back, ``activation_bytes / link_bandwidth_back[s] +
  link_latency[s]`` (``link_bandwidth_back`` defaults to ``link_bandwidth``; a scalar
  ``link_latency`` is every cut's); each direction between two groups is one link carrying
  one tensor at a time; transfers overlap compute;
- posting a transfer costs the sending group ``send_seconds`` of host time per microbatch
  sent (its stage's :attr:`StageCosts.send_seconds`): the group is busy for it, after the
  ``F`` (or ``B``/``I``) that made the tensor and before the transfer starts. The event model
  folds it into that action, whose span then ends when the transfer starts;
- memory of a device in a group: summed over the group's stages (its chunks: ``v`` under
  ``interleaved``, the two arms of the V under ``zb-v``, each with its own costs; see
  :meth:`PipelineCosts.interleave` and :meth:`PipelineCosts.v_shape`), ``param_bytes``
  times the weight versions alive + ``optimizer_bytes`` + ``stash_bytes`` times the
  microbatches in flight (forward run, backward - ``B`` or ``W`` - not yet), counted over
  the whole group:
  ``stash_bytes`` is one replica's share of a microbatch's stash (``1 / r`` of it), so a
  round-robin group holding ``q`` groups of ``r`` microbatches holds ``q`` whole stashes per
  device. Memory is counted while each action runs: what it reads and what it makes are
  both alive (a backward's stash, the gradient that came in and the weight version it read
  for the last time, next to its results). That is the planner's memory model
  (:mod:`pdjax.partition.cost`), and the simulator's by default
  (``PipelineCosts.memory_model = "planner"``). With ``memory_model = "runtime"`` it also
  counts what pdjax's runtime (:mod:`pdjax.pipeline.program`) holds besides, for one call
  of the schedule:

  ======================  ==============================================================
  the gradient sum        ``param_bytes`` from the first ``B`` (or ``W``) after an update
                          up to and including the ``U`` that applies it (slot ``g``). The
                          ``U`` donates it and the optimizer state: the new weights take the
                          sum's buffers, the new state the old state's, so the update's
                          transient (new weights next to the old) is this term. Under
                          ``pipedream`` (``B`` then ``U`` per microbatch) it is alive during
                          the ``B`` and the ``U``; a fused ``BU`` that gets no sum holds
                          the new weights next to the old ones instead, the same bytes (its
                          fresh gradient is one of XLA's temporaries)
  the call's weights      version 0, the weights the call starts from, stays alive until
                          the call returns (the caller's state holds it, and the runtime
                          never donates it): one more ``param_bytes`` once the stage has
                          replaced it
  inputs placed up front  ``input_bytes / r`` per microbatch of the call (the caller's
                          inputs at the first stage, its targets at the last, both placed
                          before the first action, batch-sharded over the ``r`` devices),
                          until the stage's ``F`` of that microbatch: from there the input
                          is part of ``stash_bytes``, and targets are dropped
  zero bubble's ``c``     ``cotangent_bytes`` (one replica's share, like ``stash_bytes``)
                          per microbatch from its ``I`` to its ``W``: the cotangents at
                          each layer's output that ``I`` keeps for ``W``
  activations in transit  ``activation_bytes / r`` per microbatch (a round-robin group's
                          devices hold one whole microbatch each): the sent copy on the
                          sender from the ``F`` (or ``B``/``I``) that made it until its
                          transfer ends, the received copy on the receiver from its
                          arrival until the ``F`` that reads it (an activation; from there
                          it is stash) or up to the ``B``/``I`` that reads it (a gradient)
  ======================  ==============================================================

  Not counted: the losses the call returns (a scalar per microbatch), the per-microbatch
  PRNG keys (8 bytes each), model state (BatchNorm statistics) and XLA's temporaries inside
  a program. The runtime's peak live bytes per device group (``RunMetrics.peak_bytes``, from
  ``Pipeline.run(..., timeline=True)``) is measured after each operation, once it has
  dropped the inputs it read for the last time: below this count where a backward frees a
  weight version (``pipedream``) or a whole stash (``gpipe``).
  ``benchmarks/bench_runtime.py --memory-only`` measures both ways and compares.

:class:`PipelineCosts` is the seam to the planner: a Plan and its Profile become one
(``pdjax.apps.commands.simulate.costs_from_plan``); :func:`unit_costs` makes one from numbers.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from pdjax.errors import ScheduleError
from pdjax.pipeline.schedules import (
    SEMANTICS,
    STREAMING,
    Action,
    Schedule,
    group_sizes,
    live_versions,
    play,
    round_robin_in_flight,
    semantics,
    validate,
)
from pdjax.pipeline.timeline import Span, Timeline, Transfer

__all__ = [
    "PipelineCosts",
    "Simulation",
    "StageCosts",
    "simulate",
    "stream_length",
    "unit_costs",
]


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """What one (virtual) stage costs, per microbatch and per device of its group.

    Attributes:
        forward: seconds of the forward.
        input_grad: seconds of the backward's input-gradient part (``I``).
        weight_grad: seconds of the backward's weight-gradient part (``W``).
        update: seconds of the optimizer update, without the all-reduce.
        activation_bytes: bytes sent to the next stage per microbatch (the gradient that
            comes back has the same size).
        param_bytes: bytes of one copy of the stage's weights.
        stash_bytes: bytes kept per microbatch in flight (saved activations).
        optimizer_bytes: bytes of optimizer state.
        input_bytes: bytes per microbatch the call places on the stage's devices before it
            starts (the whole microbatch's, like ``activation_bytes``): at the first stage
            the inputs, at the last the targets, both at a single stage; 0 elsewhere.
            Counted by the ``runtime`` memory model only.
        cotangent_bytes: bytes zero bubble's ``I`` keeps per microbatch for its ``W`` (the
            cotangent at each layer's output; one replica's share, like ``stash_bytes``).
            Counted by the ``runtime`` memory model only.
        send_seconds: host seconds the stage's device group spends posting each transfer
            it sends (an activation after ``F``, a gradient after ``B``/``I``), before the
            transfer starts; charged only for transfers to another device group.
    """

    forward: float
    input_grad: float
    weight_grad: float
    update: float = 0.0
    activation_bytes: int = 0
    param_bytes: int = 0
    stash_bytes: int = 0
    optimizer_bytes: int = 0
    input_bytes: int = 0
    cotangent_bytes: int = 0
    send_seconds: float = 0.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not _finite_non_negative(value):
                raise ScheduleError(
                    f"StageCosts.{field.name} must be a finite number >= 0; got {value!r}"
                )

    @property
    def backward(self) -> float:
        """Seconds of the whole backward, ``input_grad + weight_grad``."""
        return self.input_grad + self.weight_grad


def _finite_non_negative(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and value >= 0
        and not math.isinf(value)
    )


#: Memory models of :func:`simulate` (see the module doc).
MEMORY_MODELS = ("planner", "runtime")


@dataclasses.dataclass(frozen=True)
class PipelineCosts:
    """Per-stage costs and the links between stages.

    Build it with :meth:`build` (which accepts scalars) or :func:`unit_costs`.

    Attributes:
        stages: one entry per (virtual) stage.
        link_bandwidth: bytes/s across each cut, ``link_bandwidth[s]`` between stages
            ``s`` and ``s + 1`` (``num_stages - 1`` entries); ``math.inf`` makes it free.
            Activations travel at it, and gradients too unless ``link_bandwidth_back`` is
            given.
        allreduce_bandwidth: bytes/s of each stage's gradient all-reduce among its replicas.
        link_latency: seconds added to every transfer between device groups: one number for
            every cut, or one per cut (``num_stages - 1`` entries, ``link_latency[s]``
            between stages ``s`` and ``s + 1``, both directions).
        link_bandwidth_back: bytes/s of the gradient direction of each cut (from stage
            ``s + 1`` back to ``s``; ``num_stages - 1`` entries); ``None``: the same as
            ``link_bandwidth``.
        allreduce_seconds: per stage, the seconds of its all-reduce at each update (a
            measured all-reduce), replacing the ring formula; ``None`` as a whole or for a
            stage: the ring formula from ``allreduce_bandwidth``.
        memory_model: ``"planner"`` (weights x versions, optimizer state, stash x in
            flight: the planner's formula) or ``"runtime"`` (also what pdjax's runtime
            holds: gradient sums, the call's starting weights, inputs placed up front, zero
            bubble's cotangents, activations in transit; see the module doc).
        posted_receives: a transfer starts only when the receiving group reaches the action
            that needs it, not when the sender has produced it: what pdjax's runtime does
            across processes on CPU, where XLA runs each program on the thread that
            dispatches it, so a receive is posted only after the programs before it.
    """

    stages: tuple[StageCosts, ...]
    link_bandwidth: tuple[float, ...]
    allreduce_bandwidth: tuple[float, ...]
    link_latency: float | tuple[float, ...] = 0.0
    link_bandwidth_back: tuple[float, ...] | None = None
    allreduce_seconds: tuple[float | None, ...] | None = None
    memory_model: str = "planner"
    posted_receives: bool = False

    def __post_init__(self) -> None:
        if not self.stages:
            raise ScheduleError("PipelineCosts needs at least one stage")
        S = len(self.stages)
        # sequences given as lists (JSON) become tuples: the costs stay hashable
        for name in ("link_latency", "link_bandwidth_back", "allreduce_seconds"):
            value = getattr(self, name)
            if isinstance(value, Sequence) and not isinstance(value, str | tuple):
                object.__setattr__(self, name, tuple(value))
        checks = [
            ("link_bandwidth", self.link_bandwidth, S - 1),
            ("allreduce_bandwidth", self.allreduce_bandwidth, S),
        ]
        if self.link_bandwidth_back is not None:
            checks.append(("link_bandwidth_back", self.link_bandwidth_back, S - 1))
        for label, values, size in checks:
            _check_length(label, values, size, S)
            if any(not isinstance(b, int | float) or not b > 0 for b in values):
                raise ScheduleError(f"PipelineCosts.{label} must be > 0 bytes/s; got {values}")
        latency = self.link_latency
        if isinstance(latency, tuple):
            _check_length("link_latency", latency, S - 1, S)
            if not all(_finite_non_negative(x) for x in latency):
                raise ScheduleError(
                    f"PipelineCosts.link_latency must be finite numbers >= 0 s; got {latency}"
                )
        elif not _finite_non_negative(latency):
            raise ScheduleError(
                "PipelineCosts.link_latency must be a finite number >= 0 s or one per cut; "
                f"got {latency!r}"
            )
        if self.allreduce_seconds is not None:
            _check_length("allreduce_seconds", self.allreduce_seconds, S, S)
            if not all(x is None or _finite_non_negative(x) for x in self.allreduce_seconds):
                raise ScheduleError(
                    "PipelineCosts.allreduce_seconds must hold None or finite numbers >= 0 s; "
                    f"got {self.allreduce_seconds}"
                )
        if self.memory_model not in MEMORY_MODELS:
            raise ScheduleError(
                f"PipelineCosts.memory_model must be one of {MEMORY_MODELS}; "
                f"got {self.memory_model!r}"
            )

    def latency(self, cut: int) -> float:
        """Seconds added to a transfer across the cut between stages ``cut`` and ``cut + 1``.

        >>> PipelineCosts.build([StageCosts(1.0, 1.0, 1.0)] * 3, link_latency=[0.5, 2.0]).latency(1)
        2.0
        """
        if isinstance(self.link_latency, tuple):
            return float(self.link_latency[cut])
        return float(self.link_latency)

    def bandwidth(self, cut: int, *, backward: bool = False) -> float:
        """Bytes/s across the cut between stages ``cut`` and ``cut + 1``: of activations,
        or with ``backward`` of gradients (``link_bandwidth_back``, if given)."""
        if backward and self.link_bandwidth_back is not None:
            return self.link_bandwidth_back[cut]
        return self.link_bandwidth[cut]

    def allreduce(self, stage: int, replicas: int) -> float:
        """Seconds of ``stage``'s gradient all-reduce over ``replicas`` devices: the measured
        ``allreduce_seconds[stage]`` if given, else the ring's ``2 (r - 1) / r *
        param_bytes / allreduce_bandwidth``.

        >>> costs = PipelineCosts.build([StageCosts(1.0, 1.0, 1.0, param_bytes=100)] * 2,
        ...                             allreduce_bandwidth=10.0, allreduce_seconds=[None, 3.0])
        >>> costs.allreduce(0, 2), costs.allreduce(1, 2)
        (10.0, 3.0)
        """
        measured = None if self.allreduce_seconds is None else self.allreduce_seconds[stage]
        if measured is not None:
            return float(measured)
        r = replicas
        return 2 * (r - 1) / r * self.stages[stage].param_bytes / self.allreduce_bandwidth[stage]

    @classmethod
    def build(
        cls,
        stages: Sequence[StageCosts],
        *,
        link_bandwidth: float | Sequence[float] = math.inf,
        allreduce_bandwidth: float | Sequence[float] = math.inf,
        link_latency: float | Sequence[float] = 0.0,
        link_bandwidth_back: float | Sequence[float] | None = None,
        allreduce_seconds: Sequence[float | None] | None = None,
        memory_model: str = "planner",
        posted_receives: bool = False,
    ) -> PipelineCosts:
        """Like the constructor, with one bandwidth (bytes/s) allowed for all links.

        >>> costs = PipelineCosts.build([StageCosts(1.0, 1.0, 1.0)] * 3, link_bandwidth=1e9)
        >>> costs.link_bandwidth
        (1000000000.0, 1000000000.0)
        """
        stages = tuple(stages)

        def spread(value: float | Sequence[float], size: int) -> tuple[float, ...]:
            if isinstance(value, int | float):
                return (float(value),) * size
            return tuple(float(v) for v in value)

        return cls(
            stages=stages,
            link_bandwidth=spread(link_bandwidth, len(stages) - 1),
            allreduce_bandwidth=spread(allreduce_bandwidth, len(stages)),
            link_latency=(
                float(link_latency)
                if isinstance(link_latency, int | float)
                else tuple(float(x) for x in link_latency)
            ),
            link_bandwidth_back=(
                None
                if link_bandwidth_back is None
                else spread(link_bandwidth_back, len(stages) - 1)
            ),
            allreduce_seconds=(
                None
                if allreduce_seconds is None
                else tuple(None if x is None else float(x) for x in allreduce_seconds)
            ),
            memory_model=memory_model,
            posted_receives=posted_receives,
        )

    def interleave(self, chunks: int) -> PipelineCosts:
        """Costs of ``P * chunks`` virtual stages, each stage cut into equal chunks.

        Virtual stage ``d + c P`` gets ``1 / chunks`` of stage ``d``'s compute, weights,
        optimizer state, stash, cotangents and measured all-reduce, and stage ``d``'s
        activation bytes and send seconds; the first virtual stage gets stage 0's input
        bytes, the last stage ``P - 1``'s. The cut from the last group back to the first
        (between chunks) carries the largest activation of any cut and uses the slowest
        link (the smallest bandwidth of each direction, the largest latency): a what-if
        approximation for when no plan partitions the layers into ``P * chunks`` stages.

        Raises:
            ScheduleError: if ``chunks < 1``.
        """
        if not isinstance(chunks, int) or chunks < 1:
            raise ScheduleError(f"chunks must be an integer >= 1; got {chunks!r}")
        if chunks == 1:
            return self
        P = len(self.stages)
        widest = max((st.activation_bytes for st in self.stages), default=0)
        cuts = range(P - 1)

        def wrap(per_cut: Sequence[float], pick: Any) -> list[float]:
            """Per virtual cut: the stage's own cut, or ``pick`` of all for the wrap-around."""
            out = []
            for c in range(chunks):
                out += [per_cut[d] for d in cuts]
                if c < chunks - 1:
                    out.append(pick(per_cut, default=math.inf if pick is min else 0.0))
            return out

        stages = []
        for c in range(chunks):
            for d, st in enumerate(self.stages):
                stages.append(
                    StageCosts(
                        forward=st.forward / chunks,
                        input_grad=st.input_grad / chunks,
                        weight_grad=st.weight_grad / chunks,
                        update=st.update / chunks,
                        activation_bytes=st.activation_bytes if d < P - 1 else widest,
                        param_bytes=st.param_bytes // chunks,
                        stash_bytes=st.stash_bytes // chunks,
                        optimizer_bytes=st.optimizer_bytes // chunks,
                        input_bytes=(
                            st.input_bytes
                            if (c, d) == (0, 0) or (P > 1 and (c, d) == (chunks - 1, P - 1))
                            else 0
                        ),
                        cotangent_bytes=st.cotangent_bytes // chunks,
                        send_seconds=st.send_seconds,
                    )
                )
        latency: float | tuple[float, ...] = self.link_latency
        if isinstance(latency, tuple):
            latency = tuple(wrap(latency, max))
        measured = self.allreduce_seconds
        return PipelineCosts(
            stages=tuple(stages),
            link_bandwidth=tuple(wrap(self.link_bandwidth, min)),
            allreduce_bandwidth=self.allreduce_bandwidth * chunks,
            link_latency=latency,
            link_bandwidth_back=(
                None
                if self.link_bandwidth_back is None
                else tuple(wrap(self.link_bandwidth_back, min))
            ),
            allreduce_seconds=(
                None
                if measured is None
                else tuple(None if x is None else x / chunks for x in measured) * chunks
            ),
            memory_model=self.memory_model,
            posted_receives=self.posted_receives,
        )

    def v_shape(self) -> PipelineCosts:
        """Costs of ``zb-v``'s ``2P`` stages: each stage cut into two equal chunks placed
        in a V (:func:`~pdjax.pipeline.schedules.stage_groups`).

        Stage ``s`` of the V runs on group ``g = min(s, 2P - 1 - s)`` and gets half of
        stage ``g``'s compute, weights, optimizer state, stash, cotangents and measured
        all-reduce, and stage ``g``'s send seconds and all-reduce bandwidth. The way down
        (cuts ``0 .. P - 2``) is this pipeline's cuts; the turn (cut ``P - 1``, both
        stages on the last group) moves nothing between groups and carries the largest
        activation of any cut (it lives on the group until the next forward reads it); the
        way back up crosses cut ``c = 2P - 2 - s`` from group ``c + 1`` to ``c`` with its
        activation bytes, the activations at the cut's gradient bandwidth
        (``link_bandwidth_back``) and the gradients at its activation bandwidth. The first
        stage gets stage 0's input bytes, the last (on group 0) stage ``P - 1``'s (the
        targets; with one stage, the first gets them all, as in :meth:`interleave`). Like
        :meth:`interleave`, a what-if approximation for when no plan partitions the layers
        into the ``2P`` stages.

        >>> costs = PipelineCosts.build([StageCosts(2.0, 2.0, 2.0, activation_bytes=8)] * 2,
        ...                             link_bandwidth=[4.0], link_bandwidth_back=[1.0])
        >>> v = costs.v_shape()
        >>> [st.forward for st in v.stages], v.link_bandwidth, v.link_bandwidth_back
        ([1.0, 1.0, 1.0, 1.0], (4.0, inf, 1.0), (1.0, inf, 4.0))
        """
        P = len(self.stages)
        K = 2 * P
        widest = max((st.activation_bytes for st in self.stages), default=0)
        groups = [min(s, K - 1 - s) for s in range(K)]
        back = self.link_bandwidth_back or self.link_bandwidth
        latency = self.link_latency
        forward_bw, back_bw, cut_bytes, cut_latency = [], [], [], []
        for s in range(K - 1):
            if s < P - 1:  # down: this pipeline's cut s
                c, fwd, bwd = s, self.link_bandwidth[s], back[s]
            elif s == P - 1:  # the turn, on the last group
                c, fwd, bwd = -1, math.inf, math.inf
            else:  # up: cut c from group c + 1 to c
                c = K - 2 - s
                fwd, bwd = back[c], self.link_bandwidth[c]
            forward_bw.append(fwd)
            back_bw.append(bwd)
            cut_bytes.append(widest if c < 0 else self.stages[c].activation_bytes)
            if isinstance(latency, tuple):
                cut_latency.append(0.0 if c < 0 else latency[c])
        ends = {0: self.stages[0].input_bytes}  # one stage: its input bytes hold both
        if P > 1:
            ends[K - 1] = self.stages[-1].input_bytes
        stages = []
        for s, g in enumerate(groups):
            st = self.stages[g]
            stages.append(
                StageCosts(
                    forward=st.forward / 2,
                    input_grad=st.input_grad / 2,
                    weight_grad=st.weight_grad / 2,
                    update=st.update / 2,
                    activation_bytes=cut_bytes[s] if s < K - 1 else 0,
                    param_bytes=st.param_bytes // 2,
                    stash_bytes=st.stash_bytes // 2,
                    optimizer_bytes=st.optimizer_bytes // 2,
                    input_bytes=ends.get(s, 0),
                    cotangent_bytes=st.cotangent_bytes // 2,
                    send_seconds=st.send_seconds,
                )
            )
        measured = self.allreduce_seconds
        return PipelineCosts(
            stages=tuple(stages),
            link_bandwidth=tuple(forward_bw),
            allreduce_bandwidth=tuple(self.allreduce_bandwidth[g] for g in groups),
            link_latency=tuple(cut_latency) if isinstance(latency, tuple) else latency,
            link_bandwidth_back=(
                None
                if self.link_bandwidth_back is None and forward_bw == back_bw
                else tuple(back_bw)
            ),
            allreduce_seconds=(
                None
                if measured is None
                else tuple(None if (m := measured[g]) is None else m / 2 for g in groups)
            ),
            memory_model=self.memory_model,
            posted_receives=self.posted_receives,
        )


def _check_length(label: str, values: Sequence[Any], size: int, stages: int) -> None:
    if len(values) != size:
        what = "one per cut" if size == stages - 1 else "one per stage"
        raise ScheduleError(
            f"PipelineCosts.{label} has {len(values)} entries; expected {size} ({what}) for "
            f"{stages} stages"
        )


def unit_costs(
    num_stages: int,
    forward: float = 1.0,
    input_grad: float = 1.0,
    weight_grad: float = 1.0,
    *,
    update: float = 0.0,
    chunks: int = 1,
) -> PipelineCosts:
    """Identical stages with the given seconds, free transfers, no memory.

    Args:
        num_stages: ``P``, stages (device groups).
        forward: seconds of ``F``.
        input_grad: seconds of ``I``.
        weight_grad: seconds of ``W`` (``B = I + W``).
        update: seconds of ``U``.
        chunks: for ``interleaved`` (and ``zb-v``, with 2): ``P * chunks`` virtual stages,
            each ``1 / chunks`` of the costs, so that a device group does the same work as
            with one chunk (the stages being identical, their placement does not matter).

    Returns:
        The costs.

    >>> unit_costs(2).stages[0].backward
    2.0
    """
    stage = StageCosts(float(forward), float(input_grad), float(weight_grad), float(update))
    return PipelineCosts.build([stage] * num_stages).interleave(chunks)


def stream_length(
    name: str,
    num_stages: int,
    microbatches_per_step: int = 1,
    *,
    replicas: Sequence[int] | None = None,
    replication: Sequence[str] | str | None = None,
) -> int:
    """A stream length ``N`` for ``pipedream`` or ``2bw`` long enough for a steady state.

    ``N`` is a multiple of ``M`` (``2bw``) and of every round-robin stage's group size
    (as the generators require). Without round-robin stages it is ``M`` times
    ``max(4, ceil(2 P / M))`` (``M = 1`` for ``pipedream``); with them, long enough to hold
    the fill and the drain (the microbatches the stages keep in flight,
    :func:`~pdjax.pipeline.schedules.round_robin_in_flight`, twice over, and
    ``4 (n_0 + ... + n_{P-1})``) and four periods of ``lcm(M, n_0, ..., n_{P-1})``
    microbatches between them.

    Args:
        name: ``"pipedream"`` or ``"2bw"`` (any other name is treated as ``pipedream``).
        num_stages: ``P``.
        microbatches_per_step: ``M`` (``2bw``; ignored for ``pipedream``).
        replicas: devices per stage (default 1 each).
        replication: per stage ``"split"`` or ``"round-robin"`` (or one word for all).

    >>> stream_length("pipedream", 4), stream_length("2bw", 4, 3)
    (8, 12)
    >>> stream_length("pipedream", 2, replicas=(15, 1), replication="round-robin")
    195
    """
    row = SEMANTICS.get(name)
    streams_steps = row is not None and row.streams and not row.updates_per_microbatch
    M = microbatches_per_step if streams_steps else 1
    reps = tuple(replicas) if replicas is not None else (1,) * num_stages
    modes = (replication,) * len(reps) if isinstance(replication, str) else replication
    modes = tuple(modes or ("split",) * len(reps))
    units = group_sizes(reps, modes)
    if all(n == 1 for n in units):
        return M * max(4, -(-2 * num_stages // M))
    period = math.lcm(M, *units)
    held = sum(q * n for q, n in zip(round_robin_in_flight(units), units, strict=True))
    need = max(4 * M, 4 * sum(units) + 2 * held + 4 * period)
    return period * -(-need // period)


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The result of :func:`simulate`.

    Attributes:
        schedule: the schedule that was played.
        timeline: every action and transfer with its start and end, seconds.
        makespan: seconds from the first action to the last.
        step_time: seconds per optimizer step: for flush schedules, the makespan divided by
            the steps; for ``pipedream`` (a step is one microbatch) and ``2bw``, the steady
            state's.
        time_per_microbatch: ``step_time / microbatches_per_step``.
        bubble_fraction: idle share of device-group time: over the whole run for flush
            schedules, over the steady state for ``pipedream`` and ``2bw``.
        peak_memory: per device group, the most bytes one of its devices holds.
        peak_in_flight: per stage, the most microbatches in flight (over the stage's whole
            group: a round-robin group's ``q`` groups of ``r`` count ``q r``).
        steady_state: whether ``step_time`` and ``bubble_fraction`` come from a steady-state
            window (only ``pipedream`` and ``2bw`` with a stream long enough to have one:
            about ``2 P`` microbatches, more with round-robin stages, see
            :func:`stream_length`; otherwise they describe the whole run).
        memory_by_action: per device group, the bytes one of its devices holds during each
            of its actions (parallel to ``schedule.actions[g]``; ``peak_memory`` is the
            largest).
    """

    schedule: Schedule
    timeline: Timeline
    makespan: float
    step_time: float
    time_per_microbatch: float
    bubble_fraction: float
    peak_memory: tuple[int, ...]
    peak_in_flight: tuple[int, ...]
    steady_state: bool
    memory_by_action: tuple[tuple[int, ...], ...] = ()

    def summary(self) -> dict[str, Any]:
        """The numbers as plain JSON-able data."""
        s = self.schedule
        return {
            "schedule": s.name,
            "num_stages": s.num_stages,
            "num_groups": s.num_groups,
            "num_microbatches": s.num_microbatches,
            "microbatches_per_step": s.microbatches_per_step,
            "replicas": list(s.replicas),
            "replication": list(s.replication) or ["split"] * s.num_groups,
            "makespan": self.makespan,
            "step_time": self.step_time,
            "time_per_microbatch": self.time_per_microbatch,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory": list(self.peak_memory),
            "peak_in_flight": list(self.peak_in_flight),
            "steady_state": self.steady_state,
        }


def _check_match(schedule: Schedule, costs: PipelineCosts) -> None:
    if len(costs.stages) != schedule.num_stages:
        hint = ""
        if schedule.chunks > 1 and len(costs.stages) == schedule.num_groups:
            hint = f"; use costs.interleave({schedule.chunks}) for an interleaved schedule"
            if semantics(schedule.name).v_shaped:
                hint = "; use costs.v_shape() for zb-v (its 2P stages in a V)"
        raise ScheduleError(
            f"the costs describe {len(costs.stages)} stages but the {schedule.name} schedule "
            f"has num_stages={schedule.num_stages} ({schedule.num_groups} device groups x "
            f"{schedule.chunks} chunks){hint}; build both from the same plan"
        )


def _durations(schedule: Schedule, costs: PipelineCosts) -> dict[tuple[str, int], float]:
    """Seconds of each kind of action at each stage (see the module doc)."""
    table = {}
    where, S = schedule.stage_device, schedule.num_stages
    for s, st in enumerate(costs.stages):
        g = where[s]
        allreduce = costs.allreduce(s, schedule.replicas[g])
        # A round-robin action runs n whole microbatches side by side, one per device: the
        # time of n per-replica shares. The update is per device either way.
        n = schedule.group_size(s)
        # posting each transfer to another group occupies this group (one per microbatch)
        sends_forward = n * st.send_seconds if s + 1 < S and where[s + 1] != g else 0.0
        sends_back = n * st.send_seconds if s > 0 and where[s - 1] != g else 0.0
        table.update(
            {
                ("F", s): n * st.forward + sends_forward,
                ("B", s): n * st.backward + sends_back,
                ("I", s): n * st.input_grad + sends_back,
                ("W", s): n * st.weight_grad,
                ("U", s): st.update + allreduce,
            }
        )
    return table


def _memory(
    schedule: Schedule,
    costs: PipelineCosts,
    starts: list[list[float]],
    ends: list[list[float]],
    moves: list[tuple[int, int, float, float, Action]],
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Bytes per device of each group during each of its actions, and the peak
    microbatches in flight per stage (see the module doc for both memory models)."""
    runtime = costs.memory_model == "runtime"
    N = schedule.num_microbatches
    peak_in_flight = [0] * schedule.num_stages
    totals = [[0.0] * len(acts) for acts in schedule.actions]
    for g, acts in enumerate(schedule.actions):
        total = totals[g]
        r = schedule.replicas[g]
        for s in schedule.stages_of(g):
            st = costs.stages[s]
            versions = live_versions(acts, s)
            if runtime:
                versions = _with_call_weights(acts, s, versions)
            in_flight = 0
            waiting_for_w = 0  # zero bubble: I done, W not yet
            forwarded = 0
            summing = False  # a gradient sum is alive
            for pos, a in enumerate(acts):
                mine = a.stage == s
                if mine and a.kind == "F":
                    in_flight += len(schedule.covers(a))
                    forwarded += len(schedule.covers(a))
                if mine and a.kind == "I":
                    waiting_for_w += len(schedule.covers(a))
                if mine and a.kind in "BW":
                    summing = True
                peak_in_flight[s] = max(peak_in_flight[s], in_flight)
                total[pos] += (
                    st.param_bytes * versions[pos] + st.optimizer_bytes + st.stash_bytes * in_flight
                )
                if runtime:
                    total[pos] += (
                        st.param_bytes * summing
                        + st.input_bytes * (N - forwarded) / r
                        + st.cotangent_bytes * waiting_for_w
                    )
                if mine and a.kind in "BW":
                    in_flight -= len(schedule.covers(a))
                if mine and a.kind == "W":
                    waiting_for_w -= len(schedule.covers(a))
                if mine and a.kind == "U":
                    summing = False
    if runtime:
        _add_transit(schedule, costs, starts, ends, moves, totals)
    memory = tuple(tuple(round(x) for x in total) for total in totals)
    return memory, tuple(peak_in_flight)


def _with_call_weights(acts: Sequence[Action], stage: int, versions: list[int]) -> list[int]:
    """``versions`` plus version 0 from where it would die to the end: the weights a call
    starts from stay alive until it returns."""
    first_update = next(
        (pos for pos, a in enumerate(acts) if a.stage == stage and a.kind == "U"), None
    )
    if first_update is None:
        return versions
    last_use = max(
        (pos for pos, a in enumerate(acts) if a.stage == stage and a.version == 0), default=-1
    )
    end = max(last_use, first_update)
    return [v + (pos > end) for pos, v in enumerate(versions)]


def _add_transit(
    schedule: Schedule,
    costs: PipelineCosts,
    starts: list[list[float]],
    ends: list[list[float]],
    moves: list[tuple[int, int, float, float, Action]],
    totals: list[list[float]],
) -> None:
    """Adds to ``totals`` the activations and gradients in transit: the sender's copy from
    the action that made it until its transfer ends, the receiver's from its arrival until
    the action that reads it (an activation: before its ``F``, which stashes it; a
    gradient: up to its ``B``/``I``)."""
    S, where = schedule.num_stages, schedule.stage_device
    # where each microbatch's F, and B or I (what reads a gradient), sits in its group's list
    reader: dict[tuple[str, int, int], int] = {}
    for acts in schedule.actions:
        for pos, a in enumerate(acts):
            kind = "F" if a.kind == "F" else "G" if a.kind in "BI" else None
            if kind is not None:
                for k in schedule.covers(a):
                    reader.setdefault((kind, a.stage, k), pos)
    timed: dict[Action, list[tuple[float, float]]] = {}
    for _src, _dst, start, end, a in moves:
        timed.setdefault(a, []).append((start, end))
    deltas = [[0.0] * (len(acts) + 1) for acts in schedule.actions]
    for g, acts in enumerate(schedule.actions):
        for pos, a in enumerate(acts):
            if a.kind == "F" and a.stage + 1 < S:
                cut, peer, read = a.stage, a.stage + 1, "F"
            elif a.kind in "BI" and a.stage > 0:
                cut, peer, read = a.stage - 1, a.stage - 1, "G"
            else:
                continue
            h = where[peer]
            size = costs.stages[cut].activation_bytes
            spans = timed.get(a, [])
            for j, k in enumerate(schedule.covers(a)):
                arrival = spans[j][1] if j < len(spans) else ends[g][pos]
                if h != g:  # the sender's copy, until the transfer ends
                    last = max(pos, bisect.bisect_left(starts[g], arrival) - 1)
                    deltas[g][pos] += size / schedule.replicas[g]
                    deltas[g][last + 1] -= size / schedule.replicas[g]
                # the receiver's copy, from the first of its actions that ends after it arrives
                until = reader[read, peer, k] + (read == "G")  # exclusive
                first = bisect.bisect_right(ends[h], arrival)
                if first < until:
                    deltas[h][first] += size / schedule.replicas[h]
                    deltas[h][until] -= size / schedule.replicas[h]
    for g, delta in enumerate(deltas):
        alive = 0.0
        for pos in range(len(totals[g])):
            alive += delta[pos]
            totals[g][pos] += alive


def simulate(schedule: Schedule, costs: PipelineCosts, *, check: bool = True) -> Simulation:
    """Plays ``schedule`` against ``costs``.

    Args:
        schedule: the schedule; validated first unless ``check`` is false.
        costs: per-stage costs, one entry per (virtual) stage of ``schedule``.
        check: run :func:`~pdjax.pipeline.validate` first.

    Returns:
        Timelines, step time, bubble fraction, peak memory (see :class:`Simulation`).

    Raises:
        ScheduleError: if the schedule is invalid or the costs describe a different number
            of stages.

    >>> from pdjax.pipeline.schedules import one_f_one_b
    >>> sim = simulate(one_f_one_b(4, 8), unit_costs(4))
    >>> sim.step_time, round(sim.bubble_fraction, 4)  # 3 (M + P - 1); (P - 1) / (M + P - 1)
    (33.0, 0.2727)
    """
    if check:
        validate(schedule)
    _check_match(schedule, costs)
    table = _durations(schedule, costs)

    def duration(a: Action) -> float:
        return table[a.kind, a.stage]

    def transfer(cut: int, src: int, dst: int) -> float:
        backward = src != schedule.stage_device[cut]  # a gradient, from stage cut + 1
        seconds = costs.stages[cut].activation_bytes / costs.bandwidth(cut, backward=backward)
        return seconds + costs.latency(cut)

    starts, ends, moves = play(schedule, duration, transfer, costs.posted_receives)
    spans = tuple(
        Span(g, start, end, a)
        for g, acts in enumerate(schedule.actions)
        for a, start, end in zip(acts, starts[g], ends[g], strict=True)
    )
    timeline = Timeline(
        name=schedule.name,
        num_groups=schedule.num_groups,
        spans=spans,
        transfers=tuple(Transfer(*m) for m in moves),
    )
    makespan = timeline.makespan
    G, M = schedule.num_groups, schedule.microbatches_per_step
    window = _steady_window(schedule, ends) if schedule.name in STREAMING else None
    if window is None:
        step_time = makespan / schedule.num_steps
        lo, hi = 0.0, makespan
    else:
        lo, hi, microbatches = window
        step_time = (hi - lo) / microbatches * M
    busy = sum(timeline.busy(g, lo, hi) for g in range(G))
    bubble = 1.0 - busy / (G * (hi - lo)) if hi > lo else 0.0
    memory, peak_in_flight = _memory(schedule, costs, starts, ends, moves)
    return Simulation(
        schedule=schedule,
        timeline=timeline,
        makespan=makespan,
        step_time=step_time,
        time_per_microbatch=step_time / M,
        bubble_fraction=max(0.0, bubble),
        peak_memory=tuple(max(m, default=0) for m in memory),
        peak_in_flight=peak_in_flight,
        steady_state=window is not None,
        memory_by_action=memory,
    )


def _steady_window(schedule: Schedule, ends: list[list[float]]) -> tuple[float, float, int] | None:
    """The steady state of a stream: from the end of an update of stage 0 to a later one.

    Stage 0 finishes every microbatch last, so its updates time the stream; update ``u``
    applies microbatches ``u k .. u k + k - 1`` (``k``: ``Schedule.per_update(0)``, ``M`` for
    ``2bw``, stage 0's group size for ``pipedream``). The window skips the fill (updates
    ending before stage 0 has held its most microbatches in flight, ``W``) and the drain (the
    last ``W - 1`` microbatches), and spans whole periods of ``lcm(k, n_0, ..., n_{P-1})``
    microbatches, ``n_s`` the stages' group sizes (1 unless round-robin), so that every
    stage does the same work in it.

    Returns:
        ``(start, end, microbatches)`` in seconds, or ``None`` if the stream is too short.
    """
    N = schedule.num_microbatches
    k = schedule.per_update(0)
    fill = schedule.in_flight_bound[0]
    first = -(-fill // k) - 1
    last = (N - fill + 1) // k - 1
    units = [schedule.group_size(s) for s in range(schedule.num_stages)]
    period = math.lcm(k, *units) // k  # updates of stage 0 per period
    span = (last - first) // period * period
    if span <= 0:
        return None
    last = first + span
    update_end = {
        a.mb: end
        for a, end in zip(schedule.actions[0], ends[0], strict=True)
        if a.kind == "U" and a.stage == 0
    }
    return update_end[first], update_end[last], span * k
