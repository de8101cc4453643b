"""Scripted agents for `manage.py simulate_agents`: they call the real HTTP API through the
governance client, paced so that a person watching the dashboard sees runs start, progress
and stop. Each behaviour is one the seeds describe."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from governance_client import Decision, GovernanceClient, KillSwitchEngaged, Run

Pace = Callable[[], None]

TOPICS = ["refund policy", "shipping delays", "password reset", "invoice copy", "plan upgrade",
          "data export", "account deletion", "two-factor setup"]


def _step(run: Run, name: str, args: dict, pace: Pace, *, cost: float = 0.01,
          progress: str | None = None, type: str = "tool") -> Decision:
    decision = run.check(name, args, type=type, cost_usd=cost, progress=progress)
    pace()
    return decision


def normal(run: Run, rng: random.Random, pace: Pace) -> None:
    """Searches, looks the customer up, drafts an answer: allowed throughout, completed."""
    topic = rng.choice(TOPICS)
    plan = [("search.docs", {"query": topic}), ("crm.lookup", {"customer": rng.randint(1, 999)}),
            ("search.docs", {"query": f"{topic} exceptions"}), ("llm.draft", {"tone": "warm"})]
    for i, (name, args) in enumerate(plan):
        decision = _step(run, name, args, pace, progress=f"milestone-{i}",
                         type="llm" if name.startswith("llm") else "tool")
        if not decision.allowed:
            run.output = f"Partial answer about {topic}."
            return
        run.report({"tool": name, "found": i + 1})
    run.output = f"Here is what our documentation says about {topic}."


def hard_loop(run: Run, rng: random.Random, pace: Pace) -> None:
    """The seed's flaky search: the same call again and again until loop_detected."""
    topic = rng.choice(TOPICS)
    for _ in range(10):
        decision = _step(run, "search.docs", {"query": topic}, pace)
        if not decision.allowed:
            run.output = f"I could not get a stable answer about {topic}; here is what I have."
            return
        run.report(error="upstream timeout")


def soft_loop(run: Run, rng: random.Random, pace: Pace) -> None:
    """Varied queries whose results never change: stopped with no_progress."""
    for i in range(12):
        query = f"{rng.choice(TOPICS)} variant {i}"
        decision = _step(run, "search.web", {"query": query}, pace)
        if not decision.allowed:
            run.output = "No new information after several searches."
            return
        run.report({"results": ["the same three links"]})


def over_budget(run: Run, rng: random.Random, pace: Pace) -> None:
    """An expensive model call per step: stopped by max_usd."""
    for i in range(10):
        decision = _step(run, "llm.analyze", {"chunk": i}, pace, cost=0.3, progress=f"chunk-{i}",
                         type="llm")
        if not decision.allowed:
            run.output = f"Analyzed {i} chunks before the budget ran out."
            return


def repeated_error(run: Run, rng: random.Random, pace: Pace) -> None:
    """The seed's rename loop: 'no matches found' until the nudge makes it change approach."""
    for i in range(6):
        decision = _step(run, "edit_file", {"path": "auth.py", "old": "user_id",
                                            "new": "account_id", "attempt": i}, pace)
        if not decision.allowed:
            run.output = "Stopped while renaming."
            return
        if decision.directive:
            run.report({"read": "auth.py"})
            _step(run, "read_file", {"path": "auth.py"}, pace, progress="re-read the file")
            run.output = "The variable was already renamed; nothing left to do."
            return
        run.report(error="no matches found for 'user_id'")


def long_run(run: Run, rng: random.Random, pace: Pace) -> None:
    """Steady progress but too many steps: stopped by max_steps at step 19."""
    for i in range(30):
        decision = _step(run, "crawl.page", {"page": i}, pace, progress=f"page-{i}", cost=0.001)
        if not decision.allowed:
            run.output = f"Crawled {i} pages."
            return
        run.report({"page": i})


def denied_tool(run: Run, rng: random.Random, pace: Pace) -> None:
    """Tries a shell command the policy denies."""
    _step(run, "search.docs", {"query": "disk full"}, pace, progress="searched")
    decision = _step(run, "shell.exec", {"cmd": "rm -rf /tmp/cache"}, pace)
    run.output = "I would need shell access to go on." if not decision.allowed else "Cleaned."


BEHAVIOURS: dict[str, Callable[[Run, random.Random, Pace], None]] = {
    "normal": normal, "hard_loop": hard_loop, "soft_loop": soft_loop,
    "over_budget": over_budget, "repeated_error": repeated_error, "long_run": long_run,
    "denied_tool": denied_tool,
}
# Normal runs are the common case, as in production.
WEIGHTS = {"normal": 4, "hard_loop": 2, "soft_loop": 2, "over_budget": 1, "repeated_error": 2,
           "long_run": 1, "denied_tool": 1}
AGENT_OF = {"normal": "support-bot", "hard_loop": "support-bot", "soft_loop": "research-bot",
            "over_budget": "analyst-bot", "repeated_error": "coder-bot", "long_run": "crawler-bot",
            "denied_tool": "ops-bot"}


# A simulated agent refused by a kill switch tries again after 5 s, then 10, 20, 30, 30...
KILLED_WAIT_S = 5.0
KILLED_WAIT_MAX_S = 30.0


def simulate(client: GovernanceClient, *, agents: int, runs: int, pace_s: float, seed: int,
             stop: threading.Event, log: Callable[[str], None]) -> dict[str, int]:
    """Run ``agents`` concurrent agents until ``runs`` runs are done (0: until ``stop``)."""
    counts: dict[str, int] = {}
    lock = threading.Lock()
    started = [0]

    def worker(index: int) -> None:
        rng = random.Random(seed + index)

        def pace() -> None:
            stop.wait(pace_s * rng.uniform(0.5, 1.5))

        held = 0.0  # how long this agent last waited for a kill switch; 0: none engaged
        while not stop.is_set():
            with lock:
                if runs and started[0] >= runs:
                    return
                started[0] += 1
            kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
            try:
                with client.run(AGENT_OF[kind], task=f"simulated {kind}") as run:
                    BEHAVIOURS[kind](run, rng, pace)
            except KillSwitchEngaged:
                # Said once, then tried again less and less often while it stays engaged:
                # every agent trying each 5 s filled the demo's terminal with a refused start
                # a second (found by a newcomer who engaged the team's switch).
                if not held:
                    log(f"agent {index}: kill switch engaged, waiting until it is released")
                held = min(KILLED_WAIT_MAX_S, held * 2 or KILLED_WAIT_S)
                stop.wait(held)
                continue
            except Exception as exc:  # keep the demo alive through a restart of the server
                log(f"agent {index}: {type(exc).__name__}: {exc}")
                stop.wait(2)
                continue
            held = 0.0
            with lock:
                counts[kind] = counts.get(kind, 0) + 1
            log(f"agent {index}: {kind} run {run.id} finished")
            stop.wait(pace_s * rng.uniform(0.5, 2))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(agents)]
    for thread in threads:
        thread.start()
        time.sleep(pace_s / 2)
    for thread in threads:
        thread.join()
    return counts
