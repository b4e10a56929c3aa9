"""The documentation's code: every fenced block of the site's pages (``docs/``) and of the
README is a file a test runs (included with ``--8<--``), a Python block run here (a page's
blocks in order, in one process), or commands that a test runs. Output (``text``) is shown,
not run. ``scripts/test`` builds the site itself in strict mode."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
TOY = "packages/refit-core/tests/toy_backend"

THIRD_PARTY = ("packages/refit-core/tests/test_third_party_backend.py", '"toy_backend"')
RUN_BY = {
    "examples/custom_engine.py": ("tests/test_custom_engine_example.py", "import custom_engine"),
    "examples/driver_loop.py": (
        "tests/driver_loop_harness/driver_loop_scenario.py",
        "driver_loop.RefitLoop(",
    ),
    f"{TOY}/pyproject.toml": THIRD_PARTY,
    **{
        f"{TOY}/src/refit_toy/{m}.py": THIRD_PARTY
        for m in ("__init__", "rows", "builder", "synchronizer")
    },
}
"""A file a page includes -> the test that runs it, and what in that test shows it does
(the test installs the toy backend's folder whole, or imports the example)."""

COMMANDS = {
    "uv run refit demo": ("packages/refit-lab/tests/test_demo.py", 'main(["demo"'),
    "scripts/test": (".ci/run", "scripts/test --require-netns"),
}
"""A command a page shows in a block -> the test (or CI script) that runs it, and the line
there that does."""


def _run_by(runner: tuple[str, str]) -> bool:
    path, evidence = runner
    return evidence in (ROOT / path).read_text()


FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
INCLUDE = re.compile(r'^--8<-- "([^":]+)(?::[\w-]+)?"$')


def blocks(page: Path) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block of ``page``."""
    return FENCE.findall(page.read_text())


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [*PAGES, README], ids=_name)
def test_every_block_is_run_by_a_test_or_shown_output(page: Path) -> None:
    for language, body in blocks(page):
        included = [INCLUDE.match(line) for line in body.splitlines()]
        if body.strip() and all(included):
            for match in included:
                assert match is not None
                runner = RUN_BY.get(match[1])
                assert runner, f"{_name(page)} includes {match[1]}, which no test runs"
                assert _run_by(runner), f"{runner[0]} no longer runs {match[1]}"
        elif language == "bash":
            for command in filter(None, body.splitlines()):
                runner = COMMANDS.get(command.strip())
                assert runner, f"{_name(page)} shows `{command}`, which no test runs"
                assert _run_by(runner), f"{runner[0]} no longer runs `{command}`"
        else:
            assert language in ("python", "text"), f"{_name(page)}: a {language!r} block"


@pytest.mark.parametrize(
    "page", [p for p in PAGES if any(lang == "python" for lang, _ in blocks(p))], ids=_name
)
def test_the_python_blocks_of_a_page_run_in_order(page: Path) -> None:
    runnable = [
        body
        for language, body in blocks(page)
        if language == "python" and not all(INCLUDE.match(line) for line in body.splitlines())
    ]
    script = "\n\n".join(runnable)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, f"{_name(page)}'s blocks failed:\n{done.stderr[-3000:]}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor mkdocs' table of contents gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


@pytest.mark.parametrize("readme", [README, *sorted(ROOT.glob("packages/*/README.md"))], ids=_name)
def test_the_readmes_links_lead_somewhere(readme: Path) -> None:
    """The site checks its own links; the READMEs (read on a forge) are checked here."""
    for target in LINK.findall(readme.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        linked = (readme.parent / path).resolve()
        assert linked.exists(), f"{_name(readme)} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, f"{_name(readme)}: no #{anchor}"
