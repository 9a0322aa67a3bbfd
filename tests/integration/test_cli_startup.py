"""Start-up (issue 13): commands that move no KV import no torch (on 0f180b0 `kvc --version` alone imported it:
3.8 s of 4-7 s). Wall times are measured by benchmarks/bench_startup.py, not asserted here."""

import os
import re
import subprocess
import sys

import pytest

import clirun

KVC = clirun.KVC


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("startup") / "store"
    subprocess.run([str(KVC), "init", "--store", str(path)], check=True, capture_output=True)
    return path


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["ns", "ls"], ["ns", "ls", "--json"], ["stats"],
                                  ["stats", "--prom"], ["audit"], ["ns", "--help"], ["prefetch", "--help"]])
def test_store_only_commands_never_import_torch(store, args):
    # -X importtime lists every module the real entry point imports, one per line, on stderr
    proc = subprocess.run([sys.executable, "-X", "importtime", str(KVC), *args, "--store", str(store)]
                          if args[0] in ("ns", "stats", "audit") and "--help" not in args
                          else [sys.executable, "-X", "importtime", str(KVC), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stderr, re.M)
    assert "kvc.main" in modules  # the listing is real
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]
    assert "kvcache.engine.cache" not in modules and "pydantic" not in modules


# The console script run under a wrapper that writes every module loaded (sys.modules) when it exits, to the file
# env MODULES_OUT names: it sees what -X importtime cannot, the modules imported by importlib (kvc.main loads a
# command's module that way). Called as `python -c WRAPPER KVC ARGS...`: sys.argv is then ['-c', KVC, ARGS...].
_LOADED = """
import atexit, os, runpy, sys
out = os.environ["MODULES_OUT"]
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("args, groups", [
    (["--version"], set()),
    (["--help"], set()),
    # ns quota is a subgroup of ns, and ns probe and ns dump commands of it in their own modules (light: no store,
    # no torch; what a dump prints with is loaded when it runs)
    (["ns", "ls", "--store"], {"kvc.commands.ns", "kvc.commands.ns_quota", "kvc.commands.ns_probe",
                               "kvc.commands.ns_dump"}),
    (["stats", "--store"], {"kvc.commands.stats"}),
])
def test_a_command_loads_its_own_module_and_no_torch(store, tmp_path, args, groups):
    loaded = tmp_path / "modules"
    argv = [*args, str(store)] if args[-1] == "--store" else args
    proc = subprocess.run([sys.executable, "-c", _LOADED, str(KVC), *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MODULES_OUT": str(loaded)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = set(loaded.read_text().split())
    assert "kvc.main" in modules  # the listing is real
    assert {m for m in modules if m.startswith("kvc.commands.")} == groups
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert "kvcache.engine.cache" not in modules
