"""Transports: how a value of one stage reaches another stage's devices.

A lowered program names every transfer (``MOVE`` within a process, ``SEND``/``RECV``
across processes); binding it asks the pipeline's :class:`Transport` for one function per
transfer, built once, so the interpreter only calls it. Every multi-process special case
lives here, not in the interpreter:

- :class:`DevicePut` (default): ``jax.device_put`` within a process; across processes
  JAX's cross-host transfers (both sides call ``device_put``; on CPU through
  ``jax_cross_host_transfer_socket_address``, which pairs sends and receives per sender,
  so at most 2 processes);
- :class:`Collective`: across processes, an XLA collective (``ppermute``) over the two
  devices of each part (gloo on CPU, NCCL on GPU): any number of processes.

Values are batch-sharded activations and gradients (split in equal parts along axis 0
over the stage's devices) or replicated scalars (the global-norm exchange). Between stages
of different layouts, or across processes, a value moves part by part: each overlap of a
source part and a destination part goes from its source device to its destination device
as a single-device array, then the destination parts are assembled.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax._sharding import first_device, shard_on
from pdjax.errors import PipelineError
from pdjax.layers import PyTree

if TYPE_CHECKING:
    from pdjax.pipeline._collective import CollectiveLink
    from pdjax.pipeline.stage import Stage

__all__ = [
    "TRANSPORTS",
    "Collective",
    "DevicePut",
    "Transport",
    "auto_transport",
    "make_transport",
]

Link = Callable[[Any], Any]
"""A transfer: called with the value where this process holds the source (None elsewhere),
returns the value on the destination where this process holds it (None elsewhere)."""


class Transport:
    """Moves values between stages; one per pipeline.

    Subclasses provide :meth:`_single`: one single-device array from a device of one
    process to a device of another, called by both processes in the same order.
    """

    name = "transport"
    #: The most processes it can join on CPU (None: any number).
    cpu_processes: int | None = None
    #: It moves values by XLA collectives (the XLA CPU workarounds for them apply).
    collectives: bool = False
    #: It moves values across processes by ``jax.device_put`` (whose CPU support is
    #: checked before a pipeline across processes uses it).
    cross_process_device_put: bool = False

    def __init__(self) -> None:
        self.me = jax.process_index()
        self._sent: list[Any] = []

    def link(self, src: Stage, dst: Stage, spec: PyTree, replicated: bool = False) -> Link:
        """The transfer of a value like ``spec`` (shapes) from stage ``src`` to ``dst``.

        Within a process it returns the moved value as a 1-tuple (what the interpreter
        stores), through :func:`_receiver`; across processes the value itself."""
        target = dst.replicated if replicated else dst.batch_sharding
        src_p = {d.process_index for d in src.devices}
        dst_p = {d.process_index for d in dst.devices}
        if src.devices == dst.devices:
            return _one
        if src_p == dst_p == {self.me}:
            if len(src.devices) == len(dst.devices) == 1:
                return _receiver(target)
            # jit's resharding of a committed input handles only a change of device, not
            # of layout (a replicated or otherwise laid-out output of a replicated stage)
            return lambda value: (jax.device_put(value, target),)
        leaves, treedef = jax.tree.flatten(spec)
        shapes = [(tuple(np.shape(a)), jnp.result_type(a)) for a in leaves]
        if len(src.devices) == len(dst.devices) == 1:
            return self._point_to_point(src.devices[0], dst.devices[0], treedef, shapes)

        def move(value: Any) -> Any:
            flat = jax.tree.leaves(value) if value is not None else [None] * len(shapes)
            out = [
                self._reshard(leaf, shape, dtype, src, dst, replicated=replicated)
                for leaf, (shape, dtype) in zip(flat, shapes, strict=True)
            ]
            if self.me not in dst_p:
                return None
            return jax.tree.unflatten(treedef, out)

        return move

    def _point_to_point(
        self,
        src: jax.Device,
        dst: jax.Device,
        treedef: Any,
        shapes: list[tuple[tuple[int, ...], Any]],
    ) -> Link:
        """Between one-device stages of two processes (a pipeline of one device per stage
        and process): each leaf crosses whole, with nothing to cut or assemble (what
        :meth:`_reshard` does for other layouts costs the driver one slicing dispatch
        and two array constructions per leaf)."""
        if self.me == src.process_index:

            def send(value: Any) -> None:
                leaves = jax.tree.leaves(value)
                for leaf, (shape, dtype) in zip(leaves, shapes, strict=True):
                    self._sent.append(self._single(leaf, src, dst, shape, dtype, send=True))

            return send
        if self.me != dst.process_index:
            return lambda value: None

        def receive(value: Any) -> Any:
            got = [
                self._single(None, src, dst, shape, dtype, send=False) for shape, dtype in shapes
            ]
            return jax.tree.unflatten(treedef, got)

        return receive

    def piece(self, src: Stage, dst: Stage, part: tuple[int, int]) -> Link:
        """Within a process, one microbatch's value leaving or reaching one device of a
        round-robin stage: ``part = (source device index, destination device index)``
        within the stages (-1: the stage's own layout). Returns a 1-tuple."""
        sp, dp = part
        if dp >= 0:
            target: jax.sharding.Sharding = jax.sharding.SingleDeviceSharding(dst.devices[dp])
        else:
            target = dst.batch_sharding
        if (sp >= 0 or len(src.devices) == 1) and (dp >= 0 or len(dst.devices) == 1):
            return _receiver(target)
        return lambda value: (jax.device_put(value, target),)

    def connect(self, src: Stage, dst: Stage, replicated: bool = False) -> None:
        """Sets up, now, whatever the transfers from ``src`` to ``dst`` need (every
        process calls it for its links, in the program's order). A no-op by default."""

    def _pairs(
        self, src: Stage, dst: Stage, replicated: bool
    ) -> list[tuple[jax.Device, jax.Device]]:
        """The (source device, destination device) parts that cross processes and involve
        this process, in the order :meth:`_reshard` moves them."""
        n = len(src.devices) * len(dst.devices)  # rows every part's split divides exactly
        return [
            (e, d)
            for _, d, e, _, _, _ in _overlaps(n, src, dst, replicated)
            if d.process_index != e.process_index and self.me in (d.process_index, e.process_index)
        ]

    def broadcast(self, tree: PyTree, source: jax.Device) -> PyTree:
        """``tree`` (single-device arrays on ``source`` in its process; anything of the same
        shapes elsewhere) on every process's first device. Every process calls it."""
        owner = source.process_index
        leaves, treedef = jax.tree.flatten(tree)
        shapes = [(tuple(np.shape(a)), jnp.result_type(a)) for a in leaves]
        out = leaves
        for q in range(jax.process_count()):
            if q == owner or self.me not in (q, owner):
                continue
            dst = first_device(q)
            if self.me == owner:
                # jax leaves block_until_ready unannotated
                jax.block_until_ready(
                    [
                        self._single(leaf, source, dst, shape, dtype, send=True)
                        for leaf, (shape, dtype) in zip(leaves, shapes, strict=True)
                    ]
                )
            else:
                out = [
                    self._single(None, source, dst, shape, dtype, send=False)
                    for shape, dtype in shapes
                ]
        return jax.tree.unflatten(treedef, out)

    def drain(self) -> None:
        """Waits until every value this process sent has left (the sender must outlive
        the transfer), and forgets them."""
        # jax leaves block_until_ready unannotated
        jax.block_until_ready(self._sent)
        self._sent.clear()

    def _reshard(
        self,
        leaf: jax.Array | None,
        shape: tuple[int, ...],
        dtype: Any,
        src: Stage,
        dst: Stage,
        *,
        replicated: bool,
    ) -> jax.Array | None:
        """One array of ``src`` on ``dst``'s devices, part by part (see the module doc)."""
        me = self.me
        parts: dict[int, list[jax.Array]] = {}
        n = shape[0] if shape and not replicated else 1
        for i, d, e, a, b, start in _overlaps(n, src, dst, replicated):
            if me not in (d.process_index, e.process_index):
                continue
            if replicated:
                part_shape = shape
                piece = _source_shard(leaf, e) if e.process_index == me else None
            else:
                part_shape = (b - a, *shape[1:])
                piece = (
                    _source_shard(leaf, e)[a - start : b - start] if e.process_index == me else None
                )
            if e.process_index == me and d.process_index == me:
                got = jax.device_put(piece, d)
            elif e.process_index == me:
                self._sent.append(self._single(piece, e, d, part_shape, dtype, send=True))
                continue
            else:
                got = self._single(None, e, d, part_shape, dtype, send=False)
            parts.setdefault(i, []).append(got)
        if me not in {d.process_index for d in dst.devices}:
            return None
        sharding = dst.replicated if replicated else dst.batch_sharding
        shards = [
            ps[0] if len(ps) == 1 else jnp.concatenate(ps)
            for i, ps in sorted(parts.items())
            if dst.devices[i].process_index == me
        ]
        return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=dtype)

    def _single(
        self,
        piece: jax.Array | None,
        src: jax.Device,
        dst: jax.Device,
        shape: tuple[int, ...],
        dtype: Any,
        *,
        send: bool,
    ) -> jax.Array:
        raise NotImplementedError


