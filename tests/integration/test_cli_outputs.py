"""Writes over what is there (issue 26, item 6): an output is replaced atomically only where its name holds a
regular file or nothing; a symbolic link, FIFO or device is refused (one line, exit 2, the name left as it was)
unless --force, which writes through the link or into the FIFO, never replacing either.

On fbee4ed `kvc generate OUT` and `replay --snapshot-out OUT` renamed a temporary file over OUT: a link, FIFO or
device node became a regular file (as root this replaced /dev/full), and `kvc snapshot` wrote through a link
without a word. Every refusal test here fails there."""

import contextlib
import json
import os
import stat
import subprocess
import threading

import pytest
from typer.testing import CliRunner

import clirun
from kvc.errors import UsageError
from kvc.main import app
from kvcache import WorkloadSpec, generate, read_trace, write_trace

KVC = clirun.KVC
runner = CliRunner()
ORIGINAL = b"the file a link leads to: kept as it was\n"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def kvc(*args, timeout=120):
    return subprocess.run([str(KVC), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _one_line(result):
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvc: error: "), result.stderr
    return lines[0]


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "store"
    assert invoke("init", "--store", path, "--page-size", 4, "--layers", 1, "--kv-heads", 1,
                  "--head-dim", 16).exit_code == 0
    return path


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, generate(WorkloadSpec(requests=12, tenants=2, seed=3)))
    return path


def _link(tmp_path):
    target = tmp_path / "elsewhere" / "target"
    target.parent.mkdir()
    target.write_bytes(ORIGINAL)
    link = tmp_path / "out"
    link.symlink_to(target)
    return link, target


def _fifo(tmp_path):
    path = tmp_path / "out"
    os.mkfifo(path)
    return path


def _device(tmp_path):
    """A character device node of our own (the null device's numbers): never /dev's own, which fbee4ed would
    replace when run as root."""
    path = tmp_path / "out"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root (CAP_MKNOD)")
    return path


KINDS = {"link": (_link, stat.S_ISLNK, "a symbolic link"), "fifo": (_fifo, stat.S_ISFIFO, "a named pipe"),
         "device": (_device, stat.S_ISCHR, "a character device")}


def _commands(tmp_path, store, trace, out):
    return {"generate": ["generate", out, "--requests", "5"],
            "replay --snapshot-out": ["replay", trace, "--store", store, "--snapshot-out", out],
            "snapshot": ["snapshot", out, "--socket", tmp_path / "no-server.sock"]}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["generate", "replay --snapshot-out", "snapshot"])
def test_an_output_name_holding_a_link_fifo_or_device_is_refused_and_left_as_it_was(tmp_path, store, trace,
                                                                                      command, kind):
    make, is_kind, words = KINDS[kind]
    made = make(tmp_path)
    out = made[0] if isinstance(made, tuple) else made
    before = os.lstat(out)
    line = _one_line(invoke(*_commands(tmp_path, store, trace, out)[command]))
    assert words in line and "--force" in line, line
    after = os.lstat(out)
    assert is_kind(after.st_mode) and (after.st_ino, after.st_dev) == (before.st_ino, before.st_dev)
    if kind == "link":
        assert made[1].read_bytes() == ORIGINAL and os.readlink(out) == str(made[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["elsewhere", "out", "store", "trace.jsonl"]
                                                                if kind == "link" else
                                                                ["out", "store", "trace.jsonl"])  # no temp left


def test_a_directory_or_a_socket_is_refused_even_with_force(tmp_path):
    import socket

    (tmp_path / "dir").mkdir()
    (tmp_path / "dirlink").symlink_to(tmp_path / "dir")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        for name, words in (("dir", "a directory"), ("dirlink", "a directory (through its link)"),
                            ("sock", "a socket")):
            line = _one_line(invoke("generate", tmp_path / name, "--force"))
            assert f"is {words}, not a file kvc can write" in line


def test_force_writes_through_a_link_to_its_target_and_keeps_the_link(tmp_path):
    link, target = _link(tmp_path)
    result = invoke("generate", link, "--requests", "7", "--force", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["requests"] == 7
    assert link.is_symlink() and os.readlink(link) == str(target)  # the link is kept, pointing where it did
    assert len(read_trace(target)) == 7 and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["target"]  # replaced in its own directory
    # a dangling link: its target is made
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "elsewhere" / "new")
    assert invoke("generate", dangling, "--requests", "3", "--force").exit_code == 0
    assert dangling.is_symlink() and len(read_trace(tmp_path / "elsewhere" / "new")) == 3


def test_force_snapshot_out_through_a_link_writes_the_snapshot_at_its_target(tmp_path, store, trace):
    link, target = _link(tmp_path)
    result = invoke("replay", trace, "--store", store, "--snapshot-out", link, "--force", "--json")
    assert result.exit_code == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    audited = invoke("audit", "--snapshot", link, "--json")
    assert audited.exit_code == 0, audited.stdout + audited.stderr
    assert target.read_bytes() != ORIGINAL


def test_force_streams_into_a_fifo_and_leaves_it_a_fifo(tmp_path):
    fifo = _fifo(tmp_path)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)  # open waits for a writer
    reader.start()
    result = kvc("generate", fifo, "--requests", "9", "--force")
    if result.returncode != 0:  # nothing opened the FIFO to write: release the reader (its open is counted)
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    reader.join(timeout=120)
    assert result.returncode == 0, result.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    lines = got[0].decode().splitlines()
    assert len(lines) == 9 and all(json.loads(x)["rid"] for x in lines)


def test_force_to_stdout_keeps_the_summary_out_of_the_data(tmp_path):
    result = subprocess.run(f"{KVC} generate --force /dev/stdout --requests 4 | cat", shell=True,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [json.loads(x)["rid"] for x in result.stdout.splitlines()] == [f"r{i:06d}" for i in range(4)]
    assert "4 requests" in result.stderr


def test_a_name_that_becomes_a_link_while_the_output_is_written_is_not_replaced(tmp_path):
    """The name is checked again at the rename: work that took long must not rename over what appeared since."""
    from kvc.outputs import output_target, writing

    out = tmp_path / "out"
    target = output_target(out, "OUT")
    victim = tmp_path / "victim"
    victim.write_bytes(ORIGINAL)
    with pytest.raises(UsageError, match="became a symbolic link while kvc wrote it"):
        with writing(target) as f:
            f.write(b"data\n")
            out.symlink_to(victim)
    assert out.is_symlink() and victim.read_bytes() == ORIGINAL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "victim"]  # the temporary file is gone


def test_a_regular_file_is_replaced_atomically_as_before(tmp_path):
    out = tmp_path / "out"
    out.write_bytes(b"old\n")
    assert invoke("generate", out, "--requests", "6").exit_code == 0
    assert len(read_trace(out)) == 6 and not out.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
