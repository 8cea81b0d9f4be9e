"""Per-stage memory policies: what a stage's forward keeps for its backward.

A policy is one of :data:`MEMORY_POLICIES`:

* ``"none"``: keep every residual of the forward's VJP (the default);
* ``"full"``: keep nothing; the backward recomputes the whole forward (``remat=True``);
* ``"dots"``: the forward is ``jax.vjp`` of ``jax.checkpoint(layer, policy=
  jax.checkpoint_policies.dots_saveable)``: only matrix-product outputs are kept, the
  backward recomputes the rest (elementwise work, norms, activations) from them;
* ``"dots-no-batch"``: the same with ``dots_with_no_batch_dims_saveable``: only products
  without batch dimensions (a layer's weight matmuls) are kept; attention's
  score and value products, which have a batch dimension, are recomputed too;
* ``"offload"``: ``offload_dot_with_no_batch_dims("device", "pinned_host")``: those
  products are kept in the host's pinned memory instead of the device's, and everything
  else is recomputed. Only where every device of the stage has a ``pinned_host`` memory
  (:func:`check_available`); elsewhere it is refused, never replaced by another policy.

The named policies (every one but ``"none"`` and ``"full"``) apply per layer: the stage's
backward rebuilds each layer's VJP from what the policy saved; they are not
"recomputation" in the lowering's sense (the forward still hands residuals to the
backward). Every policy computes the same values as ``"none"``: only what is stored and
what is computed twice changes.

This module holds the names and their JAX policies, reads ``remat`` arguments
(:func:`memory_policies`) and measures a layer's residuals under a policy
(:func:`policy_vjp_residuals`); the profiler, the planner and the runtime share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pdjax.errors import PdjaxError

__all__ = [
    "CHECKPOINTED",
    "MEMORY_POLICIES",
    "OFFLOADED",
    "check_available",
    "checkpointed",
    "jax_policy",
    "memory_policies",
    "policy_name",
    "recomputes",
    "residual_split",
]

#: Every memory policy, from the one that keeps most to the one that keeps least.
MEMORY_POLICIES = ("none", "dots", "dots-no-batch", "offload", "full")
#: The policies built on ``jax.checkpoint`` (residuals kept, part of the forward redone).
CHECKPOINTED = ("dots", "dots-no-batch", "offload")
#: The policies that keep residuals in host memory (need ``pinned_host``).
OFFLOADED = ("offload",)


def policy_name(value: Any, error: type[PdjaxError] = PdjaxError, what: str = "remat") -> str:
    """One stage's policy from a ``remat`` value: a bool (``True`` is ``"full"``, ``False``
    ``"none"``) or a policy name; ``error`` for anything else."""
    if isinstance(value, (bool, np.bool_)):
        return "full" if value else "none"
    if isinstance(value, str) and value in MEMORY_POLICIES:
        return value
    raise error(
        f"{what} must be a bool or a memory policy, one of {MEMORY_POLICIES}, got {value!r}"
    )


def memory_policies(
    remat: Any, num_stages: int, error: type[PdjaxError] = PdjaxError
) -> tuple[str, ...]:
    """``remat`` as one policy per stage: a bool or a policy name for every stage, or a
    sequence of them, one per stage (``error`` for anything else)."""
    if isinstance(remat, (bool, np.bool_, str)):
        return (policy_name(remat, error),) * num_stages
    if not isinstance(remat, (list, tuple)) or not all(
        isinstance(r, (bool, np.bool_)) or r in MEMORY_POLICIES for r in remat
    ):
        raise error(
            f"remat must be a bool or one bool per stage, or a memory policy of "
            f"{MEMORY_POLICIES} (one for every stage, or one per stage); got {remat!r}"
        )
    names = tuple(policy_name(r, error) for r in remat)
    if len(names) != num_stages:
        raise error(f"remat gives {len(names)} flags for {num_stages} stages; give one per stage")
    return names


def recomputes(policy: str | bool) -> bool:
    """Whether the policy keeps nothing and recomputes the whole forward (``"full"``)."""
    return policy is True or policy == "full"


def jax_policy(policy: str) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy of a named policy; None for ``"none"``/``"full"``."""
    cp = jax.checkpoint_policies
    chosen: Callable[..., Any] | None = None
    if policy == "dots":
        chosen = cp.dots_saveable
    elif policy == "dots-no-batch":
        chosen = cp.dots_with_no_batch_dims_saveable
    elif policy == "offload":
        chosen = cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    return chosen


def checkpointed(fn: Callable[..., Any], policy: str) -> Callable[..., Any]:
    """``fn`` under ``policy``'s ``jax.checkpoint`` (``fn`` itself where it has none)."""
    p = jax_policy(policy)
    return fn if p is None else jax.checkpoint(fn, policy=p)


def check_available(
    policy: str, devices: Sequence[Any], error: type[PdjaxError] = PdjaxError, where: str = ""
) -> None:
    """Refuses (``error``) a policy the devices cannot run: ``"offload"`` needs a
    ``pinned_host`` memory beside ``device`` on every device."""
    if policy not in OFFLOADED:
        return
    for d in devices:
        try:
            kinds = {m.kind for m in d.addressable_memories()}
        except Exception:  # a platform without memories
            kinds = set()
        if not {"device", "pinned_host"} <= kinds:
            raise error(
                f"memory policy {policy!r}{where} needs host-offload memory ('pinned_host' "
                f"beside 'device') on every device; {d} has {sorted(kinds) or 'none'}: "
                "choose 'dots', 'dots-no-batch' or 'full' instead"
            )


def residual_split(leaves: Sequence[Any], inputs: Sequence[Any]) -> tuple[int, int]:
    """``(device bytes, host bytes)`` of a traced pullback's residual ``leaves`` that are
    not one of ``inputs`` (by identity): what a policy keeps beyond the weights and the
    layer's input, split by memory space (host: offloaded)."""
    ids = {id(a) for a in inputs}
    device = host = 0
    seen: set[int] = set()
    for leaf in leaves:
        if id(leaf) in ids or id(leaf) in seen or not hasattr(leaf, "shape"):
            continue
        seen.add(id(leaf))
        size = int(np.prod(leaf.shape, dtype=np.int64)) * int(leaf.dtype.itemsize)
        space = str(getattr(jax.typeof(leaf), "memory_space", "")).lower()
        if "host" in space:
            host += size
        else:
            device += size
    return device, host
