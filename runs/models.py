from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import F, Func, JSONField, Value
from django.db.models.functions import Cast, Concat

from governance_client import rules
from policies.models import PolicyVersion, Team


class RunStatus(models.TextChoices):
    """A run's status (SPEC 4), named by the pure rules. Not given to the field as choices:
    that would be a migration for a check the database would not make anyway (the rules are
    the only writers); runs/check/schemas.py's RunStatusName lists the same values."""

    RUNNING = rules.RUNNING
    STOPPED = rules.STOPPED
    KILLED = rules.KILLED
    COMPLETED = rules.COMPLETED
    FAILED = rules.FAILED


class Run(models.Model):
    """One execution of an agent. Its counters are columns (queryable, shown on screens);
    the rest of the per-run memory of SPEC 4.1 lives in ``memory`` (what stays the same size:
    the no-progress streak, the approval waited for) and in `RunMemory` rows (what grows
    with the run: one per repeat key, progress value, result signature and error text)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="runs")
    agent = models.CharField(max_length=100)
    policy_version = models.ForeignKey(PolicyVersion, on_delete=models.PROTECT, related_name="+")
    status = models.CharField(max_length=20, default=RunStatus.RUNNING)
    stop_reason = models.CharField(max_length=50, null=True, blank=True)
    steps = models.PositiveIntegerField(default=0)
    tool_calls = models.PositiveIntegerField(default=0)
    cost_usd = models.DecimalField(max_digits=18, decimal_places=6, default=0)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)  # when /finish was called
    task = models.TextField(blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    external_id = models.CharField(max_length=200, null=True, blank=True)
    output = models.TextField(blank=True)
    memory = models.JSONField(default=dict, blank=True)
    # SPEC 14: the last activity (start, check, wait) + the policy's max_idle_seconds; a
    # running run past it is abandoned. Null: never (no limit, or a run older than the field).
    idle_deadline = models.DateTimeField(null=True, blank=True)
    # SPEC 20: a child run's place in its tree. Plain ids, not foreign keys: a tree is read by
    # `root_run_id` (one index), retention deletes runs without following them, and a run's
    # ancestry never changes once it started. `ancestors` lists the ancestors' ids, the root
    # first (empty for a root), which is the order the check locks them in (runs/check/tree.py).
    parent_run_id = models.UUIDField(null=True, blank=True)
    root_run_id = models.UUIDField(null=True, blank=True)
    # Database defaults: the previous release, which does not know these columns, still
    # starts runs while this one migrates (docs/upgrades.md).
    depth = models.PositiveSmallIntegerField(default=0, db_default=0)
    ancestors = models.JSONField(default=list, blank=True, db_default=Value([], JSONField()))

    class Meta:
        ordering = ["-started_at"]
        indexes = [
            # The abandoned-run sweep reads only the running runs that are overdue.
            models.Index(fields=["idle_deadline"], name="run_idle_deadline",
                         condition=models.Q(status="running", idle_deadline__isnull=False)),
            models.Index(fields=["team", "-started_at"], name="run_team_recent"),
            models.Index(fields=["team", "status"], name="run_team_status"),
            models.Index(fields=["team", "agent", "status"], name="run_team_agent_status"),
            # An agent's runs, newest first (the runs API for an agent or an agent-bound key,
            # the dashboard's agent filter): a range of the index in the answer's order.
            models.Index(fields=["team", "agent", "-started_at"], name="run_team_agent_recent"),
            # Retention's batch read: a team's runs that ended before the cutoff, oldest
            # first (runs/audit/retention.py). Without it every batch read the team's whole
            # runs table and sorted it. Running runs (no ended_at) stay out of it, so the
            # check's update of a running run never writes to it.
            models.Index(fields=["team", "ended_at", "id"], name="run_team_ended",
                         condition=models.Q(ended_at__isnull=False)),
            # SPEC 20: a run's children in the order they started (the first ones a run's
            # answer and page list are one range of it, not a sort of every child: a tree is
            # bounded in depth, not in width), and every run of a tree (its descendants are
            # among them); only child runs are in these indexes.
            models.Index(fields=["parent_run_id", "started_at", "id"], name="run_children",
                         condition=models.Q(parent_run_id__isnull=False)),
            models.Index(fields=["root_run_id"], name="run_root",
                         condition=models.Q(root_run_id__isnull=False)),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["team", "external_id"],
                condition=models.Q(external_id__isnull=False),
                name="external_id_per_team",
            )
        ]

    @property
    def awaited_approval(self) -> dict[str, Any] | None:
        """The approval request the run waits for (SPEC 11), as its memory names it (rules.Pending's
        fields: approval_id, check_id, since, expires_at...), read from the row, no query. None
        when it waits for none, or when the memory holds there what no version of the check
        writes. Every reader of "does this run wait" asks here."""
        memory = self.memory
        pending = memory.get("pending") if isinstance(memory, dict) else None
        return pending if isinstance(pending, dict) and pending else None


class RunMemory(models.Model):
    """One entry of a run's keyed memory (SPEC 4.1; governance_client.rules `keyed`): the
    allowed count of a repeat key, the count of an error text, or a progress value or result
    signature seen (count 1). A check reads and writes only its own entries, by `digest`, so
    its cost does not grow with the run's length (docs/performance.md, "Cost as one run
    grows"). Written under the run's lock, like the run's row."""

    pk = models.CompositePrimaryKey("run_id", "digest")
    # The primary key's index leads with run_id: no index of its own.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+", db_index=False)
    # SHA-256 of kind and text (runs/check/run_memory.py): the lookup key, of one size
    # whatever the text (an error text of 2,000 characters would not fit a B-tree entry).
    digest = models.CharField(max_length=64)
    kind = models.CharField(max_length=10)  # rules.KEYED_KINDS
    text = models.TextField()
    count = models.PositiveIntegerField()


