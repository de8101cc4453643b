"""Writes for runs: start, check, finish. Each is one transaction that locks the run first,
so the checks of one run are serialized in every process (SPEC 4.5)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from policies.models import AgentKey, Policy, Team

from . import rules
from .events import publish_run_event
from .models import Decision, KillSwitch, Run, Scope
from .policy_cache import rules_for_version


class ServiceError(Exception):
    """A refusal the API turns into its JSON error (SPEC 5.3)."""

    def __init__(self, status: int, code: str, message: str, fields: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.fields = status, code, message, fields or {}


def covering_switch(*, team_id: int, agent: str, run_id: Any | None) -> KillSwitch | None:
    """The engaged kill switch that covers a run (or a run about to start), if any.

    Read inside the caller's transaction, after the run lock: a switch committed before this
    statement starts is always seen, which is the promise of SPEC 4.5.
    """
    cover = (
        Q(scope=Scope.GLOBAL)
        | Q(scope=Scope.TEAM, team_id=team_id)
        | Q(scope=Scope.AGENT, team_id=team_id, agent=agent)
    )
    if run_id is not None:
        cover |= Q(scope=Scope.RUN, run_id=run_id)
    return KillSwitch.objects.filter(cover, active=True).order_by("engaged_at").first()


def describe_switch(switch: KillSwitch) -> str:
    what = {
        Scope.GLOBAL: "the global kill switch",
        Scope.TEAM: "the team kill switch",
        Scope.AGENT: f"the kill switch of agent {switch.agent}",
        Scope.RUN: "the kill switch of this run",
    }[Scope(switch.scope)]
    return f"{what}, engaged by {switch.engaged_by_label}: {switch.reason}"


def state_of(run: Run) -> rules.RunState:
    return rules.RunState(
        started_at=run.started_at,
        status=run.status,
        stop_reason=run.stop_reason,
        ended_at=run.ended_at,
        steps=run.steps,
        tool_calls=run.tool_calls,
        cost_usd=Decimal(run.cost_usd),
    ).load_memory(run.memory)


def _store_state(run: Run, state: rules.RunState) -> None:
    run.status, run.stop_reason, run.ended_at = state.status, state.stop_reason, state.ended_at
    run.steps, run.tool_calls, run.cost_usd = state.steps, state.tool_calls, state.cost_usd
    run.memory = state.memory()


def run_start(
    *, key: AgentKey, agent: str, policy: str | None, task: str | None,
    metadata: dict[str, Any] | None, external_id: str | None,
) -> tuple[Run, bool]:
    """Start a run, or return the team's run with this external_id. Returns (run, created)."""
    team = key.team
    if key.agent and agent != key.agent:
        raise ServiceError(422, "invalid_request", "This key may only start runs of its agent.",
                           {"agent": f"this key is limited to agent {key.agent!r}"})
    if external_id is not None:
        existing = Run.objects.filter(team=team, external_id=external_id).first()
        if existing is not None:
            return existing, False
    name = policy or "default"
    policy_row = Policy.objects.filter(team=team, name=name).only("current_id").first()
    if policy_row is None or policy_row.current_id is None:
        raise ServiceError(422, "invalid_request", f"Unknown policy {name!r}.",
                           {"policy": f"no policy named {name!r} in this team"})
    metadata = rules.redact(metadata or {}, rules_for_version(policy_row.current_id).redact_args)
    try:
        with transaction.atomic():
            switch = covering_switch(team_id=team.pk, agent=agent, run_id=None)
            if switch is not None:
                raise ServiceError(409, "kill_switch_engaged",
                                   f"No new run may start: {describe_switch(switch)}.")
            run = Run.objects.create(
                team=team, agent=agent, policy_version_id=policy_row.current_id,
                started_at=timezone.now(), task=task or "", metadata=metadata,
                external_id=external_id,
            )
    except IntegrityError:
        # Two starts raced with one external_id: the loser answers with the winner's run.
        existing = Run.objects.filter(team=team, external_id=external_id).first()
        if existing is None:
            raise
        return existing, False
    publish_run_event(run, kind="run")
    return run, True


