"""Lowering: schedules become per-process programs, checked as literal tables, without
devices."""

import pytest

from pdjax.errors import PipelineError
from pdjax.pipeline.lowering import Placement, StagePlace, lower
from pdjax.schedules import SCHEDULES, generate


def _local(P, chunks=1):
    return Placement.local([(s % P,) for s in range(P * chunks)])


def _placed(schedule):
    """One device per group: stage ``s`` on device ``stage_device[s]`` (``zb-v``'s V)."""
    return Placement.local([(d,) for d in schedule.stage_device])


def _schedule(name, P):
    if name == "interleaved":
        return generate(name, P, 2 * P, chunks=2)
    if name == "zb-h2":  # 2P - 1 microbatches fill its warm-up
        return generate(name, P, max(2, 2 * P - 1))
    if name == "pipedream":
        return generate(name, P, 3)
    if name == "2bw":
        return generate(name, P, max(P, 2), stream=2 * max(P, 2))
    return generate(name, P, 2)


# One line per program: KEYS places each stage's microbatch keys; F/B/I/W/U are the
# schedule's actions; FB, FBU, BU are fused (the last stage's forward with its backward,
# a backward with the update after it); MOVE s>t carries an activation or a gradient.
PROGRAMS = {
    ("gpipe", 1): "KEYS0 0F0 0FB1 0BU0",
    ("gpipe", 2): ("KEYS0 KEYS1 0F0 MOVE0>1 0F1 MOVE0>1 1F0 1FB1 MOVE1>0 0B1 1BU0 MOVE1>0 0BU0"),
    ("1f1b", 1): "KEYS0 0FB0 0FBU1",
    ("1f1b", 2): "KEYS0 KEYS1 0F0 MOVE0>1 0F1 MOVE0>1 1FB0 MOVE1>0 0B0 1FBU1 MOVE1>0 0BU1",
    ("zb-h1", 1): "KEYS0 0F0 0I0 0W0 0F1 0I1 0W1 0U0",
    ("zb-h1", 2): (
        "KEYS0 KEYS1 0F0 MOVE0>1 0F1 MOVE0>1 1F0 1I0 MOVE1>0 0I0 1F1 0W0 1I1 MOVE1>0 0I1 "
        "1W0 0W1 1W1 0U0 1U0"
    ),
    ("zb-h2", 2): (
        "KEYS0 KEYS1 0F0 MOVE0>1 0F1 MOVE0>1 1F0 0F2 MOVE0>1 1I0 MOVE1>0 0I0 1F1 0W0 1I1 "
        "MOVE1>0 0I1 1F2 0W1 1I2 MOVE1>0 0I2 1W0 0W2 1W1 0U0 1W2 1U0"
    ),
    # the V on one group: stage 0 hands its output to stage 1 on the same device (a MOVE
    # that only renames the slot)
    ("zb-v", 1): (
        "KEYS0 KEYS1 0F0 MOVE0>1 1F0 1I0 MOVE1>0 1W0 0F1 MOVE0>1 0I0 0W0 1F1 1I1 MOVE1>0 "
        "1W1 0I1 0W1 0U0 1U0"
    ),
    # stages 1 and 2 share group 1, stages 0 and 3 group 0 (both ends of the model)
    ("zb-v", 2): (
        "KEYS0 KEYS1 KEYS2 KEYS3 0F0 MOVE0>1 0F1 MOVE0>1 1F0 MOVE1>2 2F0 MOVE2>3 3F0 1F1 "
        "MOVE1>2 3I0 MOVE3>2 2F1 MOVE2>3 3W0 2I0 MOVE2>1 3F1 2W0 3I1 MOVE3>2 1I0 MOVE1>0 3W1 "
        "1W0 0I0 2I1 MOVE2>1 0W0 2W1 1I1 MOVE1>0 0I1 1W1 0W1 1U0 0U0 2U0 3U0"
    ),
    ("interleaved", 1): (
        "KEYS0 KEYS1 0F0 MOVE0>1 1FB0 MOVE1>0 0F1 MOVE0>1 0B0 1FB1 MOVE1>0 0BU1 1U0"
    ),
    ("pipedream", 1): "KEYS0 0FBU0 0FBU1 0FBU2",
    ("pipedream", 2): (
        "KEYS0 KEYS1 0F0 MOVE0>1 0F1 MOVE0>1 1FBU0 MOVE1>0 0BU0 1FBU1 MOVE1>0 0F2 MOVE0>1 "
        "0BU1 1FBU2 MOVE1>0 0BU2"
    ),
    ("2bw", 1): "KEYS0 0FB0 0FBU1 0FB2 0FBU3",
    ("2bw", 2): (
        "KEYS0 KEYS1 0F0 MOVE0>1 0F1 MOVE0>1 1FB0 MOVE1>0 0B0 1FBU1 MOVE1>0 0F2 MOVE0>1 0BU1 "
        "1FB2 MOVE1>0 0F3 MOVE0>1 0B2 1FBU3 MOVE1>0 0BU3"
    ),
}


