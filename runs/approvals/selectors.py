"""Reads of approvals (SPEC 11): the API's answer for a request, its final answer, and what
the approvals page, the run page and the navigation show.

They change nothing (an import-linter contract in pyproject.toml): what is due on a request
(an expiry, a kill switch's cancellation) is settled before the read, by the caller's look
(runs/first_look.py).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import QuerySet, TextField
from django.db.models.functions import Cast

from governance_client import answers, rules
from policies.models import AgentKey, Team
from runs.check import records
from runs.check.policy_cache import rules_for_version
from runs.models import Approval, ApprovalStatus, Decision, Run


def iso(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment is not None else None


def with_args_text(rows: QuerySet[Approval]) -> QuerySet[Approval]:
    """``rows`` with each request's args as the database keeps their text, never decoded:
    `approval_json` puts it in the answer as it is. A request's args may be 64 KiB, a list
    of them a hundred times that; decoding it into Python only to encode it again made a
    read of a decision with such args cost 10.7 ms against 2.2 (runs/audit/selectors.py
    `decision_detail_body`), and the reads of one team, that much of a process's time
    another team's checks waited behind (SPEC 10)."""
    return rows.defer("args").annotate(args_text=Cast("args", TextField()))


def dumps(body: Any) -> bytes:
    """An answer of `approval_json`'s (or a structure holding some) as JSON: its stored args
    are orjson fragments, which only orjson writes; anything else orjson does not know (a
    Decimal) as the API's other answers write it."""
    return orjson.dumps(body, default=_ENCODER.default)


_ENCODER = DjangoJSONEncoder()


def approval_json(approval: Approval) -> dict[str, Any]:
    """The answer of GET /api/v1/approvals/{id} (SPEC 11); written with `dumps`. The args
    as stored, never decoded, when ``approval`` was read `with_args_text`."""
    if hasattr(approval, "args_text"):
        args: Any = orjson.Fragment(approval.args_text) if approval.args_text is not None \
            else {}
    else:
        args = approval.args if approval.args is not None else {}
    return {
        "id": str(approval.pk),
        "run_id": str(approval.run_id),
        "status": approval.status,
        "action": {"name": approval.action_name, "type": approval.action_type,
                   "args": args},
        "requested_at": iso(approval.requested_at),
        "expires_at": iso(approval.expires_at),
        "decided_at": iso(approval.decided_at),
        "decided_by": approval.decided_by_label or None,
        "note": approval.note or None,
        "decision": final_answer(approval),
    }


def final_answer(approval: Approval) -> dict[str, Any] | None:
    """The request's final answer as its agent must act on it: null while pending, else
    what a replay of its check answers (SPEC 4.5, 10): the stored answer while the run goes
    on, or when it was a stop; once the run is over, the run's stop. An approved action whose
    run was then killed or finished is not to be run: its answer is no longer the allow."""
    if approval.status == ApprovalStatus.PENDING:
        return None
    stored = approval.decision if isinstance(approval.decision, dict) else None
    run = approval.run
    # rules.replay_allowed, on the stored answer.
    if run.status == rules.RUNNING or (stored or {}).get("decision") == rules.STOP:
        return stored
    return records.stop_answer(run, _repeat_key(approval, stored))


def final_of(run: Any, pending: rules.Pending, decision: rules.Decision, new: rules.RunState,
             now: datetime, label: str) -> dict[str, Any]:
    """A settled request's final answer, as its settling stores it (runs/approvals/
    services.py) and as a read shows a request past its expiry that no look has settled yet
    (runs/due.py): one builder, so the two cannot drift."""
    answer = answers.answer_of(decision, new, rules_for_version(run.policy_version_id), now)
    # The approver is named in the answer (and so in its audit record): null for a command
    # run without --user, an expiry or a cancellation.
    answer["approval"] = {**(decision.approval or pending.summary()),
                          "decided_by": label or None}
    return answer


def _repeat_key(approval: Approval, stored: dict[str, Any] | None) -> str:
    """The repeat key of the request's check: in its final answer, else in the pending
    answer's audit record."""
    key = (stored or {}).get("repeat_key")
    if isinstance(key, str):
        return key
    return (Decision.objects.filter(pk=approval.requested_decision_id)
            .values_list("repeat_key", flat=True).first() or "")


def approval_for_key(key: AgentKey, approval_id: Any) -> Approval | None:
    """The key's team's approval (an agent-bound key: only its agent's), None for another's:
    as stored (the caller looks first: `first_look.look_at_approval`)."""
    approvals = with_args_text(Approval.objects.filter(team_id=key.team_id)
                               .select_related("run"))
    if key.agent:
        approvals = approvals.filter(run__agent=key.agent)
    return approvals.filter(pk=approval_id).first()


def _listed(team: Team) -> tuple[QuerySet[Approval], QuerySet[Approval]]:
    """The team's requests as the approvals page lists them: pending first (soonest to expire
    first), then the latest decided ones."""
    return (Approval.objects.filter(team=team, status=ApprovalStatus.PENDING)
            .order_by("expires_at"),
            Approval.objects.filter(team=team).exclude(status=ApprovalStatus.PENDING)
            .order_by("-decided_at", "-requested_at"))


def approvals_for_team(team: Team, *, limit: int = 100) -> list[Approval]:
    """Pending first (soonest to expire first), then the latest decided ones."""
    pending, decided = _listed(team)
    return (list(pending.select_related("run")[:limit])
            + list(decided.select_related("run")[:limit]))


def approvals_shown_key(team: Team, *, limit: int = 100) -> tuple[Any, ...]:
    """What changes the list `approvals_for_team` gives, read without the requests
    themselves: the pending ones' ids and expiries, the decided ones' ids and statuses, in
    its order. A live approvals page renders its list again only when this changes (or a
    request shown pending is past its expiry): a request's card holds up to 14 KB of task
    and args, and rendering a list of a hundred on every check of the team, in every open
    approvals page, made another team's check p99 7x (found by an attacker)."""
    pending, decided = _listed(team)
    return (tuple(pending.values_list("id", "expires_at")[:limit]),
            tuple(decided.values_list("id", "status")[:limit]))


def pending_count(team: Team) -> int:
    return Approval.objects.filter(team=team, status=ApprovalStatus.PENDING).count()


def pending_for_run(run: Run) -> Approval | None:
    return Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).first()
