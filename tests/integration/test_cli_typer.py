"""kvc under every typer (issue 36, item 6): the one its venv holds, and the newest (`make typer-next`).

On ebaf189 every command, `kvc --version` included, printed a traceback under typer 0.26 and later (`typer._click`
has no `Option`): those typers carry their own reduced click, and SGLang's venvs and GPU images hold 0.27-0.29. With
click installed beside them (other packages pull it in), a bad option was "internal error: NoSuchOption": kvc caught
the exceptions of the click it imported, not of the one typer raised them with. kvc now takes click from typer
(`kvc.clickapi`) and declares its own options through typer.

Each mode runs in a process of its own: with click importable (the usual venv) and, where the typer allows it,
without (`import click` fails, as in a venv holding typer >= 0.26 alone). In it, every case goes through the app's
own `main` (CliRunner: the error contract, exit codes and all), and the real entry point runs as a script too.
Under `make typer-next` (env KVC_TYPER_NEXT=1) the module first checks that the typer it runs under is one of those.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from kvc import clickapi
from kvc.main import COMMANDS

NEXT = os.environ.get("KVC_TYPER_NEXT", "") not in ("", "0")
# What every mode's process runs first: click made unimportable when asked (None in sys.modules: `import click`
# raises ImportError).
PRELUDE = ("import sys\n"
           "if sys.argv[1] == 'no-click':\n"
           "    sys.modules['click'] = None\n")
ENTRY = PRELUDE + "sys.argv = ['kvc', *sys.argv[2:]]\nfrom kvc.main import app\napp()\n"
# The cases, run in order through CliRunner by one process: name -> (argv, environment)
CASES_SCRIPT = PRELUDE + """
import json
from typer.testing import CliRunner
from kvc.main import app, every_command
cases = json.loads(sys.argv[2])
for path, _ in every_command():
    cases.append([" ".join(path) + " --help", [*path, "--help"], {}])
