"""The HTML report: content parity with the terminal report, escaping, CLI wiring, and a real browser.

The browser test loads the MoE demo's page in headless Chromium (Debian's `chromium`) and checks the
DOM after the page's script ran. Without chromium it is skipped, except under CI (CI=true), where it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import ac_diff
from ac_diff.cli import main
from ac_diff.render import RENDERERS, render
from ac_diff.render.html import render_html
from ac_diff.report import (AlignedRow, Cause, Divergence, PositionRow, RegionReport, Report, Suggestion,
                            TorchErrorSummary)

EVIL = "<script>alert(1)</script> & co"


@pytest.fixture(scope="module")
def report(demo) -> Report:
    return ac_diff.diagnose_paths([demo / "out"])


@pytest.fixture(scope="module")
def page(report) -> str:
    return render_html(report)


class Dom(HTMLParser):
    """Every element with its attributes and all the text inside it."""

    VOID = {"meta", "input", "br", "img", "link", "hr", "col", "wbr", "source", "area", "base", "embed"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.nodes: list[dict] = []
        self.stack: list[dict] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        node = {"tag": tag, "attrs": dict(attrs), "text": ""}
        self.nodes.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.nodes.append({"tag": tag, "attrs": dict(attrs), "text": ""})

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        for node in self.stack:
            node["text"] += data

    def find(self, tag=None, cls=None, **attrs) -> list[dict]:
        out = []
        for n in self.nodes:
            if tag and n["tag"] != tag:
                continue
            if cls and cls not in (n["attrs"].get("class") or "").split():
                continue
            if any(n["attrs"].get(k.replace("_", "-")) != v for k, v in attrs.items()):
                continue
            out.append(n)
        return out

    def by_id(self, id_: str) -> dict:
        found = [n for n in self.nodes if n["attrs"].get("id") == id_]
        assert len(found) == 1, f"{len(found)} elements with id {id_}"
        return found[0]


# --- the page's content ---------------------------------------------------------------------------------------

def test_registered_and_self_contained(page):
    assert "html" in RENDERERS
    dom = Dom(page)
    assert page.startswith("<!DOCTYPE html>")
    assert len(dom.find("script")) == 1 and len(dom.find("style")) == 1
    assert not dom.find("link") and not dom.find("img") and not dom.find("iframe")
    assert not [n for n in dom.nodes if "src" in n["attrs"]], "no external assets"
    assert all(n["attrs"]["href"].startswith("#") for n in dom.find("a")), "only in-page links"
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page
    csp = dom.find("meta", http_equiv="Content-Security-Policy")
    assert csp and "default-src 'none'" in csp[0]["attrs"]["content"]


def test_verdict_first(report, page):
    dom = Dom(page)
    body_start = page.index("<body")
    assert page.index('id="verdict"') - body_start < 200, "the verdict is the first thing in the body"
    assert dom.by_id("verdict-word")["text"] == "DIVERGED"
    assert dom.by_id("headline")["text"] == report.headline
    assert "layers.1.moe.expert_bias" in report.headline
    assert not dom.find(id="silent-warning"), "torch raised: not silent"


def test_same_content_as_terminal(report, page):
    dom = Dom(page)
    (region,) = [r for r in report.regions if r.status == "diverged"]
    section = dom.by_id(f"region-{region.rank}-{region.region}")
    text = section["text"]
    assert section["attrs"]["data-status"] == "diverged" and "open" in section["attrs"]
    # torch error summary
    err = report.torch_errors[0]
    assert ", ".join(map(str, err.positions)) in dom.by_id("torch-error")["text"]
    # region table: every region, with its status
    rows = dom.find("tr", cls="region-row")
    assert [(r["attrs"]["data-status"]) for r in rows] == [r.status for r in report.regions]
    # cause and evidence
    assert region.cause.kind == "state_mutation"
    cause = dom.find("div", cls="cause")[0]
    assert cause["attrs"]["data-cause"] == "state_mutation"
    for ev in region.cause.evidence:
        assert ev in cause["text"]
    # first divergences: the divergent ops, by kind
    divs = {n["attrs"]["data-kind"]: n["text"] for n in dom.find("tr") if "data-kind" in n["attrs"]}
    assert "aten.add.Tensor" in divs["value"]
    assert "aten.topk.default" in divs["discrete"]
    assert "aten.split_with_sizes.default" in divs["shape"]
    assert region.first_discrete_divergence.summary in divs["discrete"]
    # chain, every step
    chain = dom.find("ol", cls="chain")[0]["text"]
    for step in region.chain:
        assert step in chain
    # suggestions, with their code
    for s in region.suggestions:
        assert s.title in text and s.text in text
        if s.code:
            assert s.code in "".join(n["text"] for n in dom.find("code", cls="language-python"))
    assert "MUST_SAVE" in text
    for note in region.notes:
        assert note in text


def test_window_marks_divergent_cells(report, page):
    dom = Dom(page)
    (region,) = [r for r in report.regions if r.status == "diverged"]
    rows = [n for n in dom.find("tr") if (n["attrs"].get("id") or "").startswith(f"w-{region.rank}-{region.region}-")]
    assert len(rows) == len([w for w in region.window if w.how != "gap"])
    shape_rows = [r for r in rows if r["attrs"]["data-marker"] == "shape"]
    assert shape_rows and "split_with_sizes" in shape_rows[0]["text"]
    assert all("divergent" in r["attrs"]["class"].split() for r in shape_rows)
    marked_cells = dom.find("td", cls="div-shape")
    assert len(marked_cells) == 2 * len(shape_rows), "both sides of a divergent row are marked"
    # the differing sizes themselves are highlighted: [56 ...] vs [57 ...]
    split_row = page[page.index(f'id="{shape_rows[0]["attrs"]["id"]}"'):]
    split_row = split_row[:split_row.index("</tr>")]
    assert re.search(r"<mark>\d+</mark>", split_row)


def test_position_map_lists_every_position(report, page):
    dom = Dom(page)
    for region in report.regions:
        rows = [n for n in dom.find("tr", cls="pos")
                if n["attrs"]["id"].startswith(f"p-{region.rank}-{region.region}-")]
        assert [int(r["attrs"]["id"].rsplit("-", 1)[1]) for r in rows] == [p.position for p in region.positions]
        mismatched = {int(r["attrs"]["id"].rsplit("-", 1)[1]) for r in rows if "pos-mismatch" in r["attrs"]["class"]}
        assert mismatched == {p.position for p in region.positions if p.matches is False}
    err = report.torch_errors[0]
    torch_rows = {int(n["attrs"]["id"].rsplit("-", 1)[1]) for n in dom.find("tr", cls="pos-torch")}
    assert torch_rows == set(err.positions)


def test_plot_shows_where_divergences_are(report, page):
    dom = Dom(page)
    svgs = dom.find("svg", cls="plot")
    assert len(svgs) == 1  # one diverged region
    kinds = {n["attrs"]["data-kind"] for n in dom.find("rect", cls="mark")}
    assert {"value", "discrete", "shape", "pos_meta"} <= kinds
    assert "shape: split_with_sizes" in svgs[0]["text"]


def test_clean_and_unchecked_regions_are_collapsed(report, page):
    dom = Dom(page)
    for r in report.regions:
        if r.status != "diverged":
            section = dom.by_id(f"region-{r.rank}-{r.region}")
            assert "open" not in section["attrs"] and section["attrs"]["data-status"] == r.status


# --- escaping -------------------------------------------------------------------------------------------------

def _evil_report() -> Report:
    div = Divergence(kind="shape", op="mylib.op&<b>.default", module=EVIL, source='x.py:1 in "f"',
                     forward_index=2, recompute_index=2, summary="sizes [1 & 2] <i>", detail={"<k>": "</td>"})
    pos = PositionRow(position=0, op="mylib.op&<b>.default", module=EVIL, source="<src>", origin="op", name=None,
                      forward_index=2, saved="f32[<1>]", recomputed="f32[<2>]", matches=False, in_torch_error=True)
    diverged = RegionReport(
        rank=0, region=1, module=EVIL, kind="checkpoint", status="diverged", silent=True,
        cause=Cause(kind="unknown", tensor="</script><script>alert(2)</script>", detail="a & b",
                    evidence=["<img src=x onerror=alert(3)>"]),
        first_value_divergence=None, first_discrete_divergence=None, first_shape_divergence=div,
        first_control_divergence=None, positions=[pos],
        suggestions=[Suggestion(title="<h1>", text="'quoted' \"text\"", code="if a < b and c > d: print('</script>')")],
        chain=["<b>step</b>"], forward_ops=4, recompute_ops=4,
        window=[AlignedRow("match", 2, 2, "mylib.op&<b>.default -> f32[<1>]", "mylib.op&<b>.default -> f32[<2>]",
                           EVIL, "shape")],
        notes=["note </details>"], changed_inputs=[{"kind": "buffer", "name": "<buf>", "meta": "f32[1]",
                                                    "forward": [0], "recompute": [1], "first_op": 0}],
        state_changes={"<flag>": "<on>"})
    clean = RegionReport(rank=0, region=0, module="clean & <ok>", kind="checkpoint", status="clean", silent=False,
                         cause=None, first_value_divergence=None, first_discrete_divergence=None,
                         first_shape_divergence=None, first_control_divergence=None, positions=[], suggestions=[],
                         chain=[], forward_ops=3, recompute_ops=3)
    return Report(verdict="diverged", headline=f"{EVIL} diverged", regions=[clean, diverged],
                  torch_errors=[TorchErrorSummary(kind="<k>", rank=0, region=1, positions=[0], message="</pre><x>")],
                  sources=["<path>&"], notes=["<note>"], cross_rank=["<rank>"], exit_status="<exc>")


def test_every_string_is_escaped():
    report = _evil_report()
    page = render_html(report)
    assert page.count("<script") == 1, "only the page's own script"
    for raw in ("<script>alert", "<img", "<b>step", "&<b>", "<h1>", "<i>", "</td>\"", "<x>", "<flag>", "<buf>"):
        assert raw not in page, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in page
    assert "&lt;/script&gt;&lt;script&gt;alert(2)" in page
    dom = Dom(page)
    assert len(dom.find("script")) == 1 and not dom.find("img") and not dom.find("h1") and not dom.find("x")
    assert dom.by_id("headline")["text"] == f"{EVIL} diverged"
    assert dom.by_id("verdict-word")["text"] == "DIVERGED"
    code = dom.find("code", cls="language-python")[0]["text"]
    assert code == "if a < b and c > d: print('</script>')"
    assert "</pre><x>" in dom.find("details", cls="message")[0]["text"]
    # attribute values are escaped too: the filter text of the region holds the module literally
    rows = dom.find("tr", cls="region-row")
    assert EVIL.lower() in rows[1]["attrs"]["data-search"]
    assert dom.find("td", cls="src")[0]["text"] == 'x.py:1 in "f"'


def test_silent_divergence_is_said_loudly():
    report = _evil_report()
    report.torch_errors = []
    dom = Dom(render_html(report))
    assert dom.by_id("verdict-word")["text"] == "SILENTLY DIVERGED"
    assert "silently wrong" in dom.by_id("silent-warning")["text"]
    assert "silent" in dom.by_id("verdict")["attrs"]["class"].split()


# --- wiring ---------------------------------------------------------------------------------------------------

def test_every_renderer_writes_what_it_renders(report, tmp_path):
    """One writer: the file `render` writes is the renderer's text, whatever the format."""
    assert {name: r.suffix for name, r in RENDERERS.items()} == {"terminal": ".txt", "json": ".json", "html": ".html"}
    for name, renderer in RENDERERS.items():
        path = tmp_path / f"report{renderer.suffix}"
        render(report, name, path=str(path))
        assert path.read_text(encoding="utf-8") == renderer.render(report)
    assert "<style>\n:root{" in RENDERERS["html"].render(report)  # render/assets/report.css, inlined


