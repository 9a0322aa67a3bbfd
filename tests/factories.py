"""Builders shared by the tests: small layouts and caches on the tests' device (`devices.TEST_DEVICE`: the CPU unless
KVC_TEST_DEVICE says otherwise), importable as `factories`."""

from __future__ import annotations

import numpy as np

from devices import TEST_DEVICE
from kvcache import CacheConfig, KVLayout, TieredCache


def make_layout(page_size: int = 1, model: str = "test-model@r1", layers: int = 1,
                arrangement: str = "token") -> KVLayout:
    """A tiny layout: 16 bytes per token and layer. `arrangement="kv_layer"` for a cache over an engine's tensors
    (`engine_kv`)."""
    return KVLayout(model, layers=layers, kv_heads=1, head_dim=4, dtype="float16", page_size=page_size,
                    arrangement=arrangement)


def engine_kv(layout: KVLayout, tokens: int, device: str = TEST_DEVICE):
    """An engine's own KV for `layout`, as SGLang's MHA pool holds it: per layer a K and a V tensor
    ``[tokens, kv_heads, head_dim]`` of the layout's dtype (MLA: the latents alone), as a `KVPages`."""
    import torch

    from kvcache.ledger.kv import KVPages

    def tensor(dim: int):
        return torch.zeros(tokens, layout.kv_heads, dim, dtype=getattr(torch, layout.dtype), device=device)

    k = [tensor(layout.head_dim) for _ in range(layout.layers)]
    v = None if layout.mla else [tensor(layout.v_head_dim or layout.head_dim) for _ in range(layout.layers)]
    return KVPages.layer_first(k, v, layout.page_size)


def make_cache(page_size: int = 1, device_tokens: int = 64, host_tokens: int = 128, **kw) -> TieredCache:
    """A cache with small pools on the tests' device."""
    return TieredCache(CacheConfig(make_layout(page_size), device_tokens=device_tokens, host_tokens=host_tokens,
                                   device=TEST_DEVICE, **kw))


def make_store(path, layout: KVLayout, **kw):
    """A real LMDB store in `path` (a test's temp dir), created for `layout`; not fsynced per batch (tests)."""
    from kvcache.storage.registry import open_store

    kw.setdefault("durability", "none")
    return open_store(str(path), layout, create=True, **kw)


def l3_cache(store, page_size: int = 4, device_tokens: int = 256, host_tokens: int = 256, **kw) -> TieredCache:
    """A cache over `store` on the tests' device, L3 I/O run inline by poll() unless io_thread=True is given."""
    kw.setdefault("io_thread", False)
    return TieredCache(CacheConfig(make_layout(page_size), device_tokens=device_tokens, host_tokens=host_tokens,
                                   device=TEST_DEVICE, **kw), store)


