"""What :func:`pdjax.apps.bench.bench` reports: a :class:`BenchRow` per runner in a
:class:`BenchResult` (its header, JSON and row lookup), and :func:`format_table`.

Everything here is re-exported by :mod:`pdjax.apps.bench`, the module to import.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["BenchResult", "BenchRow", "format_table"]


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One runner's measurements and the simulator's prediction.

    Attributes:
      name: the schedule, or ``"dp"``.
      stages: where the model ran, e.g. ``"4 stages x1"`` or ``"1 stage x4"``.
      samples_per_second: median over the repeats of the measured training throughput.
      predicted_samples_per_second: the simulator's throughput for the same schedule.
      host_seconds_per_action: median over the repeats of the driver's seconds per
        dispatched action (data parallelism: per step, its one jitted call).
      actions: actions dispatched per repeat.
      samples: training samples per repeat.
      repeats: the measured samples/s of each repeat, in order.
      note: how the row was run, when it differs from the others.
      error: why the row could not run (its numbers are then NaN).
      all_reduces_per_step: all-reduce operations in the compiled programs one optimizer
        step of ``M`` microbatches runs (counted by the runtime in one extra, untimed
        call: :attr:`~pdjax.pipeline.executor.RunMetrics.all_reduces`); NaN for data
        parallelism.
    """

    name: str
    stages: str
    samples_per_second: float
    predicted_samples_per_second: float
    host_seconds_per_action: float
    actions: int
    samples: int
    repeats: tuple[float, ...] = ()
    note: str = ""
    error: str | None = None
    all_reduces_per_step: float = math.nan

    @property
    def ratio(self) -> float:
        """Measured over predicted throughput (1.0: as the simulator said)."""
        if not self.predicted_samples_per_second > 0:
            return math.nan
        return self.samples_per_second / self.predicted_samples_per_second


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """What :func:`~pdjax.apps.bench.bench` returns.

    Attributes:
      model: the model's registry name.
      config: ``"tiny"`` or ``"paper"``.
      devices: devices used.
      batch_size: samples per optimizer step.
      microbatches: ``M``.
      steps: optimizer steps timed per repeat.
      repeats: timed rounds over all runners.
      plan: the plan's one-line description.
      profile_seconds: the profile's forward + backward seconds of one microbatch on one
        device (what the predictions are built from).
      cpu_cores: cores this process may run on.
      platform: the devices' platform (``"cpu"``, ``"gpu"``, ...).
      rows: one per schedule, then data parallelism.
      pool_concurrency: on in-process CPU devices, the work their shared thread pool gets
        through at once (:func:`~pdjax.apps.bench.pool_concurrency`; 1.0 elsewhere).
    """

    model: str
    config: str
    devices: int
    batch_size: int
    microbatches: int
    steps: int
    repeats: int
    plan: str
    profile_seconds: float
    cpu_cores: int
    platform: str
    rows: tuple[BenchRow, ...]
    pool_concurrency: float = 1.0

    def row(self, name: str) -> BenchRow:
        """The row called ``name`` (a schedule or ``"dp"``)."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (NaN becomes None); rows carry their ratio."""

        def clean(x: Any) -> Any:
            return None if isinstance(x, float) and not math.isfinite(x) else x

        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}
        out["rows"] = [
            {
                k: clean(v) if not isinstance(v, tuple) else [clean(x) for x in v]
                for k, v in {**dataclasses.asdict(r), "ratio": r.ratio}.items()
            }
            for r in self.rows
        ]
        return out

    def header(self) -> str:
        """What the numbers are, and what they cannot show on this machine."""
        lines = [
            f"{self.model} ({self.config}), batch {self.batch_size} = {self.microbatches} "
            f"microbatches of {self.batch_size // self.microbatches}, {self.devices} "
            f"{self.platform} devices, {self.cpu_cores} CPU cores; {self.steps} steps per "
            f"repeat, {self.repeats} repeats round-robin, medians",
            f"plan: {self.plan}",
            f"profile (device 0): {self.profile_seconds * 1e3:.3g} ms forward + backward per "
            "microbatch; predictions: the simulator on that profile and plan",
        ]
        if self.platform == "cpu":
            lines.append(
                "In-process CPU devices share one thread pool: the stages do not run in "
                "parallel, so no pipeline speedup is expected here (least of all on a "
                "2-core machine). Predicted: the larger of the simulator's makespan (one "
                "processor per device) and the devices' summed busy seconds over the "
                f"pool's measured concurrency ({self.pool_concurrency:.2f}: two devices "
                "computing together get through that much more than one); "
                "measured/predicted shows the machinery's overhead beyond the work."
            )
        return "\n".join(lines)


def format_table(result: BenchResult) -> Any:
    """The result as a :class:`rich.table.Table` (print it with a rich ``Console``)."""
    from rich.table import Table

    table = Table(title="measured vs simulated throughput")
    for header, justify in [
        ("schedule", "left"),
        ("stages", "left"),
        ("measured samples/s", "right"),
        ("predicted samples/s", "right"),
        ("measured / predicted", "right"),
        ("host us / action", "right"),
        ("all-reduces / step", "right"),
        ("actions", "right"),
        ("note", "left"),
    ]:
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for r in result.rows:
        if r.error is not None:
            table.add_row(r.name, r.stages, "-", "-", "-", "-", "-", "-", f"not run: {r.error}")
            continue
        table.add_row(
            r.name,
            r.stages,
            f"{r.samples_per_second:,.0f}",
            f"{r.predicted_samples_per_second:,.0f}",
            f"{r.ratio:.2f}",
            f"{r.host_seconds_per_action * 1e6:,.0f}",
            "-" if math.isnan(r.all_reduces_per_step) else f"{r.all_reduces_per_step:g}",
            str(r.actions),
            r.note,
        )
    return table
