"""One rank's litgpt run that also records what TransformerEngine computed, for the bitwise tests of
``fp8_forward_gather``: each recipe state's amax history and scale, and each TE linear's FP8 weight bytes and
``_scale_inv``. ``recipe``: ``"default"`` leaves TE's recipe alone (a new one each call, scale 1); ``"persistent"``
installs one ``DelayedScaling()`` so scales carry over; ``"no_reduce_amax"`` likewise without amax reduction."""

from __future__ import annotations

import hashlib

import torch


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:32]


def _rowwise(w) -> torch.Tensor | None:
    """The weight's FP8 bytes in row layout [out, in]: ``_data``, or ``_transpose`` transposed back."""
    data = getattr(w, "_data", None)
    if data is not None:
        return data
    tr = getattr(w, "_transpose", None)
    if tr is not None and not getattr(w, "_transpose_invalid", False):
        return tr.t()
    return None


def _describe(w) -> dict:
    rows = _rowwise(w)
    si = getattr(w, "_scale_inv", None)
    return {"type": type(w).__name__, "shape": list(w.shape) if hasattr(w, "shape") else None,
            "bytes": None if rows is None else _digest(rows),
            "scale_inv": None if si is None else [float(v).hex() for v in si.detach().float().cpu().reshape(-1)]}


def run_rank_recording_te(rank: int, world_size: int, cfg, recipe: str = "default") -> dict:
    from transformer_engine.pytorch import quantization
    from transformer_engine.pytorch.ops.basic.basic_linear import BasicLinear

    from thunder_fp8shard.testing.litgpt_run import run_rank

    if recipe in ("persistent", "no_reduce_amax"):
        from transformer_engine.common.recipe import DelayedScaling

        quantization.FP8GlobalStateManager.quantization_state.fp8_recipe = DelayedScaling(
            reduce_amax=recipe == "persistent")
    elif recipe != "default":
        raise ValueError(f"recipe must be 'default', 'persistent' or 'no_reduce_amax', got {recipe!r}")
    states, fwd, bwd = [], [], []
    create, forward, backward = (quantization.RecipeState.create, BasicLinear._functional_forward,
                                 BasicLinear._functional_backward)

    def recording_create(*args, **kwargs):
        s = create(*args, **kwargs)
        states.append((kwargs.get("mode"), s))
        return s

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        fwd.append(_describe(out[2] if out[2] is not None else kwargs.get("weight")))
        return out

    def recording_backward(*args, **kwargs):
        bwd.append(_describe(kwargs.get("weight")))
        return backward(*args, **kwargs)

    quantization.RecipeState.create = staticmethod(recording_create)
    BasicLinear._functional_forward = staticmethod(recording_forward)
    BasicLinear._functional_backward = staticmethod(recording_backward)
    try:
        out = run_rank(rank, world_size, cfg)
    finally:
        quantization.RecipeState.create = staticmethod(create)
        BasicLinear._functional_forward = staticmethod(forward)
        BasicLinear._functional_backward = staticmethod(backward)
    torch.cuda.synchronize()
    out["te_states"] = [{"mode": mode, "amax_history": s.amax_history.detach().cpu().clone(),
                         "scale": s.scale.detach().cpu().clone()} for mode, s in states]
    out["te_forward_weights"] = fwd
    out["te_backward_weights"] = bwd
    return out


def assert_te_records_equal(a: list[dict], b: list[dict], what: str) -> None:
    """Every rank's TE states and the FP8 weight bytes and scale-inverses TE used, bitwise equal between two runs; each
    difference is named."""
    for ra, rb in zip(a, b):
        r = ra["rank"]
        sa, sb = ra["te_states"], rb["te_states"]
        assert [s["mode"] for s in sa] == [s["mode"] for s in sb], (
            f"{what}, rank {r}: TE created different recipe states: {[s['mode'] for s in sa]} vs "
            f"{[s['mode'] for s in sb]}")
        for i, (x, y) in enumerate(zip(sa, sb)):
            for key in ("amax_history", "scale"):
                if not torch.equal(x[key], y[key]):
                    diff = (x[key] != y[key]).nonzero().tolist()[:8]
                    raise AssertionError(
                        f"{what}, rank {r}: TE state {i} ({x['mode']}) {key} differs at {diff}: "
                        f"{[x[key][tuple(d)].item() for d in diff]} vs {[y[key][tuple(d)].item() for d in diff]}")
        for kind in ("te_forward_weights", "te_backward_weights"):
            wa, wb = ra[kind], rb[kind]
            assert len(wa) == len(wb), f"{what}, rank {r}: {len(wa)} vs {len(wb)} TE linear calls ({kind})"
            bad = [(i, x, y) for i, (x, y) in enumerate(zip(wa, wb))
                   if (x["bytes"], x["scale_inv"], x["shape"]) != (y["bytes"], y["scale_inv"], y["shape"])]
            assert not bad, (f"{what}, rank {r}: {len(bad)} of {len(wa)} TE linear calls saw other FP8 weight bytes "
                             f"or scale-inverses ({kind}); first: call {bad[0][0]}: {bad[0][1]} vs {bad[0][2]}")
            assert all(x["bytes"] is not None for x in wa), f"{what}, rank {r}: a TE weight had no FP8 bytes ({kind})"
