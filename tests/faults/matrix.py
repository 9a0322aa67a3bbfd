"""The damage matrix (issue 36, item 1), importable as `matrix`: every region of an LMDB store x every way its key
file can differ x every command that opens a store, each run as a process of its own on a damaged copy of one
template. The process is a child forked from a server that imported kvc once (`forkrun`: its own pid, exit status
and signals, kvc's entry point, without a Python start and kvc's imports per case); `serve`, which the case stops
once it is ready, is the console script.

Regions come from the template's own page map (`lmdbpages`): each meta page; a branch, a leaf and an overflow page of
each sub-database that has one (the catalogue of sub-databases and the free list's own tree included), picked by a
seeded draw; the tail cut at several points (half the file, a tenth off, the last page, half a page); a 0-byte file;
the whole file random bytes. A page region is zeroed: what a lost sector, a sparse hole or a torn write leaves.

What every case must show (`check`): an exit code and, on a failure, exactly one line naming what is wrong and what
to do -- never a signal, never a traceback, never "internal error". A plain audit of a damaged store never says
"ok". After a repair every page that was intact (`Template.intact`: its payload, its records and those of every
page above it untouched by the damage) reads back byte for byte, and the report never says "0 lost" when a page
went: with `lost_exact` its count is the loss, without it a lower bound that is not 0 (or -1, unknown).

Size: `cases("ci")` is what `make test` runs (tests/faults/test_faults_matrix.py): every region under the plain
audit, the repair and `stats`, every key state under the audit, `put` and `ns ls`, and a seeded draw of the rest;
`cases("full")` is the whole product (env KVC_DAMAGE_MATRIX=full, or `python tests/faults/matrix.py --full`, which
prints the table region x key state x command -> outcome).
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
for _dir in (str(HERE), str(HERE.parent)):  # tests/ (clirun, forkrun, lmdbpages, read_only_user) as a script
    if _dir not in sys.path:
        sys.path.insert(0, _dir)

import clirun  # noqa: E402
import forkrun  # noqa: E402
import lmdbpages  # noqa: E402
from read_only_user import NO_CAPS  # noqa: E402

KVC = clirun.KVC
PYTHON = sys.executable
SEED = int(os.environ.get("KVC_DAMAGE_SEED", "36"))
FIXED_KEY = "a5" * 32  # the template's key: its page hashes, so where each record lies, are the same every run
OTHER_KEY = "5a" * 32  # another valid key: what a wrong backup restores
TENANTS = (("tenant-a", "salt-a"), ("tenant-b", "salt-b"))
ENGINE_NS = "sglang-a"
KEY_STATES = ("intact", "missing", "empty", "corrupt", "other", "unreadable")
COMMANDS = ("audit", "repair", "repair_force", "stats", "ns_ls", "ns_show", "put", "prefetch", "serve", "migrate",
            "sglang")
KEY_MISMATCH_EXIT = 4  # `kvc audit`: the key file is not the key the store's pages were written under
CASE_TIMEOUT = 300  # seconds a command may take: generous, a hung command is a failed case, not a hung suite
# What a line that refuses names as the way out: a command, a file to restore, something to stop or wait for.
WAY_OUT = ("`kvc ", "restore", "stop ", "wait", "remove", "rebuild", "chmod", "--force", "backup", "give ", "run ")


class Region(msgspec.Struct, frozen=True):
    """One place of the file to damage: pages zeroed (`kind` "page"), the file cut at `at` bytes ("cut"), emptied
    ("empty"), or replaced by random bytes ("random")."""

    name: str
    kind: str
    pages: list[int] = []
    at: int = 0


class Outcome(msgspec.Struct):
    """What one case did: its exit code (or the signal), the error kind and line, and what broke the rules."""

    region: str
    key: str
    command: str
    code: int  # exit code; negative: killed by that signal
    kind: str = ""  # the error kind, or the findings' kinds, or what a repair did
    line: str = ""  # the error line (stderr), or a short summary
    problems: list[str] = []

    def cell(self) -> str:
        """The table cell: exit code and what it said."""
        code = f"SIG{signal.Signals(-self.code).name[3:]}" if self.code < 0 else str(self.code)
        return f"{code} {self.kind}".strip() + (" !" if self.problems else "")


def _layout():
    from kvcache.types.layout import KVLayout

    return KVLayout("matrix@r1", layers=2, kv_heads=2, head_dim=64, dtype="float16", page_size=4)  # 4 KiB pages


class Template:
    """The store every case damages a copy of: two tenants of token pages (enough to give `pages`, `meta` and
    `children` branch pages, and each payload an overflow page) and a namespace of engine pages, under a fixed key;
    and what the oracle needs: where each record lies, which page hangs from which."""

    DOCS = 10  # chains of 10 pages per tenant

    def __init__(self, path: str) -> None:
        self.path = path
        self.layout = _layout()
        self.written: dict[bytes, bytes] = {}  # page hash -> payload
        self.parent: dict[bytes, bytes] = {}
        self.engine: set[bytes] = set()  # the engine pages (their hashes proved by the key alone)
        saved = os.environ.get("KVC_FINGERPRINT_KEY")
        os.environ["KVC_FINGERPRINT_KEY"] = FIXED_KEY  # for this process's open_store: the key file it writes
        try:
            self._build()
        finally:
            if saved is None:
                del os.environ["KVC_FINGERPRINT_KEY"]
            else:
                os.environ["KVC_FINGERPRINT_KEY"] = saved
        self.records: dict[str, dict[bytes, set[int]]] = {}
        self.pages = lmdbpages.live_pages(path, self.records)
        self.free = lmdbpages.free_list_pages(path)
        with open(os.path.join(path, "data.mdb"), "rb") as f:
            head = f.read(64)
            f.seek(0, 2)
            self.size = f.tell()
        self.page_size = lmdbpages.page_size(head)

    def _build(self) -> None:
        import hashlib

        from kvcache.storage.api import engine_origins, page_origins
        from kvcache.storage.registry import open_store
        from kvcache.types.keys import pack_tokens
        from kvcache.types.namespace import Namespace
        from kvcache.workload.kvdata import SyntheticKV

        kv = SyntheticKV(self.layout)
        with open_store(self.path, self.layout, create=True, durability="none") as store:
            for t, (extra, salt) in enumerate(TENANTS):
                ns = Namespace(extra, salt)
                for doc in range(self.DOCS):
                    tokens = [t * 1000 + doc] * 4 + list(range(doc * 100, doc * 100 + 36))
                    hashes, origins = page_origins(self.layout, pack_tokens(tokens), ns, store.chain_key)
                    self._put(store, kv, hashes, origins)
            keys = [hashlib.sha256(bytes([i])).digest() for i in range(12)]
            hashes, origins = engine_origins(self.layout, Namespace(ENGINE_NS), store.chain_key, keys)
            self._put(store, kv, hashes, origins)
            self.engine = {bytes(h) for h in hashes}

    def _put(self, store, kv, hashes, origins) -> None:
        pages = list(kv.pages(hashes).numpy())
        assert store.put(hashes, pages, origins).written == len(hashes)
        for h, p, o in zip(hashes, pages, origins, strict=True):
            self.written[bytes(h)] = bytes(p)
            self.parent[bytes(h)] = bytes(o.parent)

    # -- regions ---------------------------------------------------------------------------------------------

    def regions(self) -> list[Region]:
        """Every region of the file, one page of each kind drawn by the seed (see the module docstring)."""
        rng = random.Random(SEED)
        out = [Region("meta page 0", "page", [0]), Region("meta page 1", "page", [1])]
        groups: dict[tuple[str, str], list[lmdbpages.Page]] = {}
        for p in [*self.pages, *self.free]:
            groups.setdefault((p.db, p.kind), []).append(p)
        for (db, kind), pages in sorted(groups.items()):
            page = rng.choice(pages)
            name = {"": "catalogue", "free": "free list"}.get(db, db)
            out.append(Region(f"{name} {'overflow' if kind == 'data' else kind}", "page",
                              list(range(page.pgno, page.pgno + page.span))))
        ps, size = self.page_size, self.size
        out += [Region("tail cut at half", "cut", at=size // 2 // ps * ps),
                Region("tail cut a tenth off", "cut", at=size * 9 // 10 // ps * ps),
                Region("tail cut: last page", "cut", at=size - ps),
                Region("tail cut mid-page", "cut", at=size - ps // 2),
                Region("0-byte file", "empty"), Region("random bytes", "random")]
        return out

    def damage(self, path: str, region: Region) -> None:
        data = os.path.join(path, "data.mdb")
        if region.kind == "page":
            with open(data, "r+b") as f:
                for pg in region.pages:
                    f.seek(pg * self.page_size)
                    f.write(b"\0" * self.page_size)
        elif region.kind == "cut":
            os.truncate(data, region.at)
        elif region.kind == "empty":
            os.truncate(data, 0)
        else:
            with open(data, "wb") as f:
                f.write(random.Random(f"{SEED}-random").randbytes(self.size))

    def intact(self, region: Region) -> set[bytes]:
        """The pages the damage left whole: none of the file's pages holding their payload or records, nor those of
        a page above them (a token page is reached through its parents), lies in the region. The namespace,
        layout and store records, the children index, branch pages and the free list do not count: a repair
        finds the rest without them."""
        if region.kind in ("empty", "random"):
            return set()
        if region.kind == "cut":
            hit = set(range(-(-region.at // self.page_size) - (region.at % self.page_size != 0), self.size))
        else:
            hit = set(region.pages)
        own = {h: (self.records["pages"].get(h, set()) | self.records["meta"].get(h, set())) & hit
               for h in self.written}
        intact: set[bytes] = set()
        for h in self.written:
            chain, ok = h, True
            while chain in self.written:
                if own[chain]:
                    ok = False
                    break
                chain = self.parent[chain]
            if ok:
                intact.add(h)
        return intact


# -- key states --------------------------------------------------------------------------------------------------


def set_key_state(path: str, state: str) -> None:
    key = os.path.join(path, "fingerprint.key")
    if state == "missing":
        os.unlink(key)
    elif state == "empty":
        open(key, "w").close()
    elif state == "corrupt":
        with open(key, "w") as f:
            f.write("not a key at all\n")
    elif state == "other":
        with open(key, "w") as f:
            f.write(OTHER_KEY + "\n")
    elif state == "unreadable":
        os.chmod(key, 0)  # and the command runs without root's capabilities (NO_CAPS)


# -- commands --------------------------------------------------------------------------------------------------

SGLANG_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[2])
from kvcache.errors import KVCacheError
from unit.engines.fake_sglang import FakeMHAHostPool, FakeStorageConfig
from kvcache.engines.sglang import KvcStorage
try:
    backend = KvcStorage(FakeStorageConfig(extra_config={"kvc_store": sys.argv[1], "kvc_namespace": "sglang-a"}), {})
    backend.register_mem_pool_host(FakeMHAHostPool("layer_first", 4))
except KVCacheError as exc:
    print(f"kvc-sglang: error: {type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(2)
print("registered")
"""


