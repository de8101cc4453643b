"""The dashboard stream's loop, written once (runs/dashboard/stream.py `_loop`, issue 25):
what it sends and when it looks, on a clock of the test's; and `pump` (WSGI) and `apump`
(ASGI) sending the same chunks for the same looks and wake-ups."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from runs.dashboard import stream
from runs.dashboard.stream import LOOK, WAKE, _loop


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class Screen:
    """What the loop asks of a source: whether the screen can still change."""

    team_id = 1

    def __init__(self) -> None:
        self.done = False

    def finished(self) -> bool:
        return self.done

    def concerned(self, changes: Any) -> bool:
        return changes is None or bool(changes)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch, settings: Any) -> Clock:
    settings.DASHBOARD_STREAM_LOOK_S = 10
    clock = Clock()
    monkeypatch.setattr(stream, "time", clock)
    return clock


def test_the_loop_looks_on_a_change_or_every_look_period_and_keeps_the_line_alive(
        clock: Clock) -> None:
    screen = Screen()
    loop = _loop(screen)  # type: ignore[arg-type]
    assert next(loop) == "retry: 1000\n\n"
    assert next(loop) is LOOK
    assert loop.send("first") == "first"
    assert next(loop) is WAKE

    clock.now = 1.0
    assert loop.send(False) is WAKE  # quiet, and not yet time to look or to keep alive
    clock.now = 7.0
    assert loop.send(False) == ": keep-alive\n\n"  # 5 s without a write
    assert next(loop) is WAKE
    clock.now = 11.0
    assert loop.send(False) is LOOK  # the periodic look
    assert loop.send("") is WAKE  # nothing changed: nothing sent
    clock.now = 12.0
    assert loop.send(True) is LOOK  # a change: a look at once
    screen.done = True
    assert loop.send("second") == "second"
    assert next(loop) == 'event: end\ndata: \n\n'
    with pytest.raises(StopIteration):
        next(loop)


def test_a_look_that_came_too_late_ends_the_stream(clock: Clock) -> None:
    loop = _loop(Screen())  # type: ignore[arg-type]
    next(loop)
    assert next(loop) is LOOK
    with pytest.raises(StopIteration):
        loop.send(None)


def test_pump_and_apump_send_the_same(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    looks = ["a", "", "b"]
    wakes = [(True, frozenset({"run"})), (False, frozenset()), (True, None)]

    def script_looks() -> Iterator[str]:
        yield from looks

    seen = script_looks()

    def wakeups(team_id: int, **_: Any) -> Iterator[bool]:
        for changed, _changes in wakes:
            clock.now += 3
            yield changed

    async def awakeups(team_id: int, **_: Any) -> AsyncIterator[Any]:
        for _changed, changes in wakes:
            clock.now += 3
            yield changes

    async def look(source: Any, viewer: Any) -> str:
        return next(seen)

    monkeypatch.setattr(stream, "wakeups", wakeups)
    monkeypatch.setattr(stream, "awakeups", awakeups)
    monkeypatch.setattr(stream, "_look", lambda source: next(seen))
    monkeypatch.setattr(stream.look_lane, "look", look)

    sent = list(stream.pump(Screen(), lifetime=60))  # type: ignore[arg-type]
    clock.now, seen = 0.0, script_looks()

    async def drain() -> list[str]:
        return [chunk async for chunk in stream.apump(Screen(), lifetime=60)]  # type: ignore[arg-type]

    assert sent == asyncio.run(drain()) == ["retry: 1000\n\n", "a", ": keep-alive\n\n", "b"]


def test_one_viewer_holds_at_most_its_share_of_streams(settings: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by an attacker: one viewer's 250 streams took the connections another team's
    # agents needed. Past the share, a stream ends at once and its browser waits a minute.
    settings.DASHBOARD_STREAMS_PER_VIEWER = 3
    monkeypatch.setattr(stream, "REFUSED_HOLD_S", 0.3)

    async def main() -> tuple[list[str], list[str], dict[Any, int]]:
        held = [stream.apump(Screen(), viewer="ann", lifetime=60) for _ in range(3)]  # type: ignore[arg-type]
        for one in held:
            assert await one.__anext__() == "retry: 1000\n\n"  # open, waiting
        # The refusal is held before it ends (found by benchmarking: a client reconnecting at
        # once made a sign-in storm), and the held one counts for no stream of the viewer's.
        refusing = stream.apump(Screen(), viewer="ann")  # type: ignore[arg-type]
        refused = [await refusing.__anext__()]
        started = time.monotonic()
        refused += [chunk async for chunk in refusing]
        assert time.monotonic() - started >= 0.3
        others = stream.apump(Screen(), viewer="bob", lifetime=60)  # type: ignore[arg-type]
        other = [await others.__anext__()]
        await others.aclose()
        await held[0].aclose()
        reopened = stream.apump(Screen(), viewer="ann", lifetime=60)  # type: ignore[arg-type]
        other.append(await reopened.__anext__())
        for one in (*held[1:], reopened):
            await one.aclose()
        return refused, other, dict(stream._open_streams)

    refused, other, left = asyncio.run(main())
    assert refused == [f"retry: {stream.REFUSED_RETRY_MS}\nevent: refused\ndata: too many live "
                       "views are open for this account: this one is paused\n\n"]
    assert other == ["retry: 1000\n\n", "retry: 1000\n\n"]
    assert left == {}
