"""The simulated page, ``tta-simulated.md``: the headline comparison, why pdjax's plans
differ from the paper's, the method and its caveats, and the table of every schedule."""

from __future__ import annotations

from collections.abc import Sequence

from pdjax.partition import Topology

from .paper import PAPER, PAPER_PLANS
from .simulated import HEADLINE, SIM_CLUSTERS, SIM_MODELS, SimRow, profile_batch


def simulated_table(rows: Sequence[SimRow], dp: dict[tuple[str, str], float]) -> str:
    lines = [
        "| model | cluster | paper (SOSP'19): plan, speedup over DP | run | plan | "
        "planner ms / mb | simulated ms / mb | bubble | **speedup over DP** | "
        "planner's own speedup over DP | peak memory (GB) | planned under 16 GB: plan, "
        "speedup |",
        "|" + "---|" * 12,
    ]
    last = None
    for r in rows:
        key = (r.model, r.cluster)
        if key != last:
            paper = PAPER[key]
            lines.append(
                f"| {r.model} | {r.cluster} | {paper.config}, {paper.speedup} | DP | "
                f"{_cluster_size(r.cluster)} | - | {dp[key] * 1e3:.2f} | - | 1.00 | - | - | - |"
            )
            last = key
        mem = r.peak_memory / 1e9
        lines.append(
            f"| {r.model} | {r.cluster} | | {r.label} | {r.config} | {r.planned * 1e3:.2f} | "
            f"{r.simulated * 1e3:.2f} | {r.bubble:.0%} | **{r.speedup:.2f}** | "
            f"{r.planner_speedup:.2f} | {mem:.1f}{' (> 16)' if mem > 16 else ''} | "
            f"{r.limited} |"
        )
    return "\n".join(lines)


def _cluster_size(cluster: str) -> str:
    return str(Topology.preset(cluster).num_devices)


def _row(rows: Sequence[SimRow], model: str, cluster: str, label: str) -> SimRow:
    (row,) = [r for r in rows if (r.model, r.cluster, r.label) == (model, cluster, label)]
    return row


def _best_flush(rows: Sequence[SimRow], model: str, cluster: str) -> SimRow:
    flush = [_row(rows, model, cluster, name) for name in ("1f1b", "gpipe", "2bw")]
    return max(flush, key=lambda r: r.speedup)


def headline(rows: Sequence[SimRow], flat: dict[str, tuple[str, float]]) -> str:
    """The VGG-16, 4x4 comparison the page leads with, from the rows."""
    key = HEADLINE
    rr = _row(rows, *key, "pipedream")
    split = _row(rows, *key, "pipedream, split only")
    flush = _best_flush(rows, *key)
    paper = _row(rows, *key, "paper's plan, pipedream")
    paper_flush = _row(rows, *key, "paper's plan, 1f1b")
    verdict = (
        "at least as fast as"
        if rr.speedup >= flush.speedup
        else f"**slower** than ({rr.speedup / flush.speedup:.0%} of)"
    )
    return (
        f"**VGG-16 on 4x4 V100 at 10 Gbit/s.** The planner's `pipedream` plan with "
        f"round-robin available is `{rr.config}`: **{rr.speedup:.2f}x** over DP in "
        f"simulation (split only, `{split.config}`: {split.speedup:.2f}x). The best flush "
        f"schedule's plan, {flush.label} `{flush.config}`, reaches **{flush.speedup:.2f}x**: "
        f"`pipedream` is {verdict} it. PipeDream's own 15-1 with round-robin "
        f"(`{paper.config}`, hand-made) simulates at **{paper.speedup:.2f}x** "
        f"({paper_flush.speedup:.2f}x under `1f1b` on the same stages); the paper reports "
        f"{PAPER[key].speedup}. Planned on a flat view of the 16 devices (one level at "
        f"10 Gbit/s, so that a stage may span servers) and simulated on the real cluster, "
        f"`pipedream` gets `{flat['pipedream'][0]}` at {flat['pipedream'][1]:.2f}x and the "
        f"flush schedules "
        + ", ".join(f"{n} `{flat[n][0]}` {flat[n][1]:.2f}x" for n in ("1f1b", "gpipe", "2bw"))
        + (
            _why_slower(rr, flush, flat)
            if rr.speedup < flush.speedup
            else _why_not(rr, flush, flat)
        )
    )


