"""kvcache.ledger.arena: a page's spans over many tensors as rows of one view, so that one gather and one scatter
move whole pages of every span.

On a GPU the view comes from the CUDA array interface; here the same index arithmetic runs over CPU tensors through a
view made with ctypes, over layouts generated from their parts: layers, K and V or MLA's one latent, element dtype,
heads and head size, tokens a page, and separate allocations or views of one buffer with gaps between them."""

import ctypes
import itertools

import numpy as np
import pytest
import torch

from kvcache.errors import InvalidConfig
from kvcache.ledger.arena import SpanArena, arenas
from kvcache.ledger.kv import KVPages
from kvcache.ledger.pools import SlotPool


def cpu_view(ptr, nbytes):
    """A uint8 tensor over `nbytes` bytes at `ptr` (the CPU twin of the copier's CUDA address view)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def refusing_view(ptr, nbytes):
    raise RuntimeError("no view over foreign memory here")


LAYERS = (1, 3, 32)
KINDS = ("kv", "mla")
DTYPES = (torch.float16, torch.float32, torch.int8)
SHAPES = ((2, 4), (1, 3), (8, 16))  # (heads, head size): 3 makes widths no wider element divides
PAGE_SIZES = (1, 4)
PLACEMENTS = ("separate", "one_buffer")
PAGES = 6

LAYOUTS = list(itertools.product(LAYERS, KINDS, DTYPES, SHAPES, PAGE_SIZES, PLACEMENTS))


def engine_kv(layers, kind, dtype, shape, page_size, placement):
    """(KVPages over an engine's tensors, the buffer they sit in or None): per layer K and V, or one latent, of
    `PAGES` pages; `one_buffer` cuts them out of one allocation with a gap of 3 elements after each (as an engine
    that carves its pools from one block)."""
    count = layers * (2 if kind == "kv" else 1)
    slots = PAGES * page_size + 1  # one slot past the last whole page: the engine's alone
    if placement == "separate":
        tensors, buffer = [torch.zeros((slots, *shape), dtype=dtype) for _ in range(count)], None
    else:
        each = slots * shape[0] * shape[1]
        buffer = torch.zeros(count * (each + 3), dtype=dtype)
        tensors = [buffer[i * (each + 3): i * (each + 3) + each].view(slots, *shape) for i in range(count)]
    k, v = (tensors[:layers], tensors[layers:]) if kind == "kv" else (tensors, None)
    return KVPages.layer_first(k, v, page_size), buffer


def random_pages(kv, seed):
    rows = np.random.default_rng(seed).integers(0, 256, (kv.num_pages, kv.page_bytes), dtype=np.uint8)
    kv.write(np.arange(kv.num_pages), rows)
    return rows


@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(map(str, c)) for c in LAYOUTS])
def test_one_arena_gathers_and_scatters_whole_pages_of_every_span_and_nothing_else(layout):
    kv, buffer = engine_kv(*layout)
    found = arenas(kv, cpu_view)
    assert len(found) == 1 and found[0][0] == 0
    arena = found[0][1]
    assert arena.page_bytes == kv.page_bytes and arena.rows_per_page * arena.row_bytes == kv.page_bytes
    want = random_pages(kv, 1)
    pages = np.array([4, 0, 5, 2])
    got = arena.gather(torch.from_numpy(pages)).view(torch.uint8).numpy()
    assert np.array_equal(got, want[pages])

    before = buffer.view(torch.uint8).clone() if buffer is not None else None
    rows = np.random.default_rng(2).integers(0, 256, (3, kv.page_bytes), dtype=np.uint8)
    arena.scatter(torch.tensor([5, 1, 3]), torch.from_numpy(rows).view(arena.dtype))
    expect = want.copy()
    expect[[5, 1, 3]] = rows
    assert np.array_equal(kv.read(np.arange(kv.num_pages)), expect)
    if buffer is not None:  # the gaps between the engine's tensors, and its slots past the last page, untouched
        changed = (buffer.view(torch.uint8) != before).nonzero().flatten()
        inside = torch.zeros_like(before, dtype=torch.bool)
        base = buffer.data_ptr()
        for view in kv.views:
            start = view.data_ptr() - base
            inside[start: start + view.numel()] = True
        assert inside[changed].all()


def test_the_rows_of_a_page_follow_the_page_bytes_and_a_wide_element_where_alignment_allows():
    kv, _ = engine_kv(3, "kv", torch.float16, (8, 16), 4, "separate")
    arena = SpanArena(kv.views, cpu_view, kv.page_bytes)
    assert arena.dtype == torch.int64  # widths of 1 KiB and 64-byte aligned allocations
    assert arena.rows_per_page == kv.page_bytes // arena.row_bytes
    index = arena.rows_of(torch.tensor([0, 1]))
    assert index.shape == (2 * arena.rows_per_page,)
    per_span = arena.rows_per_page // 6
    # page 1's rows of each span come one span width after page 0's
    assert torch.equal(index[arena.rows_per_page:] - index[:arena.rows_per_page],
                       torch.full((arena.rows_per_page,), per_span))
    odd, _ = engine_kv(1, "mla", torch.int8, (1, 3), 1, "separate")
    assert SpanArena(odd.views, cpu_view, odd.page_bytes).dtype == torch.uint8  # 3-byte pages


@pytest.mark.parametrize("width, align, dtype", [(64, 128, torch.int64), (64, 8, torch.int64), (64, 4, torch.int32),
                                                  (12, 4, torch.int32), (6, 2, torch.int16), (6, 1, torch.uint8)])
def test_the_element_is_the_widest_that_the_rows_and_the_other_side_of_a_copy_divide(width, align, dtype):
    span = torch.zeros(4, width, dtype=torch.uint8)
    arena = SpanArena([span], refusing_view, align)
    assert arena.dtype == dtype and arena.rows.data_ptr() == span.data_ptr()


def test_a_single_span_is_its_own_arena_one_row_a_page_without_any_view_by_address():
    kv = KVPages.own(5, 4, 64, "cpu")
    arena = SpanArena(kv.views, refusing_view, kv.page_bytes)
    assert arena.rows_per_page == 1 and arena.row_bytes == kv.page_bytes
    pages = torch.tensor([3, 1])
    assert arena.rows_of(pages) is pages  # no index arithmetic for kvc's own pool


def test_where_no_view_over_the_spans_is_given_there_is_one_arena_a_span_and_the_bytes_are_the_same():
    kv, _ = engine_kv(3, "kv", torch.float16, (1, 3), 4, "separate")
    found = arenas(kv, refusing_view)
    assert [at for at, _ in found] == [s.offset for s in kv.spans]
    want = random_pages(kv, 3)
    pages = torch.tensor([5, 2])
    got = np.concatenate([a.gather(pages).view(torch.uint8).numpy() for _, a in found], axis=1)
    assert np.array_equal(got, want[[5, 2]])


def test_the_copiers_moves_through_host_columns_land_pages_in_kv_layer_order():
    """What `Copier._move` does on a GPU, here over the CPU host pool: gather into the host pages' columns, and
    scatter back out of them."""
    kv, _ = engine_kv(32, "kv", torch.float16, (2, 4), 4, "separate")
    device = SlotPool("device", PAGES, 4, kv.page_bytes // 4, kv=kv)
    host = SlotPool("host", PAGES + 2, 4, kv.page_bytes // 4)
    want = random_pages(kv, 4)
    (at, arena), = arenas(kv, cpu_view)
    columns = host.pages[:, at:at + arena.page_bytes].view(arena.dtype)
    columns.index_copy_(0, torch.tensor([7, 0]), arena.gather(torch.tensor([1, 5])))
    assert np.array_equal(host.rows()[[7, 0]], want[[1, 5]])
    arena.scatter(torch.tensor([3]), columns.index_select(0, torch.tensor([7])))
    assert np.array_equal(device.kv.read(np.array([3]))[0], want[1])


def test_an_arena_needs_contiguous_spans():
    kv, _ = engine_kv(1, "kv", torch.float16, (2, 4), 4, "separate")
    with pytest.raises(InvalidConfig, match="contiguous"):
        SpanArena([kv.views[0][:, :4]], cpu_view, 1)
    with pytest.raises(InvalidConfig, match="at least one"):
        SpanArena([], cpu_view, 1)
