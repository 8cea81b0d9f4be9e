"""Time to accuracy on the cluster: PipeDream's headline, measured on 2 pinned workers.

PipeDream's claim is time to accuracy (TTA): hardware efficiency (samples per second)
times statistical efficiency (epochs to the target). :func:`run_tta` measures the product:
each run trains a real model on real data to a target test accuracy in 2 single-core
worker processes joined by ``jax.distributed`` on an emulated link (as
:mod:`benchmarks.harness.cluster`: each worker in a network namespace of its own, a token
bucket each way; loopback without root), through :func:`pdjax.apps.train.train` itself. Per study
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
continues where it stopped. :func:`~benchmarks.harness.cluster.tta_report.report` turns the folder
into ``tta.md``, ``tta.json`` and one accuracy-vs-seconds plot per study and link.

This module holds the studies, the runs and what their workers run; the package's
``tta_report`` the report; :mod:`benchmarks.harness.cluster_tta` re-exports both under the module
path that the runs' configs name and that starts their workers.

Run it with ``python benchmarks/cluster/tta.py`` (``--help`` for its options).
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

from benchmarks.harness.cluster.models import cluster_model
from benchmarks.harness.cluster.predict import stage_calibration, topology
from benchmarks.harness.cluster.report import link_label
from pdjax._jsonio import write_atomic
from pdjax.errors import ClusterError, PdjaxError
from pdjax.schedules import schedule_kind, semantics

__all__ = [
    "ALONE",
    "LINKS",
    "PIPELINES",
    "RUNNERS",
    "STUDIES",
    "TTAStudy",
    "cluster_spec",
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
#: The module the runs' configs name (``model=ENTRY:cluster_spec``, saved with every result;
#: a rerun does not compare it) and the launcher starts (``python -m ENTRY worker JOB_JSON``,
#: found through the ``PYTHONPATH`` the launcher sets: the repository's root).
_ENTRY = "benchmarks.harness.cluster_tta"


def cluster_spec(config: str) -> Any:
    """A :data:`benchmarks.harness.cluster.CLUSTER_MODELS` model as a model factory, named by
    ``config``: e.g. ``pdjax train --model benchmarks.harness.cluster_tta:cluster_spec --config
    vgg-digits`` (what the runs train)."""
    return cluster_model(config)


@dataclasses.dataclass(frozen=True)
class TTAStudy:
    """One model on one dataset: its training settings and target.

    Attributes:
      name: the study's model, a :data:`benchmarks.harness.cluster.CLUSTER_MODELS` key (what is
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
            model=f"{_ENTRY}:cluster_spec",
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
            options={"extra_in_flight": extra}
            if pipeline and schedule_kind(runner).takes("extra_in_flight")
            else {},
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