# A run's decisions in order, as the indexes `decision_run*` hold them: by `id + 0`, an
# expression the primary key does not index. Ordered by `id`, a run's page could be read by
# walking the primary key and filtering for the run, which PostgreSQL prices lower than the
# run's own index for a long run (its rows look frequent) and which reads every other run's
# decisions before (or after) the run's: the history, not the page (docs/performance.md,
# "Reads of one run"). The 0 is written in the SQL, not passed as a parameter: SQLite matches
# an index's expression only to the same SQL text.
def _plus_zero(value: Any) -> Func:
    return Func(value, template="(%(expressions)s + 0)", output_field=models.BigIntegerField())


IN_RUN_ORDER = _plus_zero(F("id"))

# What the timeline's "stops and warnings only" keeps (runs/dashboard/selectors.py): stops,
# shadow would-stops, waits and pendings, nudges (a directive), and uploaded allows that
# broke the policy. Here because an index holds it (`decision_run_flagged`).
FLAGGED = (~models.Q(outcome="allow") | models.Q(answer__directive__type__isnull=False)
           | models.Q(answer__policy_violation=True))


class DecisionQuerySet(models.QuerySet):
    def of_run(self, run_id: Any, *, after: Any = None, before: Any = None,
               newest_first: bool = False) -> DecisionQuerySet:
        """The run's decisions in id order (``newest_first``: reversed), those with an id
        after ``after`` and before ``before`` when given: a range of `decision_run` (or of a
        partial one, for a filter on stops or would-stops), whatever the run's length.
        ``run_id`` and the bounds may be OuterRefs."""
        rows = self.filter(run_id=run_id).alias(in_run=IN_RUN_ORDER)
        # A bound from another row `+ 0` as well: SQLite takes the index's range for the
        # expression compared with an expression, not with a column (whose affinity applies).
        if after is not None:
            rows = rows.filter(in_run__gt=after if isinstance(after, int) else _plus_zero(after))
        if before is not None:
            rows = rows.filter(
                in_run__lt=before if isinstance(before, int) else _plus_zero(before))
        return rows.order_by(IN_RUN_ORDER.desc() if newest_first else IN_RUN_ORDER.asc())


