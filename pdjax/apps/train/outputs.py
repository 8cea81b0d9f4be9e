"""What a run writes besides its checkpoints: the metrics file (strict JSON lines, kept
in step with the checkpoints, only ever appended to), the summary and plots of ``pdjax
train``, and TensorBoard event files; and the checks of all of them before any work.

The metrics file. Each line is ``{"run": label, "run_id": id, **record}``: a run's id is
made when it starts fresh and kept in its checkpoints, so a resumed run writes under the
same id. pdjax never deletes or rewrites a line; a resume appends, and the file is read
by this rule (:func:`read_metrics`): *read the lines in order, skipping any that is not a
JSON object with an integer ``epoch`` (a line a crash cut off); a line of run id R and
epoch e replaces every earlier line of R whose epoch is e or later.* What is left of R
is its history, one line per epoch 1..n, as its newest checkpoint holds it. (Lines of
pdjax before run ids have no ``run_id``; those of one label count as one run.)"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdjax._jsonio import append_text, check_file, check_folder, read_regular, refuse_link
from pdjax.apps.train.config import EpochRecord, TrainConfig, run_folder
from pdjax.apps.train.wording import setting
from pdjax.errors import PipelineError

#: The files of ``pdjax train --out``: its metrics and its summary (the plots are
#: :data:`pdjax.apps.plots.PLOT_FILES`, a run's plan ``<run>/plan.json``).
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _json_number(value: Any) -> Any:
    """``value`` for strict JSON: a NaN or infinite number becomes None (null)."""
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _values(record: EpochRecord | Mapping[str, Any]) -> dict[str, Any]:
    """An epoch's fields as its metrics line holds them (strict JSON numbers)."""
    fields = dataclasses.asdict(record) if isinstance(record, EpochRecord) else record
    return {k: _json_number(v) for k, v in fields.items()}


def _metrics_line(label: str, run_id: str, record: EpochRecord) -> str:
    return json.dumps({"run": label, "run_id": run_id, **_values(record)}, allow_nan=False)


def append_metrics(path: Path, label: str, run_id: str, records: Sequence[EpochRecord]) -> None:
    """Appends the lines of ``records`` (never through a symbolic link; a last line a
    crash cut off is kept, and the new lines start after it)."""
    if records:
        text = "".join(_metrics_line(label, run_id, r) + "\n" for r in records)
        append_text(path, text, what="metrics file", error=PipelineError)


#: The largest metrics file read (a line per epoch is a few hundred bytes).
MAX_METRICS_BYTES = 1 << 30


