"""Reads for runs, shared by the API and the dashboard. They change nothing (an import-linter
contract in pyproject.toml): whoever reads first lets runs/first_look.py settle what is due,
and the rows still due are shown as they will be (runs/due.py)."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import datetime
from typing import Any

import orjson
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Func, IntegerField, Q, QuerySet, TextField
from django.db.models.functions import Cast
from django.http import Http404
from django.utils import timezone

from governance.errors import AppError
from governance_client import rules
from policies.models import PolicyVersion, Team
from runs import due
from runs.check.policy_cache import rules_for_version
from runs.check.schemas import PolicyOut
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


def _team_runs(team: Team, *, status: str | None, agent: str | None, key_agent: str,
               now: datetime) -> QuerySet[Run]:
    """The team's runs a list shows, newest first (the run id breaks ties, so a page's
    boundary is exact). ``key_agent``: the agent an agent-bound key is limited to (SPEC 10);
    it sees only that agent's runs, as if the others were another team's."""
    runs = Run.objects.filter(team=team)
    if key_agent:
        runs = runs.filter(agent=key_agent)
    if status:
        runs = runs.filter(status=status)
        if status == rules.RUNNING:
            runs = runs.filter(due.still_running(now))  # over, however unsaid
    if agent:
        runs = runs.filter(agent=agent)
    return runs.order_by("-started_at", "-pk")


# A page of the runs list (`GET /api/v1/runs`, the operator API's `.../runs`) stops adding
# runs once its JSON would pass this many bytes, and says where the next page starts
# (`next_after`). A run's task and output may be 10,000 and 100,000 characters, so 500 of
# them were 660 MB of JSON, 7 s and over a GB of the worker's memory for one read (found by
# an attacker); a page is now at most this, whatever was recorded (SPEC 10).
RUNS_PAGE_BYTES = 4 * 1024 * 1024


class _StoredBytes(Func):
    """A text column's size in bytes as the database keeps it (UTF-8). PostgreSQL reads it
    from the value's header, without reading the text out of TOAST."""

    function = "OCTET_LENGTH"
    output_field = IntegerField()

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection,
                           template="LENGTH(CAST(%(expressions)s AS BLOB))", **extra)


def runs_page(team: Team, *, status: str | None = None, agent: str | None = None,
              limit: int = 50, after: uuid.UUID | None = None, key_agent: str = "",
              now: datetime | None = None) -> bytes:
    """A page of the team's runs, newest first, as its JSON body: `{"runs": [...],
    "next_after": run id | null}`. It holds at most ``limit`` runs, and fewer when they
    would pass RUNS_PAGE_BYTES (never none: a first run bigger than that is sent alone);
    ``next_after`` is the last one's id when more runs follow, for the next page's
    ``after``. The rows are read in two steps, so that the read's memory is bounded by the
    page and not by ``limit`` runs of the longest texts: first the ids and the stored size
    of each run's texts, then the texts of the runs that can fit (a run's JSON is never
    smaller than its stored texts). Each run as `run_json` makes it, through the answer's
    schema as before, written with orjson: text beyond ASCII as UTF-8, not 12-byte escapes.
    The rows are shown as they will be once what is due on them is settled (the caller
    looks first, runs/first_look.py)."""
    now = now or timezone.now()
    runs = _team_runs(team, status=status, agent=agent, key_agent=key_agent, now=now)
    if after is not None:
        runs = runs.filter(_after(team, after, key_agent=key_agent))
    listed = [(pk, size or 0) for pk, size in
              runs.annotate(size=_StoredBytes("task") + _StoredBytes("output"))
              .values_list("pk", "size")[:limit + 1]]
    more, listed = len(listed) > limit, listed[:limit]
    parts: list[bytes] = []
    used, last, full, start = _PAGE_FRAME, None, False, 0
    policies: dict[int, dict[str, Any]] = {}
    while start < len(listed) and not full:
        # The next runs whose stored texts fit in what the page has left (at least one).
        end, room = start + 1, RUNS_PAGE_BYTES - used - listed[start][1]
        while end < len(listed) and listed[end][1] <= room:
            room -= listed[end][1]
            end += 1
        ids = [pk for pk, _ in listed[start:end]]
        rows = (Run.objects.filter(team=team, pk__in=ids).select_related("policy_version")
                .order_by())  # by their ids (the primary key), put in order below
        found = {run.pk: run for run in due.as_it_will_be(rows, now=now)}
        for pk in ids:
            # Nothing for a run deleted since (retention) or one that cannot be shown.
            body = b"".join(one_by_one([found[pk]] if pk in found else [],
                                       lambda run: _listed_run(run, now, policies), what="run"))
            if body and parts and used + len(body) + 1 > RUNS_PAGE_BYTES:
                more = full = True
                break
            if body:
                parts.append(body)
                used += len(body) + 1
            last = pk
        start = end
    return b"".join([b'{"runs":[', b",".join(parts), b'],"next_after":',
                     orjson.dumps(str(last) if more and last is not None else None), b"}"])


# What a page's JSON holds besides its runs.
_PAGE_FRAME = len(b'{"runs":[],"next_after":"00000000-0000-0000-0000-000000000000"}')


def _after(team: Team, after: uuid.UUID, *, key_agent: str) -> Q:
    """The runs listed after this run of the team's (the previous page's last): older, or
    as old with a smaller id. 404 naming `after` for a run the caller cannot see (another
    team's, another agent's for an agent-bound key, or one deleted since), as for a
    `parent_run_id` (SPEC 20)."""
    runs = Run.objects.filter(team=team, pk=after)
    if key_agent:
        runs = runs.filter(agent=key_agent)
    started = runs.values_list("started_at", flat=True).first()
    if started is None:
        raise AppError(404, "not_found", "`after` is no run of this list.",
                       {"after": "no run of yours has this id (deleted since?): start again "
                                 "from the first page"})
    # "started <= s AND (started < s OR id < after)": the first half is a plain range of
    # the (team, started) index, walked in order (as runs/dashboard/selectors.py `_after`).
    return Q(started_at__lte=started) & (Q(started_at__lt=started) | Q(pk__lt=after))


def _listed_run(run: Run, now: datetime, policies: dict[int, dict[str, Any]]) -> bytes:
    """One run of a list as JSON, the values the answer's schema made before (a policy's
    numbers as its fields' types, the one-run fields null, ninja's times): the small
    fields through the schema, once per policy version; the texts as they are."""
    doc = run_json(run, now)
    if run.policy_version_id not in policies:
        policies[run.policy_version_id] = PolicyOut.model_validate(doc["policy"]).model_dump()
    doc.update(policy=policies[run.policy_version_id], children=None, children_more=None,
               tree_usage=None, started_at=_ENCODER.default(run.started_at),
               ended_at=_ENCODER.default(run.ended_at) if run.ended_at else None)
    try:
        return orjson.dumps(doc)
    except orjson.JSONEncodeError:  # what orjson refuses and the standard library writes
        return json.dumps(doc, separators=(",", ":")).encode()


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
