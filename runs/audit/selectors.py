"""Reads for runs, shared by the API and the dashboard. They change nothing (an import-linter
contract in pyproject.toml): whoever reads first lets runs/first_look.py settle what is due,
and the rows still due are shown as they will be (runs/due.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import orjson
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import QuerySet, TextField
from django.db.models.functions import Cast
from django.http import Http404
from django.utils import timezone

from governance_client import rules
from policies.models import PolicyVersion, Team
from runs import due
from runs.check.policy_cache import rules_for_version
from runs.models import Decision, Run
from runs.sweep import one_by_one

log = logging.getLogger(__name__)


def policy_json(version: PolicyVersion) -> dict[str, Any]:
    doc = version.document
    return {
        "name": doc["name"],
        "version": version.version,
        "mode": doc["mode"],
        "step_limits": doc["step_limits"],
        "budgets": doc["budgets"],
        "tools": doc.get("tools"),
        "repeat_key": doc.get("repeat_key"),
        "on_repeated_error": doc.get("on_repeated_error"),
        "approvals": doc.get("approvals"),
        "warnings": doc.get("warnings"),
    }


def elapsed_s(run: Run, now: datetime | None = None) -> float:
    """The rules' elapsed time (the one max_seconds is checked against), to the millisecond:
    active time (SPEC 15), without the time spent waiting for approvals."""
    memory = run.memory if isinstance(run.memory, dict) else {}
    pending = run.awaited_approval
    try:
        paused = float(memory.get("paused_s", 0.0))
        since = datetime.fromisoformat(pending["since"]) if pending else None
    except (KeyError, TypeError, ValueError):
        # A memory no version of the check writes: every list shows the run all the same,
        # its time counted without pauses (SPEC 10: one bad row breaks no page).
        log.warning("run %s has a memory the rules cannot read: %r", run.pk, memory)
        paused, since = 0.0, None
    return round(rules.elapsed_seconds(
        started_at=run.started_at, ended_at=run.ended_at, status=run.status,
        now=now or timezone.now(), paused_s=paused, pending_since=since), 3)


def run_json(run: Run, now: datetime | None = None) -> dict[str, Any]:
    return {
        "run_id": str(run.pk),
        "agent": run.agent,
        "status": run.status,
        "stop_reason": run.stop_reason,
        "steps": run.steps,
        "tool_calls": run.tool_calls,
        "cost_usd": float(run.cost_usd),
        "elapsed_s": elapsed_s(run, now),
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "policy": policy_json(run.policy_version),
        "task": run.task,
        "output": run.output,
        "parent_run_id": str(run.parent_run_id) if run.parent_run_id else None,
        "root_run_id": str(run.root_run_id) if run.root_run_id else None,
    }


# `GET /api/v1/runs/{id}` lists at most this many of a run's children, the first started
# first, and says when it has more (`children_more`): a tree is bounded in depth, not in
# width, and a read's work must not grow with what agents recorded (SPEC 10).
CHILDREN_LISTED = 1000


def children_ids(run: Run, *, key_agent: str = "") -> tuple[list[str], bool]:
    """The ids of a run's first CHILDREN_LISTED children (SPEC 20), and whether it has
    more (one range of the index of child runs by parent). ``key_agent``: an agent-bound
    key's agent, which sees only its agent's runs (SPEC 10), its children too (found by an
    attacker: another agent's child was listed, while reading it answered 404)."""
    children = Run.objects.filter(team_id=run.team_id, parent_run_id=run.pk)
    if key_agent:
        children = children.filter(agent=key_agent)
    ids = list(children.order_by("started_at", "pk").values_list("pk", flat=True)
               [:CHILDREN_LISTED + 1])
    return [str(i) for i in ids[:CHILDREN_LISTED]], len(ids) > CHILDREN_LISTED


def tree_usage(run: Run) -> dict[str, Any]:
    """The usage of the run and its descendants (SPEC 20): every check of a descendant
    counts on each ancestor too, so the run's own counters are the tree's below it."""
    return {"steps": run.steps, "tool_calls": run.tool_calls,
            "cost_usd": float(run.cost_usd)}


def run_tree_json(run: Run, now: datetime | None = None, *, key_agent: str = ""
                  ) -> dict[str, Any]:
    """One run as `GET /api/v1/runs/{id}` shows it: with its children and tree usage. The
    tree's usage is the run's own counters, every descendant's checks included, whoever's
    agent they are: they are what the run's limits are counted against."""
    children, more = children_ids(run, key_agent=key_agent)
    return {**run_json(run, now), "children": children, "children_more": more,
            "tree_usage": tree_usage(run)}


def runs_json(runs: Iterable[Run], now: datetime | None = None) -> list[dict[str, Any]]:
    """A list's runs as JSON; a run that cannot be shown is logged and left out, so one bad
    row never makes the list answer 500 (SPEC 10)."""
    now = now or timezone.now()
    return one_by_one(runs, lambda run: run_json(run, now), what="run")


def runs_for_team(team: Team, *, status: str | None = None, agent: str | None = None,
                  limit: int = 50, key_agent: str = "", now: datetime | None = None
                  ) -> list[Run]:
    """The team's newest runs, as they will be once what is due on them is settled
    (runs/first_look.py: the caller looks first). ``key_agent``: the agent an agent-bound
    key is limited to (SPEC 10); it sees only that agent's runs, as if the others were
    another team's."""
    now = now or timezone.now()
    runs = Run.objects.filter(team=team).select_related("policy_version")
    if key_agent:
        runs = runs.filter(agent=key_agent)
    if status:
        runs = runs.filter(status=status)
        if status == rules.RUNNING:
            runs = runs.filter(due.still_running(now))  # over, however unsaid
    if agent:
        runs = runs.filter(agent=agent)
    return due.as_it_will_be(runs.order_by("-started_at")[:limit], now=now)


def run_for_team(team: Team, run_id: Any, *, key_agent: str = "") -> Run:
    """The team's run (an agent-bound key: only its agent's), as stored: the caller settles
    what is due on it first (`first_look.look_at_run`); 404 for another team's."""
    runs = Run.objects.select_related("policy_version").filter(team=team, pk=run_id)
    if key_agent:
        runs = runs.filter(agent=key_agent)
    run = runs.first()
    if run is None:
        raise Http404("No such run.")
    return run


def decisions_of(run: Run, *, after: int = 0, limit: int = 100) -> QuerySet[Decision]:
    return Decision.objects.of_run(run.pk, after=after)[:limit]


def decisions_page(run: Run, *, after: int = 0, limit: int = 100) -> bytes:
    """A page of the run's decisions (`GET .../runs/{id}/decisions`, the agent's and the
    operator's) as its JSON body. A decision's args and progress go out as the database
    keeps their text, never decoded: a page of 1,000 decisions with the largest args a check
    may send is 60 MB, and decoding it into Python only to encode it again was most of what
    a page cost (0.36 to 0.75 s in process, against 0.18 s now, 0.09 s of it the worker's
    CPU; docs/performance.md, `heavy_reads`): the time another team's checks waited behind
    one team's reads (SPEC 10). The same values as before: the text is the stored JSON."""
    rows = decisions_of(run, after=after, limit=limit).defer("args", "progress").annotate(
        args_text=Cast("args", TextField()), progress_text=Cast("progress", TextField()))
    return orjson.dumps({"decisions": [
        _decision_doc(d, args=_stored(d.args_text), progress=_stored(d.progress_text))  # type: ignore[attr-defined]
        for d in rows]})


def _stored(text: str | None) -> orjson.Fragment | None:
    # SQL NULL is None; a stored JSON null is the text "null", passed through as it is.
    return None if text is None else orjson.Fragment(text)


def _decision_doc(d: Decision, *, args: Any, progress: Any) -> dict[str, Any]:
    violation = violation_of(d)
    return {
        "id": d.pk,
        "step": d.step,
        "outcome": d.outcome,
        "reason": d.reason,
        "action": {"name": d.action_name, "type": d.action_type, "args": args}
        if d.action_name else None,
        "repeat_key": d.repeat_key,
        "repeat_count": d.repeat_count,
        "progress": progress,
        # As the API's other times (ninja's encoder): milliseconds, "Z" for UTC.
        "at": _ENCODER.default(d.at),
        "local": bool((d.answer or {}).get("local")),
        "policy_violation": violation is not None,
        # What it broke, in words, as the one-decision read says it (found by a newcomer).
        "violation": violation,
        # SPEC 16: every audit record carries its rule, here too (found by a newcomer: an
        # operator's only way to the rule was the agent API's one-decision read).
        "rule": rule_of(d),
    }


_ENCODER = DjangoJSONEncoder()


def decision_for_key(team: Team, decision_id: str, *, key_agent: str = "") -> Decision:
    """A decision of the key's team (an agent-bound key: of its agent's runs, SPEC 10), by
    the id as the path gave it; 404 for any other, as for a decision that does not exist,
    and for an id that is no decision's."""
    # ASCII digits only: str.isdigit() also accepts "²", which int() refuses.
    if not (decision_id.isascii() and decision_id.isdigit()) or len(decision_id) > 18:
        raise Http404("No such decision.")
    # The args as the database keeps their text, never decoded (`decision_detail_body`).
    rows = Decision.objects.select_related("run__policy_version__policy").filter(
        pk=int(decision_id), run__team=team).defer("args", "progress").annotate(
        args_text=Cast("args", TextField()), progress_text=Cast("progress", TextField()))
    if key_agent:
        rows = rows.filter(run__agent=key_agent)
    found = rows.first()
    if found is None:
        raise Http404("No such decision.")
    return found


def rule_of(d: Decision) -> dict[str, Any] | None:
    """The rule of a decision: its column, else its answer's (the same value), null for a
    plain allow and for a decision recorded before rules existed."""
    if d.rule is not None:
        return d.rule
    answer = d.answer if isinstance(d.answer, dict) else {}
    return answer.get("rule")


def decision_detail_body(d: Decision) -> bytes:
    """SPEC 16: the decision, its rule and the values it was made from, as its JSON body; args
    redacted as stored, the result's status and digest only (its error text and summary may
    be long). ``d`` from `decision_for_key`: its args go out as the database keeps their
    text, never decoded, as in `decisions_page`: a decision with 64 KiB of args cost 10.7 ms
    of CPU a read decoded and encoded again, 100 reads a second of it from one key made
    another team's check p99 20 to 39x (found by an attacker)."""
    answer = d.answer if isinstance(d.answer, dict) else {}
    last = d.last_result if isinstance(d.last_result, dict) else None
    version = d.run.policy_version
    violation = violation_of(d)
    return orjson.dumps({
        "decision_id": d.pk,
        "run_id": d.run_id,
        "step": d.step,
        "outcome": d.outcome,
        "reason": d.reason,
        "rule": rule_of(d),
        "directive": answer.get("directive"),
        "action": {"name": d.action_name, "type": d.action_type,
                   "args": _stored(d.args_text)}  # type: ignore[attr-defined]
        if d.action_name else None,
        # As stored too: an integer beyond 64 bits (SPEC 5.2 takes any number) is one orjson
        # cannot write.
        "progress": _stored(d.progress_text),  # type: ignore[attr-defined]
        "last_result": {"status": last.get("status"), "digest": last.get("digest")}
        if last is not None else None,
        "cost_usd": float(d.cost_usd),
        "usage": answer.get("usage"),
        "policy": {"name": version.policy.name, "version": version.version},
        "at": _ENCODER.default(d.at),
        # As the run's decisions list says them (found by an attacker: the one-decision read,
        # the "why" of a decision, showed a flagged local allow as a plain allow).
        "local": bool(answer.get("local")),
        "policy_violation": violation is not None,
        "violation": violation,
    })


def violation_of(d: Decision) -> str | None:
    """Why an uploaded local allow broke its run's policy (a denied tool, an action needing
    approval: SPEC 10, "Uploaded local decisions"), in words; None for any other decision.
    Stored with the upload; a decision uploaded before that (the audit log is append-only)
    is judged when read, by the same rule against its run's policy version. ``d.run`` comes
    with the run's own decisions (no query)."""
    answer = d.answer if isinstance(d.answer, dict) else {}
    if answer.get("local") is not True or d.outcome != rules.ALLOW:
        return None
    if "policy_violation" in answer:
        if not answer["policy_violation"]:
            return None
        return str(answer.get("violation") or "the run's policy forbids this action")
    return rules.policy_violation(rules_for_version(d.run.policy_version_id), d.action_name)
