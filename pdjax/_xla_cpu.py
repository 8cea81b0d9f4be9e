"""The one home of pdjax's workarounds for XLA's CPU client.

XLA's CPU client has no per-device stream order: programs holding collectives (a
replicated stage's gradient all-reduce, the mean loss of a sharded batch, every
data-parallel step, the collective transport's transfers) that are queued together can
enter their rendezvous in different orders on different devices and, on a machine with
few cores, deadlock the in-process communicator; XLA aborts the process after its 40 s
rendezvous timeout. Measured on 4 CPU devices and 2 cores (jax 0.10.2): 100 unblocked
data-parallel steps abort, blocking every 50 do not; ``2bw`` on one stage replicated 4
ways aborts within 40 microbatches even with a bounded run-ahead. Two bounds keep the
queue short:

- *run-ahead*: the driver waits for the result of the program ``window`` steps back
  before it dispatches more (the pipeline: microbatch ``k - window``'s loss; data
  parallelism: the step ``window`` back);
- *one at a time*: a replicated pipeline stage's programs run one after the other (in
  one process, XLA's CPU devices share one thread pool, so little overlap is lost).

A third: donating a buffer that programs already queued still read makes the CPU client
wait, on the dispatching thread, until they finish (measured: a fused backward-update that
donated the weights a queued forward still read held the driver 6 ms per microbatch on a
pinned worker, and stalled the pipeline). So on CPU the fused updates do not donate the
weights they replace (``donate_weights``): the replaced version lives until the update
finishes, one more weight copy for its duration. Gradient sums and optimizer states have
no other reader and are donated everywhere.

What needs no workaround: the driver does not run programs. Dispatch on XLA's CPU client
is asynchronous (``jax_cpu_enable_async_dispatch``, on by default), with XLA's intra-op
threads or without (a cluster worker's one pinned core): a program of 1 ms or more returns
to the driver in 1-6% of its run time, and a device takes about 32 programs in flight
before a dispatch waits (``python benchmarks/bench_dispatch.py [--one-core]``; jax 0.10.2).
Sends and receives across processes are posted without waiting too, and a receive lands
while the receiving worker computes (a pipeline's operations polled for completion on 2
pinned workers, ``mlp-512``). So no host thread of pdjax's runs beside the driver, on any
platform; what the driver costs a one-core worker is its own host time per operation.

None of these applies to GPUs or TPUs, whose programs are ordered by streams.
:class:`Workarounds` says which apply to a runner; runners report it in their metrics.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["RunAhead", "Workarounds", "for_data_parallel", "for_pipeline"]

DP_WINDOW = 8
"""Data-parallel steps in flight at most on CPU."""


@dataclasses.dataclass(frozen=True)
class Workarounds:
    """What a runner does differently on XLA's CPU client, and why.

    Attributes:
      run_ahead: the driver waits for the result this many microbatches (pipeline) or
        steps (data parallelism) back; None: it never waits.
      one_at_a_time: per pipeline stage, whether its programs run one at a time.
      reasons: one line per workaround applied (empty off CPU).
      donate_weights: whether updates may donate the weights they replace.
    """

    run_ahead: int | None
    one_at_a_time: tuple[bool, ...] = ()
    reasons: tuple[str, ...] = ()
    donate_weights: bool = True


def for_pipeline(
    platform: str,
    replicas: Sequence[int],
    microbatches_per_step: int,
    groups: int,
    *,
    collectives: bool = False,
) -> Workarounds:
    """The workarounds for a pipeline whose stages have ``replicas`` devices each;
    ``collectives``: its transfers are XLA collectives too (the collective transport)."""
    replicated = tuple(r > 1 and platform == "cpu" for r in replicas)
    if platform != "cpu":
        return Workarounds(None, (False,) * len(replicas))
    keep = "updates keep the weights they replace (donating them would block the driver)"
    if not (any(replicated) or collectives):
        return Workarounds(None, replicated, (keep,), donate_weights=False)
    window = 4 * max(microbatches_per_step, groups)
    reasons = [f"run-ahead bounded to {window} microbatches (collectives on XLA's CPU client)"]
    if any(replicated):
        reasons.append("replicated stages run one program at a time (XLA's CPU client)")
    return Workarounds(window, replicated, (*reasons, keep), donate_weights=False)


def for_data_parallel(platform: str, devices: int) -> Workarounds:
    """The workarounds for a data-parallel step over ``devices`` devices."""
    if platform != "cpu" or devices < 2:
        return Workarounds(None)
    return Workarounds(
        DP_WINDOW,
        (),
        (f"run-ahead bounded to {DP_WINDOW} steps (collectives on XLA's CPU client)",),
    )


class RunAhead:
    """Waits for the result ``window`` dispatches back (no-op when ``window`` is None)."""

    def __init__(self, window: int | None) -> None:
        self.window = window
        self._pending: collections.deque[Any] = collections.deque()

    def dispatched(self, result: Any) -> None:
        if self.window is None:
            return
        self._pending.append(result)
        if len(self._pending) > self.window:
            jax.block_until_ready(self._pending.popleft())
