"""The documentation site: a short README, every page in the site's navigation, and the CLI
reference identical to what each command prints for --help. (`mkdocs build --strict`, which fails
on a broken link or a missing API reference, runs in .ci/run; here too where mkdocs is installed.
The pages' examples run in tests/test_readme.py.)"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvatlas.cli import COMMANDS
from kvatlas.cli import reference

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_one_screenful_per_task():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    for link in re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines)):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


def nav_pages() -> set[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    return set(re.findall(r":\s+([\w./-]+\.md)\s*$", text, re.M))


def test_every_page_is_in_the_navigation_and_every_entry_exists():
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts}
    assert pages == nav_pages(), (pages - nav_pages(), nav_pages() - pages)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_cli_reference_is_what_help_prints(command):
    argv = [sys.executable, "-m", "kvatlas"] + ([command] if command else []) + ["--help"]
    env = {**os.environ, "COLUMNS": str(reference.WIDTH), "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == reference.help_text(command)
    page = reference.markdown()
    assert r.stdout.rstrip() in page


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None and not os.environ.get("KVATLAS_REQUIRE_DOCS"),
                    reason="mkdocs not installed (pip install -e '.[docs]'); .ci/run builds the site")
def test_site_builds_strict(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").read_text().count("usage: kvatlas") == len(COMMANDS) + 1


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def test_results_open_with_a_headline_table_whose_links_lead_to_sections():
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{2,3} (.+)$", text, re.M):
        slug = _github_anchor(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    headline = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in headline.splitlines() if line.startswith("| [")]
    assert re.findall(r"^## .+$", text, re.M)[0] == "## Headline figures" and len(rows) >= 20
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 6 and all(cells), row           # what, figure, baseline, date, machine, command
        target = re.match(r"\[.+\]\(#([^)]+)\)", cells[0]).group(1)
        assert target in anchors, f"headline link #{target} leads to no section"
        assert re.fullmatch(r"2026-\d\d-\d\d", cells[3]), row
    assert _github_anchor("Shared tier: 4 ranks (issue 24) — 2026-12-01") == "shared-tier-4-ranks-issue-24--2026-12-01"
