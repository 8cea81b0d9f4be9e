"""Training for real: data, a plan, a runner (pipeline or data parallel), epochs, targets.

:func:`train` is the whole loop behind ``pdjax train``: it loads an offline dataset, builds
the model, makes a plan (profiling and planning on the spot for ``plan="auto"``), runs
epochs with any schedule or the data-parallel baseline, evaluates on the test split after
every epoch, stops at a target accuracy, writes metrics as JSON lines, and checkpoints.

Units of work. ``batch_size`` samples make one optimizer step of the flush schedules, of
``2bw`` and of data parallelism; a pipeline splits it into ``microbatches`` (``M``)
microbatches. PipeDream updates after every microbatch, so it makes ``M`` updates where the
others make one. A pipeline runs a whole epoch in one call (``Pipeline.run``), so
asynchronous schedules stream through the epoch and drain only at its end — where the
loop evaluates and checkpoints (a drain-then-save checkpoint).

Models and data of your own. ``model`` may be ``package.module:factory``
(:func:`pdjax.models.load_model`; the factory gets ``config`` and ``seq_len`` if it takes
them) and ``dataset`` a path to an ``.npz`` file (:func:`pdjax.apps.data.load_npz`), checked
against the model's sample batch before anything runs (:func:`build`, :func:`check`).
A model without an accuracy function is trained and evaluated on its loss alone (its
accuracy reads NaN, null in the metrics file).

Checkpoints and faults. An epoch is checkpointed only when its weights and evaluation are
finite, and its metrics line is written once the checkpoint is committed; a diverged run
names the last step saved. A run saves its plan beside its checkpoints (:data:`PLAN_FILE`)
and beside its metrics, and a resumed run follows it rather than planning again
(``resume_step`` picks an older step). A divergence is also a NaN or infinity in the
optimizer state.

Metrics and outputs. A run has an id, made when it starts fresh and kept in its
checkpoints, written in each of its metrics lines. The metrics file is only ever appended
to (never through a symbolic link), and read by :func:`read_metrics`' rule: a line of run
id R and epoch e replaces every earlier line of R whose epoch is e or later. A fresh run
refuses a metrics file holding lines of its label, and a resumed one a file holding lines
of its label with another run id, before any work. ``pdjax train`` checks every output
path first (:func:`check_output_paths`) and refuses to replace another run's summary and
plots (:func:`check_results`).
"""

from pdjax.apps.train.config import (
    DATASETS,
    SCHEDULE_CHOICES,
    TRANSPORT_CHOICES,
    EpochRecord,
    TrainConfig,
    TrainResult,
    run_folder,
)
from pdjax.apps.train.evaluation import evaluate, evaluate_runner
from pdjax.apps.train.loop import train
from pdjax.apps.train.model_data import build, check, model_spec
from pdjax.apps.train.optimizers import LR_SCHEDULES, OPTIMIZERS, build_optimizer, make_optimizer
from pdjax.apps.train.outputs import (
    METRICS_FILE,
    SUMMARY_FILE,
    check_output_paths,
    check_results,
    read_metrics,
    require_tensorboard,
)
from pdjax.apps.train.planning import PLAN_TOLERANCE, auto_plan, plan_of, resolve_auto
from pdjax.apps.train.resume import PLAN_FILE, check_outputs
from pdjax.apps.train.runner import make_runner
from pdjax.errors import TrainingDiverged

__all__ = [
    "DATASETS",
    "LR_SCHEDULES",
    "METRICS_FILE",
    "OPTIMIZERS",
    "PLAN_FILE",
    "PLAN_TOLERANCE",
    "SCHEDULE_CHOICES",
    "SUMMARY_FILE",
    "TRANSPORT_CHOICES",
    "EpochRecord",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "auto_plan",
    "build",
    "build_optimizer",
    "check",
    "check_output_paths",
    "check_outputs",
    "check_results",
    "evaluate",
    "evaluate_runner",
    "make_optimizer",
    "make_runner",
    "model_spec",
    "plan_of",
    "read_metrics",
    "require_tensorboard",
    "resolve_auto",
    "run_folder",
    "train",
]
