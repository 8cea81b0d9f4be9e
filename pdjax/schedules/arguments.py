"""Checks of the generators' arguments (shared with the validator's header checks)."""

from __future__ import annotations

from collections.abc import Sequence

from pdjax.errors import ScheduleError

__all__ = ["REPLICATION", "check_multiple", "positive", "replicas_of", "replication_of"]

REPLICATION = ("split", "round-robin")
"""How a replicated stage's devices share its microbatches."""


def positive(name: str, value: object, minimum: int = 1) -> int:
    """``value``, if it is an integer ``>= minimum``.

    Raises:
        ScheduleError: naming ``name`` otherwise.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ScheduleError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return value


def replicas_of(replicas: Sequence[int] | None, groups: int) -> tuple[int, ...]:
    """Devices per device group (default 1 each), one positive count per group."""
    if replicas is None:
        return (1,) * groups
    replicas = tuple(replicas)
    if len(replicas) != groups:
        raise ScheduleError(
            f"replicas has {len(replicas)} entries but the pipeline has {groups} device groups "
            f"(num_stages); pass one replica count per stage, e.g. the Plan's"
        )
    for r in replicas:
        positive("every replica count", r)
    return replicas


def replication_of(
    replication: Sequence[str] | str | None,
    replicas: tuple[int, ...],
    name: str = "",
    round_robin: Sequence[str] | None = None,
) -> tuple[str, ...]:
    """Per device group ``"split"`` or ``"round-robin"`` (``()`` when every group splits).

    With ``round_robin`` (the schedules that take round-robin replication), refuses
    round-robin stages for schedule ``name`` unless it is one of them."""
    if replication is None:
        return ()
    if isinstance(replication, str):
        replication = [replication] * len(replicas)
    replication = tuple(replication)
    if len(replication) != len(replicas):
        raise ScheduleError(
            f"replication has {len(replication)} entries but the pipeline has {len(replicas)} "
            "device groups; give one per group, or one word for all"
        )
    for mode in replication:
        if mode not in REPLICATION:
            raise ScheduleError(f"replication must be one of {REPLICATION}, got {mode!r}")
    if all(m == "split" or r == 1 for m, r in zip(replication, replicas, strict=True)):
        return ()
    if round_robin is not None and name not in round_robin:
        raise ScheduleError(
            f"round-robin replication runs whole groups of microbatches through 1F1B-style "
            f"orders: {', '.join(round_robin)}; {name} has no round-robin form, use "
            "replication='split'"
        )
    return replication


def check_multiple(what: str, count: int, units: Sequence[int]) -> None:
    """Raises ScheduleError unless ``count`` is a multiple of every group size."""
    for d, n in enumerate(units):
        if count % n:
            raise ScheduleError(
                f"{what}={count} is not a multiple of device group {d}'s {n} round-robin "
                f"replicas (each takes whole groups of {n} microbatches)"
            )
