"""Inputs without bounds (issue 26, item 7): a --salt-file is a regular file of at most 4 KiB (a warning when its
group or others may read it), a --tokens-file is read up to a bound, and `kvc generate` streams its trace: its
memory does not grow with --requests.

On fbee4ed a salt file was read whatever it was: /dev/zero until memory ran out, a FIFO for ever, a 0644 file
without a word; a tokens file was read whole; `kvc generate` built the whole trace in memory before writing it
(1375 MiB of peak RSS at 100k requests). Each test here fails there. The commands that would read without bound
on fbee4ed run under an address-space limit, so that trying them there fails fast instead of taking the machine's
memory."""

import contextlib
import os
import resource
import subprocess
import threading

import pytest
from typer.testing import CliRunner

import clirun
from kvc.main import app
from kvcache import read_trace

KVC = clirun.KVC
SALT = "salt-Vb7q2-inputs-secret"
TOKENS = ",".join(str(t) for t in range(1, 33))
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _capped(cap=1 << 30):
    """1 GiB of address space: enough for kvc's commands that read no KV, not for /dev/zero."""
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def kvc(*args, timeout=120):
    """kvc in a process of its own, under an address-space cap (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVC_SALT", "KVC_STORE")}
    return subprocess.run([str(KVC), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env,
                          preexec_fn=_capped)


def _one_line(result, says):
    code = getattr(result, "exit_code", getattr(result, "returncode", None))
    assert code == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvc: error: ") and says in lines[0], result.stderr
    return lines[0]


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "store"
    assert invoke("init", "--store", path, "--page-size", 4, "--layers", 1, "--kv-heads", 1,
                  "--head-dim", 16).exit_code == 0
    return path


def _salt_file(path, mode=0o600, text=SALT + "\n"):
    path.write_text(text)
    path.chmod(mode)
    return path


# --- --salt-file ------------------------------------------------------------------------------------------------

def test_a_salt_file_that_is_a_device_is_refused_not_read_until_memory_runs_out(tmp_path):
    result = kvc("ns", "drop", "t1", "--salt-file", "/dev/zero", "--yes", "--store", tmp_path / "none")
    _one_line(result, "--salt-file /dev/zero: not a regular file")


def test_a_salt_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "salt.fifo"
    os.mkfifo(fifo)
    try:
        result = kvc("ns", "drop", "t1", "--salt-file", fifo, "--yes", "--store", tmp_path / "none", timeout=60)
    finally:  # on fbee4ed kvc waits in open() for a writer: be that writer, so the process ends
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    _one_line(result, "not a regular file")


def test_a_salt_file_over_4_kib_is_refused(tmp_path):
    big = _salt_file(tmp_path / "big.salt", text=SALT + "\n" + "x" * 4096)
    line = _one_line(invoke("ns", "drop", "t1", "--salt-file", big, "--yes", "--store", tmp_path / "none"),
                     "a salt file holds at most 4096")
    assert SALT not in line
    exactly = _salt_file(tmp_path / "edge.salt", text=SALT + "\n" + "x" * (4095 - len(SALT)))
    assert exactly.stat().st_size == 4096
    _one_line(invoke("ns", "drop", "t1", "--salt-file", exactly, "--yes", "--store", tmp_path / "none"),
              "no store here")  # read; the command goes on to its store


@pytest.mark.parametrize("mode, who", [(0o644, "its group and every other user"), (0o666, "its group and every "
                                       "other user"), (0o640, "its group"), (0o604, "every other user")])
def test_a_salt_file_others_can_read_is_used_with_one_warning(store, tmp_path, mode, who):
    salt = _salt_file(tmp_path / "t1.salt", mode)
    result = invoke("put", "--store", store, "--extra-key", "t1", "--salt-file", salt, "--tokens", TOKENS)
    assert result.exit_code == 0, result.stderr
    warnings = [x for x in result.stderr.splitlines() if x.startswith("kvc: warning:")]
    assert warnings == [f"kvc: warning: --salt-file {salt} is readable by {who} (mode {mode:04o}); keep a salt "
                        f"file private: chmod 600"]
    assert SALT not in result.stdout + result.stderr


def test_a_private_salt_file_and_a_link_to_one_are_read_without_a_word(store, tmp_path):
    salt = _salt_file(tmp_path / "t1.salt")
    link = tmp_path / "mounted.salt"  # mounted secrets (Kubernetes) are links to the file
    link.symlink_to(salt)
    for path in (salt, link):
        result = invoke("put", "--store", store, "--extra-key", "t1", "--salt-file", path, "--tokens", TOKENS,
                        "--json")
        assert result.exit_code == 0 and result.stderr == "", result.stderr


# --- --tokens-file ----------------------------------------------------------------------------------------------

def test_a_tokens_file_is_read_up_to_a_bound(tmp_path):
    result = kvc("prefetch", "--extra-key", "t1", "--tokens-file", "/dev/zero", "--store", tmp_path / "none")
    _one_line(result, "--tokens-file /dev/zero: more than 16777216 bytes")


# --- kvc generate -----------------------------------------------------------------------------------------------

def _generate_peak_rss(out, requests):
    """Peak RSS (bytes) of one `kvc generate` process, from its own rusage (not the other children's)."""
    proc = subprocess.Popen([str(KVC), "generate", str(out), "--requests", str(requests)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    assert proc.returncode == 0
    return usage.ru_maxrss * 1024


def test_generate_streams_its_trace_memory_flat_in_requests(tmp_path):
    """40x the requests, the same memory: a trace of 80k requests (about 27M tokens) took 1.1 GiB more than one of
    2k on fbee4ed, which held every request as Python ints before writing."""
    small = _generate_peak_rss(tmp_path / "small.jsonl", 2_000)
    large = _generate_peak_rss(tmp_path / "large.jsonl", 80_000)
    assert large - small < 48 << 20, (small >> 20, large >> 20)
    assert len(read_trace(tmp_path / "small.jsonl")) == 2_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["large.jsonl", "small.jsonl"]


def _interruptible(cap: int) -> None:
    """In the child before it runs kvc: the address-space cap, and SIGINT at its default action. A child inherits
    an ignored SIGINT, and a test run started as a background job (`make test &`, a loop of runs `&`-ed to load the
    machine: POSIX shells start those with SIGINT ignored) hands kvc one, which kvc rightly leaves ignored (nohup):
    the Ctrl-C below was then a no-op and the 2M-request generate ran to its end, exit 0 (issue 36). A user's
    Ctrl-C reaches a foreground kvc whose SIGINT is at its default; so does this test's."""
    import signal

    _capped(cap)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_an_interrupted_generate_leaves_nothing(tmp_path):
    """Streaming keeps the trace atomic: a generate stopped half-way leaves no OUT and no temporary file."""
    import signal

    proc = subprocess.Popen([str(KVC), "generate", str(tmp_path / "out.jsonl"), "--requests", "2000000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: _interruptible(2 << 30))  # fbee4ed would build 27 GiB first
    seen = threading.Event()

    def watch():  # the temporary file appears once the generator writes: then interrupt it
        while proc.poll() is None and not seen.is_set():
            if any(p.name.startswith(".out.jsonl.") and p.stat().st_size > 0 for p in tmp_path.iterdir()):
                seen.set()
            else:
                os.sched_yield()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    watcher.join(timeout=120)
    if not seen.is_set():
        proc.kill()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert seen.is_set(), err
    assert proc.returncode == 130 and err == "kvc: interrupted\n"
    assert list(tmp_path.iterdir()) == []


def test_generate_refuses_tenants_and_documents_it_could_not_hold(tmp_path):
    """What the generator holds grows with tenants x documents, not with requests: 100k of each would be 6 TB."""
    result = kvc("generate", tmp_path / "out.jsonl", "--tenants", "100000", "--documents", "100000",
                 "--requests", "1")
    _one_line(result, "--tenants 100000 x --documents 100000: the generator would hold")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, names", [
    (["ping", "--timeout", "nan", "--socket", "/nonexistent/kvc.sock"], "--timeout"),
    (["top", "--interval", "nan", "--socket", "/nonexistent/kvc.sock"], "--interval"),
    (["audit", "--since", "1e20"], "--since"),
    (["audit", "--since", "nan"], "--since"),
    (["audit", "--since", "-5"], "--since"),
    (["audit", "--workers", str(10**20)], "--workers"),
    (["audit", "--workers", str(os.cpu_count() * 64)], "--workers"),
    (["init", "--model", "m\udcff\udcfe"], "--model"),
    (["serve", "--socket", "/nonexistent/kvc.sock", "--events", "99999"], "--events"),
    (["serve", "--socket", "/nonexistent/kvc.sock", "--events", "tcp://127.0.0.1:65536"], "--events"),
    (["serve", "--socket", "/nonexistent/kvc.sock", "--metrics-port", "65536"], "--metrics-port"),
    (["serve", "--socket", "/nonexistent/kvc.sock", "--socket-mode", "777777"], "--socket-mode"),
    (["events", "--endpoint", "99999"], "--endpoint"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_the_issues_inputs_are_usage_errors_naming_the_option(tmp_path, args, names):
    """Issue 36's list, through kvc's own entry point (in this process: none of them reads anything without
    bound): on ebaf189 the first three and the non-UTF-8 model were "internal error", `--events 99999` bound port
    34463, `--workers 1e20` started 256 processes on 2 cores. (tests/integration/test_cli_every_input.py tries
    every option the same way.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("KVC_SALT", "KVC_STORE")}
    result = clirun.in_process(*args, *(["--store", tmp_path / "store"] if args[0] in ("audit", "init") else []),
                               env=env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("kvc: error: ") and names in lines[0], result.stderr
    assert "internal error" not in lines[0] and not (tmp_path / "store").exists()

