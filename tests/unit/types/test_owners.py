from kvcache import Owner, OwnerKind
from kvcache.types.owners import FREE, FREE_CODE, describe_code, owner_code


def test_codes_round_trip():
    for kind in OwnerKind:
        o = Owner(kind, 0 if kind is OwnerKind.FREE else 12345)
        assert Owner.from_code(o.code) == o
        assert owner_code(kind, o.id) == o.code


def test_codes_distinct_across_kinds():
    codes = {Owner(k, 7).code for k in OwnerKind if k is not OwnerKind.FREE}
    assert len(codes) == len(OwnerKind) - 1 and FREE_CODE not in codes


def test_names():
    assert str(FREE) == "free"
    assert describe_code(Owner(OwnerKind.NODE, 12).code) == "node#12"
    assert describe_code(Owner(OwnerKind.OP_PREFETCH, 3).code) == "op:prefetch#3"
