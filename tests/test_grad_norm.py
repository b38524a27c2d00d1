"""The global gradient norm per piece of the model: the same bits however the layers are grouped."""

from __future__ import annotations

import pytest
import torch

from sysx.optim import StageOptimizer
from sysx.optim.grad_norm import NormSlots, Pieces, grid_cuts, grid_shards, layer_pieces, piece_chunks, piece_slots
from sysx.optim.stage import CHUNK_ELEMS, StageReport
from sysx.optim.validation import reduce_flags

# layers longer than a chunk and not multiples of it, so a unit's own chunks straddle its layers
NUMELS = [CHUNK_ELEMS + 12_345, 70_001, 2 * CHUNK_ELEMS + 3, 10, CHUNK_ELEMS - 7]


def layer_grads() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) * (10.0**i) for i, n in enumerate(NUMELS)]


def reports(groups: list[range], *, pieces: bool) -> list[StageReport]:
    """Each group of layers as one stage, loaded with the layers' gradients, as its worker reports it."""
    grads, out = layer_grads(), []
    for layers in groups:
        flat = torch.cat([grads[i] for i in layers])
        stage = StageOptimizer(
            f"u{layers.start}",
            torch.zeros(flat.numel()),
            lr=1e-3,
            backend="torch",
            pieces=layer_pieces(NUMELS, layers) if pieces else None,
        )
        found_inf, sq = stage.load_grads(flat)
        out.append(StageReport(stage.name, found_inf=found_inf, sq_norm=sq, pieces=stage.piece_squares))
        stage.close()
    return out


def reduced(rs: list[StageReport], of: int) -> tuple[int, float]:
    return reduce_flags([r.found_inf for r in rs], [r.sq_norm for r in rs], None, pieces=[r.pieces for r in rs], of=of)


LAYOUTS = [
    [range(0, 5)],
    [range(0, 2), range(2, 5)],
    [range(0, 1), range(1, 3), range(3, 5)],
    [range(i, i + 1) for i in range(5)],
]


def test_the_norm_has_the_same_bits_in_every_grouping_of_the_layers() -> None:
    norms = [reduced(reports(groups, pieces=True), len(NUMELS)) for groups in LAYOUTS]
    assert all(n == norms[0] for n in norms), norms
    want = sum(float(torch.linalg.vector_norm(g.double())) ** 2 for g in layer_grads())
    assert norms[0][0] == 0 and norms[0][1] == pytest.approx(want, rel=1e-8)


def test_a_unit_sums_each_layer_in_chunks_from_the_layers_start() -> None:
    """What makes the pieces equal: a layer is cut into chunks from its own start wherever it sits."""
    alone = list(piece_chunks(layer_pieces(NUMELS, range(2, 3)), CHUNK_ELEMS))
    inside = [(p, lo, hi) for p, lo, hi in piece_chunks(layer_pieces(NUMELS, range(0, 3)), CHUNK_ELEMS) if p == 2]
    offset = NUMELS[0] + NUMELS[1]
    assert [(p, lo - offset, hi - offset) for p, lo, hi in inside] == alone and len(alone) == 3
    a = dict(reports([range(2, 3)], pieces=True)[0].pieces)
    b = dict(reports([range(0, 3)], pieces=True)[0].pieces)
    assert a[2] == b[2]  # the same bits


def test_a_replicas_shard_holds_the_cut_of_its_layers() -> None:
    p = layer_pieces([10, 20, 30], range(0, 3), range(15, 45))
    assert p == Pieces(3, ((1, 0, 15), (2, 15, 15))) and p.numel == 30
    assert layer_pieces([10, 20, 30], range(1, 3)).spans == ((1, 0, 20), (2, 20, 30))


def test_pieces_that_do_not_tile_the_buffer_or_a_report_without_them_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        Pieces(2, ((0, 0, 5), (1, 6, 5)))
    with pytest.raises(ValueError, match="the pieces cover 5 elements, the parameters 6"):
        StageOptimizer("s0.0", torch.zeros(6), lr=1e-3, backend="torch", pieces=Pieces(1, ((0, 0, 5),)))
    rs = reports([range(0, 2)], pieces=False)
    with pytest.raises(ValueError, match="without its pieces"):
        reduced(rs, len(NUMELS))


