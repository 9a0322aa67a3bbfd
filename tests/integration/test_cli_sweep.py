"""`kvc sweep` (issue 37, item 3): the table and `--json` (the library's struct, the same figures), the plot read back
from the file (SVG parsed: title, axis labels, one line and one legend entry per tenant; PNG opened as an image of
the expected size), the note without matplotlib, and every bad input: one line naming the option, exit 2; an empty
trace exit 1 as `kvc replay`."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

import msgspec
import pytest
from typer.testing import CliRunner

from kvc.main import app
from kvcache.storage.registry import open_store
from kvcache.types.sweep import SweepPoint, SweepPolicies, SweepReport
from kvcache.workload.sweep import sweep
from kvcache.workload.traces import read_trace

runner = CliRunner()
SVG = "{http://www.w3.org/2000/svg}"


def invoke(*args, **env):
    return runner.invoke(app, [str(a) for a in args], env=env or None)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A small store (page 8, 32 bytes a token) and a salted 3-tenant trace of 60 requests."""
    tmp = tmp_path_factory.mktemp("sweep")
    store, trace = tmp / "store", tmp / "t.jsonl"
    assert invoke("init", "--store", store, "--page-size", 8, "--layers", 1, "--kv-heads", 1,
                  "--head-dim", 8).exit_code == 0
    assert invoke("generate", trace, "--requests", 60, "--tenants", 3).exit_code == 0
    return store, trace


def test_json_is_the_library_report_at_every_combination(setup):
    store, trace = setup
    result = invoke("sweep", trace, "--store", store, "--device-tokens", "512,1k", "--host-tokens", "0,2048",
                    "--storage-bytes", "0,16k", "--workers", 1, "--json")
    assert result.exit_code == 0, result.output
    got = msgspec.json.decode(result.stdout, type=SweepReport)
    points = [SweepPoint(d, h, s) for d in (512, 1024) for h in (0, 2048) for s in (0, 16384)]
    assert [p.point for p in got.points] == points and got.ok and got.requests == 60
    handle = open_store(str(store), readonly=True)
    layout, key = handle.layouts()[0], handle.fingerprint_key
    handle.close()
    expected = sweep(layout, read_trace(trace), points, SweepPolicies(), store_key=key)  # shown under the store's key
    assert [(p.hit_tokens, p.tenants, p.storage_pages) for p in got.points] == \
        [(p.hit_tokens, p.tenants, p.storage_pages) for p in expected.points]
    assert any(p.hit_tokens.storage for p in got.points) and any(p.hit_tokens.host for p in got.points)
    assert {t.namespace.extra_key for t in got.points[0].tenants} == {"tenant-0", "tenant-1", "tenant-2"}


def test_the_table_has_a_row_per_size_and_tenant_and_no_salt(setup):
    store, trace = setup
    result = invoke("sweep", trace, "--store", store, "--device-tokens", "512,2048", "--host-tokens", "1024")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    rows = [line.split("\t") for line in lines if line.startswith(("512\t", "2048\t"))]
    assert len(rows) == 2 * (3 + 1)  # 3 tenants and the total, per size
    for size in (rows[:4], rows[4:]):
        assert {r[3] for r in size[:3]} == {"tenant-0", "tenant-1", "tenant-2"} and size[3][3] == "total"
        assert int(size[3][7]) == sum(int(r[7]) for r in size[:3])  # the total's tokens are the tenants'
    assert "2 sizes" in lines[-1] and "ownership audits: ok" in lines[-1]
    salts = {r.cache_salt for r in read_trace(trace)} - {None}
    assert salts and not any(s in result.output for s in salts)


def _legend_texts(root):
    legend = next(g for g in root.iter(f"{SVG}g") if g.get("id", "").startswith("legend"))
    return ["".join(t.itertext()).strip() for t in legend.iter(f"{SVG}text")]


