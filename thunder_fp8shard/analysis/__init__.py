"""Stage 1, analysis: what a compilation's forward and backward traces say before anything is chosen (program facts,
saved tensors, candidates, replication, storage lives, compaction options). The memory model is built on it."""
