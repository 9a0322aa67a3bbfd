import functools

import numpy as np
import pytest
import torch

from kvcache import DoubleFree, InvalidConfig, InvalidInput, OwnershipError
from kvcache.ledger.kv import KVPages
from kvcache.ledger.pools import SlotPool
from kvcache.types.owners import FREE_CODE, OwnerKind, owner_code

REQ, NODE, NODE2 = owner_code(OwnerKind.REQUEST, 1), owner_code(OwnerKind.NODE, 5), owner_code(OwnerKind.NODE, 6)


def pool(pages=8, page_size=4, ledger=True):
    return SlotPool("device", pages, page_size, 16, ledger=ledger)


def test_own_storage_is_one_token_major_span_with_page_views():
    p = pool()
    assert p.kv.owned and p.kv.arrangement == "token" and len(p.kv.views) == 1
    assert tuple(p.pages.shape) == (8, 64) and p.page_rows is not None
    p.pages.zero_()
    p.pages[3] = 9
    assert (p.kv.read(np.array([3])) == 9).all() and int(p.pages.sum()) == 9 * 64
    assert list(p.slots(np.array([0, 2]))) == [0, 1, 2, 3, 8, 9, 10, 11]


def test_a_pool_over_an_engines_kv_must_match_its_geometry():
    kv = KVPages.layer_first([torch.zeros(16, 2, 4, dtype=torch.float16)] * 2, [torch.zeros(16, 2, 4,
                                                                                          dtype=torch.float16)] * 2, 4)
    p = SlotPool("device", 4, 4, 2 * 2 * 2 * 4 * 2, kv=kv)  # 2 layers, K and V, 2 heads of 4 fp16
    assert p.kv is kv and p.pages is None and p.page_rows is None and p.page_bytes == kv.page_bytes
    with pytest.raises(InvalidConfig, match="holds 4 pages of 256 bytes; the pool needs 5"):
        SlotPool("device", 5, 4, 64, kv=kv)


def test_alloc_records_owner_and_full_pool_is_a_value():
    p = pool()
    a = p.alloc(5, REQ)
    assert len(set(a.tolist())) == 5 and (p.owners(a) == REQ).all() and p.free_pages == 3
    assert p.alloc(4, REQ) is None and p.free_pages == 3  # nothing taken on failure


def test_transfer_and_free():
    p = pool()
    a = p.alloc(3, REQ)
    p.transfer(a, REQ, NODE)
    assert (p.owners(a) == NODE).all()
    p.free(a, NODE)
    assert p.free_pages == 8 and (p.ledger_codes() == FREE_CODE).all()


def test_double_free_raises_and_leaves_ledger_unchanged():
    p = pool()
    a = p.alloc(4, NODE)
    p.free(a[:2], NODE)
    before_ledger, before_free = p.ledger_codes(), p.free_list()
    with pytest.raises(DoubleFree) as err:
        p.free(a, NODE)  # a[0], a[1] are already free
    assert err.value.page == int(a[0]) and err.value.actual == "free" and err.value.expected == "node#5"
    assert err.value.slots == (int(a[0]) * 4, int(a[0]) * 4 + 3)
    assert (p.ledger_codes() == before_ledger).all() and (p.free_list() == before_free).all()


def test_wrong_owner_raises_before_any_change():
    p = pool()
    a = p.alloc(2, NODE)
    b = p.alloc(2, NODE2)
    before = p.ledger_codes()
    with pytest.raises(OwnershipError) as err:
        p.transfer(np.concatenate([a, b]), NODE, REQ)
    assert not isinstance(err.value, DoubleFree)
    assert err.value.actual == "node#6" and err.value.mismatched == 2
    assert (p.ledger_codes() == before).all()


def test_page_listed_twice_in_one_free_is_a_double_free():
    p = pool()
    a = p.alloc(3, NODE)
    with pytest.raises(DoubleFree):
        p.free(np.array([a[0], a[1], a[0]]), NODE)
    assert p.free_pages == 5 and (p.owners(a) == NODE).all()


