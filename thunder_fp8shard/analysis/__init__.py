"""Stage 1, analysis: what a compilation's forward and backward traces say before anything is agreed or chosen (the
program's facts, derived once, :mod:`~thunder_fp8shard.analysis.program`; the saved-for-backward contract, the
candidates, the replication verdicts, storages and live intervals, the compaction options). It imports nothing of
the memory model, which is built on it; :func:`~thunder_fp8shard.planning.analyze.analyze` gathers both for the
planner."""
