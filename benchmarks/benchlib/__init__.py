"""What the benchmark scripts share, once each, so that each script is its command line and its loop.

- ``stats``: the ABBA schedule and the paired statistics, the operators' CPU a step and the pass's share (pure;
  tested on the CPU).
- ``patches``: the patches to Thunder's ``benchmark_litgpt`` (simulated ranks, the CPU, the pass appended to
  ``thunder.jit`` / ``ThunderCompiler``, the pass's gathers on a side stream).
- ``collectives``: simulated collectives of one kernel each (``--sim-collectives one-kernel``).
- ``op_timer``: chosen operators of compiled programs timed where the programs call them (``--decompose-iters``).
- ``revisions``: another git revision's pass imported beside this checkout's.
- ``steps``: the measured training step (batches, ``step``, the GC log, allocator counters, one timed iteration,
  profiled iterations).
- ``reporting``: the plan as plain data, the device, the flags after ``--``, the results table, the plan-accuracy
  reports.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
