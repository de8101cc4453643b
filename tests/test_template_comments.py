"""Django's ``{# ... #}`` comments end on their line: one spread over two lines is not a
comment but text, and reached the page (found by a newcomer: a developer's note printed on
every root run's page). A note of several lines is a ``{% comment %}`` block."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = [path for path in ROOT.glob("**/templates/**/*.html")
             if ".venv" not in path.parts and "node_modules" not in path.parts]


def test_there_are_templates_to_read() -> None:
    assert len(TEMPLATES) > 10


def test_no_template_comment_spreads_over_lines() -> None:
    unclosed = [f"{path.relative_to(ROOT)}:{number}"
                for path in TEMPLATES
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if re.search(r"\{#(?!.*#\})", line)]
    assert not unclosed, f"a {{# comment #}} must end on its line: {unclosed}"