def test_render_to_path_and_stdout(report, tmp_path, capsys):
    render(report, "html", path=str(tmp_path / "r.html"))
    assert (tmp_path / "r.html").read_text(encoding="utf-8") == render_html(report)
    render(report, "html", path="-")
    assert capsys.readouterr().out.startswith("<!DOCTYPE html>")


def test_cli_report_html(demo, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(demo / "out"), "--format", "html", "-o", str(out)]) == 1  # diverged
    assert "html report written to" in capsys.readouterr().err
    assert 'id="verdict-word">DIVERGED<' in out.read_text(encoding="utf-8")


def test_demo_wrote_html(demo):
    """`ac-diff demo --format html --report FILE` (the session fixture) wrote the page."""
    page = (demo / "demo.html").read_text(encoding="utf-8")
    assert 'id="verdict-word">DIVERGED<' in page and "aten.topk.default" in page


def test_html_report_file_defaults(tmp_path, monkeypatch):
    from ac_diff.cli import _report_file

    assert _report_file("html", None, str(tmp_path)) == str(tmp_path / "report.html")
    assert _report_file("html", "x.html", str(tmp_path)) == "x.html"
    assert _report_file("terminal", None, str(tmp_path)) is None
    assert _report_file("html", None) is None  # stdout, when it is not a terminal (a pipe, a file)

    class Tty:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", Tty())
    with pytest.raises(ac_diff.InputError, match="pass --report report.html"):
        _report_file("html", None)


