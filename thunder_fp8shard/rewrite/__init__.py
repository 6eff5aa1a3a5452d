"""Stage 5, the rewrite: one module a rewrite, each a :class:`~thunder_fp8shard.rewrite.shape.Rewrite`; the forward
and backward traces with the pass's operators where the plan says (``traces.py``)."""
