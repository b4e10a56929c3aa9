"""The backend authors' guide in the README quotes the toy backend the venv test installs."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"
TOY = Path(__file__).parent / "toy_backend"


def guide_blocks() -> list[tuple[str, str]]:
    guide = README.read_text().split("## Writing a backend", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", guide, flags=re.DOTALL)


def test_the_guide_quotes_the_toy_backend() -> None:
    toy = "\n".join(p.read_text() for p in sorted(TOY.rglob("*")) if p.is_file())
    quoted = [body for language, body in guide_blocks() if "toy" in body]
    assert len(quoted) == 3
    for body in quoted:
        for paragraph in body.split("\n\n"):
            assert paragraph in toy, f"the guide's code is not the toy backend's:\n{paragraph}"
