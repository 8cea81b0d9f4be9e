"""Point-to-point transfers between processes through an XLA collective.

A :class:`CollectiveLink` moves a pytree of arrays from one device to a device of another
process with a ``ppermute`` over the 2-device mesh ``[src, dst]`` (gloo on CPU, NCCL on
GPU). JAX's CPU cross-process ``jax.device_put`` (jax 0.10) pairs sends with receives per
sender, not per pair, so a process that sends to two others hangs or misdelivers; a
collective is matched per communicator instead, and XLA keeps one communicator per ordered
device list: ``[a, b]`` and ``[b, a]`` are two independent channels, and a process outside
``{src, dst}`` takes no part.

How it behaves (measured on jax 0.10.2, CPU, gloo; see ``tests/test_collective.py``):

- **Each process compiles its own half.** In a multi-controller run every process compiles
  and runs only its own devices' part of a program, and gloo matches collectives by
  communicator and order, not by program. So the sender runs "pack the leaves, ppermute"
  and the receiver runs "ppermute a cached zeros buffer, unpack": the sender gets no copy
  of the message back, and the receiver fills no zeros per call. The two halves agree on
  what must match: the shapes of their collective-permutes ``0 -> 1`` on ``[src, dst]``.
- **One collective per message.** A ``ppermute`` of a tuple is one collective-permute per
  leaf, and XLA's CPU runtime does each as its own gloo exchange, one after the other; so
  the leaves are packed into one buffer of unsigned words (a bitcast, free, when the
  leaves have the same item size). Leaves of different item sizes need XLA's bit-shifting
  expansion to share a byte buffer (about 5x the cost of a copy): below ``_MIXED_PACK``
  bytes they are packed as bytes anyway, above it each item size gets its own collective.
- **A link is a rendezvous in device order.** A program runs on its device after the
  programs dispatched to that device before it (one in-order stream per device), and a
  collective-permute waits there until the peer's half runs. So every process must dispatch
  the transfers of its devices in one global order (e.g. a pipeline's clock order, the
  same list on every process, each taking the entries that involve it): then no cycle of
  waits can form. Transfers in opposite directions on one pair that the two sides issue in
  different orders deadlock (e.g. 1F1B's natural order, where stage ``i`` sends activation
  ``m+1`` while stage ``i+1`` sends gradient ``m``). Each message must be one event of
  the order: its two halves at the same place relative to all other transfers, e.g. both
  dispatched at the sender's action (dispatching the send at the sender's action but the
  receive at the receiver's can deadlock just the same).
- **Connect first.** The first transfer of each direction sets up its gloo communicator,
  a rendezvous through the coordination service that fails if the two ends arrive more
  than 30 s apart; :meth:`CollectiveLink.connect` does it up front (after it, a transfer
  waits up to XLA's collective timeout, 30 min).
- **Never inline.** XLA's CPU client runs a "cheap" program (under 1000 flops) on the
  calling thread when its inputs are ready and its device idle; a bare collective-permute
  is cheap, so ``send``/``recv`` would block Python until the peer arrived, stopping this
  process from dispatching work its peer may be waiting for (on another device, or a
  ``device_put``). Each half also sums a cached 1 KiB ballast buffer (about 2000 flops,
  under a microsecond), so that it is always dispatched asynchronously.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

__all__ = ["CollectiveLink"]

_AXIS = "link"
_PERM = ((0, 1),)  # position 0 of the mesh (src) sends to position 1 (dst)
_BALLAST = 1024  # bytes each half sums to stay asynchronous (see the module doc)
_MIXED_PACK = 256 * 1024  # below: leaves of mixed item sizes share one byte buffer

_Key = tuple[tuple[tuple[int, ...], np.dtype], ...]
"""A message layout: (shape, dtype) per leaf."""

# jax leaves PartitionSpec.__init__ unannotated
_REPLICATED = P()

_WORD = {w: np.dtype(f"uint{8 * w}") for w in (1, 2, 4, 8)}  # unsigned word per item size


@dataclass(frozen=True)
class _Group:
    """Leaves moved in one collective: ``leaves`` (indices) packed into ``size`` words of
    ``word`` bytes, leaf ``i`` at ``offsets[i]`` for ``lengths[i]`` words."""

    word: int
    leaves: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    size: int


def _plan(key: _Key) -> tuple[_Group, ...]:
    """How the leaves of a message are grouped into collectives (see the module doc)."""
    items = [(i, d.itemsize, int(np.prod(s, dtype=np.int64))) for i, (s, d) in enumerate(key)]
    widths = list(dict.fromkeys(w for _, w, _ in items))  # in order of first use
    if len(widths) > 1 and sum(w * n for _, w, n in items) < _MIXED_PACK:
        items, widths = [(i, 1, w * n) for i, w, n in items], [1]
    groups = []
    for w in widths:
        mine = [(i, n) for i, iw, n in items if iw == w]
        lengths = tuple(n for _, n in mine)
        offsets = tuple(int(o) for o in np.cumsum((0, *lengths[:-1])))
        groups.append(_Group(w, tuple(i for i, _ in mine), offsets, lengths, max(sum(lengths), 1)))
    return tuple(groups)


def _to_words(x: jax.Array, word: int) -> jax.Array:
    """``x`` as a flat vector of ``word``-byte unsigned integers (a bitcast when the
    widths agree; XLA's CPU backend shifts bits otherwise)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    x = jax.lax.bitcast_convert_type(x, _WORD[word])
    return x.reshape(-1)


def _from_words(v: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    """The inverse of :func:`_to_words`."""
    ratio = dtype.itemsize // v.dtype.itemsize
    v = v.reshape((*shape, ratio) if ratio > 1 else shape)
    if dtype == np.bool_:
        return v != 0
    return jax.lax.bitcast_convert_type(v, dtype)


def _ppermute(x: jax.Array) -> jax.Array:
    """``x`` moved from position 0 of the link's mesh to position 1."""
    # jax leaves ppermute unannotated
    moved: jax.Array = jax.lax.ppermute(x, _AXIS, perm=_PERM)
    return moved


def _pack(leaves: Sequence[jax.Array], group: _Group) -> jax.Array:
    parts = [_to_words(leaves[i], group.word) for i in group.leaves]
    if sum(group.lengths) == 0:  # only empty leaves: move one word, as the receiver does
        return jnp.zeros((group.size,), _WORD[group.word])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _unpack(moved: jax.Array, group: _Group, key: _Key) -> list[tuple[int, jax.Array]]:
    return [
        (i, _from_words(moved[o : o + n], *key[i]))
        for i, o, n in zip(group.leaves, group.offsets, group.lengths, strict=True)
    ]


def _spec(
    shape: tuple[int, ...], dtype: DTypeLike, sharding: NamedSharding | None = None
) -> jax.ShapeDtypeStruct:
    # jax leaves ShapeDtypeStruct.__init__ unannotated
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _ballast(buf: jax.Array) -> jax.Array:
    return jnp.sum(buf, dtype=jnp.uint32)


try:  # the hot path: wrapping a leaf costs ~5 us this way, ~9 us through the public API
    from jax._src import core as _core
    from jax._src.array import ArrayImpl as _ArrayImpl

    def _aval(shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding) -> Any:
        aval = _core.ShapedArray(shape, dtype, weak_type=False)
        return _core.update_aval_with_sharding(aval, sharding)

    def _global(aval: Any, sharding: NamedSharding, x: jax.Array) -> jax.Array:
        """``x`` (on this process's device of ``sharding``) as the global array that the
        program takes; JAX still checks the device."""
        # a committed single-device jax.Array is an ArrayImpl at run time
        return _ArrayImpl(aval, sharding, [cast(_ArrayImpl, x)], committed=True)

except (ImportError, AttributeError):  # a JAX without them: the public, slower way

    def _aval(shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding) -> Any:
        return shape

    def _global(aval: Any, sharding: NamedSharding, x: jax.Array) -> jax.Array:
        return jax.make_array_from_single_device_arrays(aval, sharding, [x])


class CollectiveLink:
    """Sends pytrees of arrays from device ``src`` to device ``dst`` of another process.

    The process of ``src`` calls :meth:`send`, the process of ``dst`` calls :meth:`recv`
    with the same leaf shapes and dtypes, once per message, in the same order; other
    processes do nothing. Across links, each process must dispatch its transfers in one
    global order (see the module doc), or two processes can wait on each other for ever.

    Programs are compiled once per message layout (leaf shapes and dtypes) and cached; a
    call costs ~15 host microseconds, ~5 more per further leaf. The receiver keeps a zeros buffer
    of the message's size per layout on ``dst`` (the operand its half of the collective
    needs; never donated, so reused as is), and each end a 1 KiB ballast buffer.
    """

    def __init__(self, src: jax.Device, dst: jax.Device) -> None:
        if src.process_index == dst.process_index:
            raise ValueError(f"{src} and {dst} are in one process; use jax.device_put")
        self.src, self.dst = src, dst
        self._mesh = Mesh(np.array([src, dst]), (_AXIS,))
        # Every operand and result is declared replicated over the pair: each process
        # gives (and reads) only its own device's buffer, and the two halves are different
        # programs anyway, so the global view is nominal. Replication needs no reshape to
        # a leading axis (a dispatch per leaf) and covers scalars.
        self._sharding = NamedSharding(self._mesh, _REPLICATED)
        me = jax.process_index()
        self._role = "src" if me == src.process_index else "dst" if me == dst.process_index else ""
        self._ballast: jax.Array | None = None
        self._senders: dict[_Key, tuple[Any, list[Any]]] = {}
        self._receivers: dict[tuple[Any, _Key], tuple[Any, list[jax.Array]]] = {}

    def __repr__(self) -> str:
        return f"CollectiveLink({self.src} -> {self.dst})"

    def connect(self) -> None:
        """Sets up the link's gloo communicator now: a one-word message, waited for.

        Both ends call it (other processes may too: a no-op), and across links in one
        global order, like transfers. Without it the first :meth:`send`/:meth:`recv` sets
        it up, and fails if the two ends reach that point more than 30 s apart (the
        coordination service's timeout for the set-up; e.g. one side still compiling a
        stage); after it, a transfer waits for its peer up to XLA's collective timeout
        (30 min).
        """
        spec = _spec((1,), jnp.uint8)
        if self._role == "src":
            self.send(jax.device_put(np.zeros((1,), np.uint8), self.src)).block_until_ready()
        elif self._role == "dst":
            # jax leaves block_until_ready unannotated
            jax.block_until_ready(self.recv(spec))

    # -- sender --------------------------------------------------------------------------

    def send(self, tree: Any) -> jax.Array:
        """Sends ``tree`` (arrays committed to ``src``; on ``src``'s process only).

        Returns at once: a scalar that is ready once the message has left (the transfer
        runs when ``src`` reaches it in its stream and ``dst`` has called :meth:`recv`).
        JAX holds the leaves until then; block on it before the process ends.
        """
        leaves = jax.tree.leaves(tree)
        key = tuple([(x.shape, x.dtype) for x in leaves])
        entry = self._senders.get(key)
        if entry is None:
            entry = self._senders[key] = self._compile_send(key)
        program, avals = entry
        sharding = self._sharding
        done: jax.Array = program(
            self._ballast, *[_global(a, sharding, x) for a, x in zip(avals, leaves, strict=True)]
        )
        return done

    def _compile_send(self, key: _Key) -> Any:
        self._check("src")
        groups = _plan(key)

        def half(ballast: jax.Array, *leaves: jax.Array) -> jax.Array:
            out = _ballast(ballast)
            for g in groups:
                moved = _ppermute(_pack(leaves, g))
                # the sender's own result is zeros; one word of it keeps the collective
                out = out + moved[0].astype(jnp.uint32)
            return out

        args = [_spec(s, d, self._sharding) for s, d in key]
        return self._compile(half, args), [_aval(s, d, self._sharding) for s, d in key]

    # -- receiver ------------------------------------------------------------------------

    def recv(self, spec: Any) -> Any:
        """The next message, like ``spec`` (a pytree of ``jax.ShapeDtypeStruct``), as
        arrays committed to ``dst`` (on ``dst``'s process only). Returns at once; the
        arrays are ready when the message has arrived."""
        leaves, treedef = jax.tree.flatten(spec)
        key = tuple([(tuple(s.shape), np.dtype(s.dtype)) for s in leaves])
        entry = self._receivers.get((treedef, key))
        if entry is None:
            entry = self._receivers[(treedef, key)] = self._compile_recv(key)
        program, operands = entry
        out = program(*operands)
        return jax.tree.unflatten(treedef, [a.addressable_data(0) for a in out[1:]])

    def _compile_recv(self, key: _Key) -> tuple[Any, list[jax.Array]]:
        ballast = self._check("dst")
        groups = _plan(key)

        def half(ballast: jax.Array, *zeros: jax.Array) -> tuple[jax.Array, ...]:
            leaves: list[Any] = [None] * len(key)
            for g, z in zip(groups, zeros, strict=True):
                for i, leaf in _unpack(_ppermute(z), g, key):
                    leaves[i] = leaf
            return (_ballast(ballast), *leaves)

        shapes = [((g.size,), _WORD[g.word]) for g in groups]
        args = [_spec(s, d, self._sharding) for s, d in shapes]
        zeros = [self._on_device(np.zeros(s, d)) for s, d in shapes]
        return self._compile(half, args), [ballast, *zeros]

    # -- both ----------------------------------------------------------------------------

    def _check(self, role: str) -> jax.Array:
        """This end's ballast buffer, made on first use; raises if this process is not
        ``role``'s."""
        if self._role != role:
            what = "send" if role == "src" else "recv"
            raise RuntimeError(f"{self}: {what} is for the process of {getattr(self, role)}")
        if self._ballast is None:
            self._ballast = self._on_device(np.ones((_BALLAST,), np.uint8))
        return self._ballast

    def _on_device(self, value: np.ndarray) -> jax.Array:
        """``value`` on this process's end of the link, as a (nominally replicated) global
        array over the pair."""
        device = self.src if self._role == "src" else self.dst
        local = jax.device_put(value, device)
        return jax.make_array_from_single_device_arrays(value.shape, self._sharding, [local])

    def _compile(self, half: Any, args: Sequence[Any]) -> Any:
        """``half`` (ballast first) as this process's part of a program over ``[src, dst]``.

        ``check_vma=False``: results are declared replicated too (see ``__init__``), which
        JAX's check refuses for a ``ppermute`` result (it differs per device).
        """
        mapped = jax.shard_map(
            half, mesh=self._mesh, in_specs=_REPLICATED, out_specs=_REPLICATED, check_vma=False
        )
        ballast = _spec((_BALLAST,), jnp.uint8, self._sharding)
        return jax.jit(mapped).lower(ballast, *args).compile()
