"""Cross-process transfers through an XLA collective (:class:`CollectiveLink`) between 3
and 4 local processes of 1 CPU device each, on 127.0.0.1 only.

JAX's CPU ``device_put`` between processes pairs sends and receives per sender, so a process
sending to two others hangs or misdelivers; these cases go through a ``ppermute`` per link
instead. Each test starts
worker processes (this file run as a script) with :func:`pdjax.distributed.launch_local`,
which bounds them in time and ends them by process group. Every process dispatches the
transfers it takes part in following one global list (the same on every process: a link is
a rendezvous in device order, see ``pdjax/pipeline/_collective.py``), without waiting in
between, and checks what it received bit for bit.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 80.0  # seconds for one launch of worker processes
ROUNDS = 20  # messages per link in the interleaved test
M = 6  # microbatches in the 1F1B test


def _launch(scenario: str, processes: int) -> None:
    from pdjax.distributed import launch_local

    env = {"PDJAX_HEARTBEAT_TIMEOUT": "5", "PYTHONPATH": str(ROOT)}
    launch_local([__file__, scenario], processes, timeout=BUDGET, env=env, cpu_devices=1)


def test_three_processes_send_to_each_other():
    """Process 0 sends to 1 and to 2 (what device_put cannot), 1 sends to 2, 2 back to 1
    and 1 back to 0, 20 messages each, interleaved; trees of float32, int32, bfloat16 (and
    bool, scalars, empty, over 256 KiB). Before that, 0 and 1 exchange messages while 2
    waits for them elsewhere: a process outside a link takes no part in it."""
    _launch("three", 3)


def test_four_process_chain_in_1f1b_order():
    """A 4-stage chain: activations 0 -> 1 -> 2 -> 3 and gradients 3 -> 2 -> 1 -> 0, in
    1F1B clock order (both directions interleaved on every pair)."""
    _launch("chain", 4)


# -- the workers ------------------------------------------------------------------------------


def _tree(layout: str, tag: float, dev: jax.Device) -> dict[str, jax.Array]:
    """A message of ``layout`` whose every value derives from ``tag`` (distinct per link and
    message, so a misdelivery shows), placed on ``dev``."""
    return jax.device_put(_host_tree(layout, tag), dev)


def _spec(layout: str) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _host_tree(layout, 0))


def _host_tree(layout: str, tag: float) -> dict[str, np.ndarray]:
    t = np.float32(tag)
    if layout == "small":  # mixed item sizes, packed as bytes into one collective
        tree = {
            "h": np.arange(24, dtype=np.float32).reshape(4, 6) + t,
            "n": np.arange(5, dtype=np.int32) * 3 + np.int32(tag),
            # small integers stay exact in bfloat16 through the chain test's additions
            "b": (np.arange(8, dtype=np.float32).reshape(2, 4) % 4 + t).astype(jnp.bfloat16),
        }
    elif layout == "big":  # over 256 KiB: one collective per item size
        tree = {
            "h": np.arange(300 * 256, dtype=np.float32).reshape(300, 256) + t,
            "n": np.arange(300, dtype=np.int32) + np.int32(tag),
            "b": (np.arange(1000, dtype=np.float32) % 97 + t).astype(jnp.bfloat16),
        }
    elif layout == "odd":  # a scalar, a bool, an empty leaf, odd sizes
        tree = {
            "s": t,
            "m": np.arange(7) % 3 == int(tag) % 3,
            "e": np.zeros((0, 3), np.float32),
            "c": np.full((3,), int(tag) % 128, np.int8),
        }
    elif layout == "one":  # a single bfloat16 leaf
        tree = {"b": (np.arange(33, dtype=np.float32) + t).astype(jnp.bfloat16)}
    else:
        raise ValueError(layout)
    return {k: np.asarray(v) for k, v in tree.items()}


def _check(got: Any, want: Any, where: str) -> None:
    """``got`` is ``want`` bit for bit, and each leaf is on ``want``'s device."""
    assert jax.tree.structure(got) == jax.tree.structure(want), where
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        name = f"{where} {jax.tree_util.keystr(path)}"
        assert g.devices() == w.devices(), name
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def _three() -> None:
    from pdjax.distributed import broadcast_json
    from pdjax.pipeline._collective import CollectiveLink

    me, devs = jax.process_index(), jax.devices()
    links: dict[tuple[int, int], CollectiveLink] = {}

    def link(s: int, d: int) -> CollectiveLink:
        if (s, d) not in links:
            links[s, d] = CollectiveLink(devs[s], devs[d])
        return links[s, d]

    # 1. 0 <-> 1 alone, while 2 waits on the coordination service; neither end of a link
    # blocks its caller when the peer is late.
    if me in (0, 1):
        peer = 1 - me
        out, into = link(me, peer), link(peer, me)
        # process 1 comes late and leaves a mark before its own calls: process 0's calls
        # must have returned before that mark exists (an order, not a clock)
        mark = Path(tempfile.gettempdir()) / f"pdjax-late-{os.environ['PDJAX_COORDINATOR']}"
        mark = mark.with_name(mark.name.replace(":", "-"))
        for late in (0.0, 2.0):  # compiles, then checks the calls of process 0
            x = jax.block_until_ready(_tree("one", 7.0 + me + late, devs[me]))
            if me == 0:
                sent, got = out.send(x), into.recv(_spec("one"))
                if late:
                    assert not mark.exists(), "send/recv blocked their caller for the peer"
            else:
                time.sleep(late)  # process 0 is already waiting on this
                if late:
                    mark.touch()
                got, sent = into.recv(_spec("one")), out.send(x)
            jax.block_until_ready((sent, got))
            _check(got, _tree("one", 7.0 + peer + late, devs[me]), "alone")
        order = [(0, 1, "odd"), (1, 0, "big"), (0, 1, "big"), (1, 0, "odd"), (0, 1, "small")]
        kept, got = [], []
        for k, (s, d, layout) in enumerate(order):
            if s == me:
                kept.append(link(s, d).send(_tree(layout, 100.0 * k + s, devs[s])))
            else:
                got.append((link(s, d).recv(_spec(layout)), _tree(layout, 100.0 * k + s, devs[d])))
        jax.block_until_ready(kept)
        for k, (g, w) in enumerate(got):
            _check(g, w, f"alone {k}")
        # process 0 sent these after its look at the mark
        mark.unlink(missing_ok=True)
    broadcast_json("0 and 1 are done", source=1)  # 2 was waiting here all along

    # 2. Every link at once, interleaved, no waiting until the end.
    pairs = [(0, 1, "small"), (0, 2, "big"), (1, 2, "small"), (2, 1, "odd"), (1, 0, "big")]
    kept, got = [], []
    for r in range(ROUNDS):
        for s, d, layout in pairs:
            tag = 1000.0 * r + 10 * s + d
            if s == me:
                kept.append(link(s, d).send(_tree(layout, tag, devs[s])))
            elif d == me:
                got.append((link(s, d).recv(_spec(layout)), _tree(layout, tag, devs[d]), tag))
    jax.block_until_ready(kept)
    assert len(got) == ROUNDS * sum(d == me for _, d, _ in pairs)
    for g, w, tag in got:
        _check(g, w, f"message {tag}")


