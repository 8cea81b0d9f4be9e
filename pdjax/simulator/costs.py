"""The simulator's costs: what each (virtual) stage costs per microbatch
(:class:`StageCosts`) and what the links between stages cost (:class:`PipelineCosts`),
with the what-if splits into interleaved chunks and ``zb-v``'s V, and :func:`unit_costs`.

:func:`pdjax.simulator.simulate` charges them; :func:`pdjax.partition.costs_from_plan` makes
them from a plan and its profile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from pdjax.errors import ScheduleError

__all__ = ["MEMORY_MODELS", "PipelineCosts", "StageCosts", "unit_costs"]


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
        names = (
            _STAGE_FIELDS  # dataclasses.fields(self), listed once
            if type(self) is StageCosts
            else tuple(field.name for field in dataclasses.fields(self))
        )
        for name in names:
            value = getattr(self, name)
            if not _finite_non_negative(value):
                raise ScheduleError(
                    f"StageCosts.{name} must be a finite number >= 0; got {value!r}"
                )

    @property
    def backward(self) -> float:
        """Seconds of the whole backward, ``input_grad + weight_grad``."""
        return self.input_grad + self.weight_grad


_STAGE_FIELDS = tuple(field.name for field in dataclasses.fields(StageCosts))
"""The fields of :class:`StageCosts`, in order (the planner builds tens of thousands)."""


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
            that needs it, not when the sender has produced it (default off: pdjax's
            runtime posts receives ahead of its devices, ``pdjax._xla_cpu``). Calibrations
            of CPU processes turned it on until the cluster benchmark measured both models
            side by side (``benchmarks/results/cluster.md``) and the other fitted better.
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
                ends = (c, d) == (0, 0) or (P > 1 and (c, d) == (chunks - 1, P - 1))
                stages.append(
                    _share(
                        st,
                        chunks,
                        activation_bytes=st.activation_bytes if d < P - 1 else widest,
                        input_bytes=st.input_bytes if ends else 0,
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
        in a V (:func:`~pdjax.schedules.stage_groups`).

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
        groups = [min(s, K - 1 - s) for s in range(K)]
        latency = self.link_latency
        forward_bw, back_bw, cut_bytes, cut_latency = self._v_cuts()
        ends = {0: self.stages[0].input_bytes}  # one stage: its input bytes hold both
        if P > 1:
            ends[K - 1] = self.stages[-1].input_bytes
        stages = [
            _share(
                self.stages[g],
                2,
                activation_bytes=cut_bytes[s] if s < K - 1 else 0,
                input_bytes=ends.get(s, 0),
            )
            for s, g in enumerate(groups)
        ]
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

    def _v_cuts(self) -> tuple[list[float], list[float], list[int], list[float]]:
        """Per cut of :meth:`v_shape`'s stages: bandwidth of activations and of gradients,
        activation bytes, and latency (only where ``link_latency`` is per cut)."""
        P = len(self.stages)
        K = 2 * P
        widest = max((st.activation_bytes for st in self.stages), default=0)
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
        return forward_bw, back_bw, cut_bytes, cut_latency


def _share(st: StageCosts, parts: int, *, activation_bytes: int, input_bytes: int) -> StageCosts:
    """``1 / parts`` of ``st``'s compute, weights, optimizer state, stash and cotangents,
    with the given activation and input bytes and ``st``'s send seconds."""
    return StageCosts(
        forward=st.forward / parts,
        input_grad=st.input_grad / parts,
        weight_grad=st.weight_grad / parts,
        update=st.update / parts,
        activation_bytes=activation_bytes,
        param_bytes=st.param_bytes // parts,
        stash_bytes=st.stash_bytes // parts,
        optimizer_bytes=st.optimizer_bytes // parts,
        input_bytes=input_bytes,
        cotangent_bytes=st.cotangent_bytes // parts,
        send_seconds=st.send_seconds,
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
