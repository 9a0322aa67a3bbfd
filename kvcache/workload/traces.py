"""Workloads: the JSONL trace format (DESIGN §8) and a synthetic multi-tenant generator.

One request per line::

    {"rid": "r1", "tokens": [1, 2, 3], "extra_key": "t1" | null, "cache_salt": "s" | null, "output_len": 16,
     "ttl_s": 600}

Unknown fields, missing fields, tokens that are not integers in 0 <= t < 2**32, an empty token list, a rid seen
on an earlier line, or a line that is not JSON are errors naming the line (`InvalidTrace`). Blank lines are
skipped. `output_len` and `ttl_s` are optional; `ttl_s` (seconds, > 0: the namespace's time to live the request
asks for, clamped by a cache's TTL policy and ignored by a cache without one) was added after DESIGN §8 pinned the
format, so every older trace stays valid; a trace that uses it is refused by a kvc that predates it.

The generator models what hierarchical prefix caches are for: tenants (each a namespace: extra_key + salt) with
their own system prompt and documents, a prefix whose token ids are the same in every tenant (it must still never
be shared across namespaces), Zipf-like popularity of tenants and documents, and multi-turn conversations whose
next turn extends the previous request with the model's reply and a new user message.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Annotated

import msgspec
import numpy as np

from ..errors import InvalidInput, InvalidTrace
from ..types.namespace import Namespace
from ..types.request import Request

Token = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]


class TraceRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One line of a trace: a request and the namespace it belongs to."""

    rid: str
    tokens: list[Token]
    extra_key: str | None = None
    cache_salt: str | None = None  # never printed; only its fingerprint leaves the Namespace
    output_len: Annotated[int, msgspec.Meta(ge=0)] | None = None  # tokens the request generates (informative)
    ttl_s: Annotated[float, msgspec.Meta(gt=0)] | None = None  # the namespace's time to live it asks for

    def namespace(self) -> Namespace:
        """The request's namespace (the one canonical constructor)."""
        return Namespace(self.extra_key, self.cache_salt)

    def request(self) -> Request:
        """The `Request` the cache schedules."""
        return Request(self.rid, self.tokens, self.namespace(), self.output_len, self.ttl_s)


_DECODER = msgspec.json.Decoder(TraceRequest)
_ENCODER = msgspec.json.Encoder()


# The longest line a trace may hold: a request of about two million tokens. A longer line is an error at once, so
# a file that is no trace (`/dev/zero`, a binary) fails on its first line instead of being read into memory whole.
MAX_TRACE_LINE_BYTES = 16 << 20


