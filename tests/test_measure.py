import torch

from thunder_fp8shard.testing.measure import saved_bytes


def test_distinct_storages_at_one_address_count_apart_and_views_once():
    """Two storages over one buffer stand for what a reused address looks like (FSDP2 frees an unsharded weight's
    storage in place after its layer, the next layer's all-gather may land there): each counts; a view of a saved
    tensor's storage does not count again."""
    buffer = bytearray(64)
    a, b = torch.frombuffer(buffer, dtype=torch.float32), torch.frombuffer(buffer, dtype=torch.float32)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    w = torch.ones(16, requires_grad=True)
    with saved_bytes() as saved:
        (w * a + w * b).sum() + (w[4:] * a[4:]).sum()
    assert saved.total == 2 * 64  # a and b (w is not needed for w.grad)
