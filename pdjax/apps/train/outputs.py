"""What a run writes besides its checkpoints: the metrics file (strict JSON lines, kept
in step with the checkpoints) and TensorBoard event files."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdjax._jsonio import write_atomic
from pdjax.apps.train.config import EpochRecord, TrainConfig
from pdjax.errors import PipelineError


def _json_number(value: Any) -> Any:
    """``value`` for strict JSON: a NaN or infinite number becomes None (null)."""
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _metrics_line(label: str, record: EpochRecord) -> str:
    values = {k: _json_number(v) for k, v in dataclasses.asdict(record).items()}
    return json.dumps({"run": label, **values}, allow_nan=False)


def _append_metrics(path: Path, label: str, records: Sequence[EpochRecord]) -> None:
    if not records:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(_metrics_line(label, r) + "\n" for r in records)
    with path.open("a+b") as f:  # appends, wherever it seeks to read
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":  # a write that a crash cut off: start a line of our own
                text = "\n" + text
        f.write(text.encode())


def _metrics_runs(path: Path) -> set[str]:
    """The runs with lines in the metrics file ``path``."""
    runs = set()
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and isinstance(entry.get("run"), str):
                runs.add(entry["run"])
    return runs


def _refuse_mixing(path: Path, label: str, checkpoint_dir: str | Path | None) -> None:
    """Refuses a fresh run of ``label`` into a metrics file holding lines of such a run."""
    if label not in _metrics_runs(path):
        return
    where = (
        f"{checkpoint_dir} holds no checkpoint to resume it from"
        if checkpoint_dir is not None
        else "there is no --checkpoint-dir to resume it from"
    )
    raise PipelineError(
        f"{path} already holds metrics of a {label!r} run, and {where}: a new run would mix "
        f"its epochs with the old ones. Choose another --out (or move {path.name} away); to "
        "go on with the earlier run instead, pass the --checkpoint-dir it saved to"
    )


def _sync_metrics(path: Path, label: str, history: Sequence[EpochRecord]) -> None:
    """Makes ``label``'s lines in the metrics file those of ``history`` (a checkpoint's):
    keeps its lines of those epochs, drops its others (later epochs, duplicates), appends
    the missing ones. Other lines stay as they are, but for a last line cut off by a crash.
    The file is rewritten only to drop, atomically (a crash leaves the old file or the new)."""
    text = path.read_text() if path.is_file() else ""
    lines = text.splitlines()
    keep: list[str] = []
    seen: set[int] = set()
    dropped = False
    for i, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            if i == len(lines) - 1 and not text.endswith("\n"):
                dropped = True  # a write that a crash cut off
            else:
                keep.append(line)
            continue
        if not isinstance(entry, dict) or entry.get("run") != label:
            keep.append(line)
            continue
        epoch = entry.get("epoch")
        if isinstance(epoch, int) and 1 <= epoch <= len(history) and epoch not in seen:
            seen.add(epoch)
            keep.append(line)
        else:
            dropped = True
    if dropped:
        write_atomic(
            path, "".join(line + "\n" for line in keep), what="metrics file", error=PipelineError
        )
    _append_metrics(path, label, [r for r in history if r.epoch not in seen])


def require_tensorboard() -> None:
    """Checks that ``tensorboardX`` can be imported.

    Raises:
      PipelineError: saying how to install it.
    """
    try:
        import tensorboardX  # noqa: F401
    except ImportError as e:
        raise PipelineError(
            "--tensorboard writes event files with tensorboardX, which is not installed: "
            "pip install 'pdjax[tensorboard]' (or pip install tensorboardX)"
        ) from e


class _TensorBoard:
    """One run's TensorBoard event files (tensorboardX), one step per epoch. The files are
    made by the first epoch written: a run that trains no epoch, or diverges in its first,
    leaves none."""

    def __init__(self, folder: Path, cfg: TrainConfig) -> None:
        self._folder, self._cfg = folder, cfg
        self._writer: Any = None

    def _open(self) -> Any:
        from tensorboardX import SummaryWriter

        writer = SummaryWriter(logdir=str(self._folder))
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
        w.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