def argv(command: str, store: str, work: str) -> list[str]:
    """The command line of `command` on `store` (`work`: a directory for its socket)."""
    s = ["--store", store]
    tokens = ",".join(map(str, range(5000, 5040)))
    return {
        "audit": ["audit", *s, "--json"],
        "repair": ["audit", *s, "--repair", "--json"],
        "repair_force": ["audit", *s, "--repair", "--force", "--json"],
        "stats": ["stats", *s, "--json"],
        "ns_ls": ["ns", "ls", *s, "--json"],
        "ns_show": ["ns", "show", TENANTS[0][0], *s, "--json"],
        "put": ["put", *s, "--extra-key", "tenant-c", "--tokens", tokens, "--json"],
        "prefetch": ["prefetch", *s, "--extra-key", TENANTS[0][0], "--json"],
        "serve": ["serve", *s, "--socket", os.path.join(work, "kvc.sock"), "--json"],
        "migrate": ["migrate", *s, "--json"],
        "sglang": [],
    }[command]


def case_env() -> dict[str, str]:
    """The environment every command runs in: no key, socket or store from the caller's, the first tenant's salt."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVC_FINGERPRINT_KEY", "KVC_SOCKET", "KVC_STORE")}
    env["KVC_SALT"] = TENANTS[0][1]
    return env


def run(command: str, store: str, work: str, no_caps: bool,
        forks: forkrun.Forks | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one command; a signal is a negative code. `serve` is stopped (SIGTERM) once
    it says it is ready. With `forks`, every command but `serve` is a child forked from that server (a process of
    its own, without a Python start and kvc's imports: `forkrun`); else the console script (or Python)."""
    env = case_env()
    prefix = NO_CAPS if no_caps else []
    if forks is not None and command != "serve":
        if command == "sglang":
            ran = forks.run(["-c", store, str(HERE.parent)], env=env, timeout=CASE_TIMEOUT, script=SGLANG_SCRIPT,
                            no_caps=bool(prefix))
        else:
            ran = forks.run(argv(command, store, work), env=env, timeout=CASE_TIMEOUT, no_caps=bool(prefix))
        return ran.returncode, ran.stdout, ran.stderr
    if command == "sglang":
        cmd = [*prefix, PYTHON, "-c", SGLANG_SCRIPT, store, str(HERE.parent)]
    else:
        cmd = [*prefix, str(KVC), *argv(command, store, work)]
    if command != "serve":
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CASE_TIMEOUT, env=env)
        return done.returncode, done.stdout, done.stderr
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        deadline = time.monotonic() + CASE_TIMEOUT
        ready = ""
        while time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                ready = proc.stdout.readline()
                break
        if ready and '"error"' not in ready:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=CASE_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        return code, ready + proc.stdout.read(), proc.stderr.read()


