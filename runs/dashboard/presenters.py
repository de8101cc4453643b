"""What the run screens show, computed once for the page and for its live stream.

The page renders each partial with these contexts and the stream re-renders the same partials
with the same contexts, so a live update can never look different from a reload. They change
nothing (an import-linter contract in pyproject.toml): the view, or the stream's look, lets
runs/first_look.py settle what is due before it calls them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.utils import timezone

from governance.templatetags.dashboard_tags import money
from governance_client import rules
from policies.models import Team
from runs import due
from runs.approvals.selectors import approvals_for_team, pending_for_run
from runs.audit.selectors import elapsed_s, violation_of
from runs.dashboard import selectors as dashboard
from runs.killswitch.selectors import engaged_for_team
from runs.models import Decision, Run, RunStatus, Scope
from runs.sweep import one_by_one

ARGS_PREVIEW_CHARS = 80
ARGS_FULL_CHARS = 4000
SUMMARY_CHARS = 160

def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class StepRow:
    id: int
    step: int
    action: str
    action_type: str
    args_preview: str
    args_full: str
    args_cut: bool
    outcome: str
    reason: str
    result_status: str
    result_summary: str
    result_full: str
    cost: Decimal
    at: datetime
    message: str
    directive: str
    shadow_reason: str
    progress: str  # the progress value the agent reported, as JSON text ("" for none)
    duration_s: float | None  # since the previous decision of the run (or its start)
    kill: bool  # a fan-out kill: no action, the step number is the previous step's
    approval_status: str = ""  # SPEC 11: the request this record opened or settled
    approval_by: str = ""
    local: bool = False  # decided by a fail-open client during an outage, uploaded later
    violation: str = ""  # a local allow that broke the run's policy: why (SPEC 10)
    retry_after_s: float | None = None
    why: str = ""  # SPEC 16: the rule that decided, in words ("" for a plain allow)
    warning: str = ""  # the directive's code, when the row carries a warning
    # A local row's upload (its `at` is when the client decided): None for any other row.
    uploaded_at: datetime | None = None


def _decided_at(d: Decision) -> datetime | None:
    """When a fail-open client decided a local decision it uploaded later (the answer's
    ``decided_at``, kept within the run's start and the upload by the service), or None."""
    answer = d.answer or {}
    text = answer.get("decided_at") if answer.get("local") is True else None
    if not isinstance(text, str):
        return None
    try:
        decided = datetime.fromisoformat(text)
    except ValueError:
        return None
    return decided if decided.tzinfo is not None else None


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _pairs(values: Any) -> str:
    if not isinstance(values, dict):
        return ""
    return ", ".join(f"{k} {_value(v)}" for k, v in values.items())


# The rules that stop a count past their limit (SPEC 4.4: steps > max_steps, elapsed >
# max_seconds); the others stop one that reaches it (repeats, cost, tool calls, no progress).
PAST_RULES = ("max_steps", "max_seconds")


def _ended(status: Any, reason: Any) -> str:
    """How a run ended, in words: "completed", "stopped by its agent", "killed by a kill
    switch", "stopped (max_steps)"... ``reason`` is its stop reason (None for a finish)."""
    if reason == rules.AGENT_STOPPED:
        return "stopped by its agent"
    if reason == rules.ABANDONED:
        return "abandoned (no activity for its max_idle_seconds)"
    if status == rules.KILLED or reason == rules.KILLED:
        return "killed by a kill switch"
    if status in (rules.COMPLETED, rules.FAILED):
        return str(status)
    if reason and reason not in (status, rules.RUN_FINISHED):
        return f"stopped ({reason})"
    return str(status) if status and status != rules.RUNNING else "over"


def after_the_end(rule: Any) -> bool:
    """Whether ``rule`` is a check's answered after its run had ended with no stop on record
    to repeat (the agent's finish): its limit is the status a check needs, ``{"status":
    "running"}``, not a value of the policy (SPEC 4.4: a check on a terminal run answers
    the run's stop). It stopped nothing: the run was over already."""
    limit = rule.get("limit") if isinstance(rule, dict) else None
    return isinstance(limit, dict) and set(limit) == {"status"}


def _is_warning(rule: dict[str, Any], warning: bool | None) -> bool:
    """Whether ``rule`` is a warning's (SPEC 16) rather than a stop's. ``no_progress`` and
    ``repeated_error`` name both a warning and a stop, with the same limit and observed
    value for ``repeated_error``: only the decision tells them apart, so the caller says
    (``warning``); None guesses from the name alone, a warning for a name that is no stop
    reason (found by a newcomer: a no_progress stop read "no_progress warning: ... 4 of
    no_progress_window 4")."""
    if warning is not None:
        return warning and rule["name"] in rules.WARNING_CODES
    return rule["name"] in rules.WARNING_CODES and rule["name"] not in rules.REASONS


def _detail(rule: dict[str, Any], warning: bool | None = False) -> str:
    """What a rule observed against its limit, in words that fit its kind: a limit is
    "reached", a pattern "matched", a switch "engaged", an approval "denied" or "not decided"
    (found by a newcomer: every kind read "{observed} reached {limit}", e.g. "decided_by
    operator, note ... reached approvals required"). ``warning``: see ``_is_warning``."""
    name = rule["name"]
    limit = rule.get("limit") if isinstance(rule.get("limit"), dict) else {}
    observed = rule.get("observed") if isinstance(rule.get("observed"), dict) else {}
    if after_the_end(rule):
        # Found by a newcomer: "status completed, stop_reason None reached status running".
        return ("the run was already "
                + _ended(observed.get("status"), observed.get("stop_reason")))
    if name == rules.KILLED:
        where = _pairs({k: v for k, v in limit.items() if k != "scope"})
        scope = limit.get("scope")
        switch = f"the {scope} kill switch" if scope else "the kill switch"
        by, why = observed.get("engaged_by"), observed.get("reason")
        return (switch + (f" ({where})" if where else "")
                + (f", engaged by {by}" if by else "") + (f": {why}" if why else ""))
    if name == rules.APPROVAL_DENIED:
        by, note = observed.get("decided_by"), observed.get("note")
        return (f"{by or 'an operator'} denied the action it had to approve"
                + (f" (note: {note})" if note else ""))
    if name == rules.APPROVAL_EXPIRED:
        return (f"nobody decided on the action it had to approve within "
                f"{_value(limit.get('timeout_s'))} s (it expired at "
                f"{observed.get('expires_at')})")
    if name == rules.PARENT_STOPPED:
        # No limit: the ancestor ended, for any reason (SPEC 20). One found past its idle
        # deadline is still "running" in the rule, and had ended all the same.
        return (f"its ancestor run {limit.get('ancestor')} had ended "
                f"({_ended(observed.get('status'), observed.get('reason'))})")
    if name == rules.DEADLINE_EXPIRED:
        # Found checking every kind after a newcomer's report: "past_deadline True".
        return ("the agent no longer waited for the answer (its deadline had passed), so "
                "nothing was decided or counted")
    if name == rules.RATE_LIMITED and "retry_after_s" in observed:
        # Not "retry_after_s 2.5 reached index 0, match search.*, per run, max 5, ...".
        index = limit.get("index")
        which = f"rate_limits[{index}]" if isinstance(index, int) else "a rate limit"
        return (f"{which} ({limit.get('match')} at most {_value(limit.get('max'))} per "
                f"{limit.get('per')} in {_value(limit.get('window_s'))} s): retry after "
                f"{_value(observed['retry_after_s'])} s")
    if rules.waited_past_budget(rule) and "elapsed_s" in observed:
        # A rate-limit wait the run's time cannot cover (SPEC 12): the elapsed time is not
        # past the limit yet, the wait would take it there.
        return (f"elapsed_s {_value(observed['elapsed_s'])} and a rate-limit wait of "
                f"{_value(observed['retry_after_s'])} s would pass max_seconds "
                f"{_value(limit.get('max_seconds'))}")
    action = observed.get("action")
    if action is not None and name in ("tool_denied", rules.APPROVAL_REQUIRED):
        pattern = _pairs({k: v for k, v in limit.items() if k != "timeout_s"})
        if "allow" in limit:
            return f"action {action} is not in allow {_value(limit['allow'])}"
        return f"action {action} matches {pattern}"
    text_observed, text_limit = _pairs(observed), _pairs(limit)
    if text_observed and text_limit:
        if _is_warning(rule, warning):
            # A warning's counter has not reached the limit (found by a newcomer: "steps 15
            # reached max_steps 18"): it is on its way, past the warning's own threshold.
            return f"{text_observed} of {text_limit}"
        if name in PAST_RULES:
            # These stop a count beyond the limit, not at it (found by a newcomer: "steps 8
            # reached max_steps 6" beside a message saying step 8 is past max_steps=6).
            return f"{text_observed} past {text_limit}"
        return f"{text_observed} reached {text_limit}"
    return text_observed or text_limit


def rule_in_words(rule: Any, *, warning: bool | None = None) -> str:
    """A decision's rule (SPEC 16), readable: "loop_detected: repeat_count 3 reached
    max_repeat_action 3 (policy default v4)". The same JSON the API's decision shows.
    ``warning``: whether the decision carried the rule's warning (an allow's directive) rather
    than stopped by it; None guesses from the rule's name (``_is_warning``)."""
    if not isinstance(rule, dict) or not rule.get("name"):
        return ""
    name = rule["name"]
    detail = _detail(rule, warning)
    kind = f"{name} warning" if _is_warning(rule, warning) else name
    text = f"{kind}: {detail}" if detail else kind
    where = ""
    # A switch is no rule of the policy, nor is a run being over already, an ancestor's end
    # (found by a newcomer: parent_stopped read "the limit of run <ancestor>") or a check
    # the agent gave up on.
    if (rule.get("policy")
            and name not in (rules.KILLED, rules.PARENT_STOPPED, rules.DEADLINE_EXPIRED)
            and not after_the_end(rule)):
        where = f" (policy {rule['policy']} v{rule.get('version')}"
        scope = rule.get("scope")
        where += ")" if scope in (None, "run") else f", the limit of run {scope})"
    return text + where


def rule_sentence(rule: Any, reason: str) -> str:
    """The stop banner's one sentence (SPEC 16): which rule of which policy stopped the run,
    with the value observed and the limit."""
    if not isinstance(rule, dict) or not rule.get("name"):
        return ""
    detail = _detail(rule)
    if after_the_end(rule):
        return detail[0].upper() + detail[1:] + "."
    if rule["name"] == rules.PARENT_STOPPED:
        # Not "the limit of ancestor run X, counted over its tree": no limit fired (found by
        # a newcomer).
        return f"Stopped because {detail}."
    if rule["name"] == "killed":
        # A switch, not a rule of the run's policy (found by a newcomer: "The rule killed of
        # policy default v2 stopped this run").
        return "A kill switch stopped this run" + (f": {detail}." if detail else ".")
    policy = f" of policy {rule['policy']} v{rule.get('version')}" if rule.get("policy") else ""
    scope = rule.get("scope")
    if scope not in (None, "run"):
        # A sub-agent stopped by its ancestor's limit (SPEC 20): the counter is the tree's,
        # not this run's own (found by a newcomer: "steps 19" on a run of 9 steps).
        policy += f" (the limit of ancestor run {scope}, counted over its tree)"
    return f"The rule {rule['name']}{policy} stopped this run" + (
        f": {detail}." if detail else ".")


def step_row(d: Decision, run_started: datetime | None = None) -> StepRow:
    args_json = json.dumps(d.args, ensure_ascii=False, sort_keys=True) if d.args else "{}"
    full = json.dumps(d.args, ensure_ascii=False, indent=2, sort_keys=True) if d.args else "{}"
    last = d.last_result or {}
    summary = last.get("summary") or last.get("error") or ""
    answer = d.answer or {}
    directive = answer.get("directive") or {}
    shadow = answer.get("shadow") or {}
    approval = answer.get("approval") or {}
    if not isinstance(approval, dict):
        approval = {}
    rule = d.rule if d.rule is not None else answer.get("rule")
    # A local decision shows when the client decided it, not when it was uploaded (found by a
    # newcomer: every action of an outage read as run at the upload's second, "+0 ms"
    # apart); its time since the previous check is not known from the rows, so it is left out.
    decided = _decided_at(d)
    return StepRow(
        id=d.pk,
        step=d.step,
        action=d.action_name,
        action_type=d.action_type,
        args_preview=_cut(args_json, ARGS_PREVIEW_CHARS),
        args_full=_cut(full, ARGS_FULL_CHARS),
        args_cut=len(args_json) > ARGS_PREVIEW_CHARS,
        outcome=d.outcome,
        reason=d.reason,
        result_status=last.get("status", ""),
        result_summary=_cut(summary, SUMMARY_CHARS),
        result_full=summary if len(summary) > SUMMARY_CHARS else "",
        cost=d.cost_usd,
        at=decided or d.at,
        message=answer.get("message") or "",
        directive=directive.get("content", "") if isinstance(directive, dict) else "",
        shadow_reason=shadow.get("reason", "") if isinstance(shadow, dict) else "",
        progress="" if d.progress is None else json.dumps(d.progress, ensure_ascii=False),
        duration_s=None if decided else _since(d.at, getattr(d, "prev_at", None) or run_started),
        kill=not d.action_name,
        approval_status=approval.get("status", ""),
        approval_by=approval.get("decided_by") or "",
        local=answer.get("local") is True,
        violation=violation_of(d) or "",
        retry_after_s=answer.get("retry_after_s"),
        # The row's rule is its warning's when the answer carried that warning: a stop of
        # no_progress or repeated_error has a rule of the same name, and is no warning.
        why=rule_in_words(rule, warning=isinstance(directive, dict) and isinstance(rule, dict)
                          and directive.get("code") == rule.get("name")),
        warning=(directive.get("code") or "") if isinstance(directive, dict) else "",
        uploaded_at=d.at if decided else None,
    )


def _since(at: datetime, before: datetime | None) -> float | None:
    return None if before is None else max(0.0, (at - before).total_seconds())


@dataclass(frozen=True)
class Counter:
    label: str
    value: str
    limit: str  # empty when the policy sets no limit
    percent: float  # 0..100, for the bar
    level: str  # ok | warn | over
    # The Time counter of a run whose time runs (running, not waiting for an approval): its
    # seconds and limit as numbers, from which the browser ticks it on (live.js), so the
    # page's stream need not look again only because a second passed.
    ticks_from: float | None = None
    ticks_limit: float | None = None


def _counter(label: str, value: float, limit: float | None,
             fmt: str | Callable[[float], str]) -> Counter:
    show = fmt.format if isinstance(fmt, str) else fmt
    if limit is None or limit <= 0:
        return Counter(label, show(value), "", 0.0, "ok")
    ratio = float(value) / float(limit)
    level = "over" if ratio >= 1 else "warn" if ratio >= 0.75 else "ok"
    return Counter(label, show(value), show(limit), round(min(ratio, 1.0) * 100, 1), level)


def _time_counter(run: Run, seconds: float, limit: float | None) -> Counter:
    counter = _counter("Time", seconds, limit, "{:.0f} s")
    if run.status != RunStatus.RUNNING or run.awaited_approval is not None:
        return counter  # its time stands still (SPEC 15: an approval's wait is not counted)
    return replace(counter, ticks_from=seconds,
                   ticks_limit=None if limit is None or limit <= 0 else float(limit))


def counters(run: Run, now: datetime | None = None) -> list[Counter]:
    doc = run.policy_version.document
    steps, budgets = doc["step_limits"], doc["budgets"]
    max_usd = budgets.get("max_usd")
    return [
        _counter("Steps", run.steps, steps["max_steps"], "{:g}"),
        # The one money format of every page: $0.0090 is not rounded up to "$0.01" here
        # while the timeline beside it says "$0.0090".
        _counter("Cost", run.cost_usd, None if max_usd is None else max_usd, money),
        _time_counter(run, elapsed_s(run, now or timezone.now()), budgets.get("max_seconds")),
        _counter("Tool calls", run.tool_calls, budgets.get("max_tool_calls"), "{:g}"),
    ]


@dataclass(frozen=True)
class Banner:
    status: str
    reason: str
    message: str
    next_action: str
    output: str
    ended_at: datetime | None
    rule: str = ""  # SPEC 16: the rule that stopped the run, in one sentence


def banner(run: Run) -> Banner | None:
    """The stop banner: why the run ended and its partial response. None while it runs."""
    if run.status == RunStatus.RUNNING:
        return None
    message = next_action = sentence = ""
    # A run its agent finished as stopped was ended by no decision: any stop on record is a
    # late check's, answered the run's end (found by a newcomer: a client's timed-out check
    # arriving after the finish put its refusal's words in the banner).
    if run.stop_reason and run.stop_reason != rules.AGENT_STOPPED:
        # The run's first stop ended it (`decision_run_stop`: one probe, however many checks
        # of the ended run were answered since), unless it repeats the run's end itself.
        stop = (Decision.objects.of_run(run.pk).filter(outcome=rules.STOP)
                .only("reason", "answer", "rule").first())
        fired = None if stop is None else (
            stop.rule if stop.rule is not None else stop.answer.get("rule"))
        if stop is not None and stop.reason == run.stop_reason and not after_the_end(fired):
            message = stop.answer.get("message") or ""
            next_action = stop.answer.get("next_action") or ""
            sentence = rule_sentence(fired, stop.reason)
            if run.status == RunStatus.KILLED and sentence:
                # A kill's message names the switch, who engaged it and why: the rule's
                # sentence says the same (found by a newcomer: the banner said it twice).
                message = ""
    return Banner(status=run.status, reason=run.stop_reason or "", message=message,
                  next_action=next_action, output=run.output, ended_at=run.ended_at,
                  rule=sentence)


# The would-stops counted for a run's shadow summary: past it the page says "N+" (every
# check of a shadow run past its limit is one, so the count would grow with the run, and the
# summary is rendered again at every update of the page's stream).
SHADOW_COUNT_CAP = 1000


@dataclass(frozen=True)
class ShadowSummary:
    step: int
    reason: str
    message: str
    count: int  # checks a shadow policy would have stopped, at most SHADOW_COUNT_CAP
    capped: bool = False  # more than SHADOW_COUNT_CAP


def shadow_summary(run: Run) -> ShadowSummary | None:
    """In shadow mode, where the run would have been stopped, had the policy enforced: reads
    of the run's would-stops in id order (the index `decision_run_would_stop`), bounded."""
    would = Decision.objects.of_run(run.pk).filter(outcome=rules.WOULD_STOP)
    first = would.only("step", "answer").first()
    if first is None:
        return None
    shadow = first.answer.get("shadow") or {}
    # Unordered: the count's rows are fetched until the cap, in whatever order the plan reads
    # them (ordered, a plan that sorts would fetch them all).
    count = would.order_by()[:SHADOW_COUNT_CAP + 1].count()
    return ShadowSummary(step=first.step, reason=shadow.get("reason", ""),
                         message=shadow.get("message", ""),
                         count=min(count, SHADOW_COUNT_CAP), capped=count > SHADOW_COUNT_CAP)


@dataclass(frozen=True)
class RunTree:
    """SPEC 20 on the run page: the parent, the children with their status, and the tree's
    usage against the root's limits (the root's counters: every check of a descendant
    counts on the root too)."""

    parent: Run | None
    root: Run | None  # None when the run is the root
    children: list[Run]
    usage: list[Counter]  # the root's counters, against the root's limits


def run_tree(run: Run, now: datetime | None = None) -> RunTree | None:
    """The run's tree, or None for a run with neither parent nor children."""
    children = dashboard.children_of(run)
    if run.parent_run_id is None and not children:
        return None
    family = dashboard.runs_by_id(run.team_id, [run.parent_run_id, run.root_run_id])
    parent = family.get(run.parent_run_id)
    root = family.get(run.root_run_id) if run.root_run_id else None
    return RunTree(parent=parent, root=root, children=children,
                   usage=counters(root or run, now))


def run_context(run: Run, now: datetime | None = None, *, tree: bool = True
                ) -> dict[str, Any]:
    """The context of every live partial of the run page except the timeline rows (without
    the run's tree, which costs queries, when ``tree`` is False)."""
    doc = run.policy_version.document
    return {
        "run": run,
        "tree": run_tree(run, now) if tree else None,
        "policy_doc": doc,
        "counters": counters(run, now),
        "banner": banner(run),
        "shadow": shadow_summary(run) if doc.get("mode") == "shadow" else None,
        "elapsed": elapsed_s(run, now),
    }


def overview_context(team: Team, now: datetime | None = None, *, range_key: str = ""
                     ) -> dict[str, Any]:
    """The context of the overview's live partials, over one of dashboard.CHART_RANGES."""
    from runs.dashboard.charts import activity_chart

    now = now or timezone.now()
    span = dashboard.chart_range(range_key)
    since = now - dashboard.RANGES[span.key]
    running, running_count = dashboard.running_runs(team, now=now)
    agents = dashboard.agent_breakdown(team, since=since)
    return {
        "team": team,
        "running": running,
        "running_count": running_count,
        "span": span,
        "ranges": list(dashboard.CHART_RANGES.values()),
        "chart": activity_chart(dashboard.hourly_activity(team, now=now, span=span)),
        "loops": dashboard.top_loops(team, since=since),
        "agents": agents,
        "would_stop": dashboard.would_stop_count(team, since=since),
        "warned": dashboard.warning_outcomes(team, since=since),
        "rate_limited": dashboard.rate_limited(team, since=now - timedelta(hours=24)),
        "switches": dashboard.switches_covering(team),
        "now": now,
    }


def runs_list_context(team: Team, filters: dashboard.RunFilters, now: datetime | None = None
                      ) -> dict[str, Any]:
    now = now or timezone.now()
    page = dashboard.runs_page(team, filters, now=now)
    return {
        "team": team,
        "filters": filters,
        "page": page,
        "runs": page.runs,
        "first_query": None if page.first else filters.query(after=""),
        "previous_query": (filters.query(before=page.previous_before)
                           if page.previous_before else None),
        "next_query": filters.query(after=page.next_after) if page.next_after else None,
    }


def killswitch_context(team: Team) -> dict[str, Any]:
    """The kill switch page's live parts: what is engaged and what may still be engaged."""
    engaged = engaged_for_team(team)
    return {
        "team": team,
        "engaged": engaged,
        # The whole team is already stopped: offering to stop it again would only confuse.
        "team_engaged": any(s.scope == Scope.TEAM for s in engaged),
        "engaged_agents": sorted(s.agent for s in engaged if s.scope == Scope.AGENT),
        "agents": dashboard.agents_of(team),
        "running": Run.objects.filter(team=team, status=RunStatus.RUNNING).count(),
        "agent_pattern": rules.AGENT_NAME_PATTERN,
    }


# --- Approvals (SPEC 11) ----------------------------------------------------------------------

@dataclass(frozen=True)
class ApprovalCard:
    id: str
    status: str
    action: str
    action_type: str
    args_preview: str
    args_full: str
    args_cut: bool
    run_id: str
    agent: str
    task: str
    step: int
    pattern: str
    requested_at: datetime
    expires_at: datetime
    seconds_left: int
    decided_at: datetime | None
    decided_by: str
    note: str
    final_message: str
    # The args were too large for a check body: the client sent their digest instead
    # (governance_client's `oversize_args`), in bytes; None when the args are all here.
    args_hidden_bytes: int | None = None


def _hidden_bytes(args: Any) -> int | None:
    """The size of args the client sent as a digest only (SPEC 5.2's 64 KiB check body):
    an approver then cannot see what the call would do, and the card says so (found by an
    attacker: padding a payment's args past 64 KiB made its request show only a digest)."""
    digest = args.get("oversize_args") if isinstance(args, dict) and len(args) == 1 else None
    size = digest.get("bytes") if isinstance(digest, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def approval_card(approval: Any, now: datetime | None = None) -> ApprovalCard:
    """One request as the approvals page and the run page show it (args as audited, so
    already redacted)."""
    now = now or timezone.now()
    args_json = json.dumps(approval.args or {}, ensure_ascii=False, sort_keys=True)
    full = json.dumps(approval.args or {}, ensure_ascii=False, indent=2, sort_keys=True)
    final = approval.decision or {}
    return ApprovalCard(
        id=str(approval.pk), status=approval.status, action=approval.action_name,
        action_type=approval.action_type, args_preview=_cut(args_json, ARGS_PREVIEW_CHARS),
        args_full=_cut(full, ARGS_FULL_CHARS), args_cut=len(args_json) > ARGS_PREVIEW_CHARS,
        run_id=str(approval.run_id), agent=approval.run.agent,
        task=_cut(approval.run.task or "", SUMMARY_CHARS), step=approval.step,
        pattern=approval.pattern, requested_at=approval.requested_at,
        expires_at=approval.expires_at,
        seconds_left=max(0, int((approval.expires_at - now).total_seconds())),
        decided_at=approval.decided_at, decided_by=approval.decided_by_label,
        note=approval.note, final_message=final.get("message") or "",
        args_hidden_bytes=_hidden_bytes(approval.args),
    )


# The approvals page lists this many pending requests, and as many decided ones.
APPROVALS_SHOWN = 50


def approvals_context(team: Team, now: datetime | None = None) -> dict[str, Any]:
    """The approvals page's live partials: pending first (soonest expiry first), then the
    latest decided (the caller looked first: `first_look.look` settles what is past its
    expiry, SPEC 11)."""
    now = now or timezone.now()
    # A request that cannot be shown is logged and left out; the page still answers.
    # What the look's bounded share left past its expiry shows expired, as the agent API
    # answers it, never pending (runs/due.py).
    shown = due.approvals_as_they_will_be(approvals_for_team(team, limit=APPROVALS_SHOWN),
                                          now=now)
    cards = one_by_one(shown, lambda a: approval_card(a, now), what="approval")
    pending = [c for c in cards if c.status == "pending"]
    return {"team": team, "pending": pending, "decided": [c for c in cards if c not in pending],
            "approvals_pending": len(pending), "now": now}


def run_approval_context(run: Run, now: datetime | None = None) -> dict[str, Any]:
    """The run page's pending banner: the request the run waits for, if any (the caller
    looked first: `first_look.look_at_run_page` settles what is due on it)."""
    pending = pending_for_run(run) if run.status == RunStatus.RUNNING else None
    return {"approval": approval_card(pending, now) if pending is not None else None}