def _why_slower(rr: SimRow, flush: SimRow, flat: dict[str, tuple[str, float]]) -> str:
    """The headline's explanation where ``pipedream``'s plan is slower than a flush one."""
    return (
        ". Why, in pdjax's model: (1) under `pipedream` a round-robin "
        "stage all-reduces once per group of r microbatches; a flush schedule with M = 16 "
        "all-reduces once per 16, so with r <= 16 round-robin saves no all-reduce over "
        "`1f1b`/`2bw`, it only removes their flush bubble, which is small here because the "
        "replicated first stage is the bottleneck (the bubble falls on the last stages); "
        "(2) the planner's hierarchical program replicates whole servers across servers "
        "(12 devices, then the fourth server's own pipeline): it cannot express 15-1, "
        "which spans four servers; (3) the schedule keeps enough groups in flight for "
        "its slowest stage's rate (`pdjax.schedules.round_robin_in_flight`; one "
        f"group more, `extra_in_flight=1`, gives {flat['extra'][1]:.2f}x at "
        f"{flat['extra'][0]} per device), so the gap is the plan's own: the planner "
        f"prices `{rr.config}` under `pipedream` at {rr.planned * 1e3:.2f} ms per "
        f"microbatch and `{flush.config}` under {flush.label} at "
        f"{flush.planned * 1e3:.2f} ms (under `pipedream` each round-robin stage "
        "all-reduces once per group of its r microbatches, under the flush schedules and "
        "`2bw` once per 16)."
    )


def _why_not(rr: SimRow, flush: SimRow, flat: dict[str, tuple[str, float]]) -> str:
    """The headline's explanation where ``pipedream``'s plan is at least as fast."""
    return (
        ". In pdjax's model the planner's hierarchical program replicates whole servers "
        "across servers (12 devices, then the fourth server's own pipeline), so it cannot "
        f"express 15-1, which spans four servers. The planner prices `{rr.config}` under "
        f"`pipedream` at {rr.planned * 1e3:.2f} ms per microbatch (simulated "
        f"{rr.simulated * 1e3:.2f} ms) and `{flush.config}` under {flush.label} at "
        f"{flush.planned * 1e3:.2f} ms (simulated {flush.simulated * 1e3:.2f} ms); one group "
        "more in flight per stage (`extra_in_flight=1`) gives "
        f"{flat['extra'][1]:.2f}x at {flat['extra'][0]} per device."
    )


def write_simulated(
    rows: Sequence[SimRow],
    dp: dict[tuple[str, str], float],
    command: str,
    flat: dict[str, tuple[str, float]],
    table1: Sequence[str] = (),
) -> str:
    return "\n".join(
        [
            "# Hardware efficiency at scale, simulated",
            "",
            f"Command: `{command}`.",
            "",
            *table1,
            *(["", "## Every schedule, per model and cluster", ""] if table1 else []),
            headline(rows, flat),
            "",
            *_method(),
            "**Why pdjax's plans differ from the paper's.**",
            "",
            *differences(rows),
            "",
            *_caveats(),
            simulated_table(rows, dp),
            "",
        ]
    )