@pytest.mark.parametrize("name,P", sorted(PROGRAMS))
def test_programs_as_literal_tables(name, P):
    sched = _schedule(name, P)
    prog = lower(sched, _placed(sched))
    assert prog.kinds() == PROGRAMS[(name, P)]


def test_one_program_in_full():
    """Every slot: which weight version each op reads, where inputs come from, what is
    dropped where (the caller's slots too), and the fused programs' flags."""
    prog = lower(generate("1f1b", 2, 2), _local(2))
    assert prog.table().splitlines() == [
        "KEYS       0    rng0 offset -> key0.0 key0.1 | free rng0",
        "KEYS       1    rng1 offset -> key1.0 key1.1 | free rng1 offset",
        "F          0    w0v0 st0 x0.0 key0.0 -> y0.0 st0.0 r0.0 | free st0 key0.0",
        "MOVE       0>1  y0.0 -> x1.0 | free y0.0",
        "F          0    w0v0 st0.0 x0.1 key0.1 -> y0.1 st0.1 r0.1 | free st0.0 key0.1",
        "MOVE       0>1  y0.1 -> x1.1 | free y0.1",
        "FB         1    w1v0 st1 x1.0 key1.0 t0 -> loss0 st1.0 g1.0 e1.0 | free st1 x1.0 "
        "key1.0 t0",
        "MOVE       1>0  e1.0 -> d0.0 | free e1.0",
        "B          0    w0v0 x0.0 r0.0 d0.0 -> g0.0 | free x0.0 r0.0 d0.0",
        "FBU+acc+newest 1    w1v0 st1.0 x1.1 key1.1 t1 g1.0 o1v0 -> loss1 st1.1 w1v1 o1v1 "
        "e1.1 | free w1v0 st1.0 x1.1 key1.1 t1 g1.0 o1v0",
        "MOVE       1>0  e1.1 -> d0.1 | free e1.1",
        "BU+acc+newest 0    w0v0 x0.1 r0.1 d0.1 g0.0 o0v0 -> w0v1 o0v1 | free w0v0 x0.1 "
        "r0.1 d0.1 g0.0 o0v0",
    ]
    assert prog.outputs == (("w0v1", "o0v1", "st0.1", "w1v1", "o1v1", "st1.1", "loss0", "loss1"),)
    assert prog.peak_versions == (1, 1)


def test_remat_keeps_what_recomputing_needs():
    prog = lower(generate("1f1b", 2, 2), _local(2), remat=True)
    lines = prog.table().splitlines()
    assert lines[2] == "F+recompute 0    w0v0 st0 x0.0 key0.0 -> y0.0 st0.0"  # no residuals
    # the backward recomputes from the input, the state before the forward and its key
    assert lines[8] == (
        "B+recompute 0    w0v0 x0.0 st0 key0.0 d0.0 -> g0.0 | free x0.0 st0 key0.0 d0.0"
    )