class DevicePut(Transport):
    """``jax.device_put`` within a process and across processes (JAX's cross-host
    transfers: both processes call it, in the same order)."""

    name = "device_put"
    # on CPU, sends and receives pair per sender: a process sending to two others hangs
    cpu_processes = 2
    cross_process_device_put = True

    def __init__(self) -> None:
        super().__init__()
        self._shardings: dict[jax.Device, jax.sharding.Sharding] = {}
        self._remotes: dict[tuple[jax.Device, tuple[int, ...], Any], jax.Array] = {}

    def _single(
        self,
        piece: jax.Array | None,
        src: jax.Device,
        dst: jax.Device,
        shape: tuple[int, ...],
        dtype: Any,
        *,
        send: bool,
    ) -> jax.Array:
        to = self._shardings.get(dst)
        if to is None:
            to = self._shardings[dst] = jax.sharding.SingleDeviceSharding(dst)
        if send:
            sent: jax.Array = jax.device_put(piece, to)
            return sent
        # what the receive reads: an array of the source's with no local data (the same
        # one for every receive of this shape: it holds nothing that a transfer changes)
        key = (src, shape, jnp.dtype(dtype))
        remote = self._remotes.get(key)
        if remote is None:
            remote = self._remotes[key] = jax.make_array_from_single_device_arrays(
                shape, jax.sharding.SingleDeviceSharding(src), [], dtype=dtype
            )
        got: jax.Array = jax.device_put(remote, to)
        return got


