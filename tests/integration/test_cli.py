"""The installed `kvc` entry point, run as a user runs it."""

import subprocess
import sys

import pytest

import clirun

KVC = clirun.KVC


def run(*args):
    cmd = [str(KVC)] if KVC.exists() else [sys.executable, "-m", "kvc"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)


def test_version():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.startswith("kvc ") and out.stderr == ""


@pytest.mark.parametrize("args, code", [(("--help",), 0), ((), 2)])
def test_help(args, code):
    # with no command at all, help is shown as a usage error (exit 2), as click does
    out = run(*args)
    assert "tiered KV-cache" in out.stdout + out.stderr and out.returncode == code


def test_unknown_option_is_usage_error():
    out = run("--no-such-option")
    assert out.returncode == 2 and "No such option" in out.stderr