def test_remat_per_stage_recomputes_only_where_asked():
    schedule = generate("1f1b", 3, 3)
    prog = lower(schedule, _local(3), remat=(False, True, False))
    kinds = {(op.stage, op.kind, "recompute" in op.flags) for op in prog.ops[0]}
    assert (0, "F", False) in kinds and (0, "B", False) in kinds  # stage 0 keeps residuals
    assert not any(s != 1 and r for s, _, r in kinds)
    assert (1, "F", True) in kinds and (1, "B", True) in kinds  # stage 1 recomputes
    # the same stage as with remat everywhere
    every = lower(schedule, _local(3), remat=True)
    assert [str(op) for op in prog.ops[0] if op.stage == 1] == [
        str(op) for op in every.ops[0] if op.stage == 1
    ]
    with pytest.raises(PipelineError, match="3 flags for 2 stages"):
        lower(generate("1f1b", 2, 2), _local(2), remat=(True, False, True))


def test_pipedream_without_stashing_recomputes_at_the_newest_weights():
    prog = lower(generate("pipedream", 2, 3, weight_stashing=False), _local(2))
    ops = [op for op in prog.ops[0] if op.stage == 0 and op.kind in ("F", "BU")]
    # stage 0: microbatch 0's backward runs at the version its forward used (residuals
    # kept); microbatch 2's forward at version 1, its backward at version 2, recomputed
    assert [(op.kind, op.mb, op.version, "recompute" in op.flags) for op in ops] == [
        ("F", 0, 0, False),
        ("F", 1, 0, True),
        ("BU", 0, 0, False),
        ("F", 2, 1, True),
        ("BU", 1, 1, True),
        ("BU", 2, 2, True),
    ]
    assert prog.peak_versions == (1, 1)


def test_updates_donate_the_weights_they_replace_only_where_allowed():
    """pipedream P = 1: from the second update on, the fused update reuses the replaced
    version's buffers (never the caller's version 0); off where donating blocks (CPU)."""
    sched = generate("pipedream", 1, 3)
    flags = [sorted(op.flags) for op in lower(sched, _local(1)).ops[0] if op.kind == "FBU"]
    assert flags == [["newest"], ["donate_w", "newest"], ["donate_w", "newest"]]
    kept = lower(sched, _local(1), donate_weights=False)
    assert not any("donate_w" in op.flags for op in kept.ops[0])


def test_waits_and_callbacks_are_operations():
    prog = lower(
        generate("1f1b", 2, 2),
        Placement.local([(0, 1), (2, 3)]),
        one_at_a_time=(True, True),
        run_ahead=1,
        on_loss=True,
    )
    assert prog.kinds() == (
        "KEYS0 KEYS1 0F0 SYNC0 MOVE0>1 0F1 SYNC0 MOVE0>1 1FB0 SYNC1 LOSS0 MOVE1>0 0B0 SYNC0 "
        "1FBU1 SYNC1 LOSS1 WAIT0 MOVE1>0 0BU1 SYNC0"
    )


def test_two_processes_send_and_receive_in_the_same_order():
    placement = Placement((StagePlace((0,), (0,)), StagePlace((1,), (1,))), "cpu", "device_put", 2)
    prog = lower(generate("1f1b", 2, 2), placement)
    assert prog.kinds(0) == "KEYS0 0F0 SEND0>1 0F1 SEND0>1 RECV1>0 0B0 RECV1>0 0BU1"
    assert prog.kinds(1) == "KEYS1 RECV0>1 RECV0>1 1FB0 SEND1>0 1FBU1 SEND1>0"
    assert prog.inputs[1] == ("offset", "w1v0", "o1v0", "st1", "rng1", "t0", "t1")
    assert prog.outputs[0] == ("w0v1", "o0v1", "st0.1")


