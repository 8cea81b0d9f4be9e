"""pdjax's errors: one small hierarchy, each message says what went wrong and what to do."""

from __future__ import annotations

import signal

__all__ = [
    "CalibrationError",
    "CheckpointError",
    "ClusterError",
    "DataError",
    "DistributedError",
    "GraphFormatError",
    "LaunchInterrupted",
    "LayerError",
    "NetworkError",
    "OptionError",
    "PdjaxError",
    "PipelineError",
    "PlanError",
    "ProfileError",
    "ScheduleError",
    "ScheduleSpecError",
    "TrainingDiverged",
]


class PdjaxError(Exception):
    """Base class of every error pdjax raises on purpose."""


class LayerError(PdjaxError):
    """A layer or layer sequence was built or called wrongly."""


class ProfileError(PdjaxError):
    """Profiling failed, or a profile is malformed."""


class GraphFormatError(ProfileError):
    """A PipeDream ``graph.txt`` file could not be parsed (names the file and the line)."""


class PlanError(PdjaxError):
    """No valid plan for the given profile, topology and constraints."""


class ScheduleError(PdjaxError):
    """A schedule is impossible, or breaks its own semantics."""


class PipelineError(PdjaxError):
    """The runtime cannot execute a plan or schedule as given."""


class ScheduleSpecError(ScheduleError, PipelineError):
    """A :class:`~pdjax.schedules.ScheduleSpec` setting is wrong or not its kind's: a
    :class:`ScheduleError`, and a :class:`PipelineError` too, as the pipeline's constructor
    raised for these settings before they became one spec."""


class DataError(PdjaxError):
    """A dataset or batching request is invalid (batch size, seed, split fraction)."""


class CheckpointError(PdjaxError):
    """A checkpoint is missing, or does not fit the state it is restored into."""


class CalibrationError(PdjaxError):
    """A calibration could not be measured, or does not fit the model, plan or devices it is
    used with (the message says what differs)."""


class TrainingDiverged(PdjaxError):
    """A loss, the test accuracy or a weight became NaN or infinite; that epoch is not
    saved, and the checkpoints saved before it are kept."""


class DistributedError(PdjaxError):
    """A multi-process run could not start, or one of its processes failed."""


class LaunchInterrupted(DistributedError):
    """A launcher got SIGTERM, SIGINT or SIGHUP and ended the processes it started."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(
            f"got {signal.Signals(signum).name}: ended the processes this launcher started "
            "(SIGTERM, then SIGKILL after a grace period)"
        )


class NetworkError(PdjaxError):
    """The emulated network could not be set up, used or torn down."""


class ClusterError(PdjaxError):
    """The cluster benchmark could not run (a worker failed or ran out of time)."""


class OptionError(PdjaxError):
    """A command-line option's value is out of its bounds (raised while parsing;
    ``command`` is the parser's ``prog``, e.g. ``pdjax plan``)."""

    def __init__(self, message: str, command: str = "pdjax") -> None:
        super().__init__(message)
        self.command = command