# --- a real browser -------------------------------------------------------------------------------------------

def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed; CI must install it (apt-get install -y chromium) for the HTML test")
    pytest.skip("chromium is not installed (apt-get install -y chromium); the browser test runs in CI")


def _dump_dom(browser: str, file: Path, fragment: str, profile: Path) -> Dom:
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-extensions",
                           f"--user-data-dir={profile}", "--virtual-time-budget=3000", "--dump-dom",
                           file.resolve().as_uri() + fragment], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "<html" in proc.stdout, proc.stderr[-2000:]
    return Dom(proc.stdout)


def test_browser_renders_verdict_and_filters(page, tmp_path):
    browser = _chromium()
    file = tmp_path / "report.html"
    file.write_text(page, encoding="utf-8")
    dom = _dump_dom(browser, file, "", tmp_path / "profile")
    assert dom.by_id("verdict-word")["text"] == "DIVERGED"
    assert "layers.1.moe.expert_bias" in dom.by_id("headline")["text"]
    assert "aten.topk.default" in "".join(n["text"] for n in dom.find("td", cls="divergent-op"))
    # the script ran: "diverged only" is on by default and hides the unchecked region, row and section
    assert dom.by_id("shown-count")["text"] == "1 of 2 region(s) shown"
    for node in dom.find(data_region="region-0-0"):
        assert "hidden" in node["attrs"] and "filtered-out" in node["attrs"]["class"].split()
    for node in dom.find(data_region="region-0-1"):
        assert "hidden" not in node["attrs"]


