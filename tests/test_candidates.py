"""Candidate discovery (thunder_fp8shard.analysis.candidates) on a real Thunder FSDP ZeRO-3 trace: which saved tensors the
pass considers, by ``candidates="fp8"`` or ``"all"``."""

from thunder.core import dtypes

from thunder_fp8shard.analysis.candidates import FLOAT8, TENSOR, find_candidates, te_quantized_names
from thunder_fp8shard.analysis.saved import forward_saved

WEIGHT_SHAPES = {(64, 24), (45, 64), (7, 45)}  # FakeFP8MLP((24, 64, 45, 7))
ACTIVATION_SHAPES = {(3, 24), (3, 64), (3, 45)}  # its inputs per layer, batch 3


def test_fp8_candidates_are_exactly_the_saved_float8_tensors(fsdp_traces):
    fw, _, _ = fsdp_traces
    found = find_candidates(forward_saved(fw)[0], "fp8", te_quantized_names(fw))
    assert {tuple(c.proxy.shape) for c in found} == WEIGHT_SHAPES | ACTIVATION_SHAPES
    assert all(c.kind == FLOAT8 and c.payload_bytes == c.proxy.numel for c in found)  # 1 byte per element


def test_all_candidates_adds_the_other_saved_tensors(fsdp_traces):
    fw, _, _ = fsdp_traces
    found = find_candidates(forward_saved(fw)[0], "all", te_quantized_names(fw))
    saved = {p.name for p in forward_saved(fw)[0]}
    assert {c.name for c in found} == saved
    f32 = [c for c in found if c.kind == TENSOR]
    assert f32 and all(c.proxy.dtype == dtypes.float32 and c.payload_bytes == 4 * c.proxy.numel for c in f32)
