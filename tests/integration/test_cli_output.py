"""Output for scripts and for eyes (issue 13): untrusted names printed safely, tables only on a terminal and tsv
/ json / jsonl for scripts, an exact Prometheus exposition (offline, live and over HTTP), `kvc top`, audits that
say which audit ran, demo totals that add up, bench figures with their units, shell completion.

On 0f180b0: `--extra-key '[bold]x[/bold]'` rendered as markup and ESC reached the terminal, piped `ns ls` kept its
box-drawing characters, `--prom` printed 6.22756e+07 for 62275584 and did not escape labels, plain `kvc audit`
did not say which audit ran, `--repair` had no dry run and exited 0 after finding violations, demo totals
did not add up to its requests, and `kvc bench` printed bare ratios."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import clirun
from kvc.main import app
from kvcache import WorkloadSpec, generate, write_trace

KVC = clirun.KVC
ROOT = Path(__file__).resolve().parents[2]
TOKENS = ",".join(str(t) for t in range(1, 41))
runner = CliRunner()
# tenant names an attacker may choose: markup, a colour escape and a newline, whitespace, quotes, a bidi override
NAMES = ["[bold]acme[/bold]", "\x1b[31mred\nsplit", " t1", "t1", 'q"uo\\te', "\u202eevil"]


def invoke(*args, code=0, **env):
    result = runner.invoke(app, [str(a) for a in args], env=env or None)
    assert result.exit_code == code, result.stderr
    return result


def samples(text):
    """{(name, sorted labels): value} of a Prometheus exposition (parsed by prometheus_client itself)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    """A store holding one namespace of 10 pages for each of NAMES (salt `s`), written once."""
    path = tmp_path_factory.mktemp("named") / "store"
    invoke("init", "--store", path, "--page-size", 4, "--layers", 1, "--kv-heads", 1, "--head-dim", 16)
    for name in NAMES:
        invoke("put", "--store", path, "--extra-key", name, "--tokens", TOKENS, KVC_SALT="s")
    return path


@pytest.fixture
def named_store(named, tmp_path):
    """This test's copy of the named store."""
    return Path(shutil.copytree(named, tmp_path / "store"))


def test_untrusted_names_are_escaped_and_whitespace_shows(named_store):
    table = invoke("ns", "ls", "--store", named_store, "-o", "table").stdout
    assert "\x1b" not in table and "\u202e" not in table
    assert "[bold]acme[/bold]" in table  # printed, not interpreted as markup
    assert "\\x1b[31mred\\nsplit" in table and "\\u202eevil" in table
    assert '" t1"' in table  # leading whitespace is visible: " t1" and t1 never look alike
    tsv = invoke("ns", "ls", "--store", named_store, "-o", "tsv", "--sort", "extra_key").stdout.splitlines()
    assert len(tsv) == 1 + len(NAMES)  # a newline in a name does not split its row
    assert all(len(line.split("\t")) == 8 for line in tsv) and "\x1b" not in "".join(tsv)
    rows = json.loads(invoke("ns", "ls", "--store", named_store, "--json").stdout)["namespaces"]
    assert sorted(r["extra_key"] for r in rows) == sorted(NAMES)  # JSON keeps the exact value
    human = invoke("put", "--store", named_store, "--extra-key", NAMES[1], "--tokens", TOKENS, KVC_SALT="s").stdout
    assert "\x1b" not in human and human.count("\n") == 1


def test_listing_formats_for_scripts(named_store):
    piped = invoke("ns", "ls", "--store", named_store).stdout  # not a terminal: tsv, no box drawing
    assert not set(piped) & set("┏━┃│└┡╇") and piped.splitlines()[0].startswith("id\textra_key\t")
    bare = invoke("ns", "ls", "--store", named_store, "--no-headers").stdout.splitlines()
    assert len(bare) == len(NAMES) and all(len(line.split("\t")[0]) == 16 for line in bare)
    lines = invoke("ns", "ls", "--store", named_store, "-o", "jsonl").stdout.splitlines()
    assert [json.loads(line)["pages"] for line in lines] == [10] * len(NAMES)
    assert json.loads(invoke("ns", "ls", "--store", named_store, "-o", "json").stdout) == \
        json.loads(invoke("ns", "ls", "--store", named_store, "--json").stdout)
    tsv = bare[0].split("\t")
    assert tsv[3] == "10" and tsv[5] == "2560" and tsv[7].isdigit()  # raw pages, bytes, unix seconds


