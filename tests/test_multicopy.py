"""The one-launch copies (``runtime/multicopy.py``): a view's copy item reads exactly the bytes of its compact copy, in
its order (on the CPU, by reading the item's runs out of the storage); on a GPU the kernel writes the bytes torch's
copies write, for runs at any alignment and views of every shape the shard op meets."""

import pytest
import torch

from thunder_fp8shard.runtime import multicopy, ops


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _read(item: multicopy.Item, v: torch.Tensor) -> torch.Tensor:
    """The item's runs of ``v``'s storage, back to back: what the kernel writes."""
    flat, first = _storage_bytes(v), v.storage_offset() * v.element_size()
    runs = [flat[first + p * item.plane_stride + r * item.row_stride:][: item.n]
            for p in range(item.planes) for r in range(item.rows)]
    return torch.cat(runs) if runs else torch.empty(0, dtype=torch.uint8)


def _compact_bytes(v: torch.Tensor) -> torch.Tensor:
    c = torch.empty_permuted(v.shape, ops._stride_order(v.stride()), dtype=v.dtype).copy_(v)
    return _storage_bytes(c)[: c.numel() * c.element_size()]


qkv = torch.randn(2, 6, 4, 3, 8, dtype=torch.bfloat16)  # LitGPT's (B, T, groups, q_per_kv + 2, head size)
VIEWS = {
    "v of qkv, transposed (LitGPT)": qkv[:, :, :, 2].transpose(1, 2),
    "q of qkv": qkv[:, :, :, 0],
    "a transposed matrix": torch.randn(5, 7).t(),
    "columns of a matrix": torch.randn(6, 10)[:, 2:7],
    "three dimensions of gaps": torch.randn(3, 4, 5, 6)[:, :, 1:4, :5],
    "a size-1 dimension between": torch.randn(4, 1, 6)[:, :, 1:],
    "a scalar": torch.tensor(2.5),
    "contiguous": torch.arange(24, dtype=torch.int16).view(2, 3, 4),
    "float8, strided rows": torch.randn(8, 32).to(torch.float8_e4m3fn)[::2],
    "empty": torch.randn(3, 0, 4),
}


@pytest.mark.parametrize("name", VIEWS)
def test_a_views_item_reads_its_compact_copys_bytes_in_order(name):
    v = VIEWS[name]
    item = multicopy.strided_item(v.shape, v.stride(), v.element_size())
    assert item is not None and item.nbytes == v.numel() * v.element_size()
    assert torch.equal(_read(item, v), _compact_bytes(v))


@pytest.mark.parametrize("v", [torch.randn(4, 1).expand(4, 6), torch.randn(6, 8)[:, ::2],
                               torch.randn(3, 4, 5, 6, 7)[::2, ::2, ::2, :, :5]], ids=["expanded", "innermost stride 2",
                                                                                 "four runs of dimensions"])
