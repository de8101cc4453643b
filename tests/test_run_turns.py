"""A run's checks take a process's API pool one at a time, each key's in its own line
(governance/asgi.py `RunTurns`): the others wait on the event loop, holding no thread."""

from __future__ import annotations

import asyncio

import pytest

from governance.asgi import RunTurns

pytestmark = pytest.mark.stack_independent


def test_one_keys_checks_of_a_run_take_turns_and_others_do_not_wait() -> None:
    async def main() -> tuple[list[str], dict[str, object]]:
        turns, order = RunTurns(), []
        release = asyncio.Event()

        async def check(name: str, whose: tuple[str, str]) -> None:
            async with turns.turn(whose):
                order.append(f"{name} in")
                if name == "first":
                    await release.wait()
                order.append(f"{name} out")

        first = asyncio.create_task(check("first", ("token:a", "RUN-1")))
        await asyncio.sleep(0)
        second = asyncio.create_task(check("second", ("token:a", "run-1")))  # same run
        other_key = asyncio.create_task(check("other key", ("token:b", "run-1")))
        other_run = asyncio.create_task(check("other run", ("token:a", "run-2")))
        await asyncio.wait_for(asyncio.gather(other_key, other_run), 1)
        assert not second.done()  # waits for the first, on the loop
        release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 1)
        return order, dict(turns._turns)

    order, left = asyncio.run(main())
    assert order.index("second in") > order.index("first out")
    assert order.index("other key out") < order.index("first out")
    assert order.index("other run out") < order.index("first out")
    assert left == {}  # nothing kept once every turn is over
