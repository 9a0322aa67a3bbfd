"""`kvc put`: write the pages of one token sequence to L3 — synthetic KV, or real KV from a tensor file."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer

from kvcache.storage.api import page_origins
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import NamespaceInfo

from ..context import fingerprints_of, open_for_cache
from ..errors import EXIT_FOUND, UsageError
from ..inputs import namespace_arg, tokens_arg
from ..options import (
    DEFAULT_STORE,
    DebugOpt,
    ExtraKeyOpt,
    JsonOpt,
    SaltFileOpt,
    SaltOpt,
    StoreOpt,
    TokensFileOpt,
    TokensOpt,
)
from ..render.output import emit_json, say
from ..render.progress import progress
from ..render.text import human_bytes, ns_label
from ..reporting import command

if TYPE_CHECKING:
    import torch

BATCH_PAGES = 64  # pages per store.put: one write transaction each


class PutOutput(msgspec.Struct):
    """`kvc put --json`."""

    namespace: NamespaceInfo
    requested_tokens: int  # tokens given
    pages: int  # whole pages of them (a partial tail page is not stored)
    written: int  # pages newly stored
    existing: int  # pages the store already held (content-addressed: unchanged)
    rejected: int  # pages refused: over the store's capacity, the namespace's quota or its store share
    failed: int  # pages not stored because the store could not be written (unreachable, a fault): try again
    bytes: int  # payload bytes newly written
    seconds: float
    kv: str  # "synthetic" (a function of each page hash; `kvc load-back` and replays can verify it) or "file"


@command
def put(
    store: StoreOpt = DEFAULT_STORE,
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    # "\\[" is rich markup's escape: a bare "[tokens, ...]" reads as a style tag and vanishes from --help
    kv_file: Annotated[Path | None, typer.Option(
        "--kv-file", help="Real KV to store instead of synthetic: a torch .pt file (or .safetensors with one "
        "tensor) of shape \\[tokens, ...] whose bytes per token match the store's layout.")] = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write the whole pages of one token sequence to the store, under the namespace given by --extra-key and
    --salt. Pages the store already holds are left as they are. Exits 1 when the store took none of the pages
    (all refused for capacity, a quota or a share, or failed: the store could not be written), and when the
    sequence is shorter than one page (nothing to store)."""
    ids = tokens_arg(tokens, tokens_file)
    if ids is None:
        raise UsageError("give the sequence with --tokens or --tokens-file")
    ns = namespace_arg(extra_key, salt, salt_file)
    with contextlib.closing(open_for_cache(store)) as handle:
        from kvcache.workload.kvdata import SyntheticKV

        layout = handle.layout
        assert layout is not None and handle.chain_key is not None  # a writer holds the store's chain key
        kv = _file_pages(kv_file, layout, len(ids)) if kv_file is not None else None
        hashes, origins = page_origins(layout, pack_tokens(ids), ns, handle.chain_key)
        synthetic = SyntheticKV(layout)
        start = time.perf_counter()
        written = existing = rejected = failed = nbytes = 0
        with progress("put", len(hashes), not json) as advance:
            for at in range(0, len(hashes), BATCH_PAGES):
                hs = hashes[at:at + BATCH_PAGES]
                rows = kv[at:at + len(hs)] if kv is not None else synthetic.pages(hs)
                result = handle.put(hs, [r.numpy() for r in rows], origins[at:at + len(hs)])
                written += result.written
                existing += result.existing
                rejected += result.rejected
                failed += result.failed
                nbytes += result.bytes_written
                advance(at + len(hs))
        handle.flush()
        info = fingerprints_of(handle).info(ns)  # under the store's key, as its registry shows the namespace
    result_ = PutOutput(info, len(ids), len(hashes), written, existing, rejected, failed, nbytes,
                        time.perf_counter() - start, "file" if kv_file is not None else "synthetic")
    if json:
        emit_json(result_)
    else:
        rate = nbytes / result_.seconds if result_.seconds else 0.0
        say(f"{ns_label(info)}: {len(hashes)} pages of {len(ids)} tokens: "
            f"{written} written, {existing} already stored, {rejected} rejected, {failed} failed; "
            f"{human_bytes(nbytes)} in "
            f"{result_.seconds * 1000:.1f} ms ({human_bytes(rate)}/s)")
    if not hashes:
        # Less than one page: nothing was stored, and a script must not go on as if it were (docs/json.md).
        sys.stderr.write(f"kvc: error: {len(ids)} tokens are less than one page of {layout.page_size}: "
                         f"nothing to store\n")
        raise typer.Exit(EXIT_FOUND)
    if not written + existing:
        # Nothing of what was given is in the store: a script must not go on as if it were.
        sys.stderr.write(f"kvc: error: the store took none of the {len(hashes)} pages ({rejected} refused for "
                         f"capacity, a quota or a share, {failed} failed: the store could not be written)\n")
        raise typer.Exit(EXIT_FOUND)


def _file_pages(path: Path, layout: KVLayout, n_tokens: int) -> "torch.Tensor":
    """[pages, bytes_per_page] uint8 rows of a KV tensor file, checked against the layout and the tokens."""
    import torch

    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UsageError(f"{path}: reading .safetensors needs the safetensors package "
                             f"(pip install safetensors), or save the tensor with torch.save") from None
        tensors = load_file(str(path))
        if len(tensors) != 1:
            raise UsageError(f"{path}: holds {len(tensors)} tensors; expected exactly one")
        tensor = next(iter(tensors.values()))
    else:
        try:
            tensor = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch.load fails with pickle, zip and runtime errors alike
            raise UsageError(f"{path}: not a torch tensor file: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
        raise UsageError(f"{path}: expected a tensor of shape [tokens, ...], got {type(tensor).__name__}")
    if tensor.shape[0] != n_tokens:
        raise UsageError(f"{path}: the tensor has {tensor.shape[0]} tokens, the sequence {n_tokens}")
    per_token = tensor[0].numel() * tensor.element_size()
    if per_token != layout.bytes_per_token:
        raise UsageError(f"{path}: {per_token} bytes per token (shape {list(tensor.shape)}, {tensor.dtype}); "
                         f"the store's layout has {layout.bytes_per_token} ({layout.describe()})")
    n_pages = n_tokens // layout.page_size
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return raw[: n_pages * layout.bytes_per_page].view(n_pages, layout.bytes_per_page)