def test_views_the_kernel_cannot_read_are_no_items(v):
    assert multicopy.strided_item(v.shape, v.stride(), v.element_size()) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_writes_the_bytes_torch_writes():
    dev = torch.device("cuda")
    assert multicopy.kernel(dev) is not None, "the copy kernel did not compile"
    buf = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=dev)
    runs = [(0, 1 << 16), (3, 1000), (17, 1 << 18), (256, 15), (5, 0), (1, 1)]  # (first byte, bytes): any alignment
    views = [v.to(dev) for v in VIEWS.values()] + [torch.randn(64, 4096, 3, 128, device=dev)[:, :, 2].transpose(1, 2)]
    items = [multicopy.Item(n) for _, n in runs]
    items += [multicopy.strided_item(v.shape, v.stride(), v.element_size()) for v in views]
    out = torch.zeros(sum(it.nbytes for it in items) + 64 * len(items), dtype=torch.uint8, device=dev)
    targets, at = [], 3  # odd offsets in the destination too
    for it in items:
        targets.append(out.data_ptr() + at)
        at += it.nbytes + 17
    sources = [buf.data_ptr() + s for s, _ in runs] + [v.data_ptr() for v in views]
    for copies in (multicopy.Copies(items, multicopy.kernel(dev)), multicopy.Copies(items * 2, multicopy.kernel(dev))):
        out.zero_()
        copies(sources * (len(copies.items) // len(items)), targets * (len(copies.items) // len(items)))
        torch.cuda.synchronize()
        at = 3
        expected = [buf[s : s + n] for s, n in runs] + [_compact_bytes(v.cpu()).to(dev) for v in views]
        for it, want in zip(items, expected):
            assert torch.equal(out[at : at + it.nbytes], want)
            at += it.nbytes + 17


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compact_copies_alone_launch_once_and_equal_torchs():
    dev = torch.device("cuda")
    base = torch.randn(2, 64, 4, 3, 32, device=dev, dtype=torch.bfloat16)
    views = (base[:, :, :, 2].transpose(1, 2), base[:, :, :, 0], torch.randn(4, 1, device=dev).expand(4, 6))
    copies = ops.CompactCopies()
    made = copies(views)
    assert copies.launch is not None and copies.items[2] is None  # the expanded view: torch copies it
    assert all(torch.equal(c, v) and c.stride() == torch.empty_permuted(v.shape, ops._stride_order(v.stride()),
                                                                        device=dev).stride()
               for c, v in zip(made, views))


class _CopiesOnTheCPU:
    """Stands for the kernel on the CPU: each item's runs moved with ``memmove`` between the same addresses."""

    def __init__(self, items, device):
        self.items, self.calls = tuple(items), 0

    def __call__(self, sources, targets):
        import ctypes

        self.calls += 1
        for item, src, dst in zip(self.items, sources, targets):
            for p in range(item.planes):
                for r in range(item.rows):
                    at = (p * item.rows + r) * item.n
                    ctypes.memmove(dst + at, src + p * item.plane_stride + r * item.row_stride, item.n)


def test_the_one_launch_path_makes_the_shard_and_copies_torch_makes(single_rank_group, monkeypatch):
    """The shard op's one-launch path (on a CUDA device) run on the CPU with the kernel replaced by ``memmove``s of
    the same items: with and without compaction views, over calls that reuse the worked-out launch, the shard's bytes
    and the compact copies are those of torch's path."""
    from thunder_fp8shard.planning.layout import bucket_layout

    made = []
    monkeypatch.setattr(ops, "_copies_on", lambda tensors, items: made.append(
        _CopiesOnTheCPU(items, torch.device("cpu"))) or made[-1])
    members = [torch.randn(5, 7), torch.arange(11, dtype=torch.int16), torch.randn(3, 3, dtype=torch.float64)]
    views = (VIEWS["v of qkv, transposed (LitGPT)"], VIEWS["a transposed matrix"],
             torch.randn(4, 1).expand(4, 6))  # the last is no item: torch copies it
    for k in (1, 3):
        size = bucket_layout([m.numel() * m.element_size() for m in members], k).shard_nbytes
        spec = ops.ShardSpec(single_rank_group, k, (size,), "slice", False, (("a", "b", "c"),))
        for with_views in (False, True, True):
            shard, _, *copies = ops._shard((tuple(members),), spec, views if with_views else ())
            expected = ops._slice(spec, spec.program, members)
            for *_, n, _, at in spec.program.pieces:  # the alignment gaps between pieces hold no member's bytes
                assert torch.equal(shard[at : at + n], expected[at : at + n])
            assert len(copies) == (3 if with_views else 0)
            for c, v in zip(copies, views):
                assert torch.equal(c, v) and c.stride() == torch.empty_permuted(
                    v.shape, ops._stride_order(v.stride())).stride()
    assert all(c.calls >= 1 for c in made) and len(made) == 4  # a launch for each program and view strides
