"""kvcache.ledger.copy: whole pages copied between a device pool and a host pool, byte for byte, over kvc's own
tensors and an engine's layer-first ones, on the tests' device (KVC_TEST_DEVICE)."""

import numpy as np
import pytest
import torch

from devices import TEST_DEVICE, needs_cuda
from kvcache.ledger.copy import Copier, copy_pages
from kvcache.ledger.kv import KVPages
from kvcache.ledger.pools import SlotPool

PS = 4


def filled(pool, seed):
    """Random bytes in every page of `pool`; returns them as [pages, page_bytes]."""
    rows = np.random.default_rng(seed).integers(0, 256, (pool.num_pages, pool.page_bytes), dtype=np.uint8)
    pool.kv.write(np.arange(pool.num_pages), rows)
    return rows


def pools(kind, pages=8, head_dim=4, dtype=torch.float16):
    """(device pool, host pool) of `pages` pages: kvc's own token-major, or over an engine's per-layer K and V."""
    if kind == "own":
        bpt = 2 * 3 * head_dim * 2
        device = SlotPool("device", pages, PS, bpt, device=TEST_DEVICE)
    else:
        k = [torch.zeros(pages * PS, 2, head_dim, dtype=dtype, device=TEST_DEVICE) for _ in range(3)]
        v = [torch.zeros(pages * PS, 2, head_dim, dtype=dtype, device=TEST_DEVICE) for _ in range(3)]
        kv = KVPages.layer_first(k, v, PS)
        bpt = kv.page_bytes // PS
        device = SlotPool("device", pages, PS, bpt, kv=kv)
    host = SlotPool("host", pages + 3, PS, bpt, pin_memory=device.device_type == "cuda")
    return device, host


def finish(event):
    if event is not None:
        event.synchronize()


@pytest.mark.parametrize("kind, head_dim", [("own", 4), ("layer_first", 4), ("layer_first", 3)])
def test_backup_and_load_back_move_exact_bytes_between_scattered_pages(kind, head_dim):
    device, host = pools(kind, head_dim=head_dim)
    copier = Copier(device, host)
    want = filled(device, 1)
    host_before = filled(host, 2)
    finish(copier.copy(device, np.array([5, 1, 3, 4]), host, np.array([9, 0, 2, 3])))  # 3, 4 -> 2, 3: a run
    got = host.kv.read(np.arange(host.num_pages))
    expect = host_before.copy()
    expect[[9, 0, 2, 3]] = want[[5, 1, 3, 4]]
    assert np.array_equal(got, expect)
    # and back, into other device pages
    finish(copier.copy(host, np.array([0, 9, 7]), device, np.array([6, 2, 0])))
    expect_device = want.copy()
    expect_device[[6, 2, 0]] = expect[[0, 9, 7]]
    assert np.array_equal(device.kv.read(np.arange(device.num_pages)), expect_device)


def test_a_copy_between_engine_tensors_lands_in_kv_layer_order_in_the_host_page():
    device, host = pools("layer_first")
    k0 = device.kv.views[0]  # layer 0's K, [pages, bytes]
    v2 = device.kv.views[5]  # layer 2's V
    k0[3] = 7
    v2[3] = 9
    finish(Copier(device, host).copy(device, np.array([3]), host, np.array([1])))
    page = host.kv.read(np.array([1]))[0]
    width = k0.shape[1]
    assert (page[:width] == 7).all() and (page[5 * width:] == 9).all() and not page[width:5 * width].any()


def test_a_copier_copies_between_its_own_pools_only_and_counts_pages():
    device, host = pools("own")
    copier = Copier(device, host)
    with pytest.raises(ValueError, match="copy of 2 pages into 1"):
        copier.copy(device, np.array([0, 1]), host, np.array([2]))
    other = SlotPool("host", 4, PS, device.page_bytes // PS)
    with pytest.raises(ValueError, match="asked to copy device -> host"):
        copier.copy(device, np.array([0]), other, np.array([0]))
    assert copier.copy(device, np.array([], dtype=np.int64), host, np.array([], dtype=np.int64)) is None


def test_copy_pages_makes_a_copier_for_one_copy():
    device, host = pools("own")
    want = filled(device, 3)
    finish(copy_pages(device, np.array([2]), host, np.array([4])))
    assert np.array_equal(host.kv.read(np.array([4]))[0], want[2])


# --- on a GPU -------------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("kind", ["own", "layer_first"])
def test_on_a_gpu_the_host_pool_is_moved_by_the_kernels_and_a_copy_completes_by_its_event(kind):
    device, host = (SlotPool("device", 64, PS, 256, device="cuda"), SlotPool("host", 64, PS, 256, pin_memory=True)) \
        if kind == "own" else pools(kind, pages=64)
    copier = Copier(device, host)
    assert copier.aliased and copier.stream is not None
    assert len(copier._arenas) == 1  # every layer's K and V in one arena: one gather and one scatter a copy
    want = filled(device, 4)
    event = copier.copy(device, np.arange(63, -1, -1), host, np.arange(64))
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    assert np.array_equal(host.kv.read(np.arange(64)), want[::-1])


@needs_cuda
def test_on_a_gpu_a_backup_reads_what_the_engine_queued_before_it_without_any_wait_by_the_caller():
    device, host = SlotPool("device", 256, PS, 4096, device="cuda"), SlotPool("host", 256, PS, 4096, pin_memory=True)
    copier = Copier(device, host)
    for round_ in range(1, 6):
        # the engine's kernels on its stream: a long one, then the write of the pages (nothing synchronizes)
        big = torch.randn(2048, 2048, device="cuda")
        for _ in range(4):
            big = big @ big / 2048
        device.pages.fill_(round_)
        event = copier.copy(device, np.arange(256), host, np.arange(256))
        event.synchronize()
        assert (host.kv.read(np.arange(256)) == round_).all()
