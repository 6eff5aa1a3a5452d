"""Stage 3, the plan: what a compilation's traces and memory model say (:mod:`~thunder_fp8shard.planning.analyze`),
what is sharded and compacted (the policies, weighed on the memory model), grouped into buckets and shard ops, and
each bucket's byte layout; :func:`~thunder_fp8shard.planning.planner.make_plan` is its entry point."""
