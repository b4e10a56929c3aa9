"""The backend authors' guide in the README: each code block is a whole file of the toy
backend that ``test_third_party_backend.py`` installs and runs, or a block run here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).parents[1] / "README.md"
TOY = Path(__file__).parent / "toy_backend"


def guide_blocks() -> list[tuple[str, str]]:
    guide = README.read_text().split("## Writing a backend", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", guide, flags=re.DOTALL)


def test_every_block_is_a_toy_file_or_runs() -> None:
    files = {p.read_text(): p.relative_to(TOY) for p in TOY.rglob("*") if p.is_file()}
    quoted = []
    for language, body in guide_blocks():
        if body in files:
            quoted.append(str(files[body]))
            continue
        assert language == "python", f"a {language} block that is no toy file:\n{body}"
        namespace: dict[str, Any] = {}
        exec(compile(body, str(README), "exec"), namespace)  # a fragment fails here
    assert sorted(quoted) == sorted(str(path) for path in files.values())