@pytest.mark.parametrize("command", [["ns", "ls"], ["ns", "show", "t1"], ["ns", "quota", "show"], ["audit"],
                                     ["stats"]])
def test_each_output_format_means_the_same_for_every_command_that_has_it(named_store, command):
    """Issue 25 #10: `kvc stats -o json|jsonl` printed tab-separated text and `-o tsv` `3,801` and `59.4 MiB`;
    `ns show -o jsonl` printed the tree as one line. Every command with -o: json is its --json document, jsonl one
    object per row, tsv a header then one line per row of raw values."""
    invoke("ns", "quota", "set", "--store", named_store, "--extra-key", "t1", "--store-bytes", 1 << 20,
           KVC_SALT="s")
    args = [*command, "--store", named_store]
    document = json.loads(invoke(*args, "-o", "json", KVC_SALT="s").stdout)
    assert document == json.loads(invoke(*args, "--json", KVC_SALT="s").stdout)
    rows = [json.loads(line) for line in invoke(*args, "-o", "jsonl", KVC_SALT="s").stdout.splitlines()]
    assert all(isinstance(row, dict) for row in rows)
    tsv = invoke(*args, "-o", "tsv", KVC_SALT="s").stdout.splitlines()
    assert len(tsv) == 1 + len(rows) and invoke(*args, "-o", "tsv", "--no-headers", KVC_SALT="s").stdout \
        .splitlines() == tsv[1:]
    widths = {len(line.split("\t")) for line in tsv}
    assert len(widths) == 1 and widths != {1}  # every line has the header's columns
    body = "\n".join(tsv[1:])
    assert not re.search(r"\d,\d{3}", body) and not re.search(r"\d (B|KiB|MiB|GiB)\b", body)  # raw numbers
    if command == ["stats"]:
        figures = dict(line.split("\t") for line in tsv[1:])
        assert tsv[0] == "figure\tvalue" and figures["pages"] == "60" and figures["bytes"] == str(document["bytes"])
        assert figures["layout_list.0.page_size"] == "4" and figures["counters.pages_read"] == "0"
        assert rows[:2] == [{"figure": "backend", "value": "lmdb"}, {"figure": "location", "value": str(named_store)}]
    if command[:2] == ["ns", "show"]:
        assert [r["depth"] for r in rows] == [1, 2, 3, 4] and rows[0]["tokens"] == [1, 2, 3, 4]


def test_completion_for_a_named_shell_works_from_any_shell():
    """Issue 25 #11: `kvc --show-completion bash` ignored its argument and detected the parent shell: from `sh -c`
    it said "Shell sh not supported" and exited 1."""
    for shell, says in (("bash", "complete -o default -F _kvc_completion kvc"), ("zsh", "#compdef kvc"),
                        ("fish", "complete --command kvc")):
        script = subprocess.run(["sh", "-c", f'"$0" --show-completion {shell}', str(KVC)], capture_output=True,
                                text=True, timeout=60)
        assert script.returncode == 0 and says in script.stdout, script.stderr
    unknown = subprocess.run(["sh", "-c", '"$0" --show-completion tcsh', str(KVC)], capture_output=True, text=True,
                             timeout=60)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.splitlines() == ["kvc: error: no completion for the shell 'tcsh': name one of bash, zsh, "
                                           "fish, powershell, pwsh (e.g. `kvc --show-completion bash`)"]


def test_progress_lines_go_to_the_descriptor_kvc_progress_fd_names(tmp_path):
    store = tmp_path / "store"
    invoke("init", "--store", store, "--page-size", 4)
    read, write = os.pipe()
    with os.fdopen(read) as lines:
        try:
            put = invoke("put", "--store", store, "--extra-key", "p", "--tokens", TOKENS, "--json",
                         KVC_PROGRESS_FD=str(write))
        finally:
            os.close(write)  # kvc writes to it, never closes it: the end of the lines is ours to make
        seen = lines.read().splitlines()
    assert json.loads(put.stdout)["pages"] == 10  # stdout is the command's alone
    assert seen[0] == "put 0/10" and seen[-1] == "put 10/10"
    bad = invoke("put", "--store", store, "--extra-key", "p", "--tokens", TOKENS, KVC_PROGRESS_FD="nine", code=2)
    assert bad.stderr.splitlines() == ["kvc: error: KVC_PROGRESS_FD='nine': not a file descriptor number"]


