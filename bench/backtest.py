"""The backtest phase (SPEC 13): replayed decisions per second on a generated history of
10,000 ended runs of about 20 steps each.

The history is generated with the check's own pure rules (so every recorded decision is one
the check would have made, with its elapsed seconds, costs, progress, errors and repeat keys)
and bulk-inserted into the benchmark's database; then `manage.py backtest`'s code path
(backtests.selectors.backtest: the chunked read and the pure replay) runs in this process,
once with a draft that keeps the recorded keys and once with one that changes
`ignore_args`, so every key is recomputed from the recorded args.
"""

from __future__ import annotations

import random
import time
import uuid
from datetime import timedelta
from decimal import Decimal
from typing import Any

RUNS = 10_000
QUICK_RUNS = 500
STEPS = 20
TEAM = "bench-backtest"
POLICY = {"step_limits": {"max_steps": 30, "max_repeat_action": 4, "no_progress_window": 6},
          "budgets": {"max_seconds": 600, "max_usd": 5.0, "max_tool_calls": None},
          "repeat_key": {"ignore_args": ["request_id"]}}


def _script(rng: random.Random) -> list[dict[str, Any]]:
    """One agent's checks: mostly searching and fetching with progress; some loop, some keep
    failing, some spend."""
    kind = rng.choice(["normal", "normal", "normal", "loop", "errors", "spender"])
    steps = []
    for i in range(rng.randint(STEPS - 4, STEPS + 4)):
        name = rng.choice(["search.docs", "fetch.page", "crm.lookup", "llm.summarize"])
        args: dict[str, Any] = {"query": f"q{i % 7 if kind != 'loop' else 0}",
                                "request_id": uuid.uuid4().hex[:8]}
        if i % 5 == 0:
            args["token"] = f"t{i}"  # stored redacted: its key cannot be recomputed
        last = None
        if kind == "errors" and i % 2:
            last = {"status": "error", "error": "Timeout talking to CRM"}
        elif i % 3 == 0:
            last = {"status": "ok", "digest": f"d{i}"}
        steps.append({
            "name": "search.docs" if kind == "loop" else name,
            "type": "llm" if name.startswith("llm") else "tool",
            "args": args, "progress": i // 2 if kind == "normal" else None, "last_result": last,
            "cost_usd": Decimal("0.03") if kind == "spender" else Decimal("0.002"),
            "elapsed_s": 1.5 * (i + 1),
        })
    return steps


def generate(team: Any, *, runs: int, seed: int = 16) -> int:
    """Record ``runs`` ended runs under the team's default policy; returns the decisions."""
    from django.utils import timezone

    from governance_client import rules
    from policies.models import Policy
    from runs.models import Decision, Run

    version = Policy.objects.get(team=team, name="default").current
    policy = rules.Policy.from_document(version.document)
    rng = random.Random(seed)
    base = timezone.now() - timedelta(days=2)
    run_rows, decision_rows = [], []
    for n in range(runs):
        started = base + timedelta(seconds=10 * n)
        state = rules.RunState(started_at=started)
        run_id = uuid.uuid4()
        for check in _script(rng):
            now = started + timedelta(seconds=check["elapsed_s"])
            last = check["last_result"]
            decision, state = rules.evaluate(policy, state, rules.Check(
                name=check["name"], type=check["type"], args=check["args"],
                progress=check["progress"], cost_usd=check["cost_usd"],
                last_result=rules.LastResult(**last) if last else None), now=now)
            decision_rows.append(Decision(
                run_id=run_id, step=decision.step, outcome=decision.outcome,
                reason=decision.reason, action_name=check["name"], action_type=check["type"],
                args=rules.redact(check["args"], policy.redact_args),
                repeat_key=decision.repeat_key, repeat_count=decision.repeat_count,
                progress=check["progress"], last_result=last, cost_usd=check["cost_usd"],
                answer={"decision": decision.answer, "reason": decision.reason}, at=now,
                elapsed_s=check["elapsed_s"]))
            if state.status != rules.RUNNING:
                break
        ended = state.ended_at or started + timedelta(seconds=40)
        run_rows.append(Run(
            id=run_id, team=team, agent="bench-agent", policy_version=version,
            status=state.status if state.status != rules.RUNNING else rules.COMPLETED,
            stop_reason=state.stop_reason, steps=state.steps, tool_calls=state.tool_calls,
            cost_usd=state.cost_usd, started_at=started, ended_at=ended, memory={}))
    Run.objects.bulk_create(run_rows, batch_size=2000)
    Decision.objects.bulk_create(decision_rows, batch_size=5000)
    return len(decision_rows)


def measure(*, quick: bool) -> dict[str, Any]:
    from backtests import selectors
    from policies.document import default_policy, parse_policy
    from policies.models import Policy
    from policies.services import policy_save, team_ensure

    team, _ = team_ensure(slug=TEAM, name="Benchmark backtest")
    document = default_policy()
    for key, value in POLICY.items():
        document[key] = {**document[key], **value}
    policy_save(team=team, document=parse_policy(document), actor=None, source="bench")
    runs = QUICK_RUNS if quick else RUNS
    started = time.monotonic()
    decisions = generate(team, runs=runs)
    generate_s = time.monotonic() - started
    policy = Policy.objects.select_related("current").get(team=team, name="default")

    out: dict[str, Any] = {"runs": runs, "decisions": decisions,
                           "generate_s": round(generate_s, 1)}
    drafts = {
        "recorded_keys": {**policy.current.document,
                          "step_limits": {**policy.current.document["step_limits"],
                                          "max_repeat_action": 2}},
        "recomputed_keys": {**policy.current.document,
                            "repeat_key": {"ignore_args": ["request_id", "query"]}},
    }
    for label, draft in drafts.items():
        wall, cpu = time.monotonic(), time.process_time()
        report = selectors.backtest(team, policy, draft, since=timedelta(days=30),
                                    limit=runs)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        out[label] = {
            "seconds": round(wall, 2),
            "cpu_seconds": round(cpu, 2),
            "decisions_per_s": round(report.decisions / wall) if wall else None,
            "runs": report.runs,
            "decisions": report.decisions,
            "changed": report.changed,
            "by_reason": report.by_reason,
            "key_fallbacks": report.key_fallbacks,
        }
    out["ok"] = all(out[label]["runs"] == runs and out[label]["decisions"] == decisions
                    for label in drafts)
    return out