def test_global_norm_exchange_moves_updates_after_every_sum():
    prog = lower(generate("1f1b", 2, 2), _local(2), coupled=True)
    assert prog.kinds().endswith("1FB1 MOVE1>0 0B1 1SQ0 MOVE1>0 0SQ0 MOVE0>1 1U0 0U0")
    u1 = next(op for op in prog.ops[0] if op.kind == "U" and op.stage == 1)
    assert u1.ins == ("g1.1", "w1v0", "o1v0", "q0.0@1")


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("P", [1, 2, 4])
def test_every_schedule_lowers_to_a_consistent_program(name, P):
    """Each slot is written once, read only after it is written, dropped after its last
    read; weight versions alive never exceed what the schedule keeps."""
    sched = _schedule(name, P)
    prog = lower(sched, _placed(sched))
    (ops,) = prog.ops
    alive = set(prog.inputs[0])
    written = set()
    for op in ops:
        missing = [s for s in op.ins if s not in alive]
        assert not missing, f"{op} reads {missing} before they are written or after a free"
        for s in op.outs:
            assert s not in written, f"{s} written twice"
            written.add(s)
            alive.add(s)
        alive -= set(op.frees)
    assert alive == set(prog.outputs[0])
    assert all(p <= b for p, b in zip(prog.peak_versions, sched.version_bound, strict=True))
    assert prog.actions == sum(len(g) for g in sched.actions)


def test_programs_that_cannot_run_are_refused_at_lowering():
    three = Placement(tuple(StagePlace((i,), (i,)) for i in range(3)), "cpu", "device_put", 3)
    with pytest.raises(PipelineError, match=r"spans 3 processes .* transport='collective'"):
        lower(generate("1f1b", 3, 3), three)
    lower(generate("1f1b", 3, 3), Placement(three.stages, "cpu", "collective", 3))
    with pytest.raises(PipelineError, match="unknown transport"):
        lower(generate("1f1b", 1, 1), Placement(_local(1).stages, "cpu", "carrier-pigeon"))
    with pytest.raises(PipelineError, match="placement has 1 stages, the schedule 2"):
        lower(generate("1f1b", 2, 2), _local(1))


def test_zb_v_turn_stays_on_its_devices_across_processes():
    """zb-v's turn (stage P - 1 to P) and any hand-over between two stages on the same
    devices is a MOVE in every process that holds them, never a send: the value is already
    there, it only changes slot. Between groups the usual SEND/RECV pairs remain."""
    sched = generate("zb-v", 2, 2)
    two = Placement(
        (
            StagePlace((0,), (0,)),
            StagePlace((1,), (1,)),
            StagePlace((1,), (1,)),
            StagePlace((0,), (0,)),
        ),
        "cpu",
        "device_put",
        2,
    )
    prog = lower(sched, two)
    first, second = prog.kinds(0).split(), prog.kinds(1).split()
    assert "MOVE1>2" in second and "MOVE1>2" not in first
    assert not any(k.startswith(("SEND1>2", "RECV1>2")) for k in first + second)
    assert first.count("SEND0>1") == 2 and second.count("RECV0>1") == 2
    assert first.count("RECV2>3") == 2 and second.count("SEND2>3") == 2
    # a group spanning both processes: each takes part in the turn as a plain MOVE
    wide = Placement(
        (
            StagePlace((0,), (0,)),
            StagePlace((1, 2), (0, 1)),
            StagePlace((1, 2), (0, 1)),
            StagePlace((0,), (0,)),
        ),
        "cpu",
        "device_put",
        2,
    )
    prog = lower(sched, wide)
    for p in (0, 1):
        kinds = prog.kinds(p).split()
        assert kinds.count("MOVE1>2") == 2
        assert not any(
            op.kind == "SENDRECV" and (op.stage, op.peer) == (1, 2) for op in prog.ops[p]
        )
