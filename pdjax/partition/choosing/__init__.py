"""Choosing among plans by simulation: a plan's costs for the simulator
(:mod:`.simulator_costs`), candidates simulated and priced (:mod:`.candidates`),
:func:`~pdjax.partition.plan_auto` (:mod:`.auto`) and plans for several lengths of
microbatch (:mod:`.buckets`). Reads the search and the cost model below it."""
