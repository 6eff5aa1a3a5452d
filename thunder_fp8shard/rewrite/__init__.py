"""Stage 5, the rewrite: the forward and backward traces with the pass's operators where the plan says."""