def link_text(rate_mbit: float | None) -> str:
    return "loopback" if rate_mbit is None else link_label(rate_mbit)


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

    cfg = TrainConfig.from_saved(job["config"])
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
    # looked up on the package, where a test replaces it, when called
    from benchmarks.harness.cluster import profile_on_workers

    path = folder.profile(study.name)
    if not path.is_file():
        L = len(cluster_model(study.name).layers)
        log(f"{study.name}: profiling and timing {2 * L - 1} stages on one pinned worker")
        prof, updates, stages = profile_on_workers(
            study.name,
            study.microbatch,
            0,
            work,
            stages=_cuts(L),
            optimizer=("adam", study.learning_rate),
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
    from benchmarks.harness.cluster import launch  # looked up on the package (see _profiled)

    path = folder.links(study.name, rate)
    if not path.is_file():
        log(f"{study.name} on {link_text(rate)}: measuring the link and the all-reduce")
        job = {"model": study.name, "microbatch": study.microbatch, "seed": 0,
               "runners": [], "calibrate": True, "repeats": 1}  # fmt: skip
        got = launch(job, 2, rate, emulate, work)
        folder.write(path, got["_calibration"])
    links: dict[str, Any] = json.loads(path.read_text())
    return links


def _predictions(
    study: TTAStudy, rate: float | None, prof_data: Mapping[str, Any], links: Any, folder: _Folder
) -> dict[str, dict[str, Any]]:
    """Per runner: the plan (pipelines: :func:`~pdjax.partition.plan_auto`'s for that
    schedule, saved as a plan file) and the predicted seconds per sample, from calibrated
    costs (see :func:`_predict_whole` for one worker and data parallelism)."""
    from pdjax.partition import Plan, auto_choice, plan_auto
    from pdjax.profile import Profile

    prof = Profile.from_json(prof_data["profile"])
    cal = stage_calibration(
        prof, study.name, study.microbatch, prof_data["stages"], links, optimizer="adam"
    )
    out: dict[str, dict[str, Any]] = {}
    for runner, stages in (("single", "1 worker"), ("single-mb", "1 worker"), ("dp", "DP x2")):
        predicted = _predict_whole(runner, study, prof_data, links)
        out[runner] = {"plan": None, "stages": stages, "predicted": predicted}
    topo = topology(cal, 2, rate)
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
                allow_stale=semantics(schedule).stale,
                memory_limit=None,
                calibration=cal,
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            plan.save(path)
        plan = two_stages(Plan.load(path), f"{study.name} on {link_text(rate)}, {schedule}")
        auto = auto_choice(plan)
        if auto is None:
            raise ValueError(f"{path} was not made by plan_auto: it records no choice")
        out[schedule] = {
            "plan": str(path),
            "stages": " / ".join(f"{s.first_layer}-{s.last_layer}" for s in plan.stages),
            "workers": plan.num_devices,
            "extra": int(auto.get("extra_in_flight", 0)),
            "predicted": float(auto["time_per_sample"]),
        }
    return out


def two_stages(plan: Any, where: str) -> Any:
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
    from benchmarks.harness.cluster import launch  # looked up on the package (see _profiled)

    cfg = study.config(runner, seed, plan=pred.get("plan") or "even", extra=pred.get("extra", 0))
    job = {"model": study.name, "runners": [runner], "config": dataclasses.asdict(cfg)}
    workers = 1 if runner in ALONE else 2
    t0 = time.monotonic()
    try:
        got = launch(
            job,
            workers,
            rate_mbit=rate,
            emulate=emulate and workers > 1,
            workdir=work,
            module=_ENTRY,
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
        :data:`benchmarks.harness.cluster.CLUSTER_MODELS`'s models).
      rates_mbit: link rates (Mbit/s each way); with ``emulate=False`` only loopback runs.
      seeds: one run per seed (weights, data order and split).
      runners: which of :data:`RUNNERS`.
      emulate: emulated links (None: where
        :func:`~benchmarks.harness.netem.network_support` allows).
      log: progress lines.

    Raises:
      ClusterError: unknown studies or runners, ``emulate=True`` where it cannot be, or a
        profile or link measurement failed (a failed *run* is recorded as failed instead).
      pdjax.errors.LaunchInterrupted: on SIGTERM, SIGINT or SIGHUP (the runs done are
        kept).
    """
    from benchmarks.harness.netem import network_support
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
                links = _linked(study, rate, emulate=emulate, folder=folder, work=work, log=log)
                preds = _predictions(study, rate, prof_data, links, folder)
                for seed in seeds:
                    for runner in runners:
                        path = folder.run(name, runner, rate, seed)
                        if path.is_file():
                            continue
                        log(f"{name} on {link_text(rate)}, seed {seed}: {runner} "
                            f"({preds[runner]['stages']})")  # fmt: skip
                        res = _run_one(
                            study,
                            runner,
                            rate,
                            seed,
                            pred=preds[runner],
                            emulate=emulate,
                            work=work,
                        )
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.harness.cluster_tta worker JOB_JSON`` (the driver starts these)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] != "worker":
        print("usage: python -m benchmarks.harness.cluster_tta worker JOB_JSON", file=sys.stderr)
        return 2
    from pdjax.distributed import watch_launcher

    watch_launcher()  # ends this worker if its launcher dies (even by SIGKILL)
    try:
        _tta_job(json.loads(argv[1]))
    except PdjaxError as e:  # one line, which the driver's ClusterError quotes
        print(f"benchmarks.harness.cluster_tta: error: {e}", file=sys.stderr)
        return 2
    return 0
