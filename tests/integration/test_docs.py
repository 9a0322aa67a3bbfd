"""The user docs (docs/*.md, the runbooks' headers, `--help`) say what the code does: each claim a test can check is
checked against what kvc really prints — kvc run in this process (`clirun.in_process`: the console script's main
and error contract) on a real LMDB store, and a real `kvc serve` process (ready once its --json ready line is read)
for the live commands' JSON."""

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import click
import pytest
from rich.text import Text

import clirun
from kvc.main import COMMANDS, _build
from kvcache.workload.traces import TraceRequest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUNBOOKS = sorted((ROOT / "examples" / "runbooks").glob("*.sh"))
KVC = clirun.KVC
SALT = "docs-test-salt-1"


def kvc(*args, env=None):
    """kvc in this process, without the caller's KVC_* settings (plus `env`)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    return clirun.in_process(*args, env={**base, **(env or {})})


def ok_json(*args, **kw):
    out = kvc(*args, **kw)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def leaf_commands():
    """(path, click command) of every command kvc has, groups walked: ("ns", "quota", "set")."""
    def walk(cmd, path):
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from walk(sub, (*path, name))
        else:
            yield path, cmd
    for name in COMMANDS:
        yield from walk(_build(name), (name,))


def sections(doc: Path) -> dict[str, str]:
    """A markdown file's `## ` sections: heading -> body."""
    parts = re.split(r"^## (.+)$", doc.read_text(), flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


# --- --help --------------------------------------------------------------------------------------------------


def test_put_help_shows_the_kv_file_shape():
    out = kvc("put", "--help", env={"COLUMNS": "400"})
    assert out.returncode == 0, out.stderr
    assert "of shape [tokens, ...] whose bytes per token" in out.stdout


def test_no_help_text_loses_brackets_to_rich_markup():
    """Every bracket a command's or an option's help holds survives rich markup (`\\[` escapes one)."""
    lost = []
    for path, cmd in leaf_commands():
        for text in [cmd.help or "", *(getattr(p, "help", None) or "" for p in cmd.params)]:
            meant = text.replace("\\[", "[")
            if Text.from_markup(text).plain.count("[") != meant.count("["):
                lost.append(f"kvc {' '.join(path)}: {text!r}")
    assert not lost, "\n".join(lost)


# --- docs/trace-format.md ------------------------------------------------------------------------------------


def test_trace_format_documents_every_field_of_a_trace_line():
    rows = set(re.findall(r"^\| `(\w+)` \|", (DOCS / "trace-format.md").read_text(), flags=re.M))
    assert rows == set(TraceRequest.__struct_fields__)


def test_trace_format_names_the_salts_kvc_generate_writes(tmp_path, monkeypatch):
    text = (DOCS / "trace-format.md").read_text()
    patterns = set(re.findall(r"`([\w-]*<[\w<>-]*)`", text))  # the placeholder forms: `tenant-<i>`, `salt-...`
    salt_forms = [p for p in patterns if "salt" in p]
    assert len(salt_forms) == 1, patterns
    monkeypatch.chdir(tmp_path)  # a path relative to where kvc runs
    doc = ok_json("generate", "trace.jsonl", "--requests", 40, "--tenants", 3, "--seed", 7, "--json")
    assert doc["spec"]["seed"] == 7
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    written = {(r["extra_key"], r["cache_salt"]) for r in lines}
    assert len(written) == 3
    for extra_key, salt in written:
        i = extra_key.removeprefix("tenant-")
        assert salt == salt_forms[0].replace("<seed>", "7").replace("<i>", i)
        assert extra_key == f"tenant-{i}" and "`tenant-<i>`" in text
    assert all("ttl_s" not in r for r in lines)  # the doc says generate never writes one


# --- docs/cli.md ---------------------------------------------------------------------------------------------


def test_cli_md_lists_every_command():
    table = (DOCS / "cli.md").read_text()
    missing = [" ".join(p) for p, _ in leaf_commands() if f"`kvc {' '.join(p)}" not in table]
    assert not missing


def test_cli_md_error_example_is_what_kvc_prints(tmp_path):
    text = (DOCS / "cli.md").read_text()
    example = re.search(r"```json\n(\{\"error\".*?)\n```", text, re.S).group(1)
    named = re.search(r"`(kvc [^`]*--store /srv/kvc[^`]*)`", text)
    assert named, "cli.md must name the command its error example comes from"
    command = named.group(1)
    where = str(tmp_path / "srv" / "kvc")  # a location that surely does not exist
    out = kvc(*command.replace("/srv/kvc", where).split()[1:])
    assert out.returncode == 2
    assert json.loads(out.stdout) == json.loads(example.replace("/srv/kvc", where))


# --- docs/json.md --------------------------------------------------------------------------------------------


def _covers(heading: str, path: tuple[str, ...]) -> bool:
    *group, leaf = path
    return heading.startswith(" ".join(group)) and leaf in re.split(r"[ ,()]+", heading)


def test_json_md_has_a_section_for_every_command_with_json():
    headings = list(sections(DOCS / "json.md"))
    missing = [" ".join(p) for p, cmd in leaf_commands()
               if "--json" in {o for param in cmd.params for o in param.opts}
               and not any(_covers(h, p) for h in headings)]
    assert not missing


def _named(section: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", section)) | set(re.findall(r'"([a-z_]+)"', section))


def _section_of(path: tuple[str, ...]) -> str:
    found = [body for h, body in sections(DOCS / "json.md").items() if _covers(h, path)]
    assert len(found) == 1, path
    return found[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A store with two tenants, and a `kvc serve` on it with a TTL policy: (store, socket, ready line)."""
    root = tmp_path_factory.mktemp("docs-live")
    store = root / "store"
    assert kvc("init", "--store", store, "--page-size", 4, "--layers", 1, "--kv-heads", 1,
               "--head-dim", 8).returncode == 0
    for key, salt in (("t1", SALT), ("t2", "")):
        put = kvc("put", "--store", store, "--extra-key", key, "--tokens", ",".join(map(str, range(1, 41))),
                  env={"KVC_SALT": salt})
        assert put.returncode == 0, put.stderr
    offline = root / "offline"
    shutil.copytree(store, offline)
    sock = str(root / "s.sock")
    with open(root / "serve.err", "w") as err:
        proc = subprocess.Popen([str(KVC), "serve", "--store", str(store), "--socket", sock, "--json",
                                 "--device-tokens", "256", "--host-tokens", "512", "--ttl-default-s", "3600"],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline()
    assert line, (root / "serve.err").read_text()
    yield offline, sock, json.loads(line)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()


def test_json_md_names_every_field_the_commands_print(served):
    """Every top-level field of each command's real --json output is named in that command's json.md section."""
    store, sock, ready = served
    t1 = {"KVC_SALT": SALT}
    tokens = ",".join(map(str, range(1, 41)))
    runs = {
        ("serve",): ready,
        ("prefetch",): ok_json("prefetch", "--store", store, "--extra-key", "t1", "--tokens", tokens, "--json",
                               env=t1),
        ("version",): ok_json("version", "--json"),
        ("ping",): ok_json("ping", "--socket", sock, "--json"),
        ("stats",): ok_json("--socket", sock, "stats", "--json"),
        ("ns", "quota", "show"): ok_json("ns", "quota", "show", "--store", store, "--json"),
        ("ns", "quota", "set"): ok_json("--socket", sock, "ns", "quota", "set", "--extra-key", "t2", "--salt", "",
                                        "--device-tokens", 64, "--json"),
        ("ns", "quota", "clear"): ok_json("--socket", sock, "ns", "quota", "clear", "--extra-key", "t2", "--salt",
                                          "", "--json"),
        ("load-back",): ok_json("--socket", sock, "load-back", "--extra-key", "t1", "--tokens", tokens, "--json",
                                env=t1),
    }
    runs[("ns", "ls")] = ok_json("--socket", sock, "ns", "ls", "--json")  # after the load-back: t1 has a deadline
    runs[("ns", "evict")] = ok_json("--socket", sock, "ns", "evict", "t1", "--json", env=t1)
    runs[("ns", "expire")] = ok_json("--socket", sock, "ns", "expire", "t1", "--yes", "--json", env=t1)
    assert runs[("ns", "expire")]["expired"] is True and runs[("ns", "evict")]["device_pages"] > 0
    assert ready["ttl"] is not None  # serve's ready line names its TTL policy
    unnamed = {}
    for path, doc in runs.items():
        named = _named(_section_of(path))
        fields = set(doc)
        for nested in ("namespaces",):  # per-namespace objects of the listings
            for item in doc.get(nested) or []:
                fields |= set(item)
        if path == ("stats",):
            fields |= set(doc["cache"])
        if path == ("ping",):
            fields |= set(doc["server"])
        if fields - named:
            unnamed[" ".join(path)] = sorted(fields - named)
    assert not unnamed


# --- the runbooks ---------------------------------------------------------------------------------------------


def test_runbooks_say_they_need_bash_and_stop_under_sh(tmp_path):
    assert RUNBOOKS
    sh_is_bash = "bash" in os.path.realpath(shutil.which("sh") or "")
    for path in RUNBOOKS:
        lines = path.read_text().splitlines()
        assert lines[0] == "#!/usr/bin/env bash", path.name
        header = [line for line in lines[1:] if line.startswith("#")][:3]
        assert any("Needs bash" in line for line in header), path.name
        assert os.access(path, os.X_OK), path.name
        settings = next(line for line in lines if line.startswith("set -"))
        assert "u" in settings.split()[1] and "pipefail" in settings, path.name
        if not sh_is_bash:  # under sh: one line on stderr, exit 2, before anything ran
            out = subprocess.run(["sh", str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                                 env={"PATH": os.environ["PATH"], "KVC": "/nonexistent/kvc"})
            assert out.returncode == 2 and out.stdout == "", path.name
            assert out.stderr.count("\n") == 1 and "needs bash" in out.stderr, (path.name, out.stderr)
    assert "bash runbooks" in (ROOT / "README.md").read_text()
