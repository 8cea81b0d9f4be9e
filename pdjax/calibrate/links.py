"""Links and all-reduces: one direction of a link between two devices timed through the
transport the runtime uses, and the all-reduce over a device group as a replicated stage's
update does it, each fitted to ``latency + bytes / bandwidth``."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdjax._timing import median_seconds
from pdjax.calibrate.calibration import AllReduceMeasure, LinkMeasure
from pdjax.calibrate.timing import fit_latency_bandwidth, with_timeout
from pdjax.errors import CalibrationError

__all__ = ["SIZES", "collective_level", "measure_allreduce", "measure_link"]

#: Default sizes (bytes) for link and all-reduce fits: 4 KiB to 4 MiB.
SIZES = (4096, 65536, 1 << 20, 4 << 20)


def measure_link(
    src: Any,
    dst: Any,
    *,
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    warmup: int = 2,
    transport: str = "device_put",
    timeout: float = 60.0,
) -> LinkMeasure | None:
    """One direction ``src -> dst`` (JAX devices), fitted to ``latency + n / bandwidth``.

    Within a process: ``jax.device_put`` of a float32 array of each size, to completion.
    Across processes (every process calls this, in the same order): the pipeline's
    transport (``transport``), the receiver acknowledging each message with 4 bytes; the
    sender's timings are taken, and returned on the sender's process (None elsewhere).

    Raises:
      CalibrationError: the link did not complete within ``timeout`` seconds.
    """
    import jax

    what = f"link {src.id} -> {dst.id}"
    if src.process_index == dst.process_index:
        if src.process_index != jax.process_index():
            return None
        return _link_in_process(
            src, dst, what=what, sizes=sizes, repeats=repeats, warmup=warmup, timeout=timeout
        )
    return _link_across_processes(
        src,
        dst,
        what=what,
        sizes=sizes,
        repeats=repeats,
        warmup=warmup,
        transport=transport,
        timeout=timeout,
    )


def _link_in_process(
    src: Any,
    dst: Any,
    *,
    what: str,
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    timeout: float,
) -> LinkMeasure:
    """``src -> dst`` within this process: ``jax.device_put`` of each size, timed."""
    import jax
    import jax.numpy as jnp

    points = []
    for n in sizes:
        a = jax.device_put(jnp.ones(max(1, n // 4), jnp.float32), src)
        to = jax.sharding.SingleDeviceSharding(dst)
        secs = with_timeout(
            what,
            timeout,
            functools.partial(
                median_seconds, functools.partial(jax.device_put, a, to), warmup, repeats
            ),
        )
        points.append(secs)
    lat, bw = fit_latency_bandwidth(sizes, points)
    return LinkMeasure(
        src=int(src.id),
        dst=int(dst.id),
        latency=lat,
        bandwidth=bw,
        send_seconds=0.0,
        sizes=tuple(sizes),
        seconds=tuple(round(p, 9) for p in points),
        transport="device_put",
    )


def _link_across_processes(
    src: Any,
    dst: Any,
    *,
    what: str,
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    transport: str,
    timeout: float,
) -> LinkMeasure | None:
    """``src -> dst`` across processes through the pipeline's ``transport``, each message
    acknowledged; the sender's measure on the sender's process, None elsewhere."""
    import jax

    from pdjax.pipeline.transport import make_transport

    me = jax.process_index()
    tr = make_transport(transport)
    sending, receiving = src.process_index == me, dst.process_index == me
    if not (sending or receiving):
        return None
    points, hosts = [], []
    for n in sizes:
        once = _exchange(tr, src, dst, n, sending=sending, receiving=receiving)

        def timed(once: Any = once) -> tuple[float, float]:
            for _ in range(warmup):
                once()
            runs = [once() for _ in range(repeats)]
            tr.drain()
            return (
                statistics.median(r[0] for r in runs),
                statistics.median(r[1] for r in runs),
            )

        total, host = with_timeout(what, timeout, timed)
        points.append(total)
        hosts.append(host)
    if not sending:
        return None
    intercept, bw = fit_latency_bandwidth(sizes, points)
    return LinkMeasure(
        src=int(src.id),
        dst=int(dst.id),
        latency=round(intercept / 2, 12),
        bandwidth=bw,
        send_seconds=round(statistics.median(hosts), 9),
        sizes=tuple(sizes),
        seconds=tuple(round(p, 9) for p in points),
        transport=transport,
    )


def _exchange(
    tr: Any, src: Any, dst: Any, n: int, *, sending: bool, receiving: bool
) -> Callable[[], tuple[float, float]]:
    """One message of ``n`` bytes ``src -> dst`` and its 4-byte acknowledgement back,
    from this process's side, as a call returning ``(seconds of the round trip, host
    seconds of this side's own call)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    ack_shape = (1,)
    shape = (max(1, n // 4),)
    a = jax.device_put(np.ones(shape, np.float32), src) if sending else None
    ok = jax.device_put(np.ones(ack_shape, np.float32), dst) if receiving else None

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        if sending:
            tr._single(a, src, dst, shape, jnp.float32, send=True)
            t1 = time.perf_counter()
            jax.block_until_ready(tr._single(None, dst, src, ack_shape, jnp.float32, send=False))
        else:
            got = tr._single(None, src, dst, shape, jnp.float32, send=False)
            jax.block_until_ready(got)
            t1 = time.perf_counter()
            tr._single(ok, dst, src, ack_shape, jnp.float32, send=True)
        return time.perf_counter() - t0, t1 - t0

    return once


def _allreduce_fn(devices: Sequence[Any], tree: Any) -> Callable[[], Any]:
    """A call that sums ``tree``-shaped ``[r, ...]`` parts over ``devices`` (one part per
    device) into a replicated result, as a replicated stage's update does."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("data",))
    r = len(devices)
    sharded = NamedSharding(mesh, P("data"))

    def place(leaf: Any) -> Any:
        shape = (r, *leaf.shape)
        return jax.make_array_from_callback(
            shape, sharded, lambda index: np.ones(shape, leaf.dtype)[index]
        )

    parts = jax.tree.map(place, tree)
    total = jax.jit(
        lambda t: jax.tree.map(lambda a: jnp.sum(a, axis=0), t),
        out_shardings=NamedSharding(mesh, P()),
    )
    return lambda: total(parts)


def measure_allreduce(
    devices: Sequence[Any],
    *,
    sizes: Sequence[int] = SIZES,
    trees: Mapping[Any, Any] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    timeout: float = 120.0,
) -> tuple[AllReduceMeasure, dict[Any, float]]:
    """The all-reduce over ``devices`` (every process holding one calls this), fitted over
    float32 arrays of ``sizes`` bytes, and timed for each tree of ``trees`` (shapes; e.g.
    a stage's gradients): ``(fit, {key: seconds})``."""
    import jax

    what = f"all-reduce over devices {[d.id for d in devices]}"
    points = []
    for n in sizes:
        part = jax.ShapeDtypeStruct((max(1, n // 4),), "float32")
        call = _allreduce_fn(devices, part)
        points.append(
            with_timeout(what, timeout, functools.partial(median_seconds, call, warmup, repeats))
        )
    lat, bw = fit_latency_bandwidth(sizes, points)
    exact = {}
    for k, tree in (trees or {}).items():
        call = _allreduce_fn(devices, tree)
        exact[k] = round(
            with_timeout(what, timeout, functools.partial(median_seconds, call, warmup, repeats)),
            9,
        )
    fit = AllReduceMeasure(
        devices=tuple(int(d.id) for d in devices),
        latency=lat,
        bandwidth=bw,
        sizes=tuple(sizes),
        seconds=tuple(round(p, 9) for p in points),
    )
    return fit, exact


def collective_level(
    devices: Sequence[Any],
    *,
    sizes: Sequence[int] = (4096, 1 << 20, 4 << 20),
    chain: int = 16,
    repeats: int = 5,
) -> Any:
    """One topology level for ``devices`` whose ring prices the collectives XLA runs
    *inside* a program on them (a sharded stage's): ``chain`` all-reduces in a row over
    all of ``devices``, in one jitted program, per size; the per-collective seconds fitted
    to ``latency + bytes / bandwidth`` and read through the ring model of
    :func:`pdjax.partition.pricing.sharded.collective_seconds` (``2 (n - 1)`` messages of
    latency, ``2 (n - 1) / n`` of the bytes), so that an all-reduce over all of them is
    priced as measured. In-process CPU devices share the host's cores: their
    collectives are memory copies whose latency and bandwidth this measures (the
    topology's link bandwidth is a transfer's, not theirs).

    Returns:
      a :class:`~pdjax.plan.Level` of ``len(devices)`` workers.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pdjax.plan.topology import Level

    n = len(devices)
    if n < 2:
        raise CalibrationError("collectives need at least two devices")
    mesh = Mesh(np.asarray(devices), ("x",))

    def run(a: Any) -> Any:
        def body(_: Any, a: Any) -> Any:
            return jax.lax.psum(a, "x") * (1.0 / n)

        return jax.lax.fori_loop(0, chain, body, a)

    call = jax.jit(
        jax.shard_map(run, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    )
    points = []
    for nbytes in sizes:
        x = jax.device_put(
            jnp.ones((n * max(1, nbytes // 4),), jnp.float32), NamedSharding(mesh, P("x"))
        )
        once = functools.partial(lambda x: jax.block_until_ready(call(x)), x)
        points.append(median_seconds(once, 1, repeats) / chain)
    # the bandwidth from the two largest sizes, the latency from the smallest: a least
    # squares line through all of them is the large sizes' and loses the latency
    (s0, t0), *_, (s1, t1), (s2, t2) = sorted(zip(sizes, points, strict=True))
    if not (s2 > s1 and t2 > t1):
        raise CalibrationError(f"collectives of {s1} and {s2} bytes took {t1} and {t2} s")
    bandwidth = (s2 - s1) / (t2 - t1)
    latency = max(t0 - s0 / bandwidth, 0.0)
    messages, volume = 2 * (n - 1), 2 * (n - 1) / n
    return Level(n, bandwidth * volume, "collective", latency / messages)