def _entries(path: Path) -> Iterator[dict[str, Any]]:
    """The lines of the metrics file ``path`` that are JSON objects, in order (no file:
    none). Read as pdjax appends to it: never through a link, never from a FIFO or a
    device, at most :data:`MAX_METRICS_BYTES`."""
    if not os.path.lexists(path):
        return
    data = read_regular(path, "metrics file", PipelineError, max_bytes=MAX_METRICS_BYTES)
    text = data.decode(errors="replace")
    for line in text.splitlines():
        with contextlib.suppress(ValueError, RecursionError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                yield entry


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a metrics file that hold each run's history, in file order: the file
    read by its rule (see the module docstring; pdjax only appends to it). A line of run
    id R and epoch e replaces every earlier line of R whose epoch is e or later; lines
    without a run id (pdjax before run ids) count as one run per label.

    Args:
      path: a ``metrics.jsonl``; a missing file has no lines.

    Returns:
      The lines that stand, as dicts: per run, one for each epoch 1..n.
    """
    kept: dict[Any, dict[int, tuple[int, dict[str, Any]]]] = {}
    for i, entry in enumerate(_entries(Path(path))):
        epoch = entry.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            continue
        run_id = entry.get("run_id")
        key = run_id if isinstance(run_id, str) else (None, entry.get("run"))
        lines = kept.setdefault(key, {})
        for e in [e for e in lines if e >= epoch]:
            del lines[e]
        lines[epoch] = (i, entry)
    return [entry for _, entry in sorted(x for run in kept.values() for x in run.values())]


def new_run_id() -> str:
    """A fresh run's id (32 hex digits), the same in every process of the run."""
    from pdjax.distributed import broadcast_json

    run_id: str = broadcast_json(uuid.uuid4().hex)
    return run_id


def refuse_mixing(path: Path, label: str, checkpoint_dir: str | Path | None) -> None:
    """Refuses a fresh run of ``label`` into a metrics file holding lines of such a run."""
    if not any(entry.get("run") == label for entry in _entries(path)):
        return
    where = (
        f"{checkpoint_dir} holds no checkpoint to resume it from"
        if checkpoint_dir is not None
        else f"there is no {setting('checkpoint_dir')} to resume it from"
    )
    raise PipelineError(
        f"{path} already holds metrics of a {label!r} run, and {where}: a new run would mix "
        f"its epochs with the old ones. Choose another {setting('metrics_path')} (or move "
        f"{path.name} away); to go on with the earlier run instead, pass the "
        f"{setting('checkpoint_dir')} it saved to"
    )


def refuse_others(
    path: Path,
    label: str,
    run_id: str,
    checkpoint_dir: str | Path | None,
    legacy: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    """Refuses to resume run ``run_id`` of ``label`` into a metrics file that holds lines
    of ``label`` with another run id, or none. ``legacy``: the history of a checkpoint of
    pdjax before run ids, whose lines (no run id, each equal to its epoch's record) are the
    run's own."""
    records = {r["epoch"]: _values(r) for r in legacy or ()}
    for entry in _entries(path):
        if entry.get("run") != label or entry.get("run_id") == run_id:
            continue
        other = entry.get("run_id")
        if other is None and legacy is not None:
            values = records.get(entry.get("epoch"))
            if values is not None and all(entry.get(k) == v for k, v in values.items()):
                continue  # this run's own line, written before run ids
        whose = f"run id {other}" if other is not None else "no run id: an older pdjax"
        raise PipelineError(
            f"{path} holds metrics of another {label!r} run ({whose}) than the one resumed "
            f"from {checkpoint_dir} (run id {run_id}): its lines would mix with that run's. "
            f"Resume with another {setting('metrics_path')} (the run's checkpointed epochs "
            f"are written there first), or move {path.name} away"
        )


def sync_metrics(path: Path, label: str, run_id: str, history: Sequence[EpochRecord]) -> None:
    """Brings run ``run_id``'s lines in the metrics file in step with ``history`` (its
    checkpoint's), by appending only (:func:`read_metrics`' rule): from the first epoch
    whose line is missing or differs (another branch of the run, before a resume from an
    older step), every epoch of ``history``; or, where the file holds later epochs than
    ``history`` (steps set aside by a resume from an older one), its last epoch again,
    which ends them. Nothing is deleted or rewritten."""
    mine = {e["epoch"]: e for e in read_metrics(path) if e.get("run_id") == run_id}
    for i, record in enumerate(history):
        line = mine.get(record.epoch)
        values = {"run": label, "run_id": run_id, **_values(record)}
        if line is None or any(line.get(k) != v for k, v in values.items()):
            append_metrics(path, label, run_id, history[i:])
            return
    if history and any(epoch > len(history) for epoch in mine):
        append_metrics(path, label, run_id, history[-1:])


def check_output_paths(
    out: str | Path,
    labels: Sequence[str],
    *,
    plots: bool,
    checkpoint_dir: str | Path | None = None,
    tensorboard: str | Path | None = None,
) -> None:
    """Refuses, before any work, an output of ``pdjax train`` that could not be written:
    ``out`` (under a file, or not writable: tested by making a file there), its metrics,
    summary, plots (``plots``) and each run's plan (a symbolic link or a folder there is
    refused, as is a link at a run's folder), ``checkpoint_dir`` and ``tensorboard`` (and
    their run folders) alike.

    Raises:
      PipelineError: naming the option, the path, what is wrong and what to do.
    """
    from pdjax.apps.plots import PLOT_FILES
    from pdjax.apps.train.resume import PLAN_FILE

    out, named = Path(out), setting("out")
    check_folder(out, named, PipelineError)
    names = [METRICS_FILE, SUMMARY_FILE, *(PLOT_FILES.values() if plots else ())]
    for name in names:
        check_file(out / name, named, PipelineError)
    for label in labels:
        check_folder(out / run_folder(label), named, PipelineError, link=False)
        check_file(out / run_folder(label) / PLAN_FILE, named, PipelineError)
    for key, folder in (("checkpoint_dir", checkpoint_dir), ("tensorboard", tensorboard)):
        if folder is None:
            continue
        option = setting(key)
        check_folder(folder, option, PipelineError)
        for label in labels:
            where = Path(folder) / run_folder(label)
            check_folder(where, option, PipelineError, link=key == "checkpoint_dir")


def check_results(out: str | Path, runs: Sequence[tuple[str, str | None]], *, plots: bool) -> None:
    """Refuses, before any work, to replace the summary (and the plots, with ``plots``) of
    another run in ``out``: they may be replaced only where ``summary.json`` lists runs
    that this command continues, each ``(label, run id)`` of ``runs`` (run id None: a fresh
    run). Plots without a summary cannot be told apart, and are refused too.

    Raises:
      PipelineError: naming the file, whose it is and what to do.
    """
    from pdjax.apps.plots import PLOT_FILES

    out = Path(out)
    summary = out / SUMMARY_FILE
    ours = {(label, run_id) for label, run_id in runs if run_id is not None}
    advice = (
        f"choose another {setting('out')}, or move it away (a run replaces only its own, as "
        f"it goes on from its {setting('checkpoint_dir')})"
    )
    if os.path.lexists(summary):
        for label, run_id in _summary_runs(summary):
            if (label, run_id) not in ours:
                whose = f"run id {run_id}" if run_id is not None else "no run id: an older pdjax"
                raise PipelineError(
                    f"{summary} holds the summary of another run ({label!r}, {whose}), which "
                    f"this command would replace: {advice}"
                )
        return
    for name in PLOT_FILES.values() if plots else ():
        if os.path.lexists(out / name):
            raise PipelineError(
                f"{out / name} is a plot of another run (there is no {SUMMARY_FILE} beside "
                f"it to say whose), which this command would replace: {advice}"
            )


def _summary_runs(path: Path) -> list[tuple[str, str | None]]:
    """The ``(label, run id)`` of each run in the summary ``path``."""
    try:
        entries = json.loads(
            read_regular(path, "summary", PipelineError, max_bytes=MAX_METRICS_BYTES)
        )
        if not isinstance(entries, list):
            raise ValueError("not a list")
        runs = []
        for entry in entries:
            run_id = entry.get("run_id")
            runs.append((str(entry["run"]), run_id if isinstance(run_id, str) else None))
    except (OSError, ValueError, KeyError, AttributeError, TypeError, RecursionError) as e:
        raise PipelineError(
            f"{path} is not a summary pdjax can read ({e}), and this command would replace "
            f"it: choose another {setting('out')}, or move it away"
        ) from e
    return runs


def require_tensorboard() -> None:
    """Checks that ``tensorboardX`` can be imported.

    Raises:
      PipelineError: saying how to install it.
    """
    try:
        import tensorboardX  # noqa: F401
    except ImportError as e:
        raise PipelineError(
            f"{setting('tensorboard_dir')} writes event files with tensorboardX, which is not "
            "installed: "
            "pip install 'pdjax[tensorboard]' (or pip install tensorboardX)"
        ) from e


class TensorBoard:
    """One run's TensorBoard event files (tensorboardX), one step per epoch. The files are
    made by the first epoch written: a run that trains no epoch, or diverges in its first,
    leaves none. Each file is new (a random name), in a folder that is not a link."""

    def __init__(self, folder: Path, cfg: TrainConfig) -> None:
        self._folder, self._cfg = folder, cfg
        self._writer: Any = None

    def _open(self) -> Any:
        from tensorboardX import SummaryWriter

        refuse_link(self._folder, "TensorBoard files in", PipelineError)
        # tensorboardX names its file by the second and the host, and opens it as it is
        # (following a link, truncating a file there): a random suffix makes it new
        suffix = "." + uuid.uuid4().hex
        writer = SummaryWriter(logdir=str(self._folder), filename_suffix=suffix)
        text = json.dumps(dataclasses.asdict(self._cfg), indent=1)
        writer.add_text("config", f"```\n{text}\n```", 0)
        return writer

    def write(self, record: EpochRecord) -> None:
        if self._writer is None:
            self._writer = self._open()
        w, step = self._writer, record.epoch
        w.add_scalar("train/loss", record.train_loss, step)
        w.add_scalar("test/loss", record.test_loss, step)
        if math.isfinite(record.test_accuracy):
            w.add_scalar("test/accuracy", record.test_accuracy, step)
        w.add_scalar("train/samples_per_second", record.samples_per_second, step)
        w.add_scalar("train/epoch_seconds", record.seconds, step)
        for tag, value in (
            ("train/tokens_per_second", record.tokens_per_second),
            ("test/perplexity", record.perplexity),
            ("train/mfu", record.mfu),
        ):
            if math.isfinite(value):
                w.add_scalar(tag, value, step)
        w.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
