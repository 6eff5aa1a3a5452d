"""Support for the tests, the benchmarks, the demo and the notebook; not part of the pass, and nothing in the pass
imports it.

- :mod:`~thunder_fp8shard.testing.harness`: runs a function on N processes (gloo, or NCCL one GPU a rank), or on one
  simulated rank of N (torch's fake process group), and collects what each rank returns.
- :mod:`~thunder_fp8shard.testing.reference_run`: a small data-parallel training run with and without the pass,
  and the exactness check (losses and gradients bit for bit).
- :mod:`~thunder_fp8shard.testing.toy_models`: fake-FP8 models whose saved-for-backward lists hold FP8 tensors.
- :mod:`~thunder_fp8shard.testing.measure`: what autograd really saves for backward, in bytes.
- :mod:`~thunder_fp8shard.testing.trained`: which plans of a run trained, and a step's totals over them.
"""
