"""The README's one-line programs, as a reader copies them: they pass ``mypy --strict`` (with
``URL``, ``KEY`` and ``question`` given). Running them against the service (a kill switch at
start) is in the project's tests/test_integrations.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack_independent

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PRELUDE = 'URL = "http://127.0.0.1:8000"\nKEY = "agent-key"\nquestion = "How do refunds work?"\n'
FRAMEWORKS = {
    "langchain": ("### LangChain", "langchain"),
    "langgraph": ("### LangGraph", "langgraph"),
    "openai_agents": ("### OpenAI Agents SDK", "agents"),
    "claude_agent_sdk": ("### Claude Agent SDK", "claude_agent_sdk"),
}


def readme_program(heading: str) -> str:
    """The first Python block after the heading, with the names the README says it assumes."""
    text = README.read_text()
    after = text[text.index(heading):]
    block = re.search(r"```python\n(.*?)```", after, re.S)
    assert block is not None
    code = block.group(1)
    # Future imports first, then what the program assumes, then the program.
    return PRELUDE + code


@pytest.fixture(scope="module")
def mypy_strict(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, str]:
    """mypy --strict over the four programs at once (one analysis of the frameworks, kept
    in pytest's cache): what it said about each program."""
    pytest.importorskip("mypy")
    folder = tmp_path_factory.mktemp("readme")
    programs = {name: folder / f"{name}_program.py" for name in FRAMEWORKS}
    for name, path in programs.items():
        path.write_text(readme_program(FRAMEWORKS[name][0]))
    config_cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    cache = config_cache.mkdir("mypy") if config_cache else folder / "cache"
    found = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache),
         *map(str, programs.values())],
        capture_output=True, text=True, timeout=900,
        env={"MYPYPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, cwd=folder,
    )
    said = found.stdout + found.stderr
    assert found.returncode in (0, 1), said  # 2: mypy itself failed
    return {name: "\n".join(line for line in said.splitlines()
                            if path.name in line or "governance_client" in line)
            for name, path in programs.items()}


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_the_readme_program_passes_mypy_strict(framework: str, mypy_strict: dict[str, str]
                                               ) -> None:
    pytest.importorskip(FRAMEWORKS[framework][1])
    assert mypy_strict[framework] == ""


def test_the_history_snippet_checks_over_budget_on_what_has_it() -> None:
    # Found by a newcomer: the snippet kept only pinned.inject(compact_with_budget(...)), a
    # plain list, and the text then said to check `messages.over_budget`: an AttributeError.
    text = README.read_text()
    section = text[text.index("## History helpers"):text.index("## `govctl`")]
    snippet = readme_program("## History helpers")
    checked = re.findall(r"check `(\w+)\.over_budget`", section)
    assert checked, "the section no longer says what to check"
    long_result = "x" * 4000
    history: list[dict[str, object]] = [{"role": "system", "content": "Rename user_id."}]
    for i in range(8):
        history += [{"role": "assistant", "tool_calls": [{"id": f"c{i}", "type": "function",
                     "function": {"name": "grep", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": f"c{i}", "content": long_result}]
    names: dict[str, object] = {"history": history, "error_text_or_None": None}
    exec(compile(snippet[len(PRELUDE):], "README history snippet", "exec"), names)
    for name in checked:
        assert isinstance(names[name].over_budget, bool), name  # type: ignore[attr-defined]
    assert isinstance(names["messages"], list)