def test_an_svg_plot_has_a_title_labelled_axes_and_a_line_per_tenant(setup, tmp_path):
    store, trace = setup
    out = tmp_path / "sweep.svg"
    result = invoke("sweep", trace, "--store", store, "--device-tokens", "512,1024,4096", "--host-tokens", "0",
                    "--workers", 1, "--plot", out)
    assert result.exit_code == 0, result.output
    root = ET.parse(out).getroot()
    texts = ["".join(t.itertext()).strip() for t in root.iter(f"{SVG}text")]
    assert any(t.startswith("kvc sweep: hit rate against capacity (t.jsonl)") for t in texts)
    assert "L1 (device) capacity, tokens" in texts and "hit rate (% of tokens)" in texts
    lines = [g for g in root.iter(f"{SVG}g") if g.get("id", "").startswith("tenant-line-")]
    assert len(lines) == 3  # one line per tenant
    assert sorted(_legend_texts(root)) == ["tenant", "tenant-0", "tenant-1", "tenant-2"]  # its title and one each


def test_a_png_plot_opens_as_an_image_of_the_documented_size(setup, tmp_path):
    from matplotlib.image import imread

    from kvc.render.sweep import PLOT_DPI, PLOT_INCHES

    store, trace = setup
    out = tmp_path / "sweep.PNG"
    result = invoke("sweep", trace, "--store", store, "--device-tokens", "512", "--host-tokens", "0,1024,4096",
                    "--storage-bytes", "8k", "--workers", 1, "--plot", out, "--json")
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # --json: the plot changes nothing on stdout
    image = imread(out)
    width, height = (round(n * PLOT_DPI) for n in PLOT_INCHES)
    assert image.shape[:2] == (height, width) and image.std() > 0  # drawn, not blank


def test_without_matplotlib_one_line_says_how_to_get_it_and_the_table_prints(setup, tmp_path, monkeypatch):
    store, trace = setup
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    out = tmp_path / "sweep.svg"
    result = invoke("sweep", trace, "--store", store, "--device-tokens", "512", "--host-tokens", "0",
                    "--workers", 1, "--plot", out)
    assert result.exit_code == 0, result.output
    assert "total" in result.stdout and not out.exists()
    assert result.stderr.strip().splitlines() == [
        f"kvc: note: --plot {out}: not drawn: plotting needs matplotlib (pip install 'kvc[plot]')"]


@pytest.mark.parametrize("args, option", [
    (["--device-tokens", ""], "--device-tokens"),
    (["--device-tokens", " , "], "--device-tokens"),
    (["--host-tokens", "-5"], "--host-tokens"),
    (["--storage-bytes", "1x"], "--storage-bytes"),
    (["--device-tokens", "abc"], "--device-tokens"),
    (["--device-tokens", "0"], "--device-tokens"),
    (["--device-tokens", "4"], "--device-tokens"),  # below one page of the store's layout
    (["--device-tokens", ",".join(str(512 + i) for i in range(65))], "--device-tokens"),
    (["--device-tokens", ",".join(str(512 + i) for i in range(9)), "--host-tokens", ",".join(map(str, range(8)))],
     "--device-tokens x --host-tokens x --storage-bytes"),
    (["--plot", "sweep.pdf"], "--plot"),
    (["--prefetch-policy", "timeout"], "--prefetch-policy"),
    (["--workers", "0"], "--workers"),
])
def test_bad_input_is_one_line_naming_the_option_exit_2(setup, args, option):
    store, trace = setup
    result = invoke("sweep", trace, "--store", store, *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and result.stdout == ""


def test_an_empty_trace_exits_1_as_replay_does(setup, tmp_path):
    store, _ = setup
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = invoke("sweep", empty, "--store", store, "--device-tokens", "512", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["requests"] == 0
    assert result.stderr.strip().splitlines() == [
        f"kvc: error: {empty}: the trace holds no request; nothing was replayed"]
