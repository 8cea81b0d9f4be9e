"""The planner's cost model: what a schedule costs the planner (:mod:`.traits`), a
profile's per-layer arrays (:mod:`.arrays`) and the cost terms of a stage, a cut and a
plan under the three cost models (:mod:`.cost`). Imports nothing else of the planner."""