def page_content(digest: bytes, page_bytes: int):
    """What a synthetic page holds: its page hash, repeated."""
    import torch

    reps = -(-page_bytes // len(digest))
    return torch.frombuffer(bytearray((digest * reps)[:page_bytes]), dtype=torch.uint8)


def forward(cache: TieredCache, request, admission) -> None:
    """Write the synthetic KV of the request's new tokens, as the engine's forward would: whole pages from their page
    hash, the tail page as noise."""
    write_kv(cache, request, admission.slots, admission.cached_tokens)


def serve(cache: TieredCache, request):
    """Admit `request` (it must be admitted), write its new tokens' KV as the engine's forward would, commit it.
    Returns the admission."""
    from kvcache import AdmitStatus

    adm = cache.admit(request)
    assert adm.status is AdmitStatus.ADMITTED, adm
    forward(cache, request, adm)
    cache.commit(request.rid)
    return adm


def seed_store(store, request, **kw) -> None:
    """Another cache (over `store`, made with `kw`) served `request` and wrote its pages to L3, then closed."""
    w = l3_cache(store, **kw)
    serve(w, request)
    w.flush()
    w.close()


def write_kv(cache: TieredCache, request, slots, cached_tokens: int) -> None:
    """`forward` for a request's device `slots` of which the first `cached_tokens` (whole pages) were cached."""
    from kvcache.types.keys import page_hashes

    ps, page_bytes = cache.page_size, cache.device_pool.page_bytes
    hashes = page_hashes(cache.layout.layout_id, request.key, ps, cache.chain_key)
    first, end = cached_tokens // ps, -(-len(request) // ps)
    if end <= first:
        return
    pages = np.asarray(slots[first * ps: end * ps: ps]) // ps
    rows = np.full((end - first, page_bytes), 0xAB, dtype=np.uint8)
    for i, p in enumerate(range(first, min(end, len(hashes)))):
        rows[i] = page_content(hashes[p], page_bytes).numpy()
    cache.device_pool.kv.write(pages, rows)


def device_bytes_ok(cache: TieredCache, request, slots, n_tokens: int) -> bool:
    """Do the first `n_tokens` (whole pages) at `slots` hold the request's synthetic KV?"""
    from kvcache.types.keys import page_hashes

    ps = cache.page_size
    n_pages = n_tokens // ps
    hashes = page_hashes(cache.layout.layout_id, request.key, ps, cache.chain_key)
    got = cache.device_pool.kv.read(np.asarray(slots[: n_pages * ps: ps]) // ps)
    return all(np.array_equal(got[p], page_content(hashes[p], cache.device_pool.page_bytes).numpy())
               for p in range(n_pages))


def store_holdings(store) -> set[tuple]:
    """((extra_key, salt fingerprint), page hash, "storage") of every page in `store`, walked from each namespace's
    roots (what a KV-event feed's storage tier must rebuild to)."""
    out = set()
    for rec in store.namespaces():
        for root_hex in rec.roots:
            stack = [bytes.fromhex(root_hex)]
            while stack:
                for child in store.children(stack.pop()):
                    out.add(((rec.extra_key, rec.salt_fingerprint), child.page_hash, "storage"))
                    stack.append(child.page_hash)
    return out


def tree_key(tokens, ns):
    """A RadixKey of `tokens` in namespace `ns` (the tree tests' keys)."""
    from kvcache import RadixKey

    return RadixKey.of(tokens, ns)


def page_range(start: int, n: int):
    """Pages start .. start + n - 1, as the tree takes them."""
    import numpy as np

    return np.arange(start, start + n, dtype=np.int64)


class PendingEvent:
    """A copy's completion as a CUDA event reports it, on the CPU: running until the test (or a wait) finishes it."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.finished = True


class PendingCopies:
    """The GPU's timing of a cache's L1 <-> L2 copies, on the CPU: the bytes land at once (the cache's own copier
    moves them), but each copy reports itself running until its `PendingEvent` is finished, and the events the
    caller's stream was made to wait for are recorded. It takes the place of the copier's two GPU-facing calls,
    through `set_attr` (pytest's `monkeypatch.setattr`, or plain `setattr` for a cache a test throws away)."""

    def __init__(self, cache: TieredCache, set_attr) -> None:
        copier = cache._staging.copier
        self._copy = copier.copy
        # one a copy, in issue order: (its event, source pool, source pages, destination pool, destination pages)
        self.copies: list[tuple[PendingEvent, object, np.ndarray, object, np.ndarray]] = []
        self.ordered: list[PendingEvent] = []  # the events the caller's stream was made to wait for
        set_attr(copier, "copy", self.copy)
        set_attr(copier, "order_current_stream", self.ordered.append)

    @property
    def events(self) -> list[PendingEvent]:
        """Every copy's event, in issue order."""
        return [c[0] for c in self.copies]

    def copy(self, src, src_pages, dst, dst_pages) -> PendingEvent:
        landed = self._copy(src, src_pages, dst, dst_pages)
        if landed is not None:  # on a GPU: the bytes land now, whatever the test's event says
            landed.synchronize()
        event = PendingEvent()
        self.copies.append((event, src, np.array(src_pages), dst, np.array(dst_pages)))
        return event

    def running(self) -> list[tuple[PendingEvent, object, np.ndarray, object, np.ndarray]]:
        """The copies not finished yet, oldest first."""
        return [c for c in self.copies if not c[0].finished]

    def finish(self, n: int | None = None) -> None:
        """The GPU gets through the oldest `n` running copies (all of them: None), in the order they were queued on
        the copier's one stream."""
        for c in self.running()[:n]:
            c[0].finished = True