class Collective(Transport):
    """Across processes through an XLA collective over the two devices of each part
    (``pdjax.pipeline._collective``): any number of processes."""

    name = "collective"
    collectives = True

    def __init__(self) -> None:
        super().__init__()
        self._links: dict[tuple[int, int], CollectiveLink] = {}

    def connect(self, src: Stage, dst: Stage, replicated: bool = False) -> None:
        """Sets up every gloo communicator these transfers use before the first one: it
        must not wait on a peer that is still compiling (a 30 s limit; see
        ``pdjax.pipeline._collective``)."""
        for e, d in self._pairs(src, dst, replicated):
            self._link(e, d)

    def _link(self, src: jax.Device, dst: jax.Device) -> CollectiveLink:
        from pdjax.pipeline._collective import CollectiveLink

        key = (src.id, dst.id)
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = CollectiveLink(src, dst)
            link.connect()
        return link

    def _single(
        self,
        piece: jax.Array | None,
        src: jax.Device,
        dst: jax.Device,
        shape: tuple[int, ...],
        dtype: Any,
        *,
        send: bool,
    ) -> jax.Array:
        link = self._link(src, dst)
        if send:
            return link.send(piece)
        # jax leaves ShapeDtypeStruct.__init__ unannotated
        spec = jax.ShapeDtypeStruct(shape, dtype)
        got: jax.Array = link.recv(spec)  # a message of one leaf: that array
        return got


TRANSPORTS: Mapping[str, type[Transport]] = types.MappingProxyType(
    {cls.name: cls for cls in (DevicePut, Collective)}
)
"""Every transport by name (:attr:`Transport.name`): what ``Pipeline(transport=...)``,
the lowering's placement and the command line accept (besides ``auto``). A new transport
is a :class:`Transport` subclass added here."""


def auto_transport(platform: str, processes: int) -> str:
    """The transport ``auto`` picks: the first of :data:`TRANSPORTS` that can join
    ``processes`` processes on ``platform`` (``device_put``, unless more than 2 processes
    on CPU: ``collective``)."""
    for name, cls in TRANSPORTS.items():
        if platform != "cpu" or cls.cpu_processes is None or processes <= cls.cpu_processes:
            return name
    return next(iter(TRANSPORTS))


def make_transport(name: str) -> Transport:
    """The transport called ``name`` (a key of :data:`TRANSPORTS`)."""
    cls = TRANSPORTS.get(name)
    if cls is None:
        choices = " or ".join(repr(n) for n in TRANSPORTS)
        raise PipelineError(f"unknown transport {name!r}; choose {choices}")
    return cls()


def _one(value: Any) -> tuple[Any]:
    return (value,)


