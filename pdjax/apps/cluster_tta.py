"""Time to accuracy on the cluster: PipeDream's headline, measured on 2 pinned workers.

PipeDream's claim is time to accuracy (TTA): hardware efficiency (samples per second)
times statistical efficiency (epochs to the target). :func:`run_tta` measures the product:
each run trains a real model on real data to a target test accuracy in 2 single-core
worker processes joined by ``jax.distributed`` on an emulated link (as
:mod:`pdjax.apps.cluster`: each worker in a network namespace of its own, a token bucket each
way; loopback without root), through :func:`pdjax.apps.train.train` itself. Per study
(:data:`STUDIES`: a parameter-heavy VGG on digits, the tiny GPT on Python's docs), per
link rate and seed, the runners are:

- ``single``: one worker alone (one jitted step per batch; no link);
- ``single-mb``: one worker alone, updating after every microbatch (a batch of one
  microbatch): the control for ``pipedream``, which updates that often too, so that its
  epochs to target show what stale weights cost apart from what more, smaller updates
  gain;
- ``dp``: data parallelism on both workers (each half of every batch, then an all-reduce
  of the gradients over the link);
- ``pipedream``, ``1f1b``, ``2bw``: 2-stage pipelines, one stage per worker, cut where
  :func:`~pdjax.partition.plan_auto` puts it for that schedule (``pipedream``: also its
  microbatches in flight), from *calibrated* costs: the candidate stages timed as
  programs on a pinned worker, the link and the gradient all-reduce measured on the
  emulated link itself.

Every runner of a seed starts from the same weights (``jax.random.key(seed)``), sees the
same batches in the same order (the seed's shuffle), uses the same optimizer (Adam) and
the same batch (``M = 4`` microbatches per step; ``pipedream`` updates after every
microbatch, as PipeDream does). Evaluation (the test split after every epoch) is not
counted in the training seconds; compilation neither (a warm-up first).

Each run's result is written (atomically) as it finishes, under ``out``; a rerun skips
the runs, profiles, link measurements and plans already there, so a killed benchmark
continues where it stopped. :func:`report` turns the folder into ``tta.md``, ``tta.json``
and one accuracy-vs-seconds plot per study and link.

Run it with ``pdjax bench --cluster --tta`` or ``python benchmarks/cluster/tta.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdjax._jsonio import write_atomic
from pdjax.apps.cluster import ClusterError, cluster_model
from pdjax.errors import PdjaxError

__all__ = [
    "ALONE",
    "LINKS",
    "PIPELINES",
    "RUNNERS",
    "STUDIES",
    "TTAStudy",
    "cluster_spec",
    "report",
    "run_tta",
]

#: Link rates (Mbit/s each way): the paper's slow cloud network, 1 and 10 Gbit Ethernet.
LINKS: tuple[float, ...] = (100.0, 1000.0, 10000.0)
#: The pipelines' schedules (``pipedream`` and ``2bw`` train on stale weights).
PIPELINES: tuple[str, ...] = ("pipedream", "1f1b", "2bw")
#: The runners on one worker (no link).
ALONE: tuple[str, ...] = ("single", "single-mb")
#: Every runner, in table order.
RUNNERS: tuple[str, ...] = (*ALONE, "dp", *PIPELINES)
#: Microbatches per batch (per optimizer step of ``dp``, ``1f1b`` and ``2bw``).
M = 4
#: Seconds one launch may take at most (a run that long is cut and reported as such).
RUN_TIMEOUT = 1200.0


def cluster_spec(config: str) -> Any:
    """A :data:`pdjax.apps.cluster.CLUSTER_MODELS` model as a model factory, named by
    ``config``: e.g. ``pdjax train --model pdjax.apps.cluster_tta:cluster_spec --config
    vgg-digits`` (what the runs train)."""
    return cluster_model(config)


@dataclasses.dataclass(frozen=True)
class TTAStudy:
    """One model on one dataset: its training settings and target.

    Attributes:
      name: the study's model, a :data:`pdjax.apps.cluster.CLUSTER_MODELS` key (what is
        profiled, and what the runs train through :func:`cluster_spec`).
      dataset: ``digits`` or ``text``.
      batch_size: samples per step (``M`` microbatches).
      learning_rate: Adam's step size.
      epochs: the budget; a run that has not reached the target by then stops.
      target: test accuracy to reach.
      why: where the target comes from.
    """

    name: str
    dataset: str
    batch_size: int
    learning_rate: float
    epochs: int
    target: float
    why: str

    @property
    def microbatch(self) -> int:
        return self.batch_size // M

    def config(self, runner: str, seed: int, plan: str = "even", extra: int = 0) -> Any:
        """The :class:`~pdjax.apps.train.TrainConfig` of ``runner`` (``plan``: a plan file)."""
        from pdjax.apps.train import TrainConfig

        pipeline = runner in PIPELINES
        per_mb = runner == "single-mb"
        return TrainConfig(
            model=f"{__name__}:cluster_spec",
            config=self.name,
            dataset=self.dataset,
            schedule=runner if pipeline else "dp",
            devices=1 if runner in ALONE else 2,
            plan=plan if pipeline else "even",
            epochs=self.epochs,
            batch_size=self.microbatch if per_mb else self.batch_size,
            microbatches=1 if per_mb else M,
            optimizer="adam",
            learning_rate=self.learning_rate,
            seed=seed,
            target_accuracy=self.target,
            extra_in_flight=extra if runner == "pipedream" else 0,
        )


STUDIES: dict[str, TTAStudy] = {
    "vgg-digits": TTAStudy(
        name="vgg-digits",
        dataset="digits",
        batch_size=128,
        learning_rate=1e-3,
        epochs=12,
        target=0.95,
        why="0.95 test accuracy (one worker: 0.947 after 3 epochs, 0.975 after 5)",
    ),
    "gpt-text": TTAStudy(
        name="gpt-text",
        dataset="text",
        batch_size=256,
        learning_rate=3e-3,
        epochs=6,
        target=0.44,
        why="0.44 next-character accuracy (one worker: 0.444 after 3 epochs, 0.49 after 6)",
    ),
}


def link_key(rate_mbit: float | None) -> str:
    """A link's name in file names and tables: ``100M``, ``1G``, ``10G``; ``none``."""
    if rate_mbit is None:
        return "none"
    if rate_mbit >= 1000 and rate_mbit % 1000 == 0:
        return f"{rate_mbit / 1000:g}G"
    return f"{rate_mbit:g}M"