class Decision(models.Model):
    """The audit log of the check: one row for every decision, allow and stop. Append-only."""

    id = models.BigAutoField(primary_key=True)
    # Indexed by `decision_run` (run, id + 0) below, which also serves the foreign key.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="decisions",
                            db_index=False)
    step = models.PositiveIntegerField()
    outcome = models.CharField(max_length=20)  # allow | stop | would_stop
    reason = models.CharField(max_length=50)
    action_name = models.CharField(max_length=200, blank=True)  # empty for a kill by fan-out
    action_type = models.CharField(max_length=10, blank=True)
    args = models.JSONField(null=True, blank=True)  # redacted per policy
    repeat_key = models.CharField(max_length=250, blank=True)
    repeat_count = models.PositiveIntegerField(default=0)
    check_id = models.CharField(max_length=100, null=True, blank=True)
    progress = models.JSONField(null=True, blank=True)
    last_result = models.JSONField(null=True, blank=True)
    cost_usd = models.DecimalField(max_digits=18, decimal_places=6, default=0)
    # Seconds since the run's start as the rules counted them for this decision (max_seconds
    # compares it), so a backtest replays the run's clock exactly (docs/backtest.md). Null on
    # decisions recorded before it existed (migration 0003).
    elapsed_s = models.FloatField(null=True, blank=True)
    # The answer as given (message, next_action, directive, shadow, usage, limits), so a
    # check_id replay returns exactly the first answer and screens show what the agent saw.
    answer = models.JSONField(default=dict)
    at = models.DateTimeField()
    # SPEC 16: the rule that decided (name, policy, version, limit, observed, scope), as the
    # answer carries it; null for a plain allow and on decisions recorded before it existed.
    rule = models.JSONField(null=True, blank=True)

    objects = DecisionQuerySet.as_manager()

    class Meta:
        ordering = ["id"]
        indexes = [
            # A run's decisions in order (IN_RUN_ORDER, `objects.of_run`): every read of one
            # run's decisions (its timeline, the decisions API, its latest id) is a range of
            # this index, bounded by the page, whatever the run's length; and the foreign
            # key's index (deletes by run).
            models.Index(F("run"), IN_RUN_ORDER, name="decision_run"),
            # A run's stops and shadow would-stops, for the reads of its first one (the
            # run's end, since a stop ends a run: its banner, and a killed run's words at
            # every later check; where a shadow policy would have stopped it): one probe
            # each, however many checks of the ended run followed. Partial: an allowed check
            # writes neither.
            models.Index(F("run"), IN_RUN_ORDER, name="decision_run_stop",
                         condition=models.Q(outcome="stop")),
            models.Index(F("run"), IN_RUN_ORDER, name="decision_run_would_stop",
                         condition=models.Q(outcome="would_stop")),
            # The timeline's "stops and warnings only" (`flagged`): a page of them is a range
            # of this index, not a walk through a long run's allows to find a few. Partial
            # on the filter's own expression, which the planner matches to the read's.
            models.Index(F("run"), IN_RUN_ORDER, name="decision_run_flagged",
                         condition=FLAGGED),
        ]
        constraints = [
            # One answer per check_id in a run (SPEC 4.5), on one expression rather than the
            # two columns: the check's lock statement finds an earlier answer by this
            # expression (runs/check/check_store.py LOCK_SQL), which no other index can
            # serve. On (run, check_id), the plan made while the table was nearly empty read
            # the run's every decision through the run's index instead, a check's cost
            # growing with its run (docs/performance.md "Two more ties").
            # A run id's text has a fixed length, so the expression is one-to-one.
            models.UniqueConstraint(
                Concat(Cast("run", models.TextField()), "check_id"),
                condition=models.Q(check_id__isnull=False),
                name="check_id_per_run",
            )
        ]