def _receiver(target: jax.sharding.Sharding) -> Link:
    """Within a process, between single-device stages: every leaf copied to ``target``'s
    device by one call of the runtime's batched copy (:func:`_copier`), else a jitted
    identity whose input and output live on ``target``, which JAX moves in its C++
    dispatch path. Driver CPU per one-leaf move (jax 0.10.2, XLA's CPU client): the copy
    5 us, the jitted identity 10 us, a Python-level ``jax.device_put`` 42 us. Returns a
    1-tuple."""
    copy = _copier(target)
    if copy is None:
        return jax.jit(_one, in_shardings=target, out_shardings=target)

    def move(value: Any) -> tuple[Any]:
        leaves, treedef = jax.tree.flatten(value)
        return (jax.tree.unflatten(treedef, copy(leaves)),)

    return move


def _copier(
    target: jax.sharding.Sharding,
) -> Callable[[list[jax.Array]], list[jax.Array]] | None:
    """The copy of committed arrays to ``target``'s device that ``jax.device_put`` itself
    ends in (jaxlib's ``batched_copy_array_to_devices_with_sharding``), without its
    Python-level checks; None where this jaxlib lacks it (the caller falls back to a jitted
    identity). Private to jaxlib: ``tests/test_runtime.py`` checks it is found and moves
    values exactly, so a jax upgrade that drops it fails there, not slowly."""
    xc = getattr(getattr(jax, "_src", None), "lib", None)
    xc = getattr(xc, "xla_client", None)
    batched = getattr(xc, "batched_copy_array_to_devices_with_sharding", None)
    semantics = getattr(getattr(xc, "ArrayCopySemantics", None), "ALWAYS_COPY", None)
    device_list = getattr(xc, "DeviceList", None)
    if batched is None or semantics is None or device_list is None:
        return None
    devices = device_list(tuple(target.device_set))

    def copy(leaves: list[jax.Array]) -> list[jax.Array]:
        n = len(leaves)
        try:
            out: list[jax.Array] = batched(leaves, [devices] * n, [target] * n, [semantics] * n)
        except TypeError:  # a leaf it does not take (an extended dtype such as a key)
            out = jax.device_put(leaves, target)
        return out

    return copy


def _rows(n: int, parts: int, i: int) -> tuple[int, int]:
    return i * n // parts, (i + 1) * n // parts


def _ranges(n: int, stage: Stage) -> list[tuple[int, int]]:
    """Per device of ``stage``, the rows ``[lo, hi)`` of a batch-sharded value of ``n`` rows
    it holds: an even split over the devices, or on a sharded stage over its batch axes
    (devices that differ only along the others, e.g. ``tensor``, hold the same rows)."""
    if stage.batch_ways == len(stage.devices):
        return [_rows(n, len(stage.devices), i) for i in range(len(stage.devices))]
    index = stage.batch_sharding.devices_indices_map((n,))
    out = []
    for d in stage.devices:
        rows = index[d][0]
        out.append((rows.start or 0, n if rows.stop is None else rows.stop))
    return out


def _overlaps(
    n: int, src: Stage, dst: Stage, replicated: bool
) -> list[tuple[int, jax.Device, jax.Device, int, int, int]]:
    """The parts of a value of ``n`` rows moving from ``src`` to ``dst``, in the order every
    process moves them: ``(destination index, destination device, source device, first row,
    end row, the source part's first row)``. A batch-sharded value moves each overlap of a
    destination part and a source part (from the first source device holding those rows);
    a replicated one goes whole from the first source."""
    out = []
    if replicated:
        return [(i, d, src.devices[0], 0, n, 0) for i, d in enumerate(dst.devices)]
    sources: dict[tuple[int, int], jax.Device] = {}
    for e, rows in zip(src.devices, _ranges(n, src), strict=True):
        sources.setdefault(rows, e)  # rows held by several devices: sent from the first
    for i, (d, (lo, hi)) in enumerate(zip(dst.devices, _ranges(n, dst), strict=True)):
        for (start, stop), e in sources.items():
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                out.append((i, d, e, a, b, start))
    return out


def _source_shard(array: jax.Array | None, device: jax.Device) -> jax.Array:
    """:func:`~pdjax._sharding.shard_on`, for a source this process holds: None (no value
    given) is an error here."""
    if array is None:
        raise PipelineError(f"this process holds {device}, the source, but was given no value")
    return shard_on(array, device)


def devices_of(stages: Sequence[Stage]) -> set[jax.Device]:
    return {d for st in stages for d in st.devices}
