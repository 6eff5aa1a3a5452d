"""CPU cost of one call of the pass's forward run-time operators, in microseconds (no device, no collective).

Times what a step pays in Python for the compaction copies (``fp8shard_compact`` of one and of four saved views, the
shape of LitGPT's ``v``, shrunk) and, where this version of the pass has them, the two first-call checks once they are
done (``fp8shard_audit``, ``fp8shard_calibrate``): each through the operator's implementation as the trace calls it
(``ops._<name>``, the module function each operator's ``<name>_impl`` looks up and calls). Tiny tensors, so that the figure is the Python around the copy.
Usage: python benchmarks/op_call_cost.py [--repeat 20000]
"""

from __future__ import annotations

import argparse
import inspect
import json
import timeit


def per_call_us(fn, repeat: int) -> float:
    """The best of 5 runs of ``repeat`` calls, per call."""
    fn()  # first call: works out what later calls keep
    return min(timeit.repeat(fn, number=repeat, repeat=5)) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20000)
    args = parser.parse_args()
    import torch

    from thunder_fp8shard.runtime import ops

    qkv = torch.randn(1, 4, 8, 3, 16)  # (batch, groups, seq, q/k/v, head dim): v is a strided view of it
    v = qkv[:, :, :, 2].transpose(1, 2)
    views = (v, v[:, :1], v[:, 1:], v.transpose(2, 3))
    rows = {}
    compact = ops._compact
    extra = _extra_args(ops)
    rows["fp8shard_compact, 1 view"] = per_call_us(lambda: compact((v,), *extra), args.repeat)
    rows["fp8shard_compact, 4 views"] = per_call_us(lambda: compact(views, *extra), args.repeat)
    rows["torch.empty_like + copy_, 1 view (floor)"] = per_call_us(lambda: torch.empty_like(v).copy_(v), args.repeat)
    if hasattr(ops, "_audit"):
        from thunder_fp8shard.runtime.audit import SavedAudit

        a = _blank(SavedAudit, expected=[], names=[])
        a.done, a.counting = True, False
        audit = ops._audit
        rows["fp8shard_audit, done"] = per_call_us(lambda: audit((v,), a), args.repeat)
    if hasattr(ops, "_calibrate"):
        from thunder_fp8shard.runtime.audit import Calibration

        c = _blank(Calibration, audit=a)
        c.done = True
        calibrate = ops._calibrate
        rows["fp8shard_calibrate, done"] = per_call_us(lambda: calibrate(c), args.repeat)
    for name, us in rows.items():
        print(f"{us:8.2f} us  {name}")
    print(json.dumps({k: round(us, 3) for k, us in rows.items()}))


def _blank(cls, **given):
    """``cls`` made with ``given`` and None for its other required arguments (their names differ by version)."""
    required = [p.name for p in inspect.signature(cls).parameters.values() if p.default is p.empty]
    return cls(*[given.get(name) for name in required])


def _extra_args(ops) -> tuple:
    """The call-site constants ``fp8shard_compact`` takes after its views, where this version has them."""
    if hasattr(ops, "CompactCopies"):
        return (ops.CompactCopies(),)
    return ()


if __name__ == "__main__":
    main()