# -- one case ------------------------------------------------------------------------------------------------


def _errors(stderr: str) -> list[str]:
    """The lines of stderr that are not notes or warnings (a lock-free read, a format note)."""
    return [line for line in stderr.splitlines() if line.strip()
            and not line.startswith(("kvc: note:", "kvc: warning:"))]


def check(outcome: Outcome, out: str, err: str, damaged: bool, key: str) -> None:
    """The rules every case keeps (see the module docstring); what breaks them goes to `outcome.problems`."""
    p = outcome.problems
    if outcome.code < 0:
        p.append(f"killed by {signal.Signals(-outcome.code).name}")
    if "Traceback" in out + err or "internal error" in err:
        p.append("a traceback or an internal error")
    lines = _errors(err)
    found = (0, 1, KEY_MISMATCH_EXIT) if outcome.command == "audit" else (0, 1)  # the audit's own codes
    if outcome.code not in found and outcome.code >= 0:
        if len(lines) != 1:
            p.append(f"{len(lines)} error lines, not one")
        elif not any(w in lines[0] for w in WAY_OUT):
            p.append("the error line names no way out")
        outcome.line = lines[0] if lines else ""
    elif lines and outcome.command != "serve":
        p.append(f"stderr says more than notes on success: {lines[0][:120]}")
    if outcome.command == "audit" and damaged and outcome.code == 0:
        p.append("a plain audit of a damaged store said ok")


