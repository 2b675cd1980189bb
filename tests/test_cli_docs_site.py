"""The documentation site: builds with `mkdocs build --strict`, reads well, and each page once.

Install mkdocs with `pip install -e ".[docs]"` (`make docs` and `.ci/run` do; the build tests skip
without it). Strict mode turns every warning (a broken link, a missing page in the nav, a
docstring mkdocstrings cannot render) into a failure. The checks on the sources (nav, titles,
code width, claims) need no mkdocs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CODE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
# `- Title: page.md` entries of mkdocs.yml's nav (titled entries only: every page has one).
NAV_ENTRY = re.compile(r"^\s*- (?:(?P<title>[^:\n]+): )?(?P<page>[\w/.-]+\.md)\s*$", re.MULTILINE)
#: Characters of a code line the site shows without scrolling at 1280 px (see extra.css).
CODE_WIDTH = 100

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs is not installed (pip install -e '.[docs]')",
)


def _nav() -> list[tuple[str | None, str]]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    return [(m["title"], m["page"]) for m in NAV_ENTRY.finditer(nav)]


def _h1(page: Path) -> str:
    for line in page.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    raise AssertionError(f"{page} has no '# ' title")


def test_every_page_is_in_the_nav_once_under_its_own_title() -> None:
    nav = _nav()
    pages = [page for _, page in nav]
    assert [p for p, n in Counter(pages).items() if n > 1] == []
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk
    titles = [title for title, _ in nav]
    assert None not in titles, nav
    assert [t for t, n in Counter(titles).items() if n > 1] == []
    h1s = [_h1(DOCS / page) for page in pages]
    assert [t for t, n in Counter(h1s).items() if n > 1] == []


def test_code_in_the_docs_fits_the_page() -> None:
    long = [
        f"{page.relative_to(ROOT)}: {len(line)} chars: {line[:50]}..."
        for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
        for _lang, block in CODE.findall(page.read_text())
        for line in block.splitlines()
        if len(line) > CODE_WIDTH
    ]
    assert long == []
    css = (DOCS / "stylesheets" / "extra.css").read_text()
    assert "max-width" in css and "pre-wrap" in css
    assert "stylesheets/extra.css" in (ROOT / "mkdocs.yml").read_text()
    assert "toc.integrate" in (ROOT / "mkdocs.yml").read_text()


def test_the_docs_say_what_the_map_backends_are() -> None:
    # The map's backend once accepted only "local"; the docs said so long after.
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = " ".join(page.read_text().split())
        assert '`"local"` only' not in text and "will plug in there" not in text, page
    workflows = " ".join((DOCS / "workflows.md").read_text().split())
    assert '`"process"`' in workflows and '`"ray"`' in workflows


def test_search_needs_a_server_and_the_readme_says_so() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make docs-serve" in readme
    assert re.search(r"^docs-serve:", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert "127.0.0.1" in (ROOT / "Makefile").read_text().split("docs-serve:")[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@needs_mkdocs
def test_docs_build_strict(site: Path) -> None:
    # .html links: the site also reads when opened from disk
    assert (site / "reference" / "loop.html").is_file()
    index = (site / "index.html").read_text()
    assert 'href="getting-started.html"' in index
    assert "stylesheets/extra.css" in index


@needs_mkdocs
def test_the_reference_leads_with_the_entry_points(site: Path) -> None:
    html = (site / "reference" / "loop.html").read_text()
    order = [html.index(f'id="treadle.loop.{name}"') for name in
             ("run_session_loop", "arun_session_loop", "stream_session_loop", "PassOptions",
              "Limits", "PassStarted", "PassStopped")]  # fmt: skip
    assert order == sorted(order)
    options = html[order[3] : order[4]]
    for field in ("agent_provider", "provider", "tools", "limits", "approvals"):
        assert f'id="treadle.loop.PassOptions.{field}"' in options, field