def test_disperse_partitions_one_holding():
    p = pool()
    a = p.alloc(6, REQ)
    p.disperse(a, REQ, [(2, FREE_CODE), (4, NODE), (5, NODE2), (6, FREE_CODE)])
    assert (p.owners(a[2:4]) == NODE).all() and p.owners(a[4:5])[0] == NODE2
    assert p.free_pages == 5
    with pytest.raises(OwnershipError):
        p.disperse(a[2:4], REQ, [(2, FREE_CODE)])  # owned by NODE now
    with pytest.raises(ValueError):
        p.disperse(a[2:4], NODE, [(1, FREE_CODE)])  # parts must cover the holding


def test_the_array_an_alloc_returned_moves_without_a_per_page_check_only_while_it_proves_ownership():
    # A move of exactly the array alloc returned skips the gather of owners; every way the proof could be stale
    # must fall back to the full check.
    p = pool(pages=16)
    a = p.alloc(3, REQ)
    p.disperse(a, REQ, [(3, NODE)])  # the proven path
    assert (p.owners(a) == NODE).all()
    with pytest.raises(OwnershipError):  # the proof went with the move: the same array is checked again
        p.disperse(a, REQ, [(3, FREE_CODE)])

    b = p.alloc(2, REQ)
    b[0] = a[0]  # changed in place (through a view the engine was handed): node-owned now
    with pytest.raises(OwnershipError):
        p.free(b, REQ)
    assert (p.owners(a) == NODE).all() and p.free_pages == 11

    c = p.alloc(2, NODE2)
    p.transfer(c[:1], NODE2, REQ)  # one page of the holding moved away: the holding no longer proves anything
    with pytest.raises(OwnershipError):
        p.free(c, NODE2)
    assert p.owners(c).tolist() == [REQ, NODE2]

    d = p.alloc(1, REQ)
    e = p.alloc(1, REQ)  # a second alloc of the same owner: only the latest array is a proof, both move
    p.free(d, REQ)
    p.free(e, REQ)
    assert p.free_pages == 9 and (p.owners(np.concatenate([d, e])) == FREE_CODE).all()


def test_free_is_not_linear_in_pool_size():
    # Free and alloc move only the pages involved: a pool of a million pages frees 1 page as cheaply as a small one.
    big = SlotPool("host", 1_000_000, 1, 1)
    pages = big.alloc(1, NODE)
    big.free(pages, NODE)
    assert big.free_pages == 1_000_000 and len(big._stack) == 1_000_000  # fixed-size stack, never grown


def test_ledger_off_skips_checks():
    p = pool(ledger=False)
    a = p.alloc(2, NODE)
    p.transfer(a, REQ, NODE2)  # would raise with the ledger on
    p.free(a, REQ)
    assert p.free_pages == 8


@pytest.mark.parametrize("ledger", [True, False])
def test_every_ledger_move_validates_its_arguments_before_any_change(ledger):
    from kvcache import InvalidInput

    p = pool(ledger=ledger)
    a = p.alloc(3, REQ)
    before = (p.ledger_codes(), p.free_list(), p.free_pages)

    def unchanged():
        return (np.array_equal(p.ledger_codes(), before[0]) and np.array_equal(p.free_list(), before[1])
                and p.free_pages == before[2])

    for n in (-30, -1, 9, 2.0, True, None):  # negative, more than the pool, not an int
        with pytest.raises(InvalidInput):
            p.alloc(n, REQ)
        assert unchanged()
    for bad in (np.array([-1]), np.array([8]), np.array([[a[0]]]), np.array([float(a[0])]), [int(a[0])]):
        for move in (functools.partial(p.transfer, bad, REQ, NODE), functools.partial(p.free, bad, REQ),
                     functools.partial(p.disperse, bad, REQ, [(1, FREE_CODE)])):
            with pytest.raises(InvalidInput):
                move()
            assert unchanged()
    for parts in ([(2, FREE_CODE)], [(4, FREE_CODE)], [(2, NODE), (1, FREE_CODE), (3, FREE_CODE)],
                  [(-1, NODE), (3, FREE_CODE)], []):
        with pytest.raises(InvalidInput):
            p.disperse(a, REQ, parts)
        assert unchanged()
    p.disperse(a, REQ, [(1, NODE), (3, FREE_CODE)])  # a valid one still goes through
    assert p.free_pages == 7


