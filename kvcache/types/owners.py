"""Typed slot owners and their compact encoding in the ownership ledger.

Every page of every pool has exactly one owner at every moment: FREE, a request's fresh allocation, a tree node,
an in-flight operation (by kind) or a staged prefetch. The ledger stores owners as int64 codes so checks are
vectorised; `Owner` is the readable value that errors and audits show.
"""

from __future__ import annotations

import enum

import msgspec

from .ids import OwnerCode

_KIND_SHIFT = 48
_ID_MASK = (1 << _KIND_SHIFT) - 1


class OwnerKind(enum.IntEnum):
    """Who can own a slot. The op kinds are owners of their own so a ledger entry says what is in flight."""

    FREE = 0
    REQUEST = 1  # a request's fresh allocation, between admit and commit
    NODE = 2  # a radix tree node's device or host copy
    STAGED = 3  # a parked buffer-mode prefetch
    OP_BACKUP = 4  # device -> host copy in flight
    OP_STORAGE_WRITE = 5  # host -> L3 write in flight
    OP_PREFETCH = 6  # L3 -> host fetch in flight
    OP_LOAD_BACK = 7  # host -> device copy in flight


# How an owner kind reads in messages and in the audit report.
_KIND_NAMES = {
    OwnerKind.FREE: "free",
    OwnerKind.REQUEST: "request",
    OwnerKind.NODE: "node",
    OwnerKind.STAGED: "staged",
    OwnerKind.OP_BACKUP: "op:backup",
    OwnerKind.OP_STORAGE_WRITE: "op:storage_write",
    OwnerKind.OP_PREFETCH: "op:prefetch",
    OwnerKind.OP_LOAD_BACK: "op:load_back",
}


class Owner(msgspec.Struct, frozen=True, gc=False):
    """One owner: a kind and an id unique within that kind (node id, request handle, op id, staged id)."""

    kind: OwnerKind
    id: int  # 0 <= id < 2**48; 0 for FREE

    @property
    def code(self) -> OwnerCode:
        """The int64 the ledger stores for this owner."""
        return OwnerCode((int(self.kind) << _KIND_SHIFT) | self.id)

    @classmethod
    def from_code(cls, code: int) -> "Owner":
        """Decode a ledger entry."""
        code = int(code)
        return cls(OwnerKind(code >> _KIND_SHIFT), code & _ID_MASK)

    def __str__(self) -> str:
        name = _KIND_NAMES[self.kind]
        return name if self.kind is OwnerKind.FREE else f"{name}#{self.id}"


FREE = Owner(OwnerKind.FREE, 0)
FREE_CODE = OwnerCode(0)


# Indexed by kind (int(kind) costs a call on the hot path); the kinds are numbered 0, 1, 2, ... for this.
_KIND_BASE = tuple(int(kind) << _KIND_SHIFT for kind in OwnerKind)
assert all(int(kind) == i for i, kind in enumerate(OwnerKind)), "OwnerKind values must be 0..n-1 (see _KIND_BASE)"


def owner_code(kind: OwnerKind, ident: int) -> OwnerCode:
    """The ledger code of (kind, id) without building an Owner (hot paths)."""
    return _KIND_BASE[kind] | ident  # type: ignore[return-value]  # an int, as OwnerCode is


def describe_code(code: int) -> str:
    """A ledger code as text, e.g. ``node#12``."""
    return str(Owner.from_code(code))
