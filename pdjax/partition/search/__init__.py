"""Making plans: PipeDream's dynamic program (:mod:`.pipedream`, over the levels of a
topology: :mod:`.levels`, its shared state :mod:`.space`, the round-trip bound
:mod:`.round_trip`), the simple partitioners (:mod:`.partitioners`) and the pricing of any
partition as a :class:`~pdjax.plan.Plan` (:mod:`.evaluate`). Reads the cost model
(:mod:`pdjax.partition.pricing`), never the choosing above it."""
