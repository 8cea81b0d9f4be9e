"""Stage executables: one stage's jitted programs on its devices.

A stage is a contiguous run of layers placed on a device group of ``r`` devices. Its
batch dimension is sharded ``r`` ways over a one-axis ``Mesh`` (``"data"``) and its
weights are replicated; ``r = 1`` is a single device.

Gradients of a replicated stage are summed on each device and all-reduced once, at the
update (``per_device``): each layer runs under ``shard_map`` on the rows its device holds
(the same kernels as on one device), its weights handed to it as one copy per device
(``[r, ...]``, sharded: a broadcast of the replicated weights, no data moves), so each
device's weight gradient is its own partial sum (``[r, ...]``, sharded) and no backward
communicates. The update sums the parts: one all-reduce. That computes exactly what the
whole microbatch computes only for layers whose output rows depend on their own input
rows alone; :meth:`Stage.check_parts` tests it on the stage's real weights before any
program is built, and a stage that fails (BatchNorm's batch statistics, dropout's masks
drawn for the whole microbatch, anything that mixes rows) keeps the whole-microbatch
programs, whose every backward all-reduces (XLA inserts it), with the reason recorded.
The loss is always taken on the whole microbatch.

A *round-robin* stage (PipeDream's replication, ``round_robin=True``) takes ``r`` whole
microbatches at once, one per device: its input is the ``r`` microbatches concatenated
(device ``d`` holds microbatch ``d`` of the group), computed as the same ``r`` parts, each
with its own microbatch's PRNG key and, on the last stage, its own loss (the programs
return the ``r`` losses). That is exactly what ``r`` separate microbatches compute, so no
check is needed; model state (BatchNorm statistics) is refused by the pipeline, since ``r``
microbatches would update it at once.

Every operation of a lowered :class:`~pdjax.pipeline.lowering.program.Program` that computes is one
call of one jitted program made here by :meth:`Stage.program` from the operation's kind and
flags. The argument and result order of each program is fixed by the table in
:mod:`pdjax.pipeline.lowering.program` (the lowering names the slots in that order); one compiled
program per (kind, flags, shapes).

Residuals without weight copies: ``jit`` never passes an input through as an output, so
returning ``jax.vjp``'s residuals from a jitted forward would copy the stage's weights
and input for every microbatch. While tracing the forward, pdjax notes which residual
leaves *are* a weight or the input (by identity), returns only the others (each once),
and the backward rebuilds the VJP from the weights and input it is handed again (the
stashed version). With ``remat`` the forward keeps nothing and the backward recomputes it.
Under a named memory policy (``"dots"``, ``"dots-no-batch"``, ``"offload"``:
:mod:`pdjax._memory_policy`) each layer's VJP is taken of ``jax.checkpoint(layer,
policy=...)``: its residuals are what the policy saves (and the layer's weights and input),
and the backward recomputes the rest from them.

Every program applies a layer through :class:`~pdjax.pipeline.layer_traces.LayerTraces`,
which compares the layer's jaxpr with its first for the same input types: a layer that
computes another function when traced again (Python-side state changing between calls)
is refused, naming it, rather than trained as a mix of its traces.

The VJP is taken layer by layer, so zero-bubble's split backward costs what the whole one
costs: ``I`` runs the chain of input gradients and keeps the cotangent at each layer's
output, ``W`` turns those into weight gradients without recomputing the chain.

Tied parameters (``sequential(..., tied=...)``): every layer keeps its copy, and one stage
*owns* each group, the first stage holding a copy (:class:`StageTies`). Its update sees
the group once (the first of its copies), with the sum of every copy's gradient: its own
copies' and those the other holders send (``TG``: their copies' summed gradients); the
optimizer's state holds the group once, there. It writes the new value into all its copies
and sends it to the other holders, whose update writes it into theirs (their optimizer
does not see the group). So the copies stay bit for bit equal, and the optimizer,
global-norm clipping included, counts the parameter once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdjax._loss import split_loss, with_aux
from pdjax._memory_policy import OFFLOADED, checkpointed, policy_name, recomputes
from pdjax._sharding import place
from pdjax.errors import PipelineError
from pdjax.layers import Layer, LossFn, PyTree, Variables, count_traces
from pdjax.layers.sharding import ShardingRules, StageSharding, make_mesh
from pdjax.mesh import MeshAxes, describe_mesh, is_sharded
from pdjax.pipeline.layer_traces import LayerTraces
from pdjax.pipeline.lowering.types import OpFlag, OpKind
from pdjax.pipeline.optim import StageOptimizer
from pdjax.pipeline.stage_programs import keys_body, program_body
from pdjax.pipeline.stage_ties import StageTies

__all__ = ["LossFn", "Stage", "StageTies", "split_loss", "with_aux"]


@dataclasses.dataclass
class _ResidualLayout:
    """How to rebuild the per-layer VJPs from (weights, input) and the kept residuals."""

    treedef: Any
    sources: list[int]  # per VJP leaf: >= 0 index into flat (params, x); < 0: -1 - kept index
    # per kept residual: (packed array, first element, shape), or None where kept as itself
    packed: list[tuple[int, int, tuple[int, ...]] | None] | None = None


def _pack(kept: list[jax.Array]) -> tuple[list[jax.Array], list[Any] | None]:
    """A single-device stage's kept residuals as one flat array per dtype (and the
    others, of extended dtypes such as keys, as themselves), and where each went.

    Why: every array a program returns costs the dispatching thread a few microseconds
    on XLA's CPU client (measured: 16 outputs 28 us of driver CPU, one 7 us), and a
    forward keeps a dozen residuals or more. The packing is a copy, no arithmetic, so
    values are unchanged; whether XLA fuses the copy away was not checked, but on the
    compute-bound model of ``benchmarks/bench_runtime.py`` (width 512, 4 stages, 16
    microbatches) a call took 64-68 ms against 68-82 before (``1f1b``) and 84-91 against
    94-127 (``pipedream``), 3 interleaved rounds against the previous commit, and peak
    memory stayed at the runtime memory model's."""
    groups: dict[Any, list[int]] = {}
    for k, a in enumerate(kept):
        if not jnp.issubdtype(a.dtype, jax.dtypes.extended):
            groups.setdefault(a.dtype, []).append(k)
    if len(groups) == sum(len(g) for g in groups.values()):
        return kept, None  # one array per dtype already: nothing to gain
    out: list[jax.Array] = []
    where: list[Any] = [None] * len(kept)
    for members in groups.values():
        offset = 0
        for k in members:
            where[k] = (len(out), offset, tuple(kept[k].shape))
            offset += kept[k].size
        out.append(jnp.concatenate([jnp.ravel(kept[k]) for k in members]))
    out.extend(a for k, a in enumerate(kept) if where[k] is None)
    return out, where


