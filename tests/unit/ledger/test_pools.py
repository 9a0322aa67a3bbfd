import numpy as np
import pytest

from kvcache import DoubleFree, OwnershipError
from kvcache.types.owners import FREE_CODE, OwnerKind, owner_code
from kvcache.ledger.pools import SlotPool

REQ, NODE, NODE2 = owner_code(OwnerKind.REQUEST, 1), owner_code(OwnerKind.NODE, 5), owner_code(OwnerKind.NODE, 6)


def pool(pages=8, page_size=4, ledger=True):
    return SlotPool("device", pages, page_size, 16, ledger=ledger)


def test_storage_shape_and_page_views():
    p = pool()
    assert tuple(p.storage.shape) == (32, 16) and tuple(p.pages.shape) == (8, 64)
    p.storage.zero_()
    p.pages[3] = 9
    assert (p.storage[12:16] == 9).all() and int(p.storage.sum()) == 9 * 64
    assert list(p.slots(np.array([0, 2]))) == [0, 1, 2, 3, 8, 9, 10, 11]


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
        for move in (lambda: p.transfer(bad, REQ, NODE), lambda: p.free(bad, REQ),
                     lambda: p.disperse(bad, REQ, [(1, FREE_CODE)])):
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