@dataclass(frozen=True)
class CheckRequest:
    name: str
    type: str
    args: dict[str, Any]
    progress: str | int | float | None
    last_result: dict[str, Any] | None
    cost_usd: Decimal
    check_id: str | None


def _answer_of(decision: rules.Decision, state: rules.RunState, policy: rules.Policy,
               now: Any) -> dict[str, Any]:
    return {
        "decision": decision.answer,
        "reason": decision.reason,
        "step": decision.step,
        "repeat_key": decision.repeat_key,
        "repeat_count": decision.repeat_count,
        "message": decision.message,
        "next_action": decision.next_action,
        "usage": state.usage(now),
        "limits": policy.limits(),
        "directive": decision.directive,
        "shadow": decision.shadow,
    }


def run_check(*, team: Team, run_id: Any, req: CheckRequest) -> dict[str, Any]:
    """Decide one check: lock the run, apply the pure rules, store state and audit record
    together, answer. Returns the JSON answer of SPEC 5.2."""
    with transaction.atomic():
        run = (
            Run.objects.select_for_update()
            .filter(team=team, pk=run_id)
            .only("id", "team_id", "agent", "policy_version_id", "status", "stop_reason",
                  "steps", "tool_calls", "cost_usd", "started_at", "ended_at", "memory")
            .first()
        )
        if run is None:
            raise ServiceError(404, "not_found", "No such run.")
        policy = rules_for_version(run.policy_version_id)
        state = state_of(run)
        if req.check_id is not None:
            first = Decision.objects.filter(run=run, check_id=req.check_id).first()
            if first is not None and (
                state.status == rules.RUNNING or first.answer.get("decision") == rules.STOP
            ):
                return {**first.answer, "decision_id": first.pk}
            check_id = None if first is not None else req.check_id
        else:
            check_id = None
        now = timezone.now()
        last = req.last_result
        check = rules.Check(
            name=req.name, type=req.type, args=req.args, progress=req.progress,
            last_result=rules.LastResult(
                status=last["status"], digest=last.get("digest"), error=last.get("error"),
                summary=last.get("summary"),
            ) if last else None,
            cost_usd=req.cost_usd,
        )
        kill = None
        if state.status == rules.RUNNING:
            switch = covering_switch(team_id=run.team_id, agent=run.agent, run_id=run.pk)
            kill = describe_switch(switch) if switch is not None else None
        decision, new_state = rules.evaluate(policy, state, check, now=now, kill=kill)
        answer = _answer_of(decision, new_state, policy, now)
        if new_state is not state:
            _store_state(run, new_state)
            run.save(update_fields=["status", "stop_reason", "ended_at", "steps", "tool_calls",
                                    "cost_usd", "memory"])
        row = Decision.objects.create(
            run=run, step=decision.step, outcome=decision.outcome, reason=decision.reason,
            action_name=req.name, action_type=req.type,
            args=rules.redact(req.args, policy.redact_args), repeat_key=decision.repeat_key,
            repeat_count=decision.repeat_count, check_id=check_id, progress=req.progress,
            last_result=last, cost_usd=req.cost_usd, answer=answer, at=now,
        )
    publish_run_event(run, kind="decision", decision_id=row.pk)
    return {**answer, "decision_id": row.pk}


def run_finish(*, team: Team, run_id: Any, status: str, output: str | None) -> Run:
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(team=team, pk=run_id).first()
        if run is None:
            raise ServiceError(404, "not_found", "No such run.")
        now = timezone.now()
        try:
            new_state = rules.finish(state_of(run), status,
                                     already_finished=run.finished_at is not None, now=now)
        except rules.FinishError:
            raise ServiceError(409, "run_finished", "This run was already finished.") from None
        _store_state(run, new_state)
        run.finished_at = now
        if output is not None:
            run.output = output
        run.save()
    publish_run_event(run, kind="run")
    return run
