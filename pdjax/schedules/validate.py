"""The validator: checks any schedule, each check recomputed here from the semantics in
``docs/semantics.md#weight-versions-and-updates`` and independent of the generators.

The bounds a schedule declares (microbatches in flight per device group, weight versions
kept per stage) and the version every action must use are recomputed by this module's
own formulas (:func:`expected_in_flight`, :func:`expected_versions`,
:func:`required_version`), not read from the generators or from the formulas of the
semantics table; ``tests/test_schedule_semantics.py`` checks that the table agrees with
them. The table is read only for which schedules flush, stack stages on a group or take
round-robin replication.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence

from pdjax.errors import ScheduleError
from pdjax.schedules.actions import KINDS, Action, Schedule
from pdjax.schedules.arguments import check_multiple, positive, replication_of
from pdjax.schedules.inflight import least_groups_in_flight, unstuck
from pdjax.schedules.play import kept_live_versions, play
from pdjax.schedules.registry import CHUNKED, FLUSHING, ROUND_ROBIN, SCHEDULES, stage_groups

__all__ = ["expected_in_flight", "expected_versions", "required_version", "validate"]


def validate(schedule: Schedule) -> None:
    """Checks that ``schedule`` is runnable and computes what its name promises.

    Checks, each independently of the generators: the header (name, sizes, stage
    placement, and bounds equal to the semantics' own), that every action is in range and
    on its stage's device group, that every ``F``, ``B`` (or ``I`` and ``W``) and ``U`` runs
    exactly once, that every ``B``/``I`` follows its ``F`` and every ``W`` its ``I``, that every
    ``U`` follows the backwards it applies, that every action uses the weight version the
    schedule's semantics require (recomputed here from the formulas of
    ``docs/semantics.md#weight-versions-and-updates``) and that it exists by then, the
    in-flight and versions-kept bounds, and that the cross-stage dependencies can be met (no
    deadlock).

    Args:
        schedule: the schedule.

    Raises:
        ScheduleError: naming the first offending action.
    """
    _check_header(schedule)
    _check_work(schedule)
    _check_order(schedule)
    play(schedule, lambda a: 1, None)


# ----------------------------------------------------------------------------- recomputation


def _extra(e: int, stage: int, num_stages: int) -> int:
    """PipeDream's extra microbatches in flight at ``stage``: ``e``, none at the last stage."""
    return e if stage < num_stages - 1 else 0


def expected_in_flight(s: Schedule, group: int) -> int:
    """In-flight bound of ``group`` under ``s.name``'s semantics (independent of generators)."""
    P, S, M, N = s.num_groups, s.num_stages, s.microbatches_per_step, s.num_microbatches
    if s.replication and s.name == "pipedream" and s.in_flight == "paper":
        sizes = tuple(s.group_size(st) for st in range(P))
        return min(_paper_groups_or_refuse(sizes)[group] * sizes[group], N)
    if s.replication and s.name != "gpipe":
        # round-robin: the schedule's own q_s (see round_robin_in_flight), if it is at least
        # the least count and whole groups (or every microbatch there is)
        units = [s.group_size(st) for st in range(P)]
        cap = N if s.name != "1f1b" else M
        e = s.extra_in_flight if s.name == "pipedream" else 0
        least = min(
            unstuck(units, [least_groups_in_flight(units, st, e) for st in range(P)])[group]
            * units[group],
            cap,
        )
        declared = s.in_flight_bound[group]
        if declared >= least and (declared % units[group] == 0 or declared == cap):
            return declared
        return least
    if s.name == "gpipe":
        return M
    if s.name == "1f1b":
        return min(P - group, M)
    if s.name == "zb-h1":
        return min(P, M)
    if s.name == "zb-h2":
        return min(2 * P - 1, M)
    if s.name == "zb-v":
        return min(2 * P, 2 * M)
    if s.name == "interleaved":
        v = S // P
        if v == 1:
            return min(P - group, M)
        return min(2 * (P - group - 1) + (v - 1) * P + 1, M * v)
    return min(P - group + _extra(s.extra_in_flight, group, P), N)


def _semantic_groups_in_flight(s: Schedule, units: Sequence[int], stage: int) -> int:
    """``q_s``, the groups in flight of a round-robin schedule's stage: PipeDream's count
    recomputed under ``in_flight="paper"``, else its in-flight bound in groups (checked
    against the least count by the header checks)."""
    if s.in_flight == "paper" and s.name == "pipedream":
        return _paper_groups_or_refuse(tuple(units))[stage]
    return -(-s.in_flight_bound[s.stage_device[stage]] // units[stage])


def _feeds(n: int, after: int, up: int, down: int) -> bool:
    """Whether a stage running 1F1B over groups of ``n`` with ``up`` in flight and the
    next one, over groups of ``after`` with ``down`` in flight, cannot deadlock.

    The next stage's forward of its group ``g`` waits for this stage's forward of the
    group ``h`` holding ``g``'s last microbatch. In 1F1B that forward follows this stage's
    backward of group ``h - up``, which waits for the next stage's backward of the group
    ``j`` holding that group's last microbatch, and the next stage runs backward ``j``
    before forward ``g`` only if ``j <= g - down``. Both sides repeat every
    ``lcm(n, after)`` microbatches, so the first ``up`` groups of this stage and two
    periods after them decide it."""
    period = math.lcm(n, after) // after
    for g in range(up * n // after + 2 * period + 2):
        h = ((g + 1) * after - 1) // n
        if h >= up and ((h - up + 1) * n - 1) // after > g - down:
            return False
    return True


@functools.lru_cache(maxsize=256)
def _paper_groups(units: tuple[int, ...]) -> tuple[int, ...] | None:
    """``q_s`` under ``pipedream``'s ``in_flight="paper"``, from
    ``docs/semantics.md#round-robin``: ``NOAM = ceil(W / n_0)`` groups at the input stage;
    at a later stage PipeDream's ``ceil(W_s / n_s)``, lowered while the stage before cannot
    feed that many (:func:`_feeds`) but not below what the stages after it need. None
    where the input stage would need more than NOAM groups."""
    P = len(units)
    need = [1] * P
    for st in range(P - 2, -1, -1):
        while not _feeds(units[st], units[st + 1], need[st], need[st + 1]):
            need[st] += 1
    noam = -(-sum(units) // units[0])
    if noam < need[0]:
        return None
    q = [noam]
    for st in range(1, P):
        count = -(-sum(units[st:]) // units[st])
        while count > need[st] and not _feeds(units[st - 1], units[st], q[-1], count):
            count -= 1
        q.append(max(count, need[st]))
    return tuple(q)


def _paper_groups_or_refuse(units: tuple[int, ...]) -> tuple[int, ...]:
    q = _paper_groups(units)
    if q is None:
        raise ScheduleError(
            f"pipedream with in_flight='paper' has no in-flight counts for round-robin groups "
            f"{units}: the input stage would need more than NOAM = "
            f"{-(-sum(units) // units[0])} groups not to deadlock; use in_flight='full-rate'"
        )
    return q


def expected_versions(s: Schedule, stage: int) -> int:
    """Weight versions ``stage`` keeps under ``s.name``'s semantics."""
    P, e = s.num_stages, s.extra_in_flight
    if s.name == "pipedream" and s.replication:
        units = [s.group_size(st) for st in range(P)]
        q = _semantic_groups_in_flight(s, units, stage)
        return min(q, s.num_microbatches // units[stage])
    if s.name == "pipedream":
        if s.vertical_sync:
            return P + e
        return P - stage + _extra(e, stage, P) if s.weight_stashing else 1
    return 2 if s.name == "2bw" else 1


def required_version(s: Schedule, a: Action, updates: int) -> tuple[int, str]:
    """The version ``a`` must use, and why, given ``updates`` already run at its stage."""
    version, why = _required_version(s, a, updates)
    return version, why()


def _required_version(
    s: Schedule, a: Action, updates: int, units: Sequence[int] | None = None
) -> tuple[int, Callable[[], str]]:
    """:func:`required_version`, the reason formatted only when asked for (the validator
    asks only when the version is wrong); ``units``: every stage's group size, if known."""
    P, M, k = s.num_stages, s.microbatches_per_step, a.mb
    if a.kind == "U":
        return updates, lambda: f"it is update number {updates} of stage {a.stage}"
    step = k // M
    if s.name in FLUSHING:
        return step, lambda: f"{s.name} runs every microbatch of step {step} with version {step}"
    if s.name == "2bw":
        return max(0, step - 1), lambda: f"2bw runs step {step} with W(t-1), version max(0, t-1)"
    if a.kind != "F" and not s.weight_stashing:
        return (
            updates,
            lambda: (
                f"pipedream without weight stashing runs the backward with the newest weights, "
                f"version {updates} after {updates} updates"
            ),
        )
    e = s.extra_in_flight
    if s.replication:
        if units is None:
            units = [s.group_size(st) for st in range(P)]
        q = _semantic_groups_in_flight(s, units, a.stage)
        g = k // units[a.stage]
        return (
            max(0, g - q + 1),
            lambda: (
                f"pipedream with round-robin stages runs group g={g} of stage {a.stage} at "
                f"version max(0, g - q_s + 1), q_s={q}"
            ),
        )
    if s.vertical_sync:
        why = "pipedream with vertical sync uses max(0, k-(P+e)+1)"
        return max(0, k - (P + e) + 1), lambda: why
    lag = P - a.stage + _extra(e, a.stage, P)
    why = "pipedream uses version max(0, k-(P-s+e)+1), e=0 at the last"
    return max(0, k - lag + 1), lambda: why


# ----------------------------------------------------------------------------- header


def _check_header(s: Schedule) -> None:
    _check_sizes(s)
    _check_placement(s)
    if s.replication:
        _check_replication(s)
    _check_bounds(s)


def _check_sizes(s: Schedule) -> None:
    """Name, sizes and options."""
    if s.name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule name {s.name!r}; accepted: {', '.join(SCHEDULES)}")
    for label, value in [
        ("num_stages", s.num_stages),
        ("num_microbatches", s.num_microbatches),
        ("microbatches_per_step", s.microbatches_per_step),
        ("number of device groups", s.num_groups),
    ]:
        positive(label, value)
    if s.name == "pipedream" and s.microbatches_per_step != 1:
        raise ScheduleError("pipedream updates after every microbatch: microbatches_per_step=1")
    if s.num_microbatches % s.microbatches_per_step:
        raise ScheduleError(
            f"num_microbatches={s.num_microbatches} is not a multiple of "
            f"microbatches_per_step={s.microbatches_per_step}"
        )
    if (s.vertical_sync or not s.weight_stashing) and s.name != "pipedream":
        raise ScheduleError("vertical_sync and weight_stashing=False are pipedream options only")
    if s.extra_in_flight and s.name != "pipedream":
        raise ScheduleError("extra_in_flight is a pipedream option only")
    positive("extra_in_flight", s.extra_in_flight, minimum=0)
    if s.in_flight not in ("full-rate", "paper"):
        raise ScheduleError(f"in_flight must be 'full-rate' or 'paper'; got {s.in_flight!r}")
    if s.in_flight != "full-rate" and s.name != "pipedream":
        raise ScheduleError("in_flight='paper' is a pipedream option only")
    if s.in_flight == "paper" and s.extra_in_flight:
        raise ScheduleError(
            "in_flight='paper' keeps PipeDream's NOAM at the input stage; it takes no "
            "extra_in_flight"
        )


def _check_placement(s: Schedule) -> None:
    """Stages per group, their groups, and one entry per group or stage in the lists."""
    if s.num_stages % s.num_groups or (s.chunks > 1 and s.name not in CHUNKED):
        raise ScheduleError(
            f"{s.name} with {s.num_stages} stages on {s.num_groups} device groups: only "
            f"{' and '.join(CHUNKED)} put several stages (a multiple of the groups) on one group"
        )
    if s.name == "zb-v" and s.chunks != 2:
        raise ScheduleError(
            f"zb-v puts two stages (a V) on each device group: 2P = {2 * s.num_groups} "
            f"stages on {s.num_groups} groups; got {s.num_stages} stages"
        )
    expected_map = stage_groups(s.name, s.num_groups, s.chunks)
    if tuple(s.stage_device) != expected_map:
        how = "the V: stage s on group min(s, 2P - 1 - s)" if s.name == "zb-v" else ""
        how = how or "stage s on group s % P"
        raise ScheduleError(
            f"stage_device must be {list(expected_map)} ({how}); got {list(s.stage_device)}"
        )
    for label, values, size in [
        ("replicas", s.replicas, s.num_groups),
        ("in_flight_bound", s.in_flight_bound, s.num_groups),
        ("version_bound", s.version_bound, s.num_stages),
    ]:
        if len(values) != size:
            raise ScheduleError(f"{label} has {len(values)} entries, expected {size}")
    for r in s.replicas:
        positive("every replica count", r)


def _check_replication(s: Schedule) -> None:
    if replication_of(s.replication, tuple(s.replicas), s.name, ROUND_ROBIN) != tuple(
        s.replication
    ):
        raise ScheduleError(
            "replication lists 'round-robin' only for stages of one replica: give () "
            "(every group split)"
        )
    if s.chunks > 1:
        raise ScheduleError("round-robin replication puts one stage on each device group")
    if s.name == "pipedream" and (s.vertical_sync or not s.weight_stashing):
        raise ScheduleError(
            "pipedream with round-robin stages is defined with weight stashing and "
            "without vertical sync"
        )
    units = [s.group_size(st) for st in range(s.num_stages)]
    per = s.num_microbatches if s.name == "pipedream" else s.microbatches_per_step
    check_multiple("microbatches per step (M; N for pipedream)", per, units)


def _check_bounds(s: Schedule) -> None:
    for d in range(s.num_groups):
        if s.in_flight_bound[d] != expected_in_flight(s, d):
            raise ScheduleError(
                f"device group {d}: in_flight_bound={s.in_flight_bound[d]} but {s.name} "
                f"holds at most {expected_in_flight(s, d)} microbatches there"
            )
    for st in range(s.num_stages):
        if s.version_bound[st] != expected_versions(s, st):
            raise ScheduleError(
                f"stage {st}: version_bound={s.version_bound[st]} but {s.name} keeps "
                f"{expected_versions(s, st)} weight versions there"
            )


# ----------------------------------------------------------------------------- the work


def _where(s: Schedule, group: int, position: int) -> str:
    return f"device group {group}, position {position}: {s.actions[group][position].describe()}"


def _check_work(s: Schedule) -> None:
    """Every action in range and on its stage's group; all work present exactly once.

    Runs after the header checks, so that every stage's group size and update count can
    be worked out once up front. The checks of :func:`_check_action` and
    :func:`_check_stage_work` are written out for the common case that passes them; where
    one would fail, the function itself runs, and raises its error."""
    S, N, where = s.num_stages, s.num_microbatches, s.stage_device
    units = [s.group_size(st) for st in range(S)]
    updates = [s.updates_of(st) for st in range(S)]
    # per kind and stage, the actions seen (each in range, once: so all of them are
    # there when the count is the number of microbatch groups, or of updates)
    counts = {kind: [0] * S for kind in KINDS}
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}
    for d, acts in enumerate(s.actions):
        for pos, a in enumerate(acts):
            kind, st, mb = a.kind, a.stage, a.mb
            if not (  # _check_action's checks
                kind in KINDS
                and type(st) is int
                and type(mb) is int
                and type(a.version) is int
                and 0 <= st < S
                and where[st] == d
                and 0 <= mb < (updates[st] if kind == "U" else N)
                and (kind == "U" or not mb % units[st])
            ):
                _check_action(s, d, pos, a)
            key = (kind, st, mb)
            if key in seen:
                first = seen[key]
                raise ScheduleError(
                    f"{_where(s, d, pos)} repeats work already done at device group "
                    f"{first[0]}, position {first[1]}"
                )
            seen[key] = (d, pos)
            counts[kind][st] += 1
    fwd, full, grad_in, grad_w, upd = (counts[kind] for kind in ("F", "B", "I", "W", "U"))
    for st in range(S):
        groups = len(range(0, N, units[st]))
        backward = (full[st] == groups and not grad_in[st] and not grad_w[st]) or (
            not full[st] and grad_in[st] == groups and grad_w[st] == groups
        )
        if not (fwd[st] == groups and backward and upd[st] == updates[st]):
            _check_stage_work(s, st, seen)


def _check_action(s: Schedule, d: int, pos: int, a: Action) -> None:
    """``a`` (at ``pos`` on group ``d``): a known kind, in range, on its stage's group."""
    S, N = s.num_stages, s.num_microbatches
    if a.kind not in KINDS:
        raise ScheduleError(f"{_where(s, d, pos)}: unknown kind {a.kind!r}")
    for field in ("stage", "mb", "version"):
        value = getattr(a, field)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ScheduleError(
                f"{_where(s, d, pos)}: {field} must be an int, not {type(value).__name__} {value!r}"
            )
    if not 0 <= a.stage < S:
        raise ScheduleError(f"{_where(s, d, pos)}: stage out of range [0, {S})")
    if s.stage_device[a.stage] != d:
        raise ScheduleError(
            f"{_where(s, d, pos)}: stage {a.stage} lives on device group "
            f"{s.stage_device[a.stage]}, not {d}"
        )
    limit = s.updates_of(a.stage) if a.kind == "U" else N
    if not 0 <= a.mb < limit:
        index = "step" if a.kind == "U" else "microbatch"
        raise ScheduleError(f"{_where(s, d, pos)}: {index} out of range [0, {limit})")
    n = s.group_size(a.stage)
    if a.kind != "U" and a.mb % n:
        raise ScheduleError(
            f"{_where(s, d, pos)}: stage {a.stage} is round-robin over {n} replicas; "
            f"its actions cover groups of {n} microbatches, named by the first (a "
            f"multiple of {n})"
        )


def _check_stage_work(s: Schedule, st: int, seen: Mapping[tuple[str, int, int], object]) -> None:
    """Every forward, backward and update of stage ``st`` present."""
    for k in range(0, s.num_microbatches, s.group_size(st)):
        if ("F", st, k) not in seen:
            raise ScheduleError(f"drops work: F(stage={st}, mb={k}) is missing")
        full = ("B", st, k) in seen
        split = [kind for kind in "IW" if (kind, st, k) in seen]
        if full and split:
            raise ScheduleError(
                f"repeats work: stage {st}, mb {k} has both B and {'/'.join(split)}; "
                f"use either B or the pair I and W"
            )
        if not full and len(split) < 2:
            lack = "B (or I and W)" if not split else ("W" if split == ["I"] else "I")
            raise ScheduleError(f"drops work: stage {st}, mb {k} has no {lack}")
    for t in range(s.updates_of(st)):
        if ("U", st, t) not in seen:
            raise ScheduleError(f"drops work: U(stage={st}, step={t}) is missing")


# ----------------------------------------------------------------------------- order


class _GroupState:
    """What one device group has run so far, in its list's order."""

    def __init__(self, s: Schedule, group: int) -> None:
        self.forwarded: set[tuple[int, int]] = set()
        self.input_grads: set[tuple[int, int]] = set()
        self.finished: set[tuple[int, int]] = set()
        self.updates = dict.fromkeys(s.stages_of(group), 0)
        self.in_flight = 0


def _check_order(s: Schedule) -> None:
    """Per device group: local order, versions, in-flight and version bounds.

    Runs after :func:`_check_work` (every action a known kind, in range, on its group).
    The checks of :func:`_check_dependencies` and :func:`_check_version` are written out
    for the common case that passes them; where one would fail, the function itself runs
    on the state so far, and raises its error."""
    S = s.num_stages
    units = [s.group_size(st) for st in range(S)]
    per_update = [s.per_update(st) for st in range(S)]
    for d, acts in enumerate(s.actions):
        state = _GroupState(s, d)
        forwarded, input_grads, finished = state.forwarded, state.input_grads, state.finished
        updates, bound = state.updates, s.in_flight_bound[d]
        for pos, a in enumerate(acts):
            kind, st, mb = a.kind, a.stage, a.mb
            if type(mb) is not int:  # another integer type (numpy's): the checks as they are
                _check_dependencies(s, d, pos, a, state)
                _check_version(s, d, pos, a, updates)
                if kind == "U":
                    updates[st] += 1
                continue
            key = (st, mb)
            n = units[st]  # len(s.covers(a)), but for U
            # _check_dependencies
            if kind == "F":
                if state.in_flight + n > bound:
                    _check_dependencies(s, d, pos, a, state)
                forwarded.add(key)
                state.in_flight += n
            elif kind == "B" or kind == "I":
                if key not in forwarded:
                    _check_dependencies(s, d, pos, a, state)
                input_grads.add(key)
            elif kind == "W" and key not in input_grads:
                _check_dependencies(s, d, pos, a, state)
            if kind == "B" or kind == "W":
                finished.update([key] if n == 1 else [(st, k) for k in range(mb, mb + n)])
                state.in_flight -= n
            if kind == "U":
                M = per_update[st]
                if any((st, k) not in finished for k in range(mb * M, (mb + 1) * M)):
                    _check_dependencies(s, d, pos, a, state)
            # _check_version
            done = updates[st]
            required, _ = _required_version(s, a, done, units)
            if a.version != required or required > done:
                _check_version(s, d, pos, a, updates)
            if kind == "U":
                updates[st] += 1
        for stage in s.stages_of(d):
            live = kept_live_versions(s, d, stage)  # live_versions(acts, stage)
            peak = max(live, default=0)
            if peak > s.version_bound[stage]:
                pos = live.index(peak)
                raise ScheduleError(
                    f"{_where(s, d, pos)}: stage {stage} keeps {peak} weight versions here, "
                    f"more than {s.name}'s bound of {s.version_bound[stage]}"
                )


def _check_dependencies(s: Schedule, d: int, pos: int, a: Action, state: _GroupState) -> None:
    """``a`` after what it needs on its own group, within the in-flight bound."""
    key = (a.stage, a.mb)
    if a.kind == "F":
        state.forwarded.add(key)
        state.in_flight += len(s.covers(a))
        if state.in_flight > s.in_flight_bound[d]:
            raise ScheduleError(
                f"{_where(s, d, pos)} exceeds the in-flight bound: "
                f"{state.in_flight} > {s.in_flight_bound[d]} microbatches on the group"
            )
    elif a.kind in "BI":
        if key not in state.forwarded:
            raise ScheduleError(
                f"{_where(s, d, pos)} runs before its forward F(stage={a.stage}, mb={a.mb})"
            )
        state.input_grads.add(key)
    elif a.kind == "W" and key not in state.input_grads:
        raise ScheduleError(
            f"{_where(s, d, pos)} runs before its input gradient I(stage={a.stage}, mb={a.mb})"
        )
    if a.kind in "BW":
        state.finished.update((a.stage, k) for k in s.covers(a))
        state.in_flight -= len(s.covers(a))
    if a.kind == "U":
        M = s.per_update(a.stage)
        for k in range(a.mb * M, (a.mb + 1) * M):
            if (a.stage, k) not in state.finished:
                raise ScheduleError(
                    f"{_where(s, d, pos)} runs before the backward of microbatch {k}, "
                    f"whose gradient it applies"
                )


def _check_version(s: Schedule, d: int, pos: int, a: Action, updates: dict[int, int]) -> None:
    """``a`` uses the version its schedule requires, and that version exists by then."""
    done = updates[a.stage]
    required, why = required_version(s, a, done)
    if a.version != required:
        raise ScheduleError(
            f"{_where(s, d, pos)} uses weight version {a.version}, but {s.name} "
            f"requires version {required}: {why}"
        )
    if required > done:
        raise ScheduleError(
            f"{_where(s, d, pos)} needs weight version {required}, which does not "
            f"exist yet: only {done} updates of stage {a.stage} have run before it"
        )