def test_prometheus_exposition_is_exact_escaped_and_per_namespace(named_store):
    invoke("prefetch", "--store", named_store, "--extra-key", 'q"uo\\te', "--tokens", TOKENS, KVC_SALT="s")
    text = invoke("stats", "--store", named_store, "--prom").stdout
    values = samples(text)
    stats = json.loads(invoke("stats", "--store", named_store, "--json").stdout)
    store_labels = (("backend", "lmdb"), ("store", str(named_store)))
    assert values[("kvc_store_footprint_bytes", store_labels)] == stats["footprint_bytes"]  # exact, not %g
    assert values[("kvc_store_pages", store_labels)] == 60
    fp = json.loads(invoke("ns", "ls", "--store", named_store, "--json").stdout)["namespaces"][0]["salt_fingerprint"]
    quoted = (("extra_key", 'q"uo\\te'), ("salt_fingerprint", fp))
    assert values[("kvc_store_namespace_pages", quoted)] == 10
    assert values[("kvc_store_namespace_served_pages_total", quoted)] == 10  # the registry's count, not 0
    assert 'extra_key="q\\"uo\\\\te"' in text and 'extra_key="\\u001b' not in text
    assert 'extra_key="\\u001b[31mred\\nsplit"' not in text and '\\nsplit"' in text  # newline escaped
    for family in text_string_to_metric_families(text):
        assert f"# HELP {family.name}" in text and f"# TYPE {family.name}" in text
    assert "kvc_store_pages_read_total" not in text  # a fresh handle's counters are always 0: not offline


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """`kvc serve` with a metrics endpoint, after a replay through its socket."""
    root = tmp_path_factory.mktemp("live")
    store, sock = root / "store", root / "s.sock"
    invoke("init", "--store", store)
    trace = root / "t.jsonl"
    write_trace(trace, generate(WorkloadSpec(requests=200, tenants=3, seed=9)))
    serve = subprocess.Popen([str(KVC), "serve", "--store", str(store), "--socket", str(sock), "--metrics-port",
                              "0", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(serve.stdout.readline())
        invoke("--socket", sock, "replay", trace, "--json")
        yield sock, ready["metrics"]
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=30)


def test_live_metrics_over_http_count_hits_per_namespace_and_tier(live):
    sock, url = live
    scrape = urllib.request.urlopen(url, timeout=10).read().decode()
    values = samples(scrape)
    hits = {k: v for k, v in values.items() if k[0] == "kvc_cache_hit_tokens_total"}
    tenants = {dict(k[1])["extra_key"] for k in hits}
    assert tenants == {"tenant-0", "tenant-1", "tenant-2"} and {dict(k[1])["tier"] for k in hits} == \
        {"device", "host", "storage"}
    stats = json.loads(invoke("--socket", sock, "stats", "--json").stdout)
    device = sum(h["device"] for h in stats["cache"]["hits"])
    assert sum(v for k, v in hits.items() if dict(k[1])["tier"] == "device") == device > 0
    assert values[("kvc_cache_pool_tokens", (("tier", "device"),))] == stats["device"]["tokens"]
    assert samples(invoke("--socket", sock, "stats", "--prom").stdout).keys() == values.keys()


def test_top_prints_plain_lines_or_json_samples(live):
    sock, _ = live
    plain = invoke("top", "--socket", sock, "--interval", "0.05", "--count", "2").stdout.splitlines()
    assert len(plain) == 2 and all(" | L1 " in line and " | L2 " in line and "prefetch" in line for line in plain)
    doc = json.loads(invoke("top", "--socket", sock, "--interval", "0.05", "--count", "1", "--json").stdout)
    tiers = {t["tier"]: t for t in doc["tiers"]}
    assert set(tiers) == {"device", "host", "storage"} and tiers["device"]["used_tokens"] > 0
    assert tiers["device"]["hit_tokens_per_s"] == 0  # nothing ran in the interval
    assert {n["extra_key"] for n in doc["namespaces"]} == {"tenant-0", "tenant-1", "tenant-2"}
    missing = invoke("top", code=2)
    assert "--socket" in missing.stderr


def _corrupt_one_page(store):
    import lmdb

    env = lmdb.open(str(store), max_dbs=16, subdir=True)
    pages = env.open_db(b"pages")
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(pages)))
        txn.put(key, value[:-1] + bytes([value[-1] ^ 0xFF]), db=pages)
    env.close()


