"""Simulated agents and the load they make.

Each agent does what an agent using governance_client does: start a run, check before every
action with a realistic body (args, `last_result` with a digest, `progress`, `cost_usd`, a
`check_id`), finish. Most runs do 20 useful steps; one in ten loops on identical calls (hard
loop, stopped with `loop_detected` at its 4th call) and one in ten varies its args but finds
nothing new (soft loop, stopped with `no_progress` at its 6th). The real check must give
exactly those answers: any other is counted as an error, so the benchmark also checks the rules.

A baseline point replays the same request sequence with the check URL pointed at a baseline
endpoint, so the runs started and finished per check are identical in every point and the
ratios compare the check alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .client import Connection, HttpError

# (kind, checks in the script, expected final answer of the real check: (decision, reason))
NORMAL, HARD_LOOP, SOFT_LOOP = "normal", "hard_loop", "soft_loop"
SCRIPT_CHECKS = {NORMAL: 20, HARD_LOOP: 4, SOFT_LOOP: 6}
EXPECTED_END = {
    NORMAL: ("allow", "step_ok"),
    HARD_LOOP: ("stop", "loop_detected"),
    SOFT_LOOP: ("stop", "no_progress"),
}
KIND_CYCLE = [NORMAL] * 8 + [HARD_LOOP, SOFT_LOOP]

# The policy of the benchmark's team: the defaults of SPEC 3, with room for 20-step runs that
# may last longer than 45 s on a loaded machine.
BENCH_POLICY: dict[str, Any] = {
    "step_limits": {"max_steps": 30, "max_repeat_action": 3, "no_progress_window": 4},
    "budgets": {"max_seconds": 3600, "max_usd": 50.0, "max_tool_calls": None},
    "repeat_key": {"ignore_args": ["request_id"]},
}

TOOLS = ["search.docs", "crm.lookup_order", "kb.fetch_article", "billing.refund_quote",
         "email.draft_reply"]
SUMMARY = ("Found 3 articles; the most relevant says refunds within 30 days are automatic for "
           "orders under 200 EUR, above that an agent approves them.")


def _digest(*parts: object) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:32]


def script(kind: str, seed: str) -> list[dict[str, Any]]:
    """The check bodies of one run."""
    bodies: list[dict[str, Any]] = []
    for i in range(SCRIPT_CHECKS[kind]):
        if kind == HARD_LOOP:
            name, args = "search.docs", {"query": "refund policy for order 1234",
                                         "limit": 10, "filters": {"lang": "en"}}
            result: dict[str, Any] = {"status": "ok", "digest": _digest(seed, "same"),
                                      "summary": SUMMARY}
        elif kind == SOFT_LOOP:
            name = "search.docs"
            args = {"query": f"refund policy wording variant {i}", "limit": 10,
                    "filters": {"lang": "en"}}
            result = {"status": "ok", "digest": _digest(seed, "nothing-new"), "summary": SUMMARY}
        else:
            name = TOOLS[i % len(TOOLS)]
            args = {"query": f"order {seed[:8]} step {i}: refund status and policy",
                    "limit": 10, "filters": {"lang": "en", "region": "eu", "since": "2024-01-01"},
                    "customer": {"id": f"cus_{seed[:10]}", "tier": "gold"}}
            if i % 9 == 7:
                result = {"status": "error", "error": "HTTP 503 from crm: upstream timed out"}
            else:
                result = {"status": "ok", "digest": _digest(seed, i), "summary": SUMMARY}
        body: dict[str, Any] = {
            "check_id": uuid.uuid4().hex,
            "action": {"name": name, "args": {**args, "request_id": uuid.uuid4().hex},
                       "type": "llm" if kind == NORMAL and i % 5 == 4 else "tool"},
            "cost_usd": 0.0012,
        }
        if kind == NORMAL:
            body["progress"] = f"milestone-{i}"
        if i > 0:
            body["last_result"] = result
        bodies.append(body)
    return bodies


@dataclass
class LoadStats:
    """What one load phase observed, from the client's side."""

    started_at: float = 0.0
    window_start: float = 0.0
    window_end: float = 0.0
    check_latencies: list[float] = field(default_factory=list)  # seconds, inside the window
    # Starts and finishes: an agent waits for them too, so a server that answered checks fast
    # by making these wait would show here.
    other_latencies: list[float] = field(default_factory=list)
    # Agents that got at least one check answered inside the window: a server that served
    # some connections and starved the others would look fast on the served ones.
    agents_served: set[int] = field(default_factory=set)
    checks_in_window: int = 0
    requests_in_window: int = 0
    checks_total: int = 0
    decision_ids: set[int] = field(default_factory=set)
    decisions_returned: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    runs_started: int = 0
    runs_finished: int = 0
    reconnects: int = 0
    refused_starts: int = 0  # 409 kill_switch_engaged while a switch is engaged
    # Kill switch scenario: (time answered, request sent at, decision, reason)
    answers: list[tuple[float, float, str, str]] = field(default_factory=list)

    def in_window(self, t: float) -> bool:
        return self.window_start <= t <= self.window_end

    def record_check(self, sent: float, done: float, status: int, answer: Any,
                     agent: int = 0) -> None:
        self.checks_total += 1
        if self.in_window(done):
            self.agents_served.add(agent)
            self.checks_in_window += 1
            self.requests_in_window += 1
            self.check_latencies.append(done - sent)
        if status == 200 and isinstance(answer, dict) and "decision_id" in answer:
            self.decision_ids.add(int(answer["decision_id"]))
            self.decisions_returned += 1
            self.outcomes[f"{answer.get('decision')}:{answer.get('reason')}"] += 1
        else:
            self.errors[f"check {status}"] += 1

    def record_other(self, sent: float, done: float) -> None:
        if self.in_window(done):
            self.requests_in_window += 1
            self.other_latencies.append(done - sent)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


