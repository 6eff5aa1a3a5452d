"""``plan_fingerprints.py --compare`` across a move of the pass's modules: the names a trace gives the pass's objects
carry their module's path (``_thunder_fp8shard_ops_ShardSpec_4`` before the package's subpackages,
``_thunder_fp8shard_runtime_ops_ShardSpec_4`` after), which the comparison leaves out; the class and the counter
still count."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import plan_fingerprints as fp  # noqa: E402

BEFORE = "  (t1, t2) = fp8shard_shard(((t0,),), _thunder_fp8shard_ops_ShardSpec_4, ())\n  fp8shard_calibrate(_thunder_fp8shard_audit_Calibration_2)"


def _record(trace: str) -> dict:
    return {"c": {"traces": [trace], "plans": []}}


def test_a_moved_module_is_the_same_behaviour():
    moved = BEFORE.replace("_fp8shard_ops_", "_fp8shard_runtime_ops_").replace("_fp8shard_audit_", "_fp8shard_runtime_audit_")
    assert fp.same_behaviour(_record(BEFORE), _record(moved)) == []


def test_another_class_or_counter_still_differs():
    assert fp.same_behaviour(_record(BEFORE), _record(BEFORE.replace("ShardSpec_4", "ShardSpec_5"))) == ["c"]
    assert fp.same_behaviour(_record(BEFORE), _record(BEFORE.replace("ShardSpec_4", "CompactCopies_4"))) == ["c"]