class RateRule(models.Model):
    """A rate-limit rule (SPEC 12) some check has met in its policy: every counted action of
    the team whose name matches it is counted for it from then on, whatever the action's
    policy (runs/check/rate_limits.py). Forgotten by the sweep once no check has read it for
    longer than the longest window."""

    key = models.UUIDField(primary_key=True)  # rate_limits.rule_key(team, per, max, match)
    team_id = models.BigIntegerField()
    per = models.CharField(max_length=10)  # run | agent | team
    match = models.CharField(max_length=200)
    regex = models.TextField()  # rate_limits.glob_regex(match), for the check's write
    max = models.IntegerField()  # the size of each scope's ring of stamps
    read_at = models.DateTimeField()  # when a check last read it (to the hour)

    class Meta:
        indexes = [
            # A team's most recently read rules first: the ones an action is counted for
            # (rate_limits.COUNTED_RULES), one range of it.
            models.Index(fields=["team_id", "-read_at", "key"], name="raterule_team_read"),
            models.Index(fields=["read_at"], name="raterule_read"),
        ]


class RateCount(models.Model):
    """How many actions a rule has counted in one scope (a run, an agent name or the team),
    and when the last one was. The n-th counted action's stamp is RateSlot (n - 1) % max."""

    pk = models.CompositePrimaryKey("rule_key", "scope")
    rule_key = models.UUIDField()
    scope = models.TextField()  # the run's id, the agent's name, or "" for the team
    n = models.BigIntegerField()
    last_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["last_at"], name="ratecount_last")]


class RateSlot(models.Model):
    """One stamp of a rule's ring in one scope: the last `max` counted actions' stamps, each
    overwriting the one `max` actions older. Stamped by the database's clock on PostgreSQL."""

    pk = models.CompositePrimaryKey("rule_key", "scope", "slot")
    rule_key = models.UUIDField()
    scope = models.TextField()
    slot = models.IntegerField()
    at = models.DateTimeField()


class Scope(models.TextChoices):
    GLOBAL = "global"
    TEAM = "team"
    AGENT = "agent"
    RUN = "run"


class KillSwitch(models.Model):
    scope = models.CharField(max_length=10, choices=Scope.choices)
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE)
    agent = models.CharField(max_length=100, blank=True)
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.CASCADE)
    # One string per covered target, so "at most one engaged switch per target" is a plain
    # partial unique index (NULLs in team/run would make a composite one useless).
    target = models.CharField(max_length=200)
    reason = models.TextField()
    engaged_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    engaged_by_label = models.CharField(max_length=150)
    engaged_at = models.DateTimeField()
    active = models.BooleanField(default=True)
    released_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    released_by_label = models.CharField(max_length=150, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    release_reason = models.TextField(blank=True)
    fanout_done_at = models.DateTimeField(null=True, blank=True)
    # The turns its fan-out has had (a batch of runs each) and when the last began: its
    # team's place in the fan-outs' turns (runs/killswitch/fanout.py `next_fanout`). A
    # default in the database too, so that the previous release's engages insert rows during
    # an upgrade (docs/upgrades.md).
    fanout_passes = models.PositiveIntegerField(default=0, db_default=0)
    fanout_turned_at = models.DateTimeField(null=True, blank=True)
    # Not stored: True on the switch `killswitch_engage` has just engaged, False on one it
    # found engaged already, which its caller reports as "already engaged". Comparing
    # `engaged_at` with the call's start told two racing engages apart wrongly: both said
    # they had engaged it (found by a tester with five tokens at once).
    engaged_now = False

    class Meta:
        ordering = ["-engaged_at"]
        indexes = [
            # The engaged switches of one team (cover.engaged_over_team): its screens and
            # its approvals' looks read them without the history of released switches.
            models.Index(fields=["team"], name="killswitch_team_engaged",
                         condition=models.Q(active=True)),
            # The history pages, newest first: a team's switches, and the global ones (the
            # team page lists both, the global page the global ones), each a range of its
            # index however long the history.
            models.Index(fields=["team", "-engaged_at", "-id"], name="killswitch_team_history"),
            models.Index(fields=["-engaged_at", "-id"], name="killswitch_global_history",
                         condition=models.Q(scope="global")),
            # The fan-outs' turns (fanout.next_fanout): the fan-outs still waiting (also the
            # sweep's, sweep.stale_work), and the last minute's turns of every team.
            models.Index(fields=["engaged_at"], name="killswitch_fanout_waiting",
                         condition=models.Q(fanout_done_at__isnull=True)),
            models.Index(fields=["fanout_turned_at"], name="killswitch_turned_at",
                         condition=models.Q(fanout_turned_at__isnull=False)),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["target"], condition=models.Q(active=True), name="one_engaged_per_target"
            )
        ]