def test_an_overflowed_stage_is_counted_and_left_out_of_the_sum() -> None:
    rs = reports([range(0, 2), range(2, 5)], pieces=True)
    bad = StageReport("u9", found_inf=True, sq_norm=float("inf"), pieces=((4, float("inf")),))
    assert reduced([*rs, bad], len(NUMELS)) == (1, reduced(rs, len(NUMELS))[1])


def test_finite_gradients_whose_squares_overflow_fp32_are_not_an_overflow() -> None:
    """A chunk's norm is taken in fp32 and again in fp64 when that overflows: gradients of 1e30 are
    finite (a sum of squares of 1e65), an inf among them is an overflow."""
    grads = torch.full((CHUNK_ELEMS + 5,), 1e30)
    stage = StageOptimizer("big", torch.zeros(grads.numel()), lr=1e-3, backend="torch")
    found_inf, sq = stage.load_grads(grads)
    assert not found_inf and sq == pytest.approx(1e60 * grads.numel(), rel=1e-6)
    grads[3] = float("inf")
    assert stage.load_grads(grads)[0]
    stage.close()


# ------------------------------------------------------------- a piece cut between ranks (spread)
def test_grid_shards_cut_on_each_layers_chunk_grid() -> None:
    shards = grid_shards(NUMELS, 4, CHUNK_ELEMS)
    assert shards[0].start == 0 and shards[-1].stop == sum(NUMELS)
    assert all(a.stop == b.start for a, b in zip(shards, shards[1:]))
    starts = [sum(NUMELS[:i]) for i in range(len(NUMELS))]
    for cut in (s.start for s in shards[1:]):
        layer = max(i for i, s in enumerate(starts) if s <= cut)
        assert (cut - starts[layer]) % CHUNK_ELEMS == 0 or cut == starts[layer] + NUMELS[layer], cut
    ideal = sum(NUMELS) / 4
    assert all(abs(len(s) - ideal) <= CHUNK_ELEMS for s in shards), [len(s) for s in shards]
    assert [len(s) for s in grid_shards([10, 20], 4, CHUNK_ELEMS)] == [10, 0, 20, 0]  # small: some empty


@pytest.mark.parametrize("order", [1, -1])
def test_a_layer_cut_between_ranks_keeps_the_norm_bits(order: int) -> None:
    """A layer of 12 chunks (their gradients 1e-3 to 1e3 in scale, so float64 sums round) cut by three
    shards on its chunk grid: the later parts' chunks go to slots of their own, added in chunk order
    after the all-reduce (which adds the ranks' vectors in either order here), and the total equals
    the whole unit's bit for bit. Adding each rank's part in the layer's slot instead (no tails)
    groups the sums differently and does not."""
    numels = [1000, 12 * CHUNK_ELEMS]
    gen = torch.Generator().manual_seed(2)  # a seed whose parts' sums round differently from the whole's
    scales = 10.0 ** torch.randint(-3, 4, (12,), generator=gen).float()
    grads = torch.cat(
        [
            torch.randn(1000, generator=gen),
            torch.randn(numels[1], generator=gen) * scales.repeat_interleave(CHUNK_ELEMS),
        ]
    )

    def total(shards: list[range], slots: NormSlots, tails: bool) -> float:
        parts = []
        for cut in shards:
            pieces = layer_pieces(numels, range(2), cut, slots if tails else None)
            stage = StageOptimizer("s", torch.zeros(len(cut)), lr=1e-3, backend="torch", pieces=pieces)
            stage.load_grads(grads[cut.start : cut.stop])
            parts.append(piece_slots([stage.piece_squares], slots.length))
            stage.close()
        return slots.total(sum(parts[::order]).tolist())

    whole = total([range(sum(numels))], NormSlots(2), False)
    shards = grid_shards(numels, 3, CHUNK_ELEMS)
    assert [s.stop for s in shards] == [1000 + 4 * CHUNK_ELEMS, 1000 + 8 * CHUNK_ELEMS, sum(numels)]
    slots = NormSlots.cut(2, grid_cuts(numels, shards), CHUNK_ELEMS)
    assert slots.tails == ((1, 4, 2),) and slots.length == 2 + 8
    assert total(shards, slots, True) == whole
    assert total(shards, NormSlots(2), False) != whole
