"""The numbers behind a policy change's confirmation (issue 26, `policies.impact`): how many
of a policy's most recent ended runs a draft would stop at their first step. The backtest's
own read and replay (selectors.py), on fewer runs: it runs inside the save's request.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from policies.impact import Impact
from policies.models import Policy, Team

from . import inputs, selectors

# The runs one draft replays: its policy's newest ended runs started within the backtest's
# default window, at most IMPACT_RUNS of them; an import of many policies shares
# inputs.DEFAULT_LIMIT (the dashboard backtest's own bound) between the policies it changes.
IMPACT_RUNS = 200
IMPACT_SINCE = inputs.DEFAULT_SINCE
# ...and of each, its first IMPACT_DECISIONS decisions, without their args and results (up
# to 64 KiB each, and nothing at the first step depends on them): a stop at the first step
# is decided there (a run that waited longer than that before its first step is not one;
# 200 runs of 50 checks with 20 KB of args each made a dry run read 200 MB). The whole
# runs were read and replayed: 200 runs of 1,000 steps made a save, or a dry run, take 6 to
# 8 s of an operator thread, and four at once slowed every team's checks (SPEC 10). So a
# replay in a request reads at most IMPACT_RUNS x IMPACT_DECISIONS decisions, each run one
# range of its index. (The rate-limit waits at once, estimated across the runs, then see
# the runs' first decisions only: an estimate from fewer of the recorded actions.)
IMPACT_DECISIONS = 50


def stopped_at_once(report: selectors.Report) -> tuple[int, dict[str, int]]:
    """Of the runs the backtest says would change, those the draft stops by its own rules at
    step 1 (a kill is replayed as recorded, never the draft's), by the draft's reason; with
    the runs whose first check would wait longer than their time left (`max_seconds`)."""
    counts = Counter(c.draft["stop_reason"] for c in report.changes
                     if c.draft["status"] == "stopped" and c.draft["step"] == 1)
    # A rate-limit wait longer than the run's time left is a stop at once too (SPEC 12,
    # issue 26): the replay of one run cannot see it, the estimate across the runs does.
    waits_stop = sum(step == 1 for step in (report.estimate.out_of_time_changes.values()
                                             if report.estimate is not None else ()))
    if waits_stop:
        counts["max_seconds"] += waits_stop
    ordered = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return sum(counts.values()), ordered


def runs_per_draft(drafts: int) -> int:
    return max(1, min(IMPACT_RUNS, inputs.DEFAULT_LIMIT // max(1, drafts)))


def recent_impacts(team: Team, documents: list[dict[str, Any]]) -> list[Impact]:
    """One Impact per draft that changes an existing policy of ``team`` (a new policy has no
    recorded runs; an unchanged one makes no new version)."""
    names = [d["name"] for d in documents]
    policies = {p.name: p for p in Policy.objects.filter(team=team, name__in=names)
                .select_related("current")}
    changed = [(policies[d["name"]], d) for d in documents
               if d["name"] in policies and policies[d["name"]].current.document != d]
    since = inputs.parse_since(IMPACT_SINCE)
    limit = runs_per_draft(len(changed))
    impacts = []
    for policy, document in changed:
        report = selectors.backtest(team, policy, document, since=since, limit=limit,
                                    per_run=IMPACT_DECISIONS)
        count, by_reason = stopped_at_once(report)
        impacts.append(Impact(policy=policy.name, runs=report.runs, stopped_at_once=count,
                              by_reason=by_reason, since_days=since.days))
    return impacts