CheckPath = Callable[[str], str]


def real_check_path(run_id: str) -> str:
    return f"/api/v1/runs/{run_id}/check"


@dataclass
class AgentOptions:
    host: str
    port: int
    token: str
    check_path: CheckPath = real_check_path
    verify_answers: bool = True  # the real check must give the scripted answers
    record_answers: bool = False  # keep every answer with its times (kill switch scenario)
    stop_event: asyncio.Event | None = None
    # The checks go to this port when set (the minimal baseline's own server); starts and
    # finishes always go to the product's.
    check_port: int | None = None
    # Checks only: each agent starts one run before the window and then only checks it, with
    # distinct args and progress at every step (a policy with room for that many steps).
    checks_only: bool = False


def long_body(seed: str, i: int) -> dict[str, Any]:
    """Step `i` of a run that never repeats itself: distinct args, progress and result."""
    body: dict[str, Any] = {
        "check_id": uuid.uuid4().hex,
        "action": {"name": TOOLS[i % len(TOOLS)],
                   "args": {"query": f"order {seed[:8]} step {i}: refund status and policy",
                            "limit": 10, "filters": {"lang": "en", "region": "eu"},
                            "request_id": uuid.uuid4().hex},
                   "type": "tool"},
        "cost_usd": 0.0001,
        "progress": f"milestone-{i}",
    }
    if i > 0:
        body["last_result"] = {"status": "ok", "digest": _digest(seed, i), "summary": SUMMARY}
    return body


async def checks_only_agent(index: int, opts: AgentOptions, stats: LoadStats,
                            deadline: float) -> None:
    """One agent of the checks-only mode: one run, started before the window, checked until
    the deadline; the start and the finish fall outside the measured window."""
    conn = Connection(opts.host, opts.port, token=opts.token)
    checks = Connection(opts.host, opts.check_port, token=opts.token) \
        if opts.check_port else conn
    seed = uuid.uuid4().hex
    try:
        status, started = await conn.post_json("/api/v1/runs", {
            "agent": f"bench-agent-{index % 16}", "task": f"Long task {seed[:8]}"})
        if status != 201:
            stats.errors[f"start {status}"] += 1
            return
        stats.runs_started += 1
        run_id = started["run_id"]
        path = opts.check_path(run_id)
        i = 0
        while time.monotonic() < deadline:
            sent = time.monotonic()
            try:
                status, last = await checks.post_json(path, long_body(seed, i))
            except HttpError as exc:
                stats.errors[f"check {exc}"] += 1
                return
            done = time.monotonic()
            stats.record_check(sent, done, status, last, index)
            i += 1
            if status != 200:
                return
            if opts.record_answers:
                stats.answers.append((done, sent, last["decision"], last["reason"]))
            if last.get("reason") == "killed":
                return  # a kill switch stopped the run: what the kill scenarios wait for
            if opts.verify_answers and last.get("decision") != "allow":
                stats.errors[f"unexpected answer {last.get('reason')} at step {i}"] += 1
                return
    finally:
        stats.reconnects += conn.reconnects + (checks.reconnects if checks is not conn else 0)
        await conn.close()
        if checks is not conn:
            await checks.close()


