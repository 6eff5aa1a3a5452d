"""Stage 3, the plan: what is sharded and compacted, grouped into buckets and shard ops, and each bucket's byte layout;
:func:`~thunder_fp8shard.planning.planner.decide` is its one decision a program, and
:func:`~thunder_fp8shard.planning.planner.make_plan` the plan's fields that decision decides."""