out = {}
for name, argv, env in cases:
    r = CliRunner().invoke(app, argv, env={"KVC_SALT": None, "KVC_STORE": None, "KVC_SOCKET": None, **env})
    out[name] = {"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}
out["click imported"] = "click" in sys.modules and sys.modules["click"] is not None
print(json.dumps(out))
"""
MODES = ["click", pytest.param("no-click", marks=pytest.mark.skipif(
    not clickapi.VENDORED, reason=f"typer {typer.__version__} runs on the click distribution: it cannot be absent"))]


def _cases(store: Path) -> list[tuple[str, list[str], dict[str, str]]]:
    s = str(store)
    return [
        ("help", ["--help"], {}),
        ("no command", [], {}),
        ("unknown command", ["no-such-command"], {}),
        ("unknown option", ["ns", "ls", "--no-such-option"], {}),
        ("unknown option json", ["ns", "ls", "--no-such-option", "--json"], {}),
        ("nan", ["ping", "--timeout", "nan", "--socket", "/nonexistent/kvc.sock"], {}),
        ("not utf-8", ["init", "--model", "m\udcff", "--store", "/nonexistent/s"], {}),
        ("env inf", ["ns", "ls"], {"KVC_TIMEOUT": "inf"}),
        ("port", ["serve", "--events", "99999", "--socket", "/nonexistent/s"], {}),
        ("completion", ["--show-completion", "bash"], {}),
        ("completion tcsh", ["--show-completion", "tcsh"], {}),
        ("init", ["init", "--store", s, "--page-size", "4", "--json"], {}),
        ("put", ["put", "--store", s, "--extra-key", "t1", "--tokens", "1,2,3,4,5,6,7,8", "--json"], {"KVC_SALT": ""}),
        ("ns ls", ["ns", "ls", "--store", s, "--json"], {}),
        ("audit", ["audit", "--store", s, "--json", "--workers", "1"], {}),
        ("stats", ["stats", "--store", s, "--json"], {}),
    ]


@pytest.fixture(scope="module", params=MODES)
def ran(request, tmp_path_factory) -> tuple[str, dict]:
    """(mode, every case's {code, stdout, stderr} by name), from one process of that mode."""
    mode = request.param
    store = tmp_path_factory.mktemp(f"typer-{mode}") / "store"
    proc = subprocess.run([sys.executable, "-c", CASES_SCRIPT, mode, json.dumps(_cases(store))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return mode, json.loads(proc.stdout)


def one_error_line(result: dict, says: str) -> None:
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == 2, result
    assert len(lines) == 1 and lines[0].startswith("kvc: error: ") and says in lines[0], result["stderr"][-800:]
    assert "internal error" not in lines[0] and "Traceback" not in result["stderr"]


def test_the_typer_under_test():
    """`make typer-next` is a check only if the newest typer is the one running: one that carries its own click."""
    if NEXT:
        assert clickapi.VENDORED, f"KVC_TYPER_NEXT=1, yet typer {typer.__version__} runs on click"
    assert clickapi.click is (typer.core._click if clickapi.VENDORED else sys.modules["click"])
    assert issubclass(typer.BadParameter, clickapi.exceptions.UsageError)  # what typer raises is what kvc catches


@pytest.mark.parametrize("mode", MODES)
def test_the_entry_point(mode):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    version = subprocess.run([sys.executable, "-c", ENTRY, mode, "--version"], capture_output=True, text=True,
                             timeout=120, env=clean)
    assert version.returncode == 0 and version.stdout.startswith("kvc ") and version.stderr == "", version.stderr
    bad = subprocess.run([sys.executable, "-c", ENTRY, mode, "ns", "ls", "--no-such-option"], capture_output=True,
                         text=True, timeout=120, env=clean)
    one_error_line({"code": bad.returncode, "stderr": bad.stderr}, "No such option")


def test_click_is_the_one_typer_runs_on(ran):
    """Under a typer with its own click nothing imports the click distribution, whether it is there or not (on
    ebaf189 kvc imported it whenever it could, and mixed its classes with typer's); under an older typer it is
    typer's own."""
    _, out = ran
    assert out["click imported"] is not clickapi.VENDORED


def test_help_and_usage_errors(ran):
    _, out = ran
    assert out["help"]["code"] == 0 and all(name in out["help"]["stdout"] for name in COMMANDS)
    assert "--show-completion" in out["help"]["stdout"]
    bare = out["no command"]  # no command: the help, as a usage error
    assert bare["code"] == 2 and "Usage" in bare["stdout"] + bare["stderr"] and "Traceback" not in bare["stderr"]
    one_error_line(out["unknown command"], "No such command")
    one_error_line(out["unknown option"], "No such option")
    assert json.loads(out["unknown option json"]["stdout"])["error"]["kind"] == "usage"


def test_every_commands_help_builds_under_this_typer(ran):
    """Each command's module is imported and its parameters built (`parser=`, ranges, choices, lists, envvars)."""
    _, out = ran
    helps = {name.removesuffix(" --help"): r["code"] for name, r in out.items() if name.endswith(" --help")}
    assert set(helps) >= {"init", "put", "replay", "audit", "serve", "events", "ns ls", "ns quota set"}
    assert {path: code for path, code in helps.items() if code != 0} == {}


def test_bad_values_are_usage_errors(ran):
    _, out = ran
    one_error_line(out["nan"], "--timeout")
    one_error_line(out["not utf-8"], "--model")
    one_error_line(out["env inf"], "--timeout")
    one_error_line(out["port"], "--events")


def test_shell_completion(ran):
    _, out = ran
    assert out["completion"]["code"] == 0 and "_kvc_completion" in out["completion"]["stdout"]
    one_error_line(out["completion tcsh"], "no completion for the shell 'tcsh'")


def test_a_store_round_trip(ran):
    _, out = ran
    assert out["init"]["code"] == 0 and json.loads(out["init"]["stdout"])["created"], out["init"]
    assert out["put"]["code"] == 0 and json.loads(out["put"]["stdout"])["written"] == 2, out["put"]
    listed = json.loads(out["ns ls"]["stdout"])
    assert [(n["extra_key"], n["pages"]) for n in listed["namespaces"]] == [("t1", 2)]
    assert out["audit"]["code"] == 0 and json.loads(out["audit"]["stdout"])["ok"], out["audit"]
    assert out["stats"]["code"] == 0 and json.loads(out["stats"]["stdout"])["pages"] == 2, out["stats"]