def _link_text(rate_mbit: float | None) -> str:
    from pdjax.apps.cluster import _link

    return "loopback" if rate_mbit is None else _link(rate_mbit)


# -- inside a worker ----------------------------------------------------------------------


def _tta_job(job: Mapping[str, Any]) -> None:
    """Every process of a run: trains (:func:`pdjax.apps.train.train`); process 0 writes the
    result to ``job["out"]``."""
    from pdjax.distributed import config_from_env, initialize

    config = config_from_env()
    if config is not None and config.num_processes > 1:
        initialize(config)
    import jax

    from pdjax.apps.train import TrainConfig, train

    cfg = TrainConfig(**job["config"])
    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    if jax.process_index() == 0:
        write_atomic(
            job["out"],
            json.dumps(
                {
                    "plan": result.plan,
                    "stopped": result.stopped,
                    "target_epoch": result.target_epoch,
                    "time_to_target": result.time_to_target,
                    "history": [dataclasses.asdict(r) for r in result.history],
                    "wall_seconds": wall,
                }
            ),
        )


# -- the driver ---------------------------------------------------------------------------


class _Folder:
    """The benchmark's files under ``out`` (each written once, atomically)."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.root = Path(out)

    def profile(self, study: str) -> Path:
        return self.root / study / "profile.json"

    def links(self, study: str, rate: float | None) -> Path:
        return self.root / study / link_key(rate) / "links.json"

    def plan(self, study: str, rate: float | None, schedule: str) -> Path:
        return self.root / study / link_key(rate) / f"plan-{schedule}.json"

    def run(self, study: str, runner: str, rate: float | None, seed: int) -> Path:
        link = "none" if runner in ALONE else link_key(rate)
        return self.root / study / "runs" / f"{runner}-{link}-seed{seed}.json"

    @staticmethod
    def write(path: Path, data: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1), what="benchmark result")


def _cuts(L: int) -> list[tuple[int, int, int, str]]:
    """The stages to calibrate: the whole model, and both halves of every 2-stage cut."""
    wanted = [(0, L - 1, 1, "split")]
    for c in range(L - 1):
        wanted += [(0, c, 1, "split"), (c + 1, L - 1, 1, "split")]
    return wanted


def _profiled(study: TTAStudy, folder: _Folder, work: Path, log: Callable[[str], None]) -> Any:
    """The study's profile and calibrated stages (measured once, then read back)."""
    from pdjax.apps.cluster import _profile

    path = folder.profile(study.name)
    if not path.is_file():
        L = len(cluster_model(study.name).layers)
        log(f"{study.name}: profiling and timing {2 * L - 1} stages on one pinned worker")
        prof, updates, stages = _profile(
            study.name, study.microbatch, 0, work, _cuts(L), ("adam", study.learning_rate)
        )
        folder.write(path, {"profile": prof.to_json(), "updates": updates, "stages": stages})
    return json.loads(path.read_text())