def test_an_alloc_off_the_untouched_stack_is_a_run_written_once_by_the_move_that_takes_its_proof():
    # A fresh pool's stack holds each page at its own index: an alloc takes the run below the top, and its owners
    # are written once, by the move that takes the proof back. Until then the ledger's own entries still read FREE,
    # and every reader (owners, ledger_codes, a full check) sees the run's owner.
    p = pool(pages=16)
    a = p.alloc(4, REQ)
    assert a.tolist() == [12, 13, 14, 15] and a.dtype == np.int64
    assert (p._owner[12:16] == FREE_CODE).all()  # not written yet: one write, by the next move
    assert (p.owners(a) == REQ).all()  # a reader writes it first
    b = p.alloc(2, REQ)
    p.transfer(b, REQ, NODE)  # proven: written once, with NODE
    assert (p._owner[10:12] == NODE).all() and (p.ledger_codes()[10:12] == NODE).all()
    c = p.alloc(3, NODE2)
    with pytest.raises(OwnershipError):  # another owner naming the run's pages: the full check sees NODE2
        p.transfer(c[:1].copy(), REQ, NODE)
    assert p.owners(c).tolist() == [NODE2] * 3


def test_an_unwritten_run_is_written_before_its_owner_allocs_again_or_its_proof_fails():
    p = pool(pages=16)
    a = p.alloc(3, REQ)
    p.alloc(2, REQ)  # a's proof is gone; its run must be in the ledger now
    assert (p._owner[13:16] == REQ).all()
    with pytest.raises(OwnershipError):
        p.free(a, NODE)  # the full check reads a's owner from the ledger
    b = p.alloc(2, NODE2)
    b[0] = a[0]  # a stale proof: the run is written, then the full check refuses the move
    with pytest.raises(OwnershipError):
        p.transfer(b, NODE2, NODE)
    assert p.owners(np.array([9, 10])).tolist() == [NODE2, NODE2] and (p.owners(a) == REQ).all()
    assert p.ledger_codes().tolist().count(FREE_CODE) == 16 - 7


def test_a_push_on_the_free_stack_ends_the_run_and_later_allocs_copy_the_stack():
    p = pool(pages=16)
    a = p.alloc(4, REQ)
    p.free(a[::-1].copy(), REQ)  # pushed in another order: the top of the stack no longer holds page i at i
    assert p._run_end == 12
    b = p.alloc(4, NODE)
    assert b.tolist() == [15, 14, 13, 12]  # off the stack, as pushed
    assert (p.owners(b) == NODE).all()
    c = p.alloc(4, NODE2)  # below the push: still a run
    assert c.tolist() == [8, 9, 10, 11] and (p.owners(c) == NODE2).all()
    p.disperse(c, NODE2, [(1, FREE_CODE), (4, REQ)])  # a proven run's parts: slices of its run
    assert p.owners(c).tolist() == [FREE_CODE, REQ, REQ, REQ] and p._run_end == 8


def test_disperse_parts_past_the_holding_raise_and_leave_the_neighbours_of_a_run_alone():
    p = pool(pages=16)
    high = p.alloc(4, NODE)  # pages 12..15: the run's neighbours just above
    p.transfer(high, NODE, NODE2)
    a = p.alloc(4, REQ)
    assert a.tolist() == [8, 9, 10, 11]
    with pytest.raises(InvalidInput):  # parts to 8 of a holding of 4: a slice of the run would reach pages 12..15
        p.disperse(a, REQ, [(2, NODE), (8, NODE)])
    assert (p.owners(a) == REQ).all() and (p.owners(high) == NODE2).all() and p.free_pages == 8