def test_audit_names_its_audits_and_repair_has_a_dry_run(named_store):
    clean = invoke("audit", "--store", named_store)
    assert "L3 integrity of the store" in clean.stdout
    assert json.loads(invoke("audit", "--store", named_store, "--json").stdout)["audits"] == ["l3_integrity"]
    _corrupt_one_page(named_store)
    dry = invoke("audit", "--store", named_store, "--repair", "--dry-run", "--json", code=1)
    doc = json.loads(dry.stdout)
    assert doc["repair"] == "dry_run" and doc["planned"][0]["kind"] == "checksum_mismatch"
    assert doc["planned"][0]["action"] == "remove the page and its subtree" and doc["removals"] == []
    still = json.loads(invoke("audit", "--store", named_store, "--json", code=1).stdout)
    assert still["violations"] == doc["violations"]  # the dry run changed nothing
    tsv = invoke("audit", "--store", named_store, "-o", "tsv", "--no-headers", code=1).stdout.splitlines()
    assert len(tsv) == 1 and tsv[0].startswith("checksum_mismatch\tpage ")
    repaired = json.loads(invoke("audit", "--store", named_store, "--repair", "--json", code=1).stdout)
    assert repaired["repaired"] == 1 and repaired["remaining"] == []  # found and repaired: still exit 1
    invoke("audit", "--store", named_store)  # now clean: exit 0
    invoke("audit", "--store", named_store, "--dry-run", code=2)  # --dry-run goes with --repair


def test_demo_totals_add_up_and_rates_are_per_run(tmp_path):
    doc = json.loads(invoke("demo", "--requests", 150, "--tenants", 3, "--device-tokens", 768, "--json").stdout)
    for run in ("cold", "warm"):
        report = doc[run]
        assert report["requests"] + report["refused"] == doc["requests"] == 150
        assert sum(t["requests"] for t in doc["tenants"]) == 150
        assert sum(t[f"{run}_refused"] for t in doc["tenants"]) == report["refused"]
        assert sum(t[f"{run}_tokens"] for t in doc["tenants"]) == report["tokens"]
    human = invoke("demo", "--requests", 150, "--tenants", 3, "--device-tokens", 768).stdout
    assert "refused" in human and "= 150 requests" in human


def test_bench_names_each_figure_s_unit_and_direction(tmp_path):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    shutil.copy(ROOT / "benchmarks" / "_report.py", bench)
    (bench / "bench_tiny.py").write_text(
        "import sys\nfrom _report import publish\n"
        "publish('bench_tiny', 'tiny', True, {'lmdb_read_over_memcpy_16k': 0.6, 'ledger_overhead_page1': 1.2,"
        " 'replay_requests_per_s': 500.0, 'kvc_version_seconds': 0.2})\n")
    doc = json.loads(invoke("bench", "--dir", bench, "--json").stdout)
    figures = {f["name"]: (f["unit"], f["better"]) for f in doc["scripts"][0]["figures"]}
    assert figures == {"lmdb_read_over_memcpy_16k": ("x (speed ratio)", "higher"),
                       "ledger_overhead_page1": ("x (time ratio)", "lower"),
                       "replay_requests_per_s": ("per second", "higher"),
                       "kvc_version_seconds": ("seconds", "lower")}
    human = invoke("bench", "--dir", bench).stdout
    assert "higher is better" in human and "lower is better" in human


def test_every_figure_the_benchmark_scripts_publish_has_a_meaning():
    import re

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _report import meaning
    finally:
        sys.path.pop(0)
    names = set()
    for script in (ROOT / "benchmarks").glob("bench_*.py"):
        src = script.read_text()
        names |= set(re.findall(r'ratios\[f?"([^"]+)"\]', src))
        for block in re.findall(r'(?:ratios\s*=\s*\{|ratios\.update\(\{|publish\([^{)]*\{)(.*?)\}', src, re.S):
            names |= set(re.findall(r'f?"([^"]+)":', block))
    names = {re.sub(r"\{[^}]*\}", "16", n) for n in names}
    assert len(names) >= 15  # every script's headline figures were found
    unknown = sorted(n for n in names if meaning(n) == ("?", "?"))
    assert not unknown, unknown


def test_shell_completion_is_enabled():
    script = subprocess.run([str(KVC), "--show-completion", "bash"], capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "_kvc_completion" in script.stdout
    env = dict(os.environ, COMP_WORDS="kvc ns dr", COMP_CWORD="2", _KVC_COMPLETE="complete_bash")
    words = subprocess.run([str(KVC)], capture_output=True, text=True, env=env, timeout=60)
    assert words.stdout.split() == ["drop"]
