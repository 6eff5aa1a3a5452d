"""The bucket byte layout: aligned segments, padding to the world size, and the pieces each rank keeps."""

import pytest

from thunder_fp8shard.planning.layout import ALIGN, bucket_layout


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("sizes", [[315], [45, 1000, 7], [256, 256], [1, 2, 3, 4, 5, 6, 7]])
def test_ranks_pieces_rebuild_every_segment_exactly_once(sizes, world_size):
    lay = bucket_layout(sizes, world_size)
    assert all(off % ALIGN == 0 for off in lay.offsets)
    assert all(a + s <= b for a, s, b in zip(lay.offsets, lay.sizes, lay.offsets[1:]))  # no overlap
    assert lay.gathered_nbytes % world_size == 0 and lay.gathered_nbytes >= lay.nbytes
    assert lay.shard_nbytes * world_size - lay.nbytes < world_size  # padding only to a multiple of the world size
    # simulate every rank's shard from its pieces, "all-gather" them, and read the segments back
    segments = [bytes((k * 37 + i) % 251 for i in range(s)) for k, s in enumerate(sizes)]
    gathered = bytearray()
    for rank in range(world_size):
        shard = bytearray(lay.shard_nbytes)
        for k, start, stop, at in lay.pieces(rank):
            assert 0 <= at and at + stop - start <= lay.shard_nbytes
            shard[at : at + stop - start] = segments[k][start:stop]
        gathered += shard
    for k, (off, s) in enumerate(zip(lay.offsets, lay.sizes)):
        assert bytes(gathered[off : off + s]) == segments[k]


def test_layout_of_nothing_and_bad_world_size():
    assert bucket_layout([], 2).nbytes == 0
    with pytest.raises(ValueError):
        bucket_layout([4], 0)
