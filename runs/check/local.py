"""The upload of the decisions a fail-open client made on its own (SPEC 10): counted as the
rules count an allow or a stop, audited with ``"local": true``, under the run's lock like a
check.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone
from governance_client.keys import repeat_key

from governance_client import answers, rules
from policies.models import Team
from runs.approvals import services as approvals
from runs.check import lineage, records, run_memory, states
from runs.check.policy_cache import rules_for_version
from runs.check.records import DecisionRow
from runs.check.services import locked_run_of_key
from runs.check.states import state_of
from runs.killswitch import fanout
from runs.live.events import publish_run_event
from runs.models import Decision, Run

# Entries recorded per transaction: the run's lock (and its ancestors') is held for one
# chunk, not for a whole upload of up to 1,000 (found by an attacker: an upload held a run
# for 1 to 3 s, and the checks of the run waiting for it took the API pool's threads).
CHUNK = 100


def run_local_decisions(*, team: Team, run_id: Any, entries: list[dict[str, Any]],
                        key_agent: str = "") -> tuple[Run, int, int]:
    """Record the decisions a fail-open client made while the service was unreachable.

    The actions it allowed ran, so each one is counted exactly as an allow (a local stop ends
    the run with its reason), with `rules.record_outcome`, and audited with its outcome and
    `"local": true` in its answer. On a run already over (ended before the upload, or by a
    stop earlier in it) an entry is audited, marked ``"after_end": true``, and counts on
    nothing, the run's ancestors included (SPEC 4.4). Entries whose check_id the run already
    has are skipped (the upload was retried, or the service did decide that check): the
    counters then agree with what ran. CHUNK entries a transaction, each under the run's lock
    like a check, in the upload's order: an upload cut short by an error is sent again, and
    what was recorded is skipped then.
    """
    recorded, changed, run = 0, False, None
    for start in range(0, max(1, len(entries)), CHUNK):
        run, count, moved = _record(team=team, run_id=run_id, key_agent=key_agent,
                                    entries=entries[start:start + CHUNK])
        recorded += count
        changed = changed or moved
    assert run is not None  # one chunk at least
    if changed:
        publish_run_event(run)
    return run, recorded, len(entries) - recorded


def _record(*, team: Team, run_id: Any, entries: list[dict[str, Any]], key_agent: str
            ) -> tuple[Run, int, bool]:
    """One chunk of an upload, in one transaction: the run, the entries recorded, and
    whether the run changed (recorded, or an expiry settled first)."""
    recorded = 0
    with transaction.atomic():
        # A child's ancestors first, root first (the tree's lock order): they count it too.
        ancestors = lineage.lock_lineage(team_id=team.pk, run_id=run_id)
        run = locked_run_of_key(team=team, run_id=run_id, key_agent=key_agent)
        # A switch engaged before the upload kills the run first, as a check's would: the
        # entries then count on nothing and a local allow is flagged (SPEC 6, 10).
        killed = fanout.kill_locked_if_covered(run)
        policy = rules_for_version(run.policy_version_id)
        checks = [_local_check(entry) for entry in entries]
        # The entries of the keyed memory every uploaded decision reads, in one query.
        loaded = state = run_memory.load(state_of(run), run.pk, [
            entry for check in checks for entry in rules.keyed_reads(
                check, repeat_key(check.name, check.args, policy.ignore_args))])
        seen = set(Decision.objects.filter(
            run=run, check_id__in=[e["check_id"] for e in entries]
        ).values_list("check_id", flat=True))
        now = timezone.now()
        # What is due first (an expiry comes before the upload that finds it), so that a
        # local stop of a waiting run then cancels its request (SPEC 10).
        state = waited = approvals.settle_due_locked(run=run, state=state, now=now,
                                                     tree=ancestors)
        rows = []
        for entry, check in zip(entries, checks, strict=True):
            if entry["check_id"] in seen:
                continue
            seen.add(entry["check_id"])
            action, last, cost = entry["action"], entry.get("last_result"), check.cost_usd
            allowed = entry["decision"] == rules.ALLOW
            before, tree = state, ancestors
            verdict, state = rules.record_outcome(
                policy, state, check, allowed=allowed,
                reason=entry["reason"], message=entry.get("message"), now=now,
            )
            if state.steps > before.steps:  # counted on every ancestor too (SPEC 20)
                ancestors = lineage.counted_on(ancestors, verdict, check, now=now)
            at = entry.get("at") or now
            # The client's clock, kept within what the service can vouch for.
            at = min(max(at, run.started_at), now)
            directive = entry.get("directive") if allowed else None
            # The warning the client gave, as the rules find it when it decided: a budget's
            # is not sent again by the service (SPEC 16).
            warning = rules.remember_warning(policy, state, check, directive, at) \
                if directive is not None and state.steps > before.steps else None
            # Kept (the action ran), but an allow the policy forbids is flagged (SPEC 10),
            # its time limits judged at the moment the client says it decided.
            violation = rules.local_violation(policy, before, check, now=at,
                                              tree=tree) if allowed else None
            answer = answers.local_answer(verdict, state, policy, now,
                                          decided_at=at.isoformat(), violation=violation,
                                          after_end=before.status in rules.TERMINAL,
                                          directive=directive, warning=warning)
            rows.append((run.pk, DecisionRow(
                step=verdict.step, outcome=verdict.outcome, reason=verdict.reason,
                action_name=action["name"], action_type=action["type"],
                args=rules.redact(action.get("args") or {}, policy.redact_args),
                repeat_key=verdict.repeat_key, repeat_count=verdict.repeat_count,
                check_id=entry["check_id"], progress=entry.get("progress"), last_result=last,
                cost_usd=cost, answer=answer, at=now, elapsed_s=None,
            )))
            recorded += 1
        if rows:
            records.insert_many(rows)
            # A local stop of a waiting run ends its wait: its request is cancelled, the
            # final answer audited after the stop that ended it (SPEC 10).
            approvals.settle_on_end(run=run, before=waited, after=state, now=now)
            Run.objects.filter(pk=run.pk).update(**states.columns_of(state, LOCAL_FIELDS))
            lineage.write_counters(ancestors, ("steps", "tool_calls", "cost_usd"))
            run_memory.save(run.pk, loaded, state)
        # Recorded, or an expiry or a kill settled first.
        changed = bool(rows) or waited is not loaded or killed
        if changed:
            run.refresh_from_db()
    return run, recorded, changed


# What an upload of local decisions changes: what a check does but the idle deadline, which
# only a check and a start move (an upload is no activity of the run, SPEC 14).
LOCAL_FIELDS = tuple(name for name in states.UPDATE_FIELDS if name != "idle_deadline")


def _local_check(entry: dict[str, Any]) -> rules.Check:
    """An uploaded local decision's check, as the rules count it."""
    action = entry["action"]
    return rules.make_check(action["name"], action.get("args"), type=action["type"],
                            progress=entry.get("progress"),
                            last_result=entry.get("last_result") or None,
                            cost_usd=entry.get("cost_usd"))
