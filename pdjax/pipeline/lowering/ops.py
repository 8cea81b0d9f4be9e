"""The operations of a schedule, for every process together, in its unit-time clock order.

:func:`global_ops` walks the schedule's actions tick by tick and turns each into the
operations of :mod:`pdjax.pipeline.lowering.program`'s table: one helper per action kind (forward,
the last stage's fused forward-backward, backward ``B``/``I``/``W``, update ``U``) and the
transfers, gathers and parts around them. :func:`~pdjax.pipeline.lowering.lower` then orders,
splits per process and annotates these operations.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdjax.errors import PipelineError
from pdjax.pipeline.lowering.types import OFFSET, Op, OpFlag, OpKind, Slot, SlotKind
from pdjax.schedules import Action, Schedule

__all__ = ["global_ops"]


def global_ops(
    schedule: Schedule,
    *,
    remat: Sequence[bool],
    fuse: bool,
    coupled: bool,
    run_ahead: int | None,
    on_loss: bool,
    tied: Sequence[tuple[int, ...]] = (),
) -> list[Op]:
    """The operations of every process, in the schedule's unit-time clock order.

    Args:
      schedule: a validated schedule.
      remat: per stage, whether its backward recomputes the forward (its memory policy is
        ``"full"``; the other policies keep residuals and lower as ``"none"`` does).
      fuse: fuse a backward with the update that follows it, and on the last stage a
        forward with its backward.
      coupled: updates wait for every stage's gradient sum of squares.
      run_ahead: the driver waits for microbatch ``k - run_ahead``'s loss after
        dispatching microbatch ``k``'s (None: never).
      on_loss: report each loss as it is dispatched (``LOSS`` operations).
      tied: per tied group across stages, its stages ascending (the first owns it).

    Returns:
      The operations, before any reordering by data dependencies.
    """
    lowering = _Lowering(
        schedule,
        remat=remat,
        fuse=fuse,
        coupled=coupled,
        run_ahead=run_ahead,
        on_loss=on_loss,
        tied=tied,
    )
    order = sorted(
        (tick, g, i) for g, ticks in enumerate(schedule.clock()) for i, tick in enumerate(ticks)
    )
    for _, g, i in order:
        if (g, i) in lowering.skip:
            continue
        acts = schedule.actions[g]
        kind = acts[i].kind
        if kind == "F":  # schedule actions' kinds are the schedule's letters
            lowering.forward(acts, g, i)
        elif kind in ("B", "I", "W"):
            lowering.backward(acts, g, i)
        else:  # U
            lowering.update(acts[i])
    return lowering.ops


class _Lowering:
    """What the walk over the actions knows so far: each stage's newest weight version,
    model state slot, running gradient sum and updates, and the operations made."""

    def __init__(
        self,
        schedule: Schedule,
        *,
        remat: Sequence[bool],
        fuse: bool,
        coupled: bool,
        run_ahead: int | None,
        on_loss: bool,
        tied: Sequence[tuple[int, ...]],
    ) -> None:
        S, N = schedule.num_stages, schedule.num_microbatches
        self.S, self.last = S, S - 1
        self.remat, self.fuse, self.coupled = remat, fuse, coupled
        self.run_ahead, self.on_loss = run_ahead, on_loss
        # tied groups across stages: per stage, the owners it sends gradients to (and gets
        # new values from), and the holders of the groups it owns (the other way round)
        self.owners = [sorted({h[0] for h in tied if s in h[1:]}) for s in range(S)]
        self.members = [sorted({r for h in tied if h[0] == s for r in h[1:]}) for s in range(S)]
        # an update that waits for other stages' values is not fused with a backward
        self.unfused = [coupled or bool(self.owners[s] or self.members[s]) for s in range(S)]
        self.n_of = [schedule.group_size(s) for s in range(S)]
        self.rr = [n > 1 for n in self.n_of]
        self.latest = [0] * S
        self.state = [Slot(SlotKind.STATE, s) for s in range(S)]
        self.state_before: dict[tuple[int, int], Slot] = {}
        self.forward_version: dict[tuple[int, int], int] = {}
        self.backward_version = {
            (a.stage, a.mb): a.version for g in schedule.actions for a in g if a.kind in "BI"
        }
        self.acc: list[Slot | None] = [None] * S
        self.updates = [0] * S
        self.skip: set[tuple[int, int]] = set()  # (group, index) fused into an earlier op
        self.ops: list[Op] = [
            Op(
                OpKind.KEYS,
                s,
                outs=tuple(
                    Slot(SlotKind.KEY, s, k, group=self.rr[s]) for k in range(0, N, self.n_of[s])
                ),
                ins=(Slot(SlotKind.RNG, s), OFFSET),
            )
            for s in range(S)
        ]

    # ------------------------------------------------------------------------- actions

    def forward(self, acts: Sequence[Action], g: int, i: int) -> None:
        """``F`` (on the last stage, fused with the ``B`` after it where it can be)."""
        a = acts[i]
        s, k, v = a.stage, a.mb, a.version
        nxt = acts[i + 1] if i + 1 < len(acts) else None
        self.forward_version[(s, k)] = v
        self.state_before[(s, k)] = self.state[s]
        if s > 0:
            self.ops += self.gathered(SlotKind.X, s, k)
        if (
            s == self.last
            and self.fuse
            and nxt is not None
            and nxt.kind == "B"
            and (nxt.stage, nxt.mb, nxt.version) == (s, k, v)
        ):
            self.forward_backward(acts, g, i)
            return
        new_state = Slot(SlotKind.STATE, s, k)
        recompute = self.remat[s] or self.backward_version[(s, k)] != v
        out = self.loss_slot(s, k) if s == self.last else self.name(SlotKind.Y, s, k)
        tgt = (self.target(s, k),) if s == self.last else ()
        res = () if recompute else (Slot(SlotKind.RESIDUALS, s, k),)
        self.ops.append(
            Op(
                kind=OpKind.F,
                stage=s,
                mb=k,
                version=v,
                flags=frozenset({OpFlag.RECOMPUTE}) if recompute else frozenset(),
                ins=(
                    _w(s, v),
                    self.state[s],
                    self.name(SlotKind.X, s, k),
                    self.name(SlotKind.KEY, s, k),
                    *tgt,
                ),
                outs=(out, new_state, *res),
                actions=(a,),
            )
        )
        self.state[s] = new_state
        if s == self.last:
            self.ops += self.losses(s, k) if self.rr[s] else self.loss_ops(k)
        else:
            pieces = [Slot(SlotKind.Y, s, j) for j in self.covered(s, k)]
            self.ops += self.parted(out, s, k, pieces)
            for j in self.covered(s, k):
                self.ops += self.moved(
                    Slot(SlotKind.Y, s, j), Slot(SlotKind.X, s + 1, j), s, s + 1, j
                )

    def forward_backward(self, acts: Sequence[Action], g: int, i: int) -> None:
        """The last stage's ``F`` and ``B`` of one microbatch as ``FB`` (``FBU`` with the
        update after them)."""
        a, nxt = acts[i], acts[i + 1]
        nxt2 = acts[i + 2] if i + 2 < len(acts) else None
        s, k, v = a.stage, a.mb, a.version
        self.skip.add((g, i + 1))
        new_state = Slot(SlotKind.STATE, s, k)
        acc = self.acc[s]
        g_in = (acc,) if acc else ()
        flags = {OpFlag.ACC} if acc else set()
        e = () if s == 0 else (self.name(SlotKind.E, s, k),)
        ins = (
            _w(s, v),
            self.state[s],
            self.name(SlotKind.X, s, k),
            self.name(SlotKind.KEY, s, k),
            self.target(s, k),
            *g_in,
        )
        if not self.unfused[s] and nxt2 is not None and nxt2.kind == "U" and nxt2.stage == s:
            self.skip.add((g, i + 2))
            tail, more = self.update_tail(s, v)
            w2, o2 = self.after_update(s)
            op = Op(
                kind=OpKind.FBU,
                stage=s,
                mb=k,
                version=v,
                flags=frozenset(flags | more),
                ins=ins + tail,
                outs=(self.loss_slot(s, k), new_state, w2, o2, *e),
                actions=(a, nxt, nxt2),
            )
        else:
            self.acc[s] = gsum = Slot(SlotKind.GRADS, s, k)
            op = Op(
                kind=OpKind.FB,
                stage=s,
                mb=k,
                version=v,
                flags=frozenset(flags),
                ins=ins,
                outs=(self.loss_slot(s, k), new_state, gsum, *e),
                actions=(a, nxt),
            )
        self.ops.append(op)
        self.state[s] = new_state
        self.ops += self.losses(s, k) if self.rr[s] else self.loss_ops(k)
        if s > 0:
            self.ops += self.sent_back(s, k)

    def backward(self, acts: Sequence[Action], g: int, i: int) -> None:
        """``B`` (``BU`` fused with the update after it where it can be), ``I`` or ``W``."""
        a = acts[i]
        s, k, v = a.stage, a.mb, a.version
        recompute = self.remat[s] or self.forward_version[(s, k)] != v
        flags = {OpFlag.RECOMPUTE} if recompute else set()
        reads = (_w(s, v), self.name(SlotKind.X, s, k), *self.residual_args(s, k, recompute))
        d = () if s == self.last else (self.name(SlotKind.D, s, k),)
        e = () if s == 0 else (self.name(SlotKind.E, s, k),)
        if s < self.last:
            self.ops += self.gathered(SlotKind.D, s, k)
        if a.kind == "I":
            self.ops.append(
                Op(
                    kind=OpKind.I,
                    stage=s,
                    mb=k,
                    version=v,
                    flags=frozenset(flags),
                    ins=reads + d,
                    outs=(*e, Slot(SlotKind.COTANGENTS, s, k)),
                    actions=(a,),
                )
            )
        else:
            acc = self.acc[s]
            g_in = (acc,) if acc else ()
            if acc:
                flags.add(OpFlag.ACC)
            if a.kind == "W":
                self.acc[s] = gsum = Slot(SlotKind.GRADS, s, k)
                self.ops.append(
                    Op(
                        kind=OpKind.W,
                        stage=s,
                        mb=k,
                        version=v,
                        flags=frozenset(flags),
                        ins=(*reads, Slot(SlotKind.COTANGENTS, s, k), *g_in),
                        outs=(gsum,),
                        actions=(a,),
                    )
                )
                return
            nxt = acts[i + 1] if i + 1 < len(acts) else None
            self.ops.append(
                self.gradient(a, nxt=nxt, at=(g, i), flags=flags, ins=reads + d + g_in, e=e)
            )
        if s > 0:
            self.ops += self.sent_back(s, k)

    def gradient(
        self,
        a: Action,
        *,
        nxt: Action | None,
        at: tuple[int, int],
        flags: set[OpFlag],
        ins: tuple[Slot, ...],
        e: tuple[Slot, ...],
    ) -> Op:
        """A ``B`` whose inputs are ``ins``: as ``BU`` with the update ``nxt`` where that
        follows on the same stage and may be fused (``at``: ``a``'s group and index)."""
        s, k, v = a.stage, a.mb, a.version
        if (
            self.fuse
            and not self.unfused[s]
            and nxt is not None
            and nxt.kind == "U"
            and nxt.stage == s
        ):
            self.skip.add((at[0], at[1] + 1))
            tail, more = self.update_tail(s, v)
            w2, o2 = self.after_update(s)
            return Op(
                kind=OpKind.BU,
                stage=s,
                mb=k,
                version=v,
                flags=frozenset(flags | more),
                ins=ins + tail,
                outs=(w2, o2, *e),
                actions=(a, nxt),
            )
        self.acc[s] = gsum = Slot(SlotKind.GRADS, s, k)
        return Op(
            kind=OpKind.B,
            stage=s,
            mb=k,
            version=v,
            flags=frozenset(flags),
            ins=ins,
            outs=(gsum, *e),
            actions=(a,),
        )

    def update(self, a: Action) -> None:
        """``U``, with the exchanges around it: tied gradients to their owners (``TG``),
        sums of squares to every stage (``SQ``), new tied values to their holders."""
        s, v = a.stage, a.version
        if v != self.latest[s]:
            raise PipelineError(
                f"{a.describe()} expects version {v}, stage {s} is at {self.latest[s]}"
            )
        grads = self.acc[s]
        if grads is None:
            raise PipelineError(f"{a.describe()} has no gradient to apply")
        n = self.latest[s]
        u = self.updates[s]
        owners, members = self.owners[s], self.members[s]
        if owners:  # this stage's tied gradients, to each owner of a group it holds
            sums = tuple(Slot(SlotKind.TIED_GRADS, s, u, to=o) for o in owners)
            self.ops.append(Op(OpKind.TG, s, u, ins=(grads,), outs=sums))
            for o, made in zip(owners, sums, strict=True):
                self.ops += self.moved(made, made.evolve(to=-1, at=o), s, o, u, part=False)
        tied_in = tuple(Slot(SlotKind.TIED_GRADS, r, u, at=s) for r in members)
        new_in = tuple(Slot(SlotKind.TIED_VALUES, o, u, to=s, at=s) for o in owners)
        norms: tuple[Slot, ...] = ()
        if self.coupled:
            # every stage's sum of squares for this update, on this stage's devices
            norms = tuple(Slot(SlotKind.SQUARES, r, u, at=s) for r in range(self.S) if r != s)
            mine = Slot(SlotKind.SQUARES, s, u)
            self.ops.append(Op(OpKind.SQ, s, u, ins=(grads, *tied_in), outs=(mine,)))
            for r in range(self.S):
                if r != s:
                    self.ops += self.moved(mine, mine.evolve(at=r), s, r, u, part=False)
        w2, o2 = self.after_update(s)
        sent = tuple(Slot(SlotKind.TIED_VALUES, s, u, to=r) for r in members)
        self.ops.append(
            Op(
                kind=OpKind.U,
                stage=s,
                mb=a.mb,
                version=n,
                flags=frozenset(),
                ins=(grads, _w(s, n), _o(s, n), *tied_in, *new_in, *norms),
                outs=(w2, o2, *sent),
                actions=(a,),
            )
        )
        for r, value in zip(members, sent, strict=True):
            self.ops += self.moved(value, value.evolve(at=r), s, r, u, part=False)

    # ------------------------------------------------------------------------- slots

    def name(self, kind: SlotKind, s: int, k: int) -> Slot:
        """A stage's slot for microbatch ``k`` (a round-robin stage's: the group's)."""
        return Slot(kind, s, k, group=self.rr[s])

    def target(self, s: int, k: int) -> Slot:
        return Slot(SlotKind.TARGET, s, k, group=self.rr[s])

    def loss_slot(self, s: int, k: int) -> Slot:
        return Slot(SlotKind.LOSS, s, k, group=self.rr[s])

    def covered(self, s: int, k: int) -> range:
        return range(k, k + self.n_of[s])

    def residual_args(self, s: int, k: int, recompute: bool) -> tuple[Slot, ...]:
        if recompute:
            extra = (self.target(s, k),) if s == self.last else ()
            return (self.state_before[(s, k)], self.name(SlotKind.KEY, s, k), *extra)
        return (Slot(SlotKind.RESIDUALS, s, k),)

    def update_tail(self, s: int, read_version: int) -> tuple[tuple[Slot, ...], frozenset[OpFlag]]:
        """(extra inputs, flags) of a fused update after a backward at ``read_version``."""
        n = self.latest[s]
        if read_version == n:
            return (_o(s, n),), frozenset({OpFlag.NEWEST})
        return (_w(s, n), _o(s, n)), frozenset()

    def after_update(self, s: int) -> tuple[Slot, Slot]:
        self.latest[s] += 1
        self.updates[s] += 1
        self.acc[s] = None
        return _w(s, self.latest[s]), _o(s, self.latest[s])

    # ------------------------------------------------------------------------- moves

    def moved(
        self, slot_from: Slot, slot_to: Slot, src: int, dst: int, mb: int, part: bool = True
    ) -> list[Op]:
        sp, dp = (mb % self.n_of[t] if part and self.rr[t] else -1 for t in (src, dst))
        return [
            Op(OpKind.MOVE, src, mb, ins=(slot_from,), outs=(slot_to,), peer=dst, part=(sp, dp))
        ]

    def gathered(self, kind: SlotKind, s: int, k: int) -> list[Op]:
        """A round-robin stage's group value from the pieces on its devices."""
        if not self.rr[s]:
            return []
        pieces = tuple(Slot(kind, s, j) for j in range(k, k + self.n_of[s]))
        return [Op(OpKind.GATHER, s, k, ins=pieces, outs=(Slot(kind, s, k, group=True),))]

    def parted(self, slot: Slot, s: int, k: int, pieces: list[Slot]) -> list[Op]:
        return [Op(OpKind.PART, s, k, ins=(slot,), outs=tuple(pieces))] if self.rr[s] else []

    def sent_back(self, s: int, k: int) -> list[Op]:
        """The input gradient of stage ``s > 0`` to stage ``s - 1``, piece by piece."""
        pieces = [Slot(SlotKind.E, s, j) for j in self.covered(s, k)]
        out = self.parted(Slot(SlotKind.E, s, k, group=True), s, k, pieces)
        for j in self.covered(s, k):
            out += self.moved(Slot(SlotKind.E, s, j), Slot(SlotKind.D, s - 1, j), s, s - 1, j)
        return out

    def losses(self, s: int, k: int) -> list[Op]:
        pieces = [Slot(SlotKind.LOSS, self.last, j) for j in self.covered(s, k)]
        out = self.parted(Slot(SlotKind.LOSS, s, k, group=True), s, k, pieces)
        for j in self.covered(s, k):
            out += self.loss_ops(j)
        return out

    def loss_ops(self, k: int) -> list[Op]:
        out = []
        if self.on_loss:
            out.append(Op(OpKind.LOSS, self.last, k, ins=(Slot(SlotKind.LOSS, self.last, k),)))
        if self.run_ahead is not None and k - self.run_ahead >= 0:
            k0 = k - self.run_ahead
            out.append(Op(OpKind.WAIT, self.last, k0, ins=(Slot(SlotKind.LOSS, self.last, k0),)))
        return out


def _w(s: int, n: int) -> Slot:
    """Stage ``s``'s weights, version ``n``."""
    return Slot(SlotKind.WEIGHTS, s, n)


def _o(s: int, n: int) -> Slot:
    """Stage ``s``'s optimizer state after the update that made version ``n``."""
    return Slot(SlotKind.OPT, s, n)
