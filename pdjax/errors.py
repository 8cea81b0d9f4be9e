"""pdjax's errors: one small hierarchy, each message says what went wrong and what to do."""

from __future__ import annotations

__all__ = [
    "CalibrationError",
    "CheckpointError",
    "DataError",
    "GraphFormatError",
    "LayerError",
    "PdjaxError",
    "PipelineError",
    "PlanError",
    "ProfileError",
    "ScheduleError",
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


class DataError(PdjaxError):
    """A dataset or batching request is invalid (batch size, seed, split fraction)."""


class CheckpointError(PdjaxError):
    """A checkpoint is missing, or does not fit the state it is restored into."""


class CalibrationError(PdjaxError):
    """A calibration could not be measured, or does not fit the model, plan or devices it is
    used with (the message says what differs)."""
