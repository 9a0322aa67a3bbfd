"""kvcache.ops.requests: the admin requests and their results are the admin socket's wire format; moving them
out of kvcache.live.protocol must not change a byte of it."""

from __future__ import annotations

import msgspec

from kvcache.live import protocol
from kvcache.ops import requests
from kvcache.types.namespace import NamespaceInfo
from kvcache.types.reports import AuditChecked, AuditReport, NamespaceReplay, ReplayReport, TierTokens, VerifyMismatch
from kvcache.types.stats import BackupStats, PrefetchStats

# Tag and field order of every request as protocol version 2 carries them (at 33c1189, before the move).
WIRE = {
    "PingRequest": ("ping", ()),
    "PrefetchRequest": ("prefetch", ("extra_key", "cache_salt", "tokens", "max_pages", "max_bytes", "policy",
                                     "timeout_ms")),
    "StageRequest": ("stage", ("tokens", "extra_key", "cache_salt", "policy", "timeout_ms")),
    "LoadBackRequest": ("load_back", ("tokens", "extra_key", "cache_salt", "policy", "timeout_ms")),
    "NamespacesRequest": ("ns_ls", ()),
    "AuditRequest": ("audit", ()),
    "SnapshotRequest": ("snapshot", ()),
    "StatsRequest": ("stats", ()),
    "EvictRequest": ("evict", ("extra_key", "cache_salt", "device", "host")),
    "DropRequest": ("ns_drop", ("extra_key", "cache_salt", "id", "fingerprint", "dry_run")),
    "SharesRequest": ("ns_quota", ("shares", "extra_key", "cache_salt")),
    "ExpireRequest": ("ns_expire", ("extra_key", "cache_salt")),
    # issue 37: the router's views (kvc ns dump / kvc ns probe --socket), new requests: no frame of before changes
    "DumpRequest": ("ns_dump", ("tier", "medium_names", "cursor", "max_pages")),
    "ProbeRequest": ("ns_probe", ("tokens", "page_hashes", "extra_key", "cache_salt")),
    # issue 37: `kvc explain --socket`, a new request; a replay's lines (`explain`, sent only when set)
    "ExplainRequest": ("explain", ("tokens", "extra_key", "cache_salt", "rid")),
    "ReplayRequest": ("replay", ("chunk", "more", "verify", "batch", "lookahead", "snapshot", "explain")),
}
# Whole frames written by 33c1189's protocol module.
FRAMES = [
    (7, requests.PrefetchRequest("t1", "s", [1, 2, 70000], max_pages=8),
     "0000008783a17602a2696407a77265717565737488a474797065a87072656665746368a965787472615f6b6579a27431aa63616368655f"
     "73616c74a173a6746f6b656e73930102ce00011170a96d61785f706167657308a96d61785f6279746573c0a6706f6c696379ad776169"
     "745f636f6d706c657465aa74696d656f75745f6d73cb408f400000000000"),
    (8, requests.EvictRequest("t1", host=False),
     "0000004383a17602a2696408a77265717565737485a474797065a56576696374a965787472615f6b6579a27431aa63616368655f73616c"
     "74c0a6646576696365c3a4686f7374c2"),
]


def test_every_request_keeps_its_tag_and_fields():
    union = protocol.AdminRequest.__args__
    assert {cls.__name__: (cls.__struct_config__.tag, cls.__struct_fields__) for cls in union} == WIRE
    assert all(cls.__struct_config__.forbid_unknown_fields for cls in union)
    moved = [cls for cls in union if cls is not protocol.ReplayRequest]
    assert all(getattr(requests, cls.__name__) is cls for cls in moved)  # one class, re-exported by the protocol


def test_a_replay_without_lines_sends_no_new_field():
    """A version-2 server before issue 37 refuses unknown fields: a replay frame carries `explain` only when set."""
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(protocol.ReplayRequest(b"x", verify=True)))
    assert "explain" not in plain and plain["verify"] is True
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(protocol.ReplayRequest(b"x", explain=True)))["explain"]


def test_request_frames_are_the_bytes_they_were():
    for ident, request, frame in FRAMES:
        assert protocol.frame(protocol.Envelope(protocol.PROTOCOL_VERSION, ident, request)).hex() == frame
        assert protocol.decode_envelope(bytes.fromhex(frame)[4:]).request == request


def _report() -> ReplayReport:
    ns = NamespaceInfo("t1", "0123456789ab")
    return ReplayReport(3, 0, 144, TierTokens(8, 16, 32), [NamespaceReplay(ns, 3, 144, TierTokens(8, 16, 32))], True,
                        56, 1, [VerifyMismatch("r1", 2, ns)], 0, 1, PrefetchStats(attempts=3, declined={"empty": 1}),
                        BackupStats(host_pages=4), AuditReport(True, [], AuditChecked(10, 4, 0, 0, 0)), 0.25, 12.0,
                        576.0, blocked=1)


def test_a_replay_outcome_travels_as_the_raw_report_did():
    """The report was a msgspec.Raw of its msgpack, decoded on demand; typed now, with the same bytes both ways."""
    report = _report()
    snapshot = requests.SnapshotData(1.5, 2, 3, b"snap")
    typed = protocol.encode(requests.ReplayOutcome(report, snapshot))
    as_raw = msgspec.msgpack.encode({"report": msgspec.Raw(msgspec.msgpack.encode(report)), "snapshot": snapshot})
    assert typed == as_raw
    outcome = msgspec.msgpack.decode(as_raw, type=requests.ReplayOutcome)
    assert outcome.report == report and outcome.replay_report() == report and outcome.snapshot == snapshot