def _one_f_one_b(stages: int, m: int) -> list[tuple[int, str, int]]:
    """The actions ``(stage, 'F' or 'B', microbatch)`` of a 1F1B pipeline in clock order
    (each action takes one tick once its inputs are there)."""
    per_stage = []
    for s in range(stages):
        warm = min(stages - s - 1, m)
        seq = [("F", k) for k in range(warm)]
        for k in range(m - warm):
            seq += [("F", warm + k), ("B", k)]
        seq += [("B", k) for k in range(m - warm, m)]
        per_stage.append(seq)
    done: dict[tuple[int, str, int], int] = {}
    free, nxt, actions = [0] * stages, [0] * stages, []
    while len(done) < 2 * stages * m:
        for s in range(stages):
            if nxt[s] == len(per_stage[s]):
                continue
            kind, k = per_stage[s][nxt[s]]
            deps = [(s - 1, "F", k)] if kind == "F" and s else []
            deps += [(s + 1, "B", k)] if kind == "B" and s < stages - 1 else []
            deps += [(s, "F", k)] if kind == "B" else []
            if all(d in done for d in deps):
                start = max([free[s], *(done[d] for d in deps)])
                done[s, kind, k] = free[s] = start + 1
                actions.append((start, s, kind, k))
                nxt[s] += 1
    return [(s, kind, k) for _, s, kind, k in sorted(actions)]


def _chain() -> None:
    """Stage ``s`` on process ``s``; a forward adds 1 to every leaf, the last stage turns
    its activation into a gradient (+100), a backward adds 10. Each transfer is one event
    of the clock order, dispatched by both its processes at the sender's action (as the
    pipeline does), so the two directions of a pair interleave as 1F1B has them."""
    from pdjax.pipeline._collective import CollectiveLink

    me, devs = jax.process_index(), jax.devices()
    n = len(devs)
    dev = devs[me]
    # every process makes every link and connects them in one order (a no-op for the
    # links it is not on): the communicators exist before the first, late, transfers
    pairs = sorted([(s, s + 1) for s in range(n - 1)] + [(s + 1, s) for s in range(n - 1)])
    links = {p: CollectiveLink(devs[p[0]], devs[p[1]]) for p in pairs}
    for p in pairs:
        links[p].connect()
    fwd, from_next = links.get((me, me + 1)), links.get((me + 1, me))
    bwd, from_prev = links.get((me, me - 1)), links.get((me - 1, me))
    spec = _spec("small")
    step = jax.jit(lambda t, c: jax.tree.map(lambda a: a + jnp.asarray(c, a.dtype), t))
    acts: dict[int, Any] = {}
    grads: dict[int, Any] = {}
    kept, checks = [], []
    for s, kind, k in _one_f_one_b(n, M):
        if kind == "F" and s == me:
            x = _tree("small", float(k), dev) if me == 0 else acts[k]
            y = step(x, 1)
            if fwd is not None:
                kept.append(fwd.send(y))
            else:
                grads[k] = step(y, 100)  # the loss
        elif kind == "F" and s == me - 1:  # the previous stage's activation arrives
            acts[k] = from_prev.recv(spec)
            checks.append((acts[k], k + me, f"activation {k}"))
        elif kind == "B" and s == me:
            g = step(grads.pop(k), 10)
            if bwd is not None:
                kept.append(bwd.send(g))
        elif kind == "B" and s == me + 1:  # the next stage's gradient arrives
            grads[k] = from_next.recv(spec)
            checks.append((grads[k], k + n + 100 + 10 * (n - 1 - me), f"gradient {k}"))
    jax.block_until_ready(kept)
    assert not grads and len(checks) == M * ((me > 0) + (me < n - 1))
    for got, offset, where in checks:
        _check(got, _tree("small", float(offset), dev), f"stage {me}: {where}")


def _worker(scenario: str) -> None:
    from pdjax.distributed import config_from_env, initialize

    initialize(config_from_env())
    jax.config.update("jax_numpy_rank_promotion", "raise")
    {"three": _three, "chain": _chain}[scenario]()
    print(f"process {jax.process_index()}: {scenario} ok", flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])