def _method() -> list[str]:
    """How the rows are computed: profiles, clusters, replication, DP, the paper column."""
    return [
        'PipeDream\'s published per-layer profiles (`Profile.load("pipedream:NAME")`, '
        "measured on V100s at the profile's minibatch size, used as pdjax's microbatch "
        "size: VGG-16 and ResNet-50 128, AlexNet 256, GNMT "
        f"{profile_batch('gnmt')}) on the SOSP'19 "
        "clusters: **4x4-v100-10gbps** (Cluster-A: 4 servers x 4 V100, 10 GB/s inside a "
        "server, 10 Gbit/s between) and **2x8-v100-25gbps** (Cluster-B: 2 servers x 8 "
        "V100, 100 GB/s NVLink, 25 Gbit/s). For each schedule: `plan_pipedream` (pdjax "
        "cost model, planned for that schedule, `M = 16` microbatches per step, no "
        "memory limit), then `simulate` on `costs_from_plan(plan, profile)` (flush "
        "schedules: one step; `pipedream` and `2bw`: the steady state of a stream).",
        "",
        '**Replication.** `pipedream` is planned with `replication="auto"`: every '
        "replicated stage round-robin (`rr` in the plan: PipeDream's replication, each "
        "device takes whole microbatches, r at once, and the stage all-reduces once per "
        "group of r), which the planner prices cheaper than split under `pipedream`. "
        "`pipedream, split only` is the same schedule planned with split replication "
        "(each microbatch split across the stage's devices, an all-reduce after every "
        "microbatch). The flush schedules and `2bw` split (their all-reduce is once per "
        "step in either mode). **paper's plan** rows evaluate PipeDream's own 15-1 (the "
        "stages of the repository's 16-GPU configuration: stage 1 = the fully connected "
        "layers) under `pipedream` with round-robin and under `1f1b`.",
        "",
        "**DP** is data parallelism on all 16 devices as PipeDream's papers run it: each "
        "device processes one microbatch, then one all-reduce of all the weights (a flat "
        "ring at the slowest level's bandwidth: the simulator's model). It is simulated "
        "as a one-stage plan replicated 16 ways whose microbatch is 16 profile "
        "microbatches, and reported per profile microbatch, like the pipelines. "
        "**speedup over DP** is DP's simulated time per microbatch over the run's. The "
        "planner's own number (`Plan.speedup_over_data_parallel`) is shown next to it: "
        "its DP all-reduces once per round of 16 microbatches under `pipedream` (each "
        "level's ring in turn), once per step of `M = 16` under the others; its "
        "hierarchical all-reduce is faster than the simulator's flat ring.",
        "",
        "**The paper column** quotes Table 1 of the SOSP'19 paper as the task brief gave "
        "it. What could be checked here: the 15-1 configurations of VGG-16 and AlexNet "
        "on 16 GPUs over 4 servers (msr-fiddle/pipedream's "
        "`runtime/image_classification/models/*/gpus=16/hybrid_conf.json` and its "
        "driver configs), the 12-GPU GNMT-8 configuration 1-1-1-1-1-1-1-1-3-1, "
        "ResNet-50 run as DP on 16 GPUs (only `resnet50_16dp.yml` is shipped), and the "
        "abstract's 'up to 5.3x'. The table itself could not be read in the stored "
        "copies of the paper, so every speedup there is marked *not verified*. The "
        "paper's speedups are time to accuracy measured on real clusters (PyTorch, "
        "Gloo/NCCL, per-GPU batch 64 for VGG-16); pdjax's are throughput predicted by "
        "a cost model from profiles at batch 128 against an idealised DP (one flat-ring "
        "all-reduce per round, not overlapped with the backward pass), so they are not "
        "expected to match in size, only in direction.",
        "",
    ]


def _caveats() -> list[str]:
    """What the simulation leaves out, and what a 2-core machine can show."""
    return [
        "Caveats. GPipe keeps all 16 microbatches' activations; peak memory is the "
        "simulator's, and `> 16` marks plans that would not fit a 16 GB V100. A "
        "round-robin stage keeps whole microbatches' activations on every device (q of "
        "them: 2 for a stage of 12 or 15 in front of a small one), at the profile's "
        "batch of 128 about 14 GB each for VGG-16's convolutions, where split keeps "
        "1/r of a microbatch: the first stage of a round-robin VGG-16 plan needs ~28 GB "
        "per device at batch 128 (PipeDream ran batch 64). The last column re-plans "
        "under a 16 GB limit; the planner's memory check is conservative (it assumes "
        "the largest possible in-flight count for a stage before knowing its "
        "position), so it can reject plans that fit. GNMT's `graph.txt` does not say "
        "its batch size; pdjax's reader infers it from the recurrent state sizes "
        f"({profile_batch('gnmt')} for GNMT-8, {profile_batch('gnmt_large')} for GNMT-16). The "
        "simulator gives a "
        "cut the fastest link joining the two stages: for the paper's 15-1 on 4x4 that "
        "is the fourth server's own link, though 12 of stage 0's 15 devices are in "
        "other servers (optimistic for both modes; the first stage is the bottleneck "
        "there: with that cut at 10 Gbit/s the two 15-1 rows change by under 3%).",
        "",
        "**What a 2-core machine can and cannot show.** These numbers are predictions "
        "from measured GPU profiles and a cost model, not measurements: nothing here ran "
        "on a GPU or a network. They show what the planner picks and how the schedules "
        "compare under the model (bubbles, all-reduce volume, cut transfers, memory). "
        "The measured part (`tta.md`) shows statistical efficiency for real, but its "
        "seconds are those of 4 CPU devices sharing 2 cores.",
        "",
    ]


