"""A plan as data: :class:`Plan` (stages, their devices, the
:class:`~pdjax.schedules.ScheduleSpec` they run, and what the cost model predicts) and the
:class:`Topology` it was made for. The planner (:mod:`pdjax.partition`) writes plans, a
user may write or edit one, and the runtime (:mod:`pdjax.pipeline`) reads them: this
package sits below both, so that they meet only through data."""

from pdjax.plan.plan import Plan, StagePlan
from pdjax.plan.topology import Level, Topology

__all__ = ["Level", "Plan", "StagePlan", "Topology"]