def _linked(
    study: TTAStudy,
    rate: float | None,
    emulate: bool,
    folder: _Folder,
    work: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The link and the all-reduce measured on the emulated link (once, then read back)."""
    from pdjax.apps.cluster import _launch

    path = folder.links(study.name, rate)
    if not path.is_file():
        log(f"{study.name} on {_link_text(rate)}: measuring the link and the all-reduce")
        job = {"model": study.name, "microbatch": study.microbatch, "seed": 0,
               "runners": [], "calibrate": True, "repeats": 1}  # fmt: skip
        got = _launch(job, 2, rate, emulate, work)
        folder.write(path, got["_calibration"])
    links: dict[str, Any] = json.loads(path.read_text())
    return links


def _predictions(
    study: TTAStudy, rate: float | None, prof_data: Mapping[str, Any], links: Any, folder: _Folder
) -> dict[str, dict[str, Any]]:
    """Per runner: the plan (pipelines: :func:`~pdjax.partition.plan_auto`'s for that
    schedule, saved as a plan file) and the predicted seconds per sample, from calibrated
    costs (see :func:`_predict_whole` for one worker and data parallelism)."""
    from pdjax.apps.cluster import _calibration, _topology
    from pdjax.partition import Plan, plan_auto
    from pdjax.profile import Profile

    prof = Profile.from_json(prof_data["profile"])
    cal = _calibration(prof, study.name, study.microbatch, prof_data["stages"], links, "adam")
    out: dict[str, dict[str, Any]] = {}
    for runner, stages in (("single", "1 worker"), ("single-mb", "1 worker"), ("dp", "DP x2")):
        predicted = _predict_whole(runner, study, prof_data, links)
        out[runner] = {"plan": None, "stages": stages, "predicted": predicted}
    topo = _topology(cal, 2, rate)
    for schedule in PIPELINES:
        path = folder.plan(study.name, rate, schedule)
        if not path.is_file():
            plan = plan_auto(
                prof,
                topo,
                batch_size=study.batch_size,
                schedules=[schedule],
                microbatches=[M],
                straight=True,
                allow_stale=schedule != "1f1b",
                memory_limit=None,
                calibration=cal,
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            plan.save(path)
        plan = _two_stages(Plan.load(path), f"{study.name} on {_link_text(rate)}, {schedule}")
        auto = plan.options["auto"]
        out[schedule] = {
            "plan": str(path),
            "stages": " / ".join(f"{s.first_layer}-{s.last_layer}" for s in plan.stages),
            "workers": plan.num_devices,
            "extra": int(auto.get("extra_in_flight", 0)),
            "predicted": float(auto["time_per_sample"]),
        }
    return out


def _two_stages(plan: Any, where: str) -> Any:
    """``plan`` if it is a 2-stage pipeline over both workers; else a ClusterError (a
    pipeline runner on fewer stages or workers would be reported as what it is not)."""
    if plan.num_stages != 2 or plan.num_devices != 2:
        raise ClusterError(
            f"{where}: the planner's plan is {plan.config!r} ({plan.num_stages} stages on "
            f"{plan.num_devices} workers), not a 2-stage pipeline over the 2 workers; this "
            "benchmark compares 2-stage pipelines, so it stops here (delete the plan file to "
            "plan again, or leave this schedule out with runners=...)"
        )
    return plan


def _predict_whole(
    runner: str, study: TTAStudy, prof_data: Mapping[str, Any], links: Mapping[str, Any]
) -> float:
    """Predicted seconds per sample of one worker alone or of data parallelism, from the
    whole model's calibrated forward, backward and Adam update (timed at one microbatch;
    taken to scale with the rows) and the all-reduce of its gradients measured on the link:
    a step of ``B`` samples is ``B / b`` microbatches of compute (half that per worker for
    data parallelism, which then all-reduces once) and one update."""
    last = max(st["last"] for st in prof_data["stages"])
    whole = next(
        st
        for st in prof_data["stages"]
        if (st["first"], st["last"], st["replicas"]) == (0, last, 1)
    )
    per_mb = float(whole["forward"] + whole["backward"])
    update = float(whole["update"])
    mbs = study.batch_size // study.microbatch
    if runner == "single-mb":
        return (per_mb + update) / study.microbatch
    if runner == "single":
        step = mbs * per_mb + update
    else:
        step = mbs / 2 * per_mb + float(links["allreduce_model"]) + update
    return step / study.batch_size


def _run_one(
    study: TTAStudy,
    runner: str,
    rate: float | None,
    seed: int,
    pred: Mapping[str, Any],
    emulate: bool,
    work: Path,
) -> dict[str, Any]:
    """One training run in its own launch; its result."""
    from pdjax.apps.cluster import _launch

    cfg = study.config(runner, seed, plan=pred.get("plan") or "even", extra=pred.get("extra", 0))
    job = {"model": study.name, "runners": [runner], "config": dataclasses.asdict(cfg)}
    workers = 1 if runner in ALONE else 2
    t0 = time.monotonic()
    try:
        got = _launch(
            job,
            workers,
            rate,
            emulate and workers > 1,
            work,
            module=__name__,
            timeout=RUN_TIMEOUT,
        )
    except ClusterError as e:  # recorded (and reported) as a failed run
        got = {"error": str(e)[-2000:], "history": [], "stopped": "failed"}
    return {
        "study": study.name,
        "settings": dataclasses.asdict(study),
        "runner": runner,
        "link_mbit": None if runner in ALONE else rate,
        "seed": seed,
        "config": dataclasses.asdict(cfg),
        "stages": pred["stages"],
        "predicted_seconds_per_sample": pred["predicted"],
        **got,
        "launch_seconds": time.monotonic() - t0,
    }


def run_tta(
    out: str | os.PathLike[str],
    *,
    studies: Sequence[str | TTAStudy] = tuple(STUDIES),
    rates_mbit: Sequence[float] = LINKS,
    seeds: Sequence[int] = (0, 1),
    runners: Sequence[str] = RUNNERS,
    emulate: bool | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> list[dict[str, Any]]:
    """Runs every (study, link, runner, seed) not yet in ``out``; returns every result there.

    Args:
      out: the folder of results (created; reused to resume).
      studies: :data:`STUDIES` keys, or studies of your own (on
        :data:`pdjax.apps.cluster.CLUSTER_MODELS`'s models).
      rates_mbit: link rates (Mbit/s each way); with ``emulate=False`` only loopback runs.
      seeds: one run per seed (weights, data order and split).
      runners: which of :data:`RUNNERS`.
      emulate: emulated links (None: where :func:`~pdjax.apps.netem.network_support` allows).
      log: progress lines.

    Raises:
      ClusterError: unknown studies or runners, ``emulate=True`` where it cannot be, or a
        profile or link measurement failed (a failed *run* is recorded as failed instead).
      pdjax.errors.LaunchInterrupted: on SIGTERM, SIGINT or SIGHUP (the runs done are
        kept).
    """
    from pdjax.apps.netem import network_support
    from pdjax.distributed import ending_on_signals

    bad = [s for s in studies if isinstance(s, str) and s not in STUDIES]
    bad += [r for r in runners if r not in RUNNERS]
    if bad:
        raise ClusterError(f"unknown {bad}: studies {list(STUDIES)}, runners {list(RUNNERS)}")
    reason = network_support()
    if emulate and reason:
        raise ClusterError(f"cannot emulate a network here: {reason}")
    emulate = reason is None if emulate is None else emulate
    rates: list[float | None] = list(rates_mbit) if emulate else [None]
    folder = _Folder(out)
    with ending_on_signals(), tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for given in studies:
            study = STUDIES[given] if isinstance(given, str) else given
            name = study.name
            prof_data = _profiled(study, folder, work, log)
            for rate in rates:
                links = _linked(study, rate, emulate, folder, work, log)
                preds = _predictions(study, rate, prof_data, links, folder)
                for seed in seeds:
                    for runner in runners:
                        path = folder.run(name, runner, rate, seed)
                        if path.is_file():
                            continue
                        log(f"{name} on {_link_text(rate)}, seed {seed}: {runner} "
                            f"({preds[runner]['stages']})")  # fmt: skip
                        res = _run_one(study, runner, rate, seed, preds[runner], emulate, work)
                        folder.write(path, res)
                        log("  " + _one_line(res))
    return load_results(out)


def load_results(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every run result under ``out``."""
    results = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*/runs/*.json"))]
    for r in results:
        if r["runner"] in ALONE:  # one worker runs on no link (the first saves said the loop's)
            r["link_mbit"] = None
    return results


def _one_line(res: Mapping[str, Any]) -> str:
    hist = res.get("history") or []
    if res.get("error"):
        return f"failed: {res['error']}"
    acc = hist[-1]["test_accuracy"] if hist else math.nan
    tta = res.get("time_to_target")
    reached = f"target in {res['target_epoch']} epochs, {tta:.1f} s" if tta else "no target"
    return f"{reached}; accuracy at stop {acc:.3f}; launch {res['launch_seconds']:.0f} s"


# -- the report ---------------------------------------------------------------------------


def _samples_per_second(res: Mapping[str, Any] | None) -> float | None:
    """Training samples per second over the run's epochs (None without any)."""
    hist = (res or {}).get("history") or []
    if not hist:
        return None
    samples = sum(h["samples_per_second"] * h["seconds"] for h in hist)
    return float(samples / sum(h["seconds"] for h in hist))


def _over(a: float | None, b: float | None) -> float | None:
    """``a / b``, None where either is missing, zero or NaN."""
    if a is None or b is None or not a or not b or a != a or b != b:
        return None
    return a / b


def _links_of(results: Sequence[Mapping[str, Any]]) -> list[float | None]:
    links = {r["link_mbit"] for r in results if r["runner"] not in ALONE}
    return sorted(links, key=lambda x: -1.0 if x is None else x)


def summarize(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (study, link, runner), each field a list over the seeds: seconds and
    epochs to target, samples per second, accuracy at stop, and the speedups over data
    parallelism and over one worker of the same seed (time to target, measured); next to
    them the measured and the predicted throughput over data parallelism's."""
    runs = {(r["study"], r["link_mbit"], r["runner"], r["seed"]): r for r in results}
    rows = []
    order = {name: i for i, name in enumerate(STUDIES)}
    studies = sorted(dict.fromkeys(r["study"] for r in results), key=lambda s: order.get(s, 99))
    for study in studies:
        mine = [r for r in results if r["study"] == study]
        seeds = sorted({r["seed"] for r in mine})
        for rate in _links_of(mine):
            for runner in RUNNERS:
                link = None if runner in ALONE else rate
                got = [runs.get((study, link, runner, s)) for s in seeds]
                present = [r for r in got if r is not None]
                if not present:
                    continue
                dps = [runs.get((study, rate, "dp", s)) for s in seeds]
                ones = [runs.get((study, None, "single", s)) for s in seeds]
                tta = [r.get("time_to_target") if r else None for r in got]
                sps = [_samples_per_second(r) for r in got]
                pred = present[0]["predicted_seconds_per_sample"]
                pred_dp = next((r["predicted_seconds_per_sample"] for r in dps if r), None)
                pred_one = next((r["predicted_seconds_per_sample"] for r in ones if r), None)
                rows.append(
                    {
                        "study": study,
                        "settings": present[0]["settings"],
                        "link_mbit": rate,
                        "runner": runner,
                        "seeds": seeds,
                        "stages": present[0]["stages"],
                        "time_to_target": tta,
                        "epochs_to_target": [r.get("target_epoch") if r else None for r in got],
                        "samples_per_second": sps,
                        "accuracy_at_stop": [
                            r["history"][-1]["test_accuracy"] if r and r.get("history") else None
                            for r in got
                        ],
                        "errors": [r.get("error") if r else "not run (yet)" for r in got],
                        "speedup_vs_dp": [
                            _over(d.get("time_to_target") if d else None, t)
                            for d, t in zip(dps, tta, strict=True)
                        ],
                        "speedup_vs_single": [
                            _over(o.get("time_to_target") if o else None, t)
                            for o, t in zip(ones, tta, strict=True)
                        ],
                        "throughput_vs_dp": [
                            _over(a, _samples_per_second(d)) for a, d in zip(sps, dps, strict=True)
                        ],
                        "predicted_throughput_vs_dp": _over(pred_dp, pred),
                        "predicted_throughput_vs_single": _over(pred_one, pred),
                    }
                )
    return rows


def _cell(values: Sequence[Any], fmt: str) -> str:
    return " / ".join("-" if v is None or v != v else format(v, fmt) for v in values)


def markdown(
    rows: Sequence[Mapping[str, Any]],
    seconds: float | None = None,
    launched: float | None = None,
) -> str:
    """The report's tables, one per study (``seconds``: this invocation's wall time;
    ``launched``: the seconds of every run's launch together, resumed runs included)."""
    lines: list[str] = []
    for study in dict.fromkeys(r["study"] for r in rows):
        first = next(r for r in rows if r["study"] == study)
        s = TTAStudy(**first["settings"])
        lines += [
            f"## {study} on {s.dataset}",
            "",
            f"Target: {s.why}; budget {s.epochs} epochs; batch {s.batch_size} ({M} "
            f"microbatches of {s.microbatch}), Adam at {s.learning_rate:g}. Seeds: "
            f"{', '.join(map(str, first['seeds']))} (a cell reads `seed a / seed b`; `-`: "
            "the target was not reached). One worker alone (`single`, and `single-mb`: an "
            "update per microbatch, like `pipedream`) uses no link: its rows repeat under "
            "each link, against that link's DP.",
            "",
            "| link | runner | stages | time to target (s) | epochs to target | samples/s | "
            "**TTA speedup vs DP** | TTA speedup vs 1 worker | samples/s vs DP | predicted "
            "samples/s vs DP | predicted vs 1 worker | accuracy at stop |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r["study"] == study):
            cells = [
                _link_text(r["link_mbit"]),
                r["runner"],
                r["stages"] + (", no link" if r["runner"] in ALONE else ""),
                _cell(r["time_to_target"], ".1f"),
                _cell(r["epochs_to_target"], "d"),
                _cell(r["samples_per_second"], ".0f"),
                f"**{_cell(r['speedup_vs_dp'], '.2f')}**",
                _cell(r["speedup_vs_single"], ".2f"),
                _cell(r["throughput_vs_dp"], ".2f"),
                _cell([r["predicted_throughput_vs_dp"]], ".2f"),
                _cell([r["predicted_throughput_vs_single"]], ".2f"),
                _cell(r["accuracy_at_stop"], ".3f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        failed = [(r, e) for r in rows if r["study"] == study for e in r["errors"] if e]
        lines += [""] + [f"* {r['runner']} at {_link_text(r['link_mbit'])}: {e.splitlines()[-1]}"
                         for r, e in failed]  # fmt: skip
        lines.append("")
    if launched is not None:
        lines.append(f"Runs: {launched / 60:.0f} min of launches in all (each run: starting the "
                     "workers, compiling, training, evaluating).")  # fmt: skip
    if seconds is not None:
        lines.append(f"Wall time of the invocation that wrote this: {seconds / 60:.0f} min.")
    return "\n".join(lines)


def plot(
    results: Sequence[Mapping[str, Any]], out: str | os.PathLike[str], seed: int = 0
) -> list[Path]:
    """One accuracy-vs-training-seconds plot per study and link (``seed``'s runs; one
    worker alone on each), ``tta-<study>-<link>.png`` in ``out``; returns the paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    mine = [r for r in results if r["seed"] == seed and r.get("history")]
    for study in dict.fromkeys(r["study"] for r in mine):
        theirs = [r for r in mine if r["study"] == study]
        for rate in _links_of(theirs):
            fig = Figure(figsize=(6, 4), dpi=110)
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
            for r in theirs:
                if r["link_mbit"] == rate or r["runner"] in ALONE:
                    xs = [h["elapsed"] for h in r["history"]]
                    ys = [h["test_accuracy"] for h in r["history"]]
                    ax.plot(xs, ys, marker="o", label=r["runner"])
            ax.axhline(theirs[0]["settings"]["target"], color="grey", linestyle=":",
                       label="target")  # fmt: skip
            ax.set_xlabel("training seconds")
            ax.set_ylabel("test accuracy")
            ax.set_title(f"{study}, {_link_text(rate)} (seed {seed})")
            ax.legend()
            fig.tight_layout()
            path = folder / f"tta-{study}-{link_key(rate)}.png"
            fig.savefig(path)
            paths.append(path)
    return paths


def report(
    out: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    seconds: float | None = None,
) -> list[Path]:
    """Writes ``tta.md``, ``tta.json`` and the plots of the results under ``out`` into
    ``dest`` (default: ``out``); returns the paths."""
    results = load_results(out)
    rows = summarize(results)
    folder = Path(dest if dest is not None else out)
    folder.mkdir(parents=True, exist_ok=True)
    md, js = folder / "tta.md", folder / "tta.json"
    launched = sum(r.get("launch_seconds", 0.0) for r in results)
    write_atomic(md, markdown(rows, seconds, launched) + "\n", what="report")
    write_atomic(js, json.dumps(rows, indent=1), what="report")
    paths = [md, js]
    try:
        paths += plot(results, folder)
    except ImportError:  # matplotlib is the [plot] extra
        pass
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pdjax.apps.cluster_tta worker JOB_JSON`` (the driver starts these)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] != "worker":
        print("usage: python -m pdjax.apps.cluster_tta worker JOB_JSON", file=sys.stderr)
        return 2
    try:
        _tta_job(json.loads(argv[1]))
    except PdjaxError as e:  # one line, which the driver's ClusterError quotes
        print(f"pdjax.apps.cluster_tta: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