def kinds_of(doc: dict) -> str:
    if "error" in doc:
        return doc["error"].get("kind", "")
    if "violations" in doc:
        found = sorted({v["kind"] for v in doc["violations"]})
        return ",".join(found)
    return ""


def run_case(template: Template, region: Region | None, key: str, command: str, root: str,
             forks: forkrun.Forks | None = None) -> Outcome:
    """Damage a copy of the template (`region` None: no damage), set its key state, run the command (`forks`: see
    `run`), check it; for a repair, read every page back afterwards."""
    work = tempfile.mkdtemp(dir=root)
    store = os.path.join(work, "s")
    try:
        shutil.copytree(template.path, store)
        if region is not None:
            template.damage(store, region)
        set_key_state(store, key)
        code, out, err = run(command, store, work, no_caps=key == "unreadable", forks=forks)
        outcome = Outcome(region.name if region is not None else "none", key, command, code)
        doc: dict = {}
        try:
            doc = json.loads(out.splitlines()[0]) if out.strip() else {}
        except (json.JSONDecodeError, IndexError):
            doc = {}
        outcome.kind = kinds_of(doc) if isinstance(doc, dict) else ""
        if command == "sglang" and code == 2:
            outcome.kind = err.split(": ")[2] if err.count(": ") >= 2 else ""
        check(outcome, out, err, region is not None, key)
        # a forced repair under another valid key removes, on purpose, what that key does not reach
        if command in ("repair", "repair_force") and code in (0, 1) and not (key == "other" and command ==
                                                                             "repair_force"):
            # forced without the key, a rebuild drops the engine pages it cannot prove (it says so): the rest is
            # held to the rule
            provable = key == "intact" or command == "repair"
            _check_repair(template, region, store, doc, outcome, engine_pages=provable)
        if command in ("repair", "repair_force") and code == 1 and "salvage" in doc and doc["salvage"]:
            s = doc["salvage"]
            outcome.kind = f"kept {s['kept']}, lost {s['lost']}{'' if s['lost_exact'] else '+'}"
        return outcome
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_repair(template: Template, region: Region | None, store: str, doc: dict, outcome: Outcome,
                  engine_pages: bool = True) -> None:
    """After a repair: every intact page reads back exact (with the store's own key put back: the key file is
    part of the store, the pages are what is judged), and the report's loss is honest."""
    key = os.path.join(store, "fingerprint.key")
    if os.path.exists(key):
        os.chmod(key, 0o600)
    with open(key, "w") as f:
        f.write(FIXED_KEY + "\n")
    readable = read_back(store, template)
    intact = template.intact(region) if region is not None else set(template.written)
    if not engine_pages:
        intact -= template.engine
    missing = intact - readable
    if missing:
        outcome.problems.append(f"{len(missing)} intact page(s) lost by the repair")
    lost = len(template.written) - len(readable)
    s = doc.get("salvage")
    if s:
        if s["lost_exact"] and s["lost"] != lost:
            outcome.problems.append(f"the report says exactly {s['lost']} lost, {lost} were")
        if not s["lost_exact"] and lost > 0 and (s["lost"] == 0 or s["lost"] > lost):
            outcome.problems.append(f"the report says at least {s['lost']} lost, {lost} were")
    elif lost > 0:
        removed = sum(r["what"] == "page" for r in doc.get("removals", []))
        if removed < lost:
            outcome.problems.append(f"{lost} pages gone, the repair lists {removed} removed")