def test_browser_filters_from_url_and_escapes(tmp_path):
    browser = _chromium()
    file = tmp_path / "evil.html"
    file.write_text(render_html(_evil_report()), encoding="utf-8")
    # the state comes from the URL: all regions, text filter on a module name
    dom = _dump_dom(browser, file, "#diverged=0&q=clean", tmp_path / "profile")
    assert len(dom.find("script")) == 1 and not dom.find("img")
    assert dom.by_id("headline")["text"] == f"{EVIL} diverged"
    assert dom.by_id("filter")["attrs"].get("value", "") in ("", "clean")
    clean, diverged = dom.find("tr", cls="region-row")
    assert "hidden" not in clean["attrs"] and "hidden" in diverged["attrs"]
    assert dom.by_id("shown-count")["text"] == "1 of 2 region(s) shown"


def test_a_divergence_in_the_checkpointed_root_module_names_it(tmp_path):
    """checkpoint(model, x): the root's FQN is "", and the "first divergences" line showed no module where the regions
    table named the region `Net`; both renderers name it now."""
    from io import StringIO

    import torch
    from rich.console import Console
    from torch.utils.checkpoint import checkpoint

    from ac_diff.render.terminal import render_terminal

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x):
            return torch.tanh(self.fc(x) * self.scale)

    net = Net()
    with ac_diff.record(tmp_path / "t.jsonl"):
        y = checkpoint(net, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
        with torch.no_grad():
            net.scale.mul_(2)  # (a buffer changed between the forward and the backward)
        y.sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    out = StringIO()
    render_terminal(report, Console(file=out, width=200, color_system=None))
    line = next(x for x in out.getvalue().splitlines() if x.startswith("  value "))
    assert "  Net  " in line, line
    assert "<td>Net</td>" in render_html(report)