def parse_trace(lines: Iterable[str | bytes], source: str = "<trace>") -> Iterator[TraceRequest]:
    """Decode trace lines lazily, raising `InvalidTrace` (source and 1-based line number) on the first bad one."""
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if len(line) > MAX_TRACE_LINE_BYTES:
            raise InvalidTrace(source, number, f"the line is longer than {MAX_TRACE_LINE_BYTES} bytes (a trace holds "
                                               f"one JSON request per line)")
        if not line.strip():
            continue
        try:
            item = _DECODER.decode(line)
        except msgspec.ValidationError as exc:
            raise InvalidTrace(source, number, str(exc)) from None
        except msgspec.DecodeError as exc:
            raise InvalidTrace(source, number, f"not a JSON object: {exc}") from None
        if not item.rid:
            raise InvalidTrace(source, number, "rid is empty")
        if not item.tokens:
            raise InvalidTrace(source, number, f"request {item.rid!r} has no tokens")
        if item.rid in seen:
            raise InvalidTrace(source, number, f"rid {item.rid!r} already used on line {seen[item.rid]}")
        seen[item.rid] = number
        yield item


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a JSONL trace file, validated (see `parse_trace`)."""
    with open(path, "rb") as f:
        return list(parse_trace(trace_lines(f), str(path)))


def trace_lines(f: IO[bytes]) -> Iterator[bytes]:
    """The lines of a binary file, none read past MAX_TRACE_LINE_BYTES (a longer one comes back cut just over the
    limit, for `parse_trace` to refuse)."""
    while line := f.readline(MAX_TRACE_LINE_BYTES + 1):
        yield line


class TraceCount(msgspec.Struct, frozen=True):
    """What was written of a trace."""

    requests: int
    tokens: int


def dump_trace(f: IO[bytes], requests: Iterable[TraceRequest]) -> TraceCount:
    """Write requests to a binary file as JSONL, one at a time: memory stays flat however many `requests` yields."""
    n = tokens = 0
    for item in requests:
        f.write(_ENCODER.encode(item) + b"\n")
        n += 1
        tokens += len(item.tokens)
    return TraceCount(n, tokens)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    """Write requests as JSONL; returns how many were written."""
    with open(path, "wb") as f:
        return dump_trace(f, requests).requests


class WorkloadSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape of a synthetic multi-tenant workload. Token counts are per request part."""

    requests: int = 1000
    tenants: int = 4  # namespaces: extra_key "tenant-<i>"
    salted: bool = True  # every tenant also has a cache_salt
    shared_prefix_tokens: int = 32  # the same token ids at the start of every request of every tenant
    system_prompt_tokens: int = 96  # per tenant
    documents: int = 6  # per tenant, Zipf popularity
    document_tokens: int = 160
    user_tokens: int = 24  # mean new user tokens per turn (uniform in [mean/2, 3*mean/2])
    output_tokens: int = 16  # output_len; the reply is part of the next turn's prompt
    continue_prob: float = 0.5  # chance a request continues one of its tenant's open conversations
    max_turns: int = 4  # turns before a conversation closes
    open_conversations: int = 8  # per tenant; the oldest is dropped beyond this
    zipf: float = 1.1  # popularity exponent of tenants and documents
    vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "tenants", "documents", "max_turns", "open_conversations", "vocab"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"WorkloadSpec.{name}={getattr(self, name)} must be >= 1")
        for name in ("shared_prefix_tokens", "system_prompt_tokens", "document_tokens", "user_tokens",
                     "output_tokens"):
            if getattr(self, name) < 0:
                raise InvalidInput(f"WorkloadSpec.{name}={getattr(self, name)} must be >= 0")
        if not 0.0 <= self.continue_prob <= 1.0:
            raise InvalidInput(f"WorkloadSpec.continue_prob={self.continue_prob} must be in [0, 1]")

    def held_bytes(self) -> int:
        """The most memory `iter_generate` holds for this spec, whatever the number of requests: every tenant's
        system prompt and documents, and its open conversations at their longest (4 bytes a token)."""
        user_hi = max(1, self.user_tokens + self.user_tokens // 2)
        conversation = (self.shared_prefix_tokens + self.system_prompt_tokens + self.document_tokens
                        + self.max_turns * (user_hi + self.output_tokens))
        per_tenant = self.system_prompt_tokens + self.documents * self.document_tokens \
            + self.open_conversations * conversation
        return 4 * (self.shared_prefix_tokens + self.tenants * per_tenant)

    def tenant(self, i: int) -> tuple[str, str | None]:
        """extra_key and cache_salt of tenant `i`."""
        return f"tenant-{i}", (f"salt-{self.seed}-{i}" if self.salted else None)


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    weights: np.ndarray = w / w.sum()
    return weights


class _Conversation:
    __slots__ = ("tokens", "turns")

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.turns = 1


def generate(spec: WorkloadSpec) -> list[TraceRequest]:
    """A deterministic (by `spec.seed`) multi-tenant trace."""
    return list(iter_generate(spec))


def iter_generate(spec: WorkloadSpec) -> Iterator[TraceRequest]:
    """`generate`'s requests one at a time, the same ones: what it holds is the tenants' prompts, documents and
    open conversations, never the requests already yielded (`kvc generate` streams them to its file)."""
    rng = np.random.default_rng(spec.seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, spec.vocab, size=n, dtype=np.uint32)

    shared = tokens(spec.shared_prefix_tokens)
    systems = [tokens(spec.system_prompt_tokens) for _ in range(spec.tenants)]
    documents = [[tokens(spec.document_tokens) for _ in range(spec.documents)] for _ in range(spec.tenants)]
    tenant_w = _zipf_weights(spec.tenants, spec.zipf)
    doc_w = _zipf_weights(spec.documents, spec.zipf)
    conversations: list[list[_Conversation]] = [[] for _ in range(spec.tenants)]
    lo, hi = max(1, spec.user_tokens // 2), max(1, spec.user_tokens + spec.user_tokens // 2)
    for r in range(spec.requests):
        t = int(rng.choice(spec.tenants, p=tenant_w))
        user = tokens(int(rng.integers(lo, hi + 1)))
        open_ = conversations[t]
        if open_ and rng.random() < spec.continue_prob:
            conv = open_[int(rng.integers(len(open_)))]
            conv.tokens = np.concatenate([conv.tokens, tokens(spec.output_tokens), user])
            conv.turns += 1
            if conv.turns >= spec.max_turns:
                open_.remove(conv)
        else:
            doc = documents[t][int(rng.choice(spec.documents, p=doc_w))]
            conv = _Conversation(np.concatenate([shared, systems[t], doc, user]))
            open_.append(conv)
            if len(open_) > spec.open_conversations:
                open_.pop(0)
        extra_key, salt = spec.tenant(t)
        yield TraceRequest(f"r{r:06d}", conv.tokens.tolist(), extra_key, salt, spec.output_tokens)