def read_back(store: str, template: Template) -> set[bytes]:
    """The template's pages that read back byte for byte from `store` (in a child: a store still damaged may kill
    a reader; then none)."""
    from kvcache.storage.isolated import run_isolated

    def reader(_):
        import numpy as np

        from kvcache.storage.registry import open_store

        good = []
        out = np.zeros((1, template.layout.bytes_per_page), np.uint8)
        with open_store(store, readonly=True) as s:
            for h, payload in template.written.items():
                if s.get_into([h], list(out)) == 1 and out[0].tobytes() == payload:
                    good.append(h)
        return good

    got, died = run_isolated(reader, result_type=list[bytes])
    return set(got or []) if died is None else set()


# -- the cases ---------------------------------------------------------------------------------------------------


def cases(template: Template, size: str) -> list[tuple[Region | None, str, str]]:
    """(region, key state, command) of the `size` run: "ci" (see the module docstring) or "full"."""
    regions = template.regions()
    if size == "full":
        return [(r, k, c) for r in [None, *regions] for k in KEY_STATES for c in COMMANDS]
    rng = random.Random(f"{SEED}-ci")
    chosen: list[tuple[Region | None, str, str]] = []
    chosen += [(r, "intact", c) for r in regions for c in ("audit", "repair", "stats")]
    chosen += [(None, k, c) for k in KEY_STATES for c in ("audit", "put", "ns_ls")]
    rest = [(r, k, c) for r in [None, *regions] for k in KEY_STATES for c in COMMANDS if (r, k, c) not in chosen]
    chosen += rng.sample(rest, 12)
    return chosen


def table_of(path: str) -> str:
    """The table of the outcomes a run appended to `path` (`--json`)."""
    with open(path, "rb") as f:
        return table([msgspec.json.decode(line, type=Outcome) for line in f if line.strip()])


def table(outcomes: list[Outcome]) -> str:
    """region x key state x command -> outcome, as Markdown: one row per (region, key state)."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for o in outcomes:
        rows.setdefault((o.region, o.key), {})[o.command] = o.cell()
    used = [c for c in COMMANDS if any(c in r for r in rows.values())]
    lines = ["| region | key file | " + " | ".join(used) + " |", "|---|---|" + "---|" * len(used)]
    for (region, key), cells in rows.items():
        lines.append(f"| {region} | {key} | " + " | ".join(cells.get(c, "") for c in used) + " |")
    return "\n".join(lines)


def main() -> None:
    """Run the matrix and print its table; `--full` for the whole product, `--shard I/N` for every N-th case from
    the I-th (to run it in N processes), `--json FILE` to append the outcomes as JSON lines (a run stopped part way
    resumes: the cases the file already holds are not run again, and its table counts them)."""
    size = "full" if "--full" in sys.argv else os.environ.get("KVC_DAMAGE_MATRIX", "ci")
    shard, shards = (map(int, sys.argv[sys.argv.index("--shard") + 1].split("/")) if "--shard" in sys.argv
                     else (0, 1))
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    with tempfile.TemporaryDirectory(prefix="kvc-matrix-") as root:
        template = Template(os.path.join(root, "template"))
        forks = forkrun.Forks(env=case_env())
        outcomes = []
        if out is not None and os.path.exists(out):
            with open(out, "rb") as f:
                outcomes = [msgspec.json.decode(line, type=Outcome) for line in f if line.strip()]
        done = {(o.region, o.key, o.command) for o in outcomes}
        for region, key, command in cases(template, size)[shard::shards]:
            if (region.name if region is not None else "none", key, command) in done:
                continue
            o = run_case(template, region, key, command, root, forks)
            outcomes.append(o)
            if out is not None:
                with open(out, "ab") as f:
                    f.write(msgspec.json.encode(o) + b"\n")
            print(f"{o.region} / {o.key} / {o.command}: {o.cell()} {o.line[:160]} {o.problems or ''}", file=sys.stderr)
        forks.close()
        print(table(outcomes))
        bad = [o for o in outcomes if o.problems]
        print(f"\n{len(outcomes)} cases, {len(bad)} broke a rule; signals {sum(o.code < 0 for o in outcomes)}")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
