"""kvcache/workload.py: the trace format (DESIGN §8) and the synthetic multi-tenant generator."""

import msgspec
import pytest

from kvcache import InvalidTrace, Namespace, TraceRequest, WorkloadSpec, generate, read_trace, write_trace
from kvcache.workload.traces import parse_trace


def test_round_trip_keeps_every_field(tmp_path):
    reqs = [TraceRequest("a", [1, 2, 3], "t1", "s", 16), TraceRequest("b", [0, 4294967295])]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, reqs) == 2
    assert read_trace(path) == reqs
    assert path.read_text().splitlines()[1] == '{"rid":"b","tokens":[0,4294967295]}'


def test_ttl_s_is_optional_and_reaches_the_request():
    """Added after the format was pinned: older lines (without it) stay valid and write back unchanged."""
    old, new = parse_trace(['{"rid": "a", "tokens": [1]}', '{"rid": "b", "tokens": [1], "ttl_s": 600}'])
    assert old.request().ttl_s is None and new.request().ttl_s == 600
    assert msgspec.json.encode(old) == b'{"rid":"a","tokens":[1]}'


def test_request_carries_the_lines_namespace():
    r = TraceRequest("a", [5, 6], "t1", "s").request()
    assert r.namespace == Namespace("t1", "s") and r.tokens == [5, 6]
    assert TraceRequest("b", [1], "", None).request().namespace == Namespace()


@pytest.mark.parametrize("line, why", [
    ('{"rid": "x", "tokens": [1], "colour": "red"}', "unknown field"),
    ('{"rid": "x", "tokens": [1, -2]}', ">= 0"),
    ('{"rid": "x", "tokens": [1, 4294967296]}', "<= 4294967295"),
    ('{"rid": "x", "tokens": [1, 2.5]}', "Expected `int`"),
    ('{"rid": "x", "tokens": [true]}', "Expected `int`"),
    ('{"rid": "x", "tokens": "1,2"}', "Expected `array`"),
    ('{"rid": "x", "tokens": []}', "no tokens"),
    ('{"tokens": [1]}', "missing required field `rid`"),
    ('{"rid": "", "tokens": [1]}', "rid is empty"),
    ('{"rid": "x", "tokens": [1], "output_len": -1}', ">= 0"),
    ('{"rid": "x", "tokens": [1], "ttl_s": 0}', "> 0"),
    ('{"rid": "x", "tokens": [1], "ttl_s": "1h"}', "Expected `float | null`"),
    ('{"rid": "x", "tokens": [1]', "not a JSON object"),
    ('[1, 2]', "Expected `object`"),
])
def test_a_bad_line_is_an_error_naming_the_line(line, why):
    lines = ['{"rid": "ok", "tokens": [1]}', "", line]
    with pytest.raises(InvalidTrace) as info:
        list(parse_trace(lines, "t.jsonl"))
    assert info.value.line == 3
    assert str(info.value).startswith("t.jsonl:3: ") and why in str(info.value)


def test_a_repeated_rid_names_both_lines():
    with pytest.raises(InvalidTrace, match=r"t:2: rid 'a' already used on line 1"):
        list(parse_trace(['{"rid": "a", "tokens": [1]}', '{"rid": "a", "tokens": [2]}'], "t"))


def test_generator_is_deterministic_and_multi_tenant():
    spec = WorkloadSpec(requests=400, tenants=3, seed=5)
    trace = generate(spec)
    assert trace == generate(spec) and trace != generate(WorkloadSpec(requests=400, tenants=3, seed=6))
    assert len(trace) == 400 and len({r.rid for r in trace}) == 400
    keys = {(r.extra_key, r.cache_salt) for r in trace}
    assert keys == {spec.tenant(i) for i in range(3)}
    counts = sorted((sum(r.extra_key == k for r in trace) for k, _ in keys), reverse=True)
    assert counts[0] > counts[-1]  # Zipf: tenant 0 is the most popular


def test_every_tenant_starts_with_the_same_token_ids():
    spec = WorkloadSpec(requests=200, tenants=4, shared_prefix_tokens=24)
    trace = generate(spec)
    firsts = {tuple(r.tokens[:24]) for r in trace}
    assert len(firsts) == 1  # same ids everywhere: only the namespace keeps tenants apart
    by_tenant = {r.extra_key: r.tokens[24:24 + spec.system_prompt_tokens] for r in trace}
    assert len({tuple(v) for v in by_tenant.values()}) == 4  # private system prompts


def test_later_turns_extend_an_earlier_request_of_the_same_tenant():
    trace = generate(WorkloadSpec(requests=300, tenants=2, continue_prob=0.8))
    extended = 0
    for i, r in enumerate(trace):
        if any(p.extra_key == r.extra_key and len(p.tokens) < len(r.tokens) and r.tokens[:len(p.tokens)] == p.tokens
               for p in trace[max(0, i - 40):i]):
            extended += 1
    assert extended > 100


def test_unsalted_tenants_and_bad_specs():
    assert all(r.cache_salt is None for r in generate(WorkloadSpec(requests=20, salted=False)))
    with pytest.raises(ValueError, match="tenants=0"):
        WorkloadSpec(tenants=0)
    with pytest.raises(ValueError, match="continue_prob"):
        WorkloadSpec(continue_prob=1.5)


def test_an_endless_line_is_refused_at_the_cap_not_read_whole(tmp_path, monkeypatch):
    from kvcache.workload import traces as workload

    monkeypatch.setattr(workload, "MAX_TRACE_LINE_BYTES", 1000)
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"rid": "a", "tokens": [1]}\n' + b"x" * 5000)
    with pytest.raises(InvalidTrace, match=r"t.jsonl:2: the line is longer than 1000 bytes"):
        read_trace(path)
    with pytest.raises(InvalidTrace, match=":1: the line is longer"):
        list(parse_trace([b"y" * 1001]))


def test_iter_generate_yields_generates_requests_one_at_a_time_and_dump_trace_counts_them():
    """Issue 26 #7: `kvc generate` streams: the generator is lazy (its first request comes before any later one is
    made) and yields exactly `generate`'s trace; dump_trace writes as it goes and counts requests and tokens."""
    import io
    import types

    from kvcache.workload.traces import dump_trace, iter_generate

    spec = WorkloadSpec(requests=300, tenants=3, seed=11)
    lazy = iter_generate(spec)
    assert isinstance(lazy, types.GeneratorType)
    assert next(lazy) == generate(spec)[0]
    assert [next(lazy)] + list(lazy) == generate(spec)[1:]
    sink = io.BytesIO()
    count = dump_trace(sink, iter_generate(spec))
    assert count.requests == 300 and count.tokens == sum(len(r.tokens) for r in generate(spec))
    assert sink.getvalue().count(b"\n") == 300