def _unpack(residuals: list[jax.Array], where: list[Any]) -> list[jax.Array]:
    """The kept residuals back from :func:`_pack`'s arrays."""
    packed_count = len({w[0] for w in where if w is not None})
    others = iter(residuals[packed_count:])
    out = []
    for w in where:
        if w is None:
            out.append(next(others))
            continue
        g, offset, shape = w
        size = math.prod(shape)
        out.append(residuals[g][offset : offset + size].reshape(shape))
    return out


_Pullbacks = list[Callable[..., Any]]

# jax leaves PartitionSpec.__init__ unannotated
_BATCH = P("data")
_WHOLE = P()


@functools.lru_cache(maxsize=256)
def _keys_program(group: int, sharding: NamedSharding) -> Callable[..., Any]:
    """The ``KEYS`` program of the stages on ``sharding``'s devices (``group``: see
    :func:`~pdjax.pipeline.stage_programs.keys_body`), shared by every stage and pipeline
    of the process: it reads nothing of a stage's layers, so it is traced and compiled
    once per device set and microbatch count, not once per stage."""
    return jax.jit(keys_body(group), out_shardings=sharding, static_argnums=(2,))


class Stage:
    """The compiled programs of one pipeline stage.

    Args:
      index: the stage number ``s`` (0-based).
      layers: the stage's layers, in order.
      first_layer: the index of ``layers[0]`` in the whole model (for per-layer RNG
        streams: layer ``i`` of the model draws from ``fold_in(microbatch key, i)``).
      devices: the stage's device group; the microbatch is split over them.
      optimizer: the optax transformation applied to this stage's parameters (or a
        :class:`~pdjax.pipeline.optim.StageOptimizer` that exchanges a global norm).
      loss_fn: the loss, on the last stage only.
      train: training-mode forward (dropout, BatchNorm batch statistics).
      remat: the stage's memory policy (:data:`pdjax._memory_policy.MEMORY_POLICIES`):
        ``"none"`` (or False) keeps the forward's residuals, ``"full"`` (or True)
        recomputes the forward in the backward, a named policy keeps what its
        ``jax.checkpoint`` policy saves. ``remat`` is then whether it is ``"full"``,
        ``policy`` its name.
      scale: the factor applied to a step's summed gradients before the update (``1/M``).

    ``trace_counts`` counts traces per program name (kind and flags).
    """

    def __init__(
        self,
        index: int,
        layers: Sequence[Layer],
        first_layer: int,
        devices: Sequence[jax.Device],
        optimizer: optax.GradientTransformation | StageOptimizer,
        loss_fn: LossFn | None = None,
        *,
        train: bool = True,
        remat: bool | str = False,
        scale: float = 1.0,
        round_robin: bool = False,
        mesh: MeshAxes | None = None,
        rules: ShardingRules | None = None,
    ) -> None:
        self.index = index
        self.layers = tuple(layers)
        self.first_layer = first_layer
        self.devices = tuple(devices)
        # a plain optax transformation runs on this stage alone
        self.optimizer = (
            optimizer
            if isinstance(optimizer, StageOptimizer)
            else StageOptimizer(optimizer, (), scope="stage")
        )
        self.loss_fn = loss_fn
        self.is_last = loss_fn is not None
        self.train = train
        #: the memory policy's name; ``remat``: whether it recomputes the whole forward
        self.policy = policy_name(remat, PipelineError)
        self.remat = recomputes(self.policy)
        self.scale = scale
        #: the stage's mesh axes (``(("data", r),)`` unless the plan shards the stage)
        self.mesh_axes: MeshAxes = (
            mesh if mesh is not None and is_sharded(mesh) else (("data", len(self.devices)),)
        )
        #: the placement of a sharded stage's parameters (None: weights replicated)
        self.layout: StageSharding | None = None
        if is_sharded(mesh):
            if round_robin:
                raise PipelineError(
                    f"stage {index} is round-robin (whole microbatches per device) and "
                    f"sharded ({describe_mesh(self.mesh_axes)}): a round-robin stage holds "
                    "whole weights on each device; use replication='split' for it"
                )
            rules = rules if rules is not None else ShardingRules()
            self.mesh = make_mesh(self.devices, self.mesh_axes, rules.axis_names)
            self.layout = StageSharding(self.mesh, rules)
            self.replicated = self.layout.replicated
            self.batch_sharding = self.layout.batch
        else:
            self.mesh = Mesh(np.asarray(self.devices), ("data",))
            self.replicated = NamedSharding(self.mesh, _WHOLE)
            self.batch_sharding = NamedSharding(self.mesh, _BATCH)
        self.trace_counts: dict[str, int] = {}
        # per-device gradient sums (see the module docstring); decided by check_parts
        self.per_device = False
        self.whole_reason = "one device" if self.num_replicas == 1 else "not checked yet"
        if self.layout is not None:
            self.whole_reason = (
                f"sharded ({describe_mesh(self.mesh_axes)}): XLA's partitioner places the "
                "reductions"
            )
        # PipeDream's replication: r whole microbatches at once, one per device
        self.round_robin = round_robin and self.num_replicas > 1
        if self.round_robin:
            self.whole_reason = ""
        self._layout: dict[Any, _ResidualLayout] = {}
        self._programs: dict[Any, Callable[..., Any]] = {}
        #: every trace of a layer computes what its first did (:mod:`.layer_traces`)
        self.layer_traces = LayerTraces()
        #: the stage's tied parameter copies (set by the pipeline before any program)
        self.ties: StageTies | None = None

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    @property
    def sharded(self) -> bool:
        """Whether the stage's weights are split over its mesh (:mod:`.sharding`)."""
        return self.layout is not None

    @property
    def batch_ways(self) -> int:
        """The row blocks a microbatch is split into on the stage's devices: its devices,
        or on a sharded stage the sizes of the mesh axes the batch is split over."""
        return self.layout.batch_ways if self.layout is not None else len(self.devices)

    def shard(self, params: list[PyTree]) -> None:
        """Decides a sharded stage's parameter shardings from its (abstract) parameters,
        checking every annotation against the mesh (nothing is compiled); once."""
        if self.layout is not None and not self.layout.params:
            self.layout.resolve(self.layers, params, f"stage {self.index}")

    # -- programs ---------------------------------------------------------------------------

    def program(
        self, kind: OpKind | str, flags: frozenset[OpFlag] | frozenset[str] = frozenset()
    ) -> Callable[..., Any]:
        """The jitted program of an operation (see :mod:`pdjax.pipeline.lowering.program` for the
        arguments and results of each kind and flag). Built once per (kind, flags)."""
        key = (kind, flags)
        fn = self._programs.get(key)
        if fn is None:
            # kinds and flags compare as their names: normalised only to build
            typed = frozenset(OpFlag(f) for f in flags)
            fn = self._programs[key] = self._build(OpKind(kind), typed)
        return fn

    def _build(self, kind: OpKind, flags: frozenset[OpFlag]) -> Callable[..., Any]:
        if kind is OpKind.KEYS:  # the same for every stage on these devices: built once
            if self.round_robin:
                return _keys_program(self.num_replicas, self.batch_sharding)
            return _keys_program(0, self.replicated)
        name = kind + "".join(f"+{f}" for f in sorted(flags))
        body, donate = program_body(self, kind, flags)
        rep, batch = self.replicated, self.batch_sharding
        kwargs: dict[str, Any] = {"donate_argnums": donate}
        first = self.index == 0
        # weights and optimizer state stay replicated: XLA would otherwise carry the batch
        # sharding of the gradient computation into them
        if self.layout is not None:
            pass  # update() pins the weights and optimizer state to their shardings
        elif kind is OpKind.U:
            sent = len(self.ties.members) if self.ties is not None else 0
            kwargs["out_shardings"] = (rep,) * (2 + sent)
        elif kind is OpKind.TG:
            kwargs["out_shardings"] = rep
        elif kind is OpKind.BU:
            kwargs["out_shardings"] = (rep, rep) if first else (rep, rep, batch)
        elif kind is OpKind.FBU:
            loss = batch if self.round_robin else rep  # round-robin: r losses, one per device
            kwargs["out_shardings"] = (loss, rep, rep, rep) + (() if first else (batch,))
        return jax.jit(count_traces(self.trace_counts, name, body), **kwargs)

    def eval_program(self, loss: bool, metrics: Callable[..., Any] | None = None) -> Any:
        """The jitted eval-mode forward (no dropout, BatchNorm running statistics) of the
        stage's layers: ``(w, st, x) -> y``, or with ``loss`` (the last stage)
        ``(w, st, x, t) -> loss | (loss, aux)``, and with ``metrics`` ``(loss, aux,
        metrics(y, t))``. The model state is not updated."""
        key: Any = ("EVAL", frozenset({"loss"} if loss else ()), metrics)
        fn = self._programs.get(key)
        if fn is None:
            loss_fn = self.loss_fn
            if loss and loss_fn is None:
                raise ValueError(f"stage {self.index} is not the last: it has no loss")

            def forward(w: Any, st: Any, x: Any, *tgt: Any) -> Any:
                for j, layer in enumerate(self.layers):
                    x, _ = self.layer_traces.apply(
                        self.first_layer + j,
                        layer,
                        {**st[j], "params": w[j]},
                        x,
                        train=False,
                        rng=None,
                        context="",
                    )
                if loss:
                    assert loss_fn is not None
                    value, aux = split_loss(loss_fn(x, tgt[0]))
                    if metrics is not None:
                        return value, aux, metrics(x, tgt[0])
                    return with_aux(value, aux)
                return x

            name = "EVAL" + ("+loss" if loss else "") + ("+metrics" if metrics else "")
            fn = self._programs[key] = jax.jit(count_traces(self.trace_counts, name, forward))
        return fn

    def place_eval(self, tree: PyTree) -> PyTree:
        """An eval input (or targets) on the stage's devices: batch-sharded when its rows
        divide among them, else whole on each."""
        n = jax.tree.leaves(tree)[0].shape[0] if jax.tree.leaves(tree) else 0
        if n and n % self.batch_ways == 0:
            return self.place_batch(tree)
        return self.place_weights(tree)

    # -- per-device gradient sums ------------------------------------------------------------

    @property
    def parts(self) -> int:
        """Parts an input is computed in: ``r`` with per-device gradient sums or round-robin
        (then each part is a whole microbatch), else 1."""
        return self.num_replicas if self.per_device or self.round_robin else 1

    def _view(self, params: list[PyTree], x: PyTree, parts: int) -> Any:
        """``(params, x)`` as the layers see them: with ``parts > 1`` the weights broadcast
        to ``[parts, ...]`` on the stage's devices (one copy each: device ``d``'s weight
        gradient stays its own); the input as it is (device ``d`` holds part ``d``)."""
        if parts == 1:
            return params, x
        pv = jax.tree.map(lambda a: self._pin(jnp.broadcast_to(a, (parts, *a.shape))), params)
        return pv, x

    def _pin(self, a: jax.Array) -> jax.Array:
        # jax leaves with_sharding_constraint unannotated
        pinned: jax.Array = jax.lax.with_sharding_constraint(a, self.batch_sharding)
        return pinned

    def reduce(self, g: list[PyTree]) -> list[PyTree]:
        """The weight gradient from the per-device partial sums (the one all-reduce)."""
        if self.parts == 1:
            return g
        summed: list[PyTree] = jax.tree.map(lambda a: jnp.sum(a, axis=0), g)
        return summed

    def check_parts(
        self, params: list[PyTree], state: list[Variables], x: PyTree, rtol: float = 1e-5
    ) -> str | None:
        """Whether this stage's layers compute on ``r`` parts of a microbatch what they
        compute on the whole; sets :attr:`per_device` and returns ``None`` if so, else
        the reason (kept in :attr:`whole_reason`). ``params``, ``state``: the stage's
        weights and model state on one device; ``x``: the stage's microbatch input (arrays
        or shapes). Runs the forward twice on random inputs of ``x``'s shapes, on the
        device ``params`` lives on. Must run before any program is built."""
        r = self.num_replicas
        if self._programs:
            raise RuntimeError("check_parts must run before the stage's programs are built")
        if self.round_robin:
            raise RuntimeError("a round-robin stage computes whole microbatches: no check")
        self.per_device = False
        if r == 1:
            self.whole_reason = "one device"
            return self.whole_reason
        leaves = jax.tree.leaves(x)
        if any(np.ndim(a) == 0 or np.shape(a)[0] % r for a in leaves):
            self.whole_reason = f"an input leaf's first axis is not a multiple of {r} rows"
            return self.whole_reason
        device = (
            next(iter(jax.tree.leaves(params)[0].devices())) if jax.tree.leaves(params) else None
        )
        xs = _random_like(x, device)
        key = jax.device_put(jax.random.key(0), device)

        @jax.jit
        def fwd(p: Any, st: Any, x: Any, k: Any) -> Any:
            new = []
            for j in range(len(self.layers)):
                x, sj = self._layer_fn(j, st[j], k)(p[j], x)
                new.append(sj)
            return x, new

        def rows(tree: Any, d: int) -> Any:
            return jax.tree.map(
                lambda a: a[d * (a.shape[0] // r) : (d + 1) * (a.shape[0] // r)], tree
            )

        def run_parts() -> Any:
            """What each device computes on its rows, put back together."""
            outs = [fwd(params, state, rows(xs, d), key) for d in range(r)]
            y = jax.tree.map(lambda *a: jnp.concatenate(a), *[o[0] for o in outs])
            return y, [o[1] for o in outs]

        try:
            (whole, whole_state), (split, part_states) = fwd(params, state, xs, key), run_parts()
        except Exception as err:  # any failure means: keep the whole microbatch
            self.whole_reason = f"its layers do not run on parts ({type(err).__name__}: {err})"
            self.whole_reason = self.whole_reason[:300]
            return self.whole_reason
        if not _parts_agree(whole, split, whole_state, part_states, rtol):
            self.whole_reason = (
                "its output rows depend on other rows of the microbatch (batch statistics, "
                "dropout masks drawn for the whole microbatch, or another batch-wide "
                "operation)"
            )
            return self.whole_reason
        self.per_device = True
        self.whole_reason = ""
        return None

    # -- the stage's function -------------------------------------------------------------

    def _layer_fn(
        self, j: int, state: Variables, key: jax.Array, parts: int = 1
    ) -> Callable[[PyTree, PyTree], tuple[PyTree, Variables]]:
        layer = self.layers[j]
        index = self.first_layer + j
        traces = self.layer_traces

        def f(p: PyTree, x: PyTree, k: jax.Array) -> tuple[PyTree, Variables]:
            rng = jax.random.fold_in(k, index)
            variables = {**state, "params": p}
            y, new = traces.apply(index, layer, variables, x, train=self.train, rng=rng, context="")
            return self.by_rows(y), new

        if parts == 1:
            return lambda p, x: f(p, x, key)
        # each device runs the layer on its rows with its own copy of the weights (so its
        # weight gradient stays its own: no psum in the transpose); round-robin parts are
        # microbatches, each drawing from its own key. The model state is the same on every
        # device (check_parts, or none: round-robin)
        rr = self.round_robin
        data, same = _BATCH, _WHOLE

        def body(p: PyTree, st: Variables, x: PyTree, k: jax.Array) -> Any:
            mine = jax.tree.map(lambda a: a[0], p)
            y, new = traces.apply(
                index,
                layer,
                {**st, "params": mine},
                x,
                train=self.train,
                rng=jax.random.fold_in(k[0] if rr else k, index),
                context="one device's part (shard_map)",
            )
            return y, new

        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(data, same, data, data if rr else same),
            out_specs=(data, same),
            check_vma=False,
        )
        return lambda p, x: mapped(p, state, x, key)

    def by_rows(self, y: PyTree) -> PyTree:
        """A sharded stage's layer output split by rows over the batch axes, as it
        crosses to the next stage (XLA would otherwise keep some activations split along
        a feature dimension over ``fsdp`` and whole along the batch: more bytes held per
        device, and a full rematerialisation to change layouts); leaves whose rows the
        batch axes do not divide stay as XLA lays them out."""
        if self.layout is None:
            return y
        ways, batch = self.batch_ways, self.batch_sharding

        def pin(a: Any) -> Any:
            if ways == 1 or np.ndim(a) == 0 or np.shape(a)[0] % ways:
                return a
            return jax.lax.with_sharding_constraint(a, batch)

        return jax.tree.map(pin, y)

    def apply(
        self, params: list[PyTree], state: list[Variables], x: PyTree, key: jax.Array, tgt: Any
    ) -> tuple[PyTree, list[Variables]]:
        parts = self.parts
        params, x = self._view(params, x, parts)
        new_state = []
        for j in range(len(self.layers)):
            x, s = self._layer_fn(j, state[j], key, parts)(params[j], x)
            new_state.append(s)
        if self.round_robin and self.loss_fn is not None:
            return with_aux(*self._group_loss(tgt)(x)), new_state
        if self.loss_fn is not None:
            x = with_aux(*split_loss(self.loss_fn(x, tgt)))
        return x, new_state

    def forward_vjp(
        self, params: list[PyTree], state: list[Variables], x: PyTree, key: jax.Array, tgt: Any
    ) -> tuple[PyTree, list[Variables], _Pullbacks, Any]:
        """The forward, layer by layer, with each layer's pullback (and the loss's last),
        and the viewed ``(weights, input)`` the pullbacks may hold (see :meth:`keep`)."""
        parts = self.parts
        params, x = sources = self._view(params, x, parts)
        pbs: _Pullbacks = []
        new_state = []
        for j in range(len(self.layers)):
            layer_fn = checkpointed(self._layer_fn(j, state[j], key, parts), self.policy)
            x, pb, s = jax.vjp(layer_fn, params[j], x, has_aux=True)
            pbs.append(pb)
            new_state.append(s)
        if self.loss_fn is not None:  # round-robin: each microbatch's own loss
            loss_fn = self.loss_fn
            fn = (
                self._group_loss(tgt)
                if self.round_robin
                else (lambda y: split_loss(loss_fn(y, tgt)))
            )
            loss, pb, aux = jax.vjp(fn, x, has_aux=True)
            pbs.append(pb)
            x = with_aux(loss, aux)
        return x, new_state, pbs, sources

    def microbatch_output(
        self, params: list[PyTree], state: list[Variables], x: PyTree, key: jax.Array
    ) -> PyTree:
        """The layers' output for one microbatch ``x`` (whatever the stage's mode: for
        shapes, e.g. under ``jax.eval_shape``)."""
        for j in range(len(self.layers)):
            x, _ = self._layer_fn(j, state[j], key)(params[j], x)
        return x

    def _group_loss(self, tgt: PyTree) -> Callable[[PyTree], tuple[jax.Array, PyTree]]:
        """Round-robin: the ``r`` microbatches' losses (``[r]``) and their aux (each leaf
        ``[r, ...]``) from the group's outputs (microbatch ``d``: the rows device ``d``
        holds)."""
        loss_fn = self.loss_fn
        assert loss_fn is not None
        r = self.num_replicas
        t = _split(tgt, r, self._pin)

        def losses(y: PyTree) -> tuple[jax.Array, PyTree]:
            out = jax.vmap(lambda a, b: split_loss(loss_fn(a, b)))(_split(y, r, self._pin), t)
            # microbatch d's on device d (even constants)
            pinned: tuple[jax.Array, PyTree] = jax.tree.map(self._pin, out)
            return pinned

        return losses

    def keep(self, params: list[PyTree], x: PyTree, pbs: _Pullbacks) -> list[jax.Array]:
        """The pullbacks' residual leaves that are neither a weight nor the input, each once."""
        leaves, treedef = jax.tree.flatten(pbs)
        inputs = {id(leaf): k for k, leaf in enumerate(jax.tree.leaves((params, x)))}
        kept: list[Any] = []
        where: dict[int, int] = {}
        sources = []
        for leaf in leaves:
            if id(leaf) in inputs:
                sources.append(inputs[id(leaf)])
                continue
            if id(leaf) not in where:
                where[id(leaf)] = len(kept)
                kept.append(leaf)
            sources.append(-1 - where[id(leaf)])
        kept = self._rows_split(kept, x)
        packed = None
        # a sharded stage's would be resharded by the ravel; offloaded ones moved back
        if len(self.devices) == 1 and self.policy not in OFFLOADED:
            kept, packed = _pack(kept)
        self._layout[self._key(params, x, kept)] = _ResidualLayout(treedef, sources, packed)
        return kept

    def _rows_split(self, kept: list[Any], x: PyTree) -> list[Any]:
        """On a stage whose every device holds its own rows of each microbatch (replicated,
        or a mesh of ``data`` and ``fsdp`` only), the residuals with a row per sample
        split by rows too. XLA otherwise leaves some whole on every
        device (Llama's attention probabilities and masks, some of its block's
        activations: at data 8 a stage then held 1.8x the stash the memory model
        counts); a sharding changes where values live, not what they are."""
        leaves = jax.tree.leaves(x)
        ways = self.batch_ways
        # a stage with an axis that splits no rows (tensor) keeps XLA's layout: a
        # constraint to the batch sharding would gather what it splits over that axis
        if ways != len(self.devices) or self.parts > 1 or ways == 1 or not leaves:
            return kept
        rows = np.shape(leaves[0])[0] if np.ndim(leaves[0]) else 0
        if not rows or rows % ways:
            return kept
        batch = self.batch_sharding
        return [
            jax.lax.with_sharding_constraint(a, batch)
            if np.ndim(a) and np.shape(a)[0] == rows
            else a
            for a in kept
        ]

    def rebuild(self, params: list[PyTree], x: PyTree, residuals: list[jax.Array]) -> _Pullbacks:
        params, x = self._view(params, x, self.parts)
        layout = self._layout[self._key(params, x, residuals)]
        if layout.packed is not None:
            residuals = _unpack(residuals, layout.packed)
        flat = jax.tree.leaves((params, x))
        leaves = [flat[s] if s >= 0 else residuals[-1 - s] for s in layout.sources]
        pbs: _Pullbacks = jax.tree.unflatten(layout.treedef, leaves)
        return pbs

    def chain(
        self,
        pbs: _Pullbacks,
        ct: PyTree | None,
        want: str,
        first: bool,
        w: list[PyTree] | None = None,
    ) -> tuple[list[PyTree] | None, PyTree | None, list[PyTree]]:
        """Back through the layers: ``(weight gradients or None, input gradient, the
        cotangent at each layer's output)``; XLA drops what the caller does not return.
        ``w``: the weights the backward reads; on the last stage of a loss-scaled
        optimizer the pipeline passes them with the loss scale after them
        (:meth:`weights_in`), the backward's seed (weights without it, as a stage timed
        alone by :mod:`pdjax.calibrate` has, seed 1)."""
        n = len(self.layers)
        if self.loss_fn is not None:  # round-robin: one loss per microbatch of the group
            seed = jnp.ones((self.num_replicas,) if self.round_robin else (), jnp.float32)
            if self._carries_scale(w):
                assert w is not None
                seed = seed * w[n]  # the scaled loss's cotangent: exact (a power of 2)
            (ct,) = pbs[n](seed)
        cts: list[PyTree] = [None] * n
        grads: list[PyTree] = [None] * n
        for j in reversed(range(n)):
            cts[j] = ct
            if want == "input" and j == 0 and first:
                break  # the first stage has no input gradient to pass on
            gp, ct = pbs[j](ct)
            grads[j] = gp
        return (None if want == "input" else self._pin_grads(grads)), ct, cts

    def weight_grads(self, pbs: _Pullbacks, cts: list[PyTree]) -> list[PyTree]:
        """Zero bubble's ``W``: each layer's weight gradient from its output cotangent."""
        return self._pin_grads([pbs[j](cts[j])[0] for j in range(len(self.layers))])

    def _pin_grads(self, grads: list[PyTree]) -> list[PyTree]:
        """A sharded stage's weight gradients on their parameters' shardings: XLA would
        otherwise leave them whole over ``fsdp`` (an all-reduce, not a reduce-scatter), and
        the gradient sum would take ``fsdp`` times a weight shard's bytes."""
        if self.layout is None:
            return grads
        pinned: list[PyTree] = jax.lax.with_sharding_constraint(grads, self.layout.params)
        return pinned

    def scaled(self, g: list[PyTree]) -> list[PyTree]:
        if self.scale == 1.0:
            return g
        s = jnp.float32(self.scale)
        scaled: list[PyTree] = jax.tree.map(lambda a: a * s.astype(a.dtype), g)
        return scaled

    def fused_update(
        self, g: list[PyTree], w: list[PyTree], tail: Sequence[Any], newest: bool
    ) -> tuple[list[PyTree], optax.OptState, tuple[Any, ...]]:
        """The update at the end of a fused program; ``tail`` holds ``[w_newest] o
        [norms...]`` (the newest weights only when the ones read are not the newest)."""
        if not newest:
            w, tail = tail[0], tail[1:]
        return self.update(g, w, tail[0], tail[1:])

    def update(
        self, g: list[PyTree], w: list[PyTree], o: optax.OptState, rest: Sequence[Any]
    ) -> tuple[list[PyTree], optax.OptState, tuple[Any, ...]]:
        """``-> (new weights, new optimizer state, tied values sent)``. ``rest``: the tied
        gradients from :attr:`StageTies.members`, the new tied values from
        :attr:`StageTies.owners`, then the other stages' sums of squares (if exchanged)."""
        g = self.scaled(self.reduce(g))
        scaled = self._carries_scale(w)
        if scaled:  # the loss scale the weights carry: the new one is the optimizer's
            w = w[: len(self.layers)]
        ties = self.ties
        received: Sequence[Any] = ()
        treedef: Any = None
        if ties is not None:
            n_in, n_new = len(ties.members), len(ties.owners)
            incoming, received, rest = rest[:n_in], rest[n_in : n_in + n_new], rest[n_in + n_new :]
            treedef = jax.tree.structure(w)
            g, w = ties.grad_view(g, incoming), ties.view(w)
        norms = rest
        if norms:  # the other stages' sums of squares: the optimizer clips by the global norm
            others = norms[0]
            for q in norms[1:]:
                others = others + q
            updates, o = self.optimizer.update(g, o, w, others)
        elif self.optimizer.needs_exchange:  # no other stage: nothing outside this one
            updates, o = self.optimizer.update(g, o, w, jnp.zeros((), jnp.float32))
        else:
            updates, o = self.optimizer.update(g, o, w)
        new_w = optax.apply_updates(w, updates)
        sent: tuple[Any, ...] = ()
        if ties is not None:
            new_w, sent = ties.expand(new_w, treedef, received)
        if self.layout is not None:  # a sharded stage's new weights keep their shardings
            n = len(self.layers)
            pinned = jax.lax.with_sharding_constraint(list(new_w[:n]), self.layout.params)
            new_w = [*pinned, *new_w[n:]]
            o = jax.lax.with_sharding_constraint(o, self.layout.like_params(o))
        if scaled:
            new_w = [*new_w, self.optimizer.loss_scale(o)]
        return new_w, o, sent

    @property
    def seeds_loss_scale(self) -> bool:
        """Whether this stage seeds its backward with the loss scale: the last stage of a
        :func:`~pdjax.precision.loss_scaled` optimizer, whose weights (as the programs
        see them) end with the scale (:meth:`weights_in`)."""
        return self.is_last and self.optimizer.loss_scaled

    def _carries_scale(self, w: list[PyTree] | None) -> bool:
        """Whether ``w`` (weights as a program takes them) ends with the loss scale."""
        return self.seeds_loss_scale and w is not None and len(w) == len(self.layers) + 1

    def weights_in(self, params: list[PyTree], opt_state: optax.OptState) -> list[PyTree]:
        """The weights as the stage's programs take them: ``params``, and on a stage that
        :attr:`seeds_loss_scale`, the loss scale of ``opt_state`` after them (each update
        writes the new scale there, so a backward reads the scale of its weights'
        version). The scale is a copy, a buffer of its own: a fused update (the one stage
        of a plan reads, seeds and updates in one program) donates ``opt_state``, and a
        buffer donated while the same call reads it is refused by XLA."""
        if not self.seeds_loss_scale:
            return params
        return [*params, jnp.array(self.optimizer.loss_scale(opt_state), copy=True)]

    def weights_out(self, w: list[PyTree]) -> list[PyTree]:
        """The layers' parameters of weights as the programs hold them (see
        :meth:`weights_in`)."""
        return list(w[: len(self.layers)]) if self._carries_scale(w) else w

    @staticmethod
    def _key(params: list[PyTree], x: PyTree, residuals: list[Any]) -> Any:
        leaves = jax.tree.leaves((params, x, residuals))
        return (jax.tree.structure((params, x)), tuple((a.shape, str(a.dtype)) for a in leaves))

    # -- placement --------------------------------------------------------------------------

    def place_weights(self, tree: PyTree) -> PyTree:
        """Puts weights (or optimizer state) on the stage's devices, replicated. A stage
        spanning processes takes them from this process's copy of the whole value."""
        return place(tree, self.replicated)

    def place_params(self, params: list[PyTree]) -> list[PyTree]:
        """The stage's parameters on its devices: replicated, or on a sharded stage each
        on its own sharding (:meth:`shard` first)."""
        if self.layout is None:
            replicated: list[PyTree] = self.place_weights(params)
            return replicated
        placed: list[PyTree] = list(jax.device_put(params, self.layout.params))
        return placed

    def place_variables(self, offset: int, variables: list[Variables]) -> list[Variables]:
        """Layers ``offset ..``'s variables on a sharded stage: parameters on their
        shardings, other collections replicated (for
        :func:`~pdjax.layers.init_programs.init_on`)."""
        assert self.layout is not None
        params = self.layout.params
        return [
            {
                k: jax.device_put(a, params[offset + j])
                if k == "params"
                else place(a, self.replicated)
                for k, a in v.items()
            }
            for j, v in enumerate(variables)
        ]

    def place_opt_state(self, opt_state: Any) -> Any:
        """Optimizer state on the stage's devices, as its parameters are."""
        if self.layout is None:
            return self.place_weights(opt_state)
        return jax.device_put(opt_state, self.layout.like_params(opt_state))

    def place_batch(self, tree: PyTree) -> PyTree:
        """Puts an activation or gradient on the stage's devices, batch-sharded (from
        the whole value, when the stage spans processes)."""
        return place(tree, self.batch_sharding)


def _split(tree: PyTree, parts: int, pin: Callable[[jax.Array], jax.Array]) -> PyTree:
    """Every leaf ``[b, ...]`` as ``[parts, b/parts, ...]`` (part ``d``: rows ``d*b/parts ..``)."""
    return jax.tree.map(lambda a: pin(a.reshape((parts, a.shape[0] // parts, *a.shape[1:]))), tree)


def _key_data(tree: PyTree) -> PyTree:
    """``tree`` with every typed PRNG key leaf as its ``key_data``."""
    return jax.tree.map(
        lambda a: (
            jax.random.key_data(a) if jnp.issubdtype(jnp.result_type(a), jax.dtypes.prng_key) else a
        ),
        tree,
    )


def _parts_agree(
    whole: PyTree, split: PyTree, whole_state: PyTree, part_states: list[PyTree], rtol: float
) -> bool:
    """Whether the output computed in parts matches the whole microbatch's, and each part's
    new model state the whole's (within ``rtol``, relative to each leaf's scale)."""
    whole, split, whole_state, part_states = _key_data(
        (whole, split, whole_state, part_states)
    )  # PRNG keys (nnx RNG streams in the model state) compare by their bits
    a_leaves, b_leaves = jax.tree.leaves(whole), jax.tree.leaves(split)
    # jaxlib ships no type stub for PyTreeDef (its == is unknown to mypy)
    same = jax.tree.structure(whole) == jax.tree.structure(split) and all(  # type: ignore[operator]
        np.shape(a) == np.shape(b)
        and np.allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol * _scale(a))
        for a, b in zip(a_leaves, b_leaves, strict=True)
    )
    return same and all(
        jax.tree.structure(ps) == jax.tree.structure(whole_state)  # type: ignore[operator]
        and all(
            np.allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol * _scale(a))
            for a, b in zip(jax.tree.leaves(whole_state), jax.tree.leaves(ps), strict=True)
        )
        for ps in part_states
    )


def _random_like(tree: PyTree, device: jax.Device | None) -> PyTree:
    """Random arrays of ``tree``'s shapes and dtypes (normal floats, small integers)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(1), max(len(leaves), 1))
    out = []
    for k, a in zip(keys, leaves, strict=False):
        shape, dtype = np.shape(a), jnp.result_type(a)
        if jnp.issubdtype(dtype, jnp.floating):
            v = jax.random.normal(k, shape, dtype)
        elif jnp.issubdtype(dtype, jnp.integer):
            v = jax.random.randint(k, shape, 0, 2).astype(dtype)
        else:
            v = jax.random.bernoulli(k, 0.5, shape).astype(dtype)
        out.append(jax.device_put(v, device))
    return jax.tree.unflatten(treedef, out)


def _scale(a: Any) -> float:
    """The tolerance scale of a leaf: its largest magnitude (at least 1)."""
    return max(1.0, float(np.max(np.abs(np.asarray(a)))) if np.size(a) else 1.0)