def differences(rows: Sequence[SimRow]) -> list[str]:
    """One bullet per model and cluster: the paper's plan against pdjax's, and why."""
    out = []
    for model in SIM_MODELS:
        for cluster in SIM_CLUSTERS:
            rr = _row(rows, model, cluster, "pipedream")
            paper = PAPER[model, cluster]
            why = WHY[model, cluster]
            out.append(
                f"- **{model}, {cluster}**: paper {paper.config}, {paper.speedup} "
                f"({paper.source}); pdjax `pipedream` plan `{rr.config}`, "
                f"{rr.speedup:.2f}x in simulation. {why}{_compared(rows, model, cluster)}"
            )
    return out


def _compared(rows: Sequence[SimRow], model: str, cluster: str) -> str:
    """The comparisons the bullets make, from the rows: the hand-made 15-1 against the
    planner's plan; for round-robin plans of several stages, the simulated time against
    the planner's and the split-only plan."""
    rr = _row(rows, model, cluster, "pipedream")
    out = ""
    if model in PAPER_PLANS:
        paper = _row(rows, model, cluster, "paper's plan, pipedream")
        flush = _row(rows, model, cluster, "paper's plan, 1f1b")
        best = max(paper.speedup, flush.speedup)
        verdict = "faster than" if best > rr.speedup else "no faster than"
        out += (
            f" Evaluated by hand, the paper's 15-1 ({paper.speedup:.2f}x under `pipedream`, "
            f"{flush.speedup:.2f}x under `1f1b`) is {verdict} the planner's plan in "
            "pdjax's model."
        )
    if "rr-" in rr.config:
        split = _row(rows, model, cluster, "pipedream, split only")
        off = round(rr.simulated / rr.planned - 1, 2) + 0.0  # no "-0%"
        out += (
            f" Here the round-robin plan simulates at {rr.simulated * 1e3:.2f} ms per "
            f"microbatch against the planner's {rr.planned * 1e3:.2f} ms "
            f"({off:+.0%}); the split-only plan `{split.config}` "
            f"({split.speedup:.2f}x) is {'faster' if split.speedup > rr.speedup else 'slower'}."
        )
    return out


#: Why the planner's plan differs from the paper's, per model and cluster (written from
#: the rows of this table; regenerate the numbers with --simulated-only).
_HIERARCHY = (
    "pdjax's planner is PipeDream's hierarchical program: across servers it replicates "
    "only whole servers running the same sub-pipeline, so a stage of 15 devices spread "
    "over the servers is outside its space. "
)
_LOCKSTEP = (
    "The planner's round-robin plan has adjacent stages with different group sizes: the "
    "round-robin schedule runs each stage's r microbatches in lockstep, and where adjacent "
    "group sizes differ its group orders stall even at unit costs with free transfers "
    "(replicas 1 then 2: 4.5 time units per microbatch instead of 3), which the planner's "
    "steady-state model does not see."
)
WHY = {
    ("vgg16", "4x4-v100-10gbps"): _HIERARCHY
    + "Its best plan puts the convolutions on 3 whole servers (12 devices) and pipelines "
    "the fourth.",
    ("vgg16", "2x8-v100-25gbps"): _HIERARCHY
    + "Within its space, at 25 Gbit/s, data parallelism (16 round-robin replicas, i.e. "
    "DP) is the best by its model.",
    ("alexnet", "4x4-v100-10gbps"): _HIERARCHY
    + "As for VGG-16, the convolutions go to 3 whole servers.",
    ("alexnet", "2x8-v100-25gbps"): _HIERARCHY
    + "The planner gives the convolutions one server (8) and pipelines the other.",
    ("resnet50", "4x4-v100-10gbps"): "Same answer: data parallelism (16 round-robin "
    "replicas of the whole model is DP; the planner's own speedup is 1.00x). "
    "ResNet-50's weights are small for its compute, so no pipeline beats DP.",
    ("resnet50", "2x8-v100-25gbps"): "Same answer: data parallelism, as on 4x4.",
    ("gnmt", "4x4-v100-10gbps"): "Not comparable row for row: the paper runs GNMT-8 on 12 "
    "GPUs there (the repository's 12-GPU configuration is a pipeline with one stage of 3 "
    "replicas, close to pdjax's split-only plan). " + _LOCKSTEP,
    ("gnmt", "2x8-v100-25gbps"): "The paper runs GNMT-8 on Cluster-B as DP (not verified); "
    "in pdjax's model, whose DP is idealised (one flat-ring all-reduce per round, not "
    "overlapped), a pipeline is far faster. " + _LOCKSTEP,
}