async def agent(index: int, opts: AgentOptions, stats: LoadStats, deadline: float) -> None:
    """One agent: runs, one after another, until the deadline."""
    conn = Connection(opts.host, opts.port, token=opts.token)
    checks = Connection(opts.host, opts.check_port, token=opts.token) \
        if opts.check_port else conn
    name = f"bench-agent-{index % 16}"
    run_no = 0
    try:
        while time.monotonic() < deadline:
            kind = KIND_CYCLE[(index * 3 + run_no) % len(KIND_CYCLE)]
            run_no += 1
            seed = uuid.uuid4().hex
            sent = time.monotonic()
            try:
                status, started = await conn.post_json("/api/v1/runs", {
                    "agent": name, "task": f"Answer ticket {seed[:8]} about a refund",
                    "metadata": {"ticket": seed[:8], "channel": "email"},
                })
            except HttpError as exc:
                stats.errors[f"start {exc}"] += 1
                await asyncio.sleep(0.05)
                continue
            done = time.monotonic()
            stats.record_other(sent, done)
            if status == 409:
                # A kill switch covers the agent: a real agent would wait; so does this one.
                stats.refused_starts += 1
                await asyncio.sleep(0.05)
                continue
            if status != 201:
                stats.errors[f"start {status}"] += 1
                await asyncio.sleep(0.05)
                continue
            stats.runs_started += 1
            run_id = started["run_id"]
            path = opts.check_path(run_id)
            bodies = script(kind, seed)
            last: Any = None
            for step, body in enumerate(bodies, start=1):
                if time.monotonic() >= deadline:
                    return  # the run stays open, as when an agent is interrupted
                sent = time.monotonic()
                try:
                    status, last = await checks.post_json(path, body)
                except HttpError as exc:
                    stats.errors[f"check {exc}"] += 1
                    last = None
                    break
                done = time.monotonic()
                stats.record_check(sent, done, status, last, index)
                if status != 200:
                    break
                if opts.record_answers:
                    stats.answers.append((done, sent, last["decision"], last["reason"]))
                if last.get("decision") == "stop":
                    got = ("stop", last.get("reason"))
                    if opts.verify_answers and got[1] != "killed" and (
                        step != len(bodies) or got != EXPECTED_END[kind]
                    ):
                        stats.errors[f"unexpected stop {got[1]} at step {step} ({kind})"] += 1
                    break
            else:
                if opts.verify_answers and last is not None:
                    got = (last.get("decision"), last.get("reason"))
                    if got != EXPECTED_END[kind]:
                        stats.errors[f"unexpected answer {got} ({kind})"] += 1
            stopped = isinstance(last, dict) and last.get("decision") == "stop"
            sent = time.monotonic()
            try:
                status, _ = await conn.post_json(f"/api/v1/runs/{run_id}/finish", {
                    "status": "stopped" if stopped else "completed",
                    "output": "Refund approved; the customer was told it takes 5 days.",
                })
            except HttpError as exc:
                stats.errors[f"finish {exc}"] += 1
                continue
            stats.record_other(sent, time.monotonic())
            if status != 200:
                stats.errors[f"finish {status}"] += 1
            else:
                stats.runs_finished += 1
    finally:
        stats.reconnects += conn.reconnects + (checks.reconnects if checks is not conn else 0)
        await conn.close()
        if checks is not conn:
            await checks.close()


async def run_load(opts: AgentOptions, agents: int, seconds: float, warmup: float
                   ) -> LoadStats:
    """`agents` agents at once for `seconds`; the first `warmup` seconds are not measured."""
    stats = LoadStats()
    now = time.monotonic()
    stats.started_at = now
    stats.window_start = now + warmup
    stats.window_end = now + seconds
    deadline = stats.window_end
    one = checks_only_agent if opts.checks_only else agent
    await asyncio.gather(*(one(i, opts, stats, deadline) for i in range(agents)))
    return stats