class ApprovalStatus(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


class Approval(models.Model):
    """An action waiting for an operator's decision (SPEC 11), and that decision.

    Every change of ``status`` happens under the run's row lock (the check's lock), as one
    conditional UPDATE from ``pending``: that UPDATE is what lets exactly one decision win.
    The audit records are the decisions' (``requested_decision_id``: the pending answer;
    ``final_decision_id``: the final answer at the same step); ``decision`` repeats the final
    answer as the agent receives it.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="approvals")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="approvals")
    check_id = models.CharField(max_length=100)
    step = models.PositiveIntegerField()
    status = models.CharField(max_length=20, choices=ApprovalStatus.choices,
                              default=ApprovalStatus.PENDING)
    action_name = models.CharField(max_length=200)
    action_type = models.CharField(max_length=10)
    args = models.JSONField(null=True, blank=True)  # redacted per policy, as audited
    pattern = models.CharField(max_length=200, blank=True)
    requested_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    requested_decision_id = models.BigIntegerField(null=True, blank=True)
    final_decision_id = models.BigIntegerField(null=True, blank=True)
    decision = models.JSONField(null=True, blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_by_label = models.CharField(max_length=150, blank=True)
    note = models.TextField(blank=True)

    class Meta:
        ordering = ["-requested_at"]
        indexes = [
            models.Index(fields=["team", "status", "-requested_at"], name="approval_team_status"),
            models.Index(fields=["status", "expires_at"], name="approval_status_expiry"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["run", "check_id"], name="approval_per_check_id"),
            models.UniqueConstraint(fields=["run"], condition=models.Q(status="pending"),
                                    name="one_pending_approval_per_run"),
        ]


class WebhookDelivery(models.Model):
    """A notification to a team's webhook and its delivery state: a kill switch engaged
    (``switch``), or an approval requested or decided (``approval``, ``event``)."""

    switch = models.ForeignKey(KillSwitch, null=True, blank=True, on_delete=models.CASCADE,
                               related_name="deliveries")
    approval = models.ForeignKey(Approval, null=True, blank=True, on_delete=models.CASCADE,
                                 related_name="deliveries")
    event = models.CharField(max_length=50, default="killswitch.engaged")
    team = models.ForeignKey(Team, on_delete=models.CASCADE)
    url = models.URLField(max_length=500)
    payload = models.JSONField()
    status = models.CharField(max_length=20, default="pending")  # pending|delivered|failed
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["switch", "team"], name="one_delivery_per_team"),
            models.UniqueConstraint(fields=["approval", "event"],
                                    condition=models.Q(approval__isnull=False),
                                    name="one_delivery_per_approval_event"),
        ]


class WebhookAttempt(models.Model):
    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="tries")
    number = models.PositiveIntegerField()
    at = models.DateTimeField()
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    duration_ms = models.PositiveIntegerField(default=0)
    # Which signing secret signed this attempt (policies.services.webhook_secret_id), so a
    # receiver whose check fails after a rotation can see which secret was used.
    secret_id = models.CharField(max_length=20, blank=True)

    class Meta:
        ordering = ["number"]
