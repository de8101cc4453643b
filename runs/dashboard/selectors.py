"""Reads for the operator dashboard (SPEC section 7): runs lists, overview figures, timelines.

Every function takes the team first and filters by it, so a view cannot show another team's
rows by passing the wrong id.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode

from django.db.models import Avg, Count, Exists, Max, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import TruncDay, TruncHour, TruncMinute
from django.utils import timezone
from governance_client.rules import WOULD_STOP

from policies.models import Policy, Team
from runs import due
from runs.killswitch import cover
from runs.models import FLAGGED, IN_RUN_ORDER, Decision, KillSwitch, Run, RunStatus

RUN_STATUSES = tuple(RunStatus.values)
TERMINAL_STOPS = (RunStatus.STOPPED, RunStatus.KILLED)
RUNS_PER_PAGE = 25
# Counting every run of a big team costs as much as listing them all; past this the list
# says "10,000+".
COUNT_CAP = 10_000

# Time ranges offered by the runs list and the overview: name -> length.
RANGES: dict[str, timedelta] = {
    "1h": timedelta(hours=1),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
    "30d": timedelta(days=30),
}
# Sort orders: name -> (column, descending). The run id breaks ties, so a page boundary is
# exact (keyset paging: the next page starts after the last row's (value, id), the previous
# one ends before the first row's).
SORTS: dict[str, tuple[str, bool]] = {
    "newest": ("started_at", True),
    "oldest": ("started_at", False),
    "steps": ("steps", True),
    "cost": ("cost_usd", True),
}
HEX = re.compile(r"[0-9a-f]{4,32}")


@dataclass(frozen=True)
class RunFilters:
    status: str = ""
    agent: str = ""
    stop_reason: str = ""
    q: str = ""  # run id (or its first characters), task text or external id
    since: str = ""  # a key of RANGES, or "" for all time
    sort: str = "newest"
    would_stop: bool = False  # only runs a shadow policy would have stopped
    after: str = ""  # keyset cursor: the page starts after this row (the previous last)
    before: str = ""  # or: the page ends before this row (the next page's first); wins

    @classmethod
    def from_query(cls, query: Any) -> RunFilters:
        status = query.get("status", "")
        since = query.get("since", "")
        sort = query.get("sort", "")
        return cls(
            status=status if status in RUN_STATUSES else "",
            agent=(query.get("agent") or "")[:100],
            stop_reason=(query.get("stop_reason") or "")[:50],
            q=(query.get("q") or "").strip()[:200],
            since=since if since in RANGES else "",
            sort=sort if sort in SORTS else "newest",
            would_stop=query.get("would_stop") in ("1", "on", "true"),
            after=(query.get("after") or "")[:200],
            before=(query.get("before") or "")[:200],
        )

    def query(self, *, after: str | None = None, before: str | None = None) -> str:
        """The query string of these filters (for links and the stream URL); naming a cursor
        drops the other one, and ``after=""`` (with no before) is the first page."""
        if after is not None or before is not None:
            after, before = after or "", before or ""
        else:
            after, before = self.after, self.before
        pairs = [("status", self.status), ("agent", self.agent),
                 ("stop_reason", self.stop_reason), ("q", self.q), ("since", self.since),
                 ("sort", "" if self.sort == "newest" else self.sort),
                 ("would_stop", "1" if self.would_stop else ""),
                 ("after", after), ("before", before)]
        return urlencode([(k, v) for k, v in pairs if v])

    @property
    def paged(self) -> bool:
        """A page other than the first one was asked for."""
        return bool(self.after or self.before)


@dataclass(frozen=True)
class RunsPage:
    runs: list[Run]
    next_after: str | None  # the cursor of the next page, None on the last one
    previous_before: str | None  # the cursor of the previous page, None on the first one
    first: bool  # the first page (no cursor, an unreadable one, or paged back to the start)
    count: int  # matching runs, at most COUNT_CAP + 1
    capped: bool


def would_stop_q() -> Exists:
    return Exists(Decision.objects.filter(run=OuterRef("pk"), outcome=WOULD_STOP))


def _matching(team: Team, filters: RunFilters, now: datetime) -> QuerySet[Run]:
    runs = Run.objects.filter(team=team)
    if filters.status:
        runs = runs.filter(status=filters.status)
        if filters.status == RunStatus.RUNNING:
            runs = runs.filter(due.still_running(now))  # over, however unsaid
    if filters.agent:
        runs = runs.filter(agent=filters.agent)
    if filters.stop_reason:
        runs = runs.filter(stop_reason=filters.stop_reason)
    if filters.since:
        runs = runs.filter(started_at__gte=now - RANGES[filters.since])
    if filters.q:
        runs = runs.filter(_search_q(filters.q))
    if filters.would_stop:
        runs = runs.filter(would_stop_q())
    return runs


def _search_q(text: str) -> Q:
    try:
        return Q(pk=uuid.UUID(text))
    except ValueError:
        pass
    found = Q(task__icontains=text) | Q(external_id=text)
    bare = text.lower().replace("-", "")
    if HEX.fullmatch(bare):
        found |= Q(pk__startswith=bare)  # the 8 characters the list shows
    return found


def _cursor(run: Run, column: str) -> str:
    value = getattr(run, column)
    raw = value.isoformat() if isinstance(value, datetime) else str(value)
    return f"{raw}~{run.pk}"


# A cursor comes from the address bar: a value its column cannot hold (NaN, 1e999999999, a
# date whose offset puts it past year 9999) was a 500 from the database, not a first page.
_MAX_COST = Decimal(10) ** 12  # runs_run.cost_usd: 18 digits, 6 after the point
_COST_STEP = Decimal("0.000001")
_MAX_STEPS = 2**31 - 1


def _cursor_value(column: str, raw: str) -> Any:
    """The sort column's value of a cursor, or None when the column cannot hold it."""
    if column == "started_at":
        at = datetime.fromisoformat(raw)
        if at.tzinfo is None:
            return None
        return at.astimezone(UTC)  # OverflowError past year 9999 or before year 1
    if column == "steps":
        steps = int(raw)
        return steps if 0 <= steps <= _MAX_STEPS else None
    cost = Decimal(raw)
    if not cost.is_finite() or abs(cost) >= _MAX_COST:
        return None
    return cost.quantize(_COST_STEP)  # the column's 6 places (1e-999999999 overflowed too)


def _after(column: str, descending: bool, cursor: str) -> Q | None:
    """Rows strictly after the cursor's (value, id) in the sort order; None if unreadable.
    (Rows strictly before it are the rows after it in the opposite order.)"""
    raw, _, pk = cursor.rpartition("~")
    try:
        run_id = uuid.UUID(pk)
        value = _cursor_value(column, raw)
    except (ValueError, ArithmeticError, OverflowError):
        return None
    if value is None:
        return None
    op = "lt" if descending else "gt"
    # "value <= v AND (value < v OR id < pk)": the first half is a plain range on the
    # (team, value) index, which the planner walks in order; the OR alone would make it
    # merge two index lookups and sort the whole team's rows.
    return Q(**{f"{column}__{op}e": value}) & (
        Q(**{f"{column}__{op}": value}) | Q(**{f"pk__{op}": run_id}))


def page_rows(team: Team, filters: RunFilters, *, now: datetime | None = None,
              backwards: bool = False) -> QuerySet[Run]:
    """The rows of one page and the ones after it, in order (slice it: RUNS_PER_PAGE + 1).
    ``backwards``: the rows before ``filters.before``, nearest first (the page in reverse
    and the ones before it), the same index range walked the other way."""
    rows = _matching(team, filters, now or timezone.now())
    column, descending = SORTS[filters.sort]
    if backwards:
        descending = not descending
    cursor = filters.before if backwards else filters.after
    if cursor and (after := _after(column, descending, cursor)) is not None:
        rows = rows.filter(after)
    order = [f"-{column}", "-pk"] if descending else [column, "pk"]
    # prefetch, not a join: the page query stays on runs_run alone, whose index gives the order.
    # Not the output nor the metadata, which the list does not show: a run's output may be
    # 100,000 characters, 400 KB of emoji (the agents' list is bounded for the same reason,
    # runs/audit/selectors.py `runs_page`).
    return (rows.defer("output", "metadata").prefetch_related("policy_version__policy").annotate(
        shadow_step=Subquery(_first_would_stop().values("step")[:1]),
        shadow_reason=Subquery(_first_would_stop().values("answer__shadow__reason")[:1]),
    ).order_by(*order))


def runs_page(team: Team, filters: RunFilters, *, now: datetime | None = None) -> RunsPage:
    """One page of runs, by keyset: the query reads the next RUNS_PER_PAGE + 1 rows of an
    index range, whatever the page, so the 4,000th page costs what the first does; the
    count stops at COUNT_CAP. Paging back (``before``) reads the range the other way; when
    it reaches the start it is the first page, shown whole. The rows are shown as they will
    be once what is due on them is settled (runs/first_look.py: the caller looks first)."""
    now = now or timezone.now()
    column, descending = SORTS[filters.sort]
    runs: list[Run] = []
    if filters.before and _after(column, descending, filters.before) is not None:
        found = list(page_rows(team, filters, now=now, backwards=True)[:RUNS_PER_PAGE + 1])
        if len(found) > RUNS_PER_PAGE:  # rows before this page: a page in the middle
            runs = found[:RUNS_PER_PAGE][::-1]
            # Reached from the next page, whose rows follow this one's.
            first, more_after = False, True
        else:  # nothing before it: the first page, shown whole rather than short
            filters = replace(filters, before="", after="")
    if not runs:
        found = list(page_rows(team, filters, now=now)[:RUNS_PER_PAGE + 1])
        runs, more_after = found[:RUNS_PER_PAGE], len(found) > RUNS_PER_PAGE
        first = not filters.after or _after(column, descending, filters.after) is None
    count = _matching(team, filters, now).order_by()[:COUNT_CAP + 1].count()
    return RunsPage(runs=due.as_it_will_be(runs, now=now), first=first,
                    next_after=_cursor(runs[-1], column) if runs and more_after else None,
                    # A later page was reached from an earlier one: rows come before it.
                    previous_before=_cursor(runs[0], column) if runs and not first else None,
                    count=min(count, COUNT_CAP), capped=count > COUNT_CAP)


def _first_would_stop() -> QuerySet[Decision]:
    return Decision.objects.of_run(OuterRef("pk")).filter(outcome=WOULD_STOP)


def run_filter_choices(team: Team) -> dict[str, Any]:
    # order_by() on the column itself: Run.Meta.ordering would otherwise add started_at to
    # the SELECT DISTINCT and yield one option per run instead of one per value.
    runs = Run.objects.filter(team=team)
    return {
        "statuses": list(RUN_STATUSES),
        "agents": list(runs.order_by("agent").values_list("agent", flat=True).distinct()),
        "stop_reasons": list(
            runs.exclude(stop_reason__isnull=True).order_by("stop_reason")
            .values_list("stop_reason", flat=True).distinct()
        ),
        "ranges": [("", "any time"), ("1h", "last hour"), ("24h", "last 24 hours"),
                   ("7d", "last 7 days"), ("30d", "last 30 days")],
        "sorts": [("newest", "newest first"), ("oldest", "oldest first"),
                  ("steps", "most steps"), ("cost", "most cost")],
    }


def agents_of(team: Team, *, limit: int = 200) -> list[str]:
    """The agent names this team has run, for pickers and the unknown-name warning."""
    return list(Run.objects.filter(team=team).order_by("agent")
                .values_list("agent", flat=True).distinct()[:limit])


def agent_seen(team: Team, agent: str) -> bool:
    return Run.objects.filter(team=team, agent=agent).exists()


def running_runs(team: Team, *, limit: int = 10, now: datetime | None = None
                 ) -> tuple[list[Run], int]:
    """The newest running runs and how many run. "Running now" never counts a run past its
    idle deadline (SPEC 14) or waiting for a request past its expiry (SPEC 11), ended or not
    yet (runs/first_look.py: the caller looks first)."""
    now = now or timezone.now()
    running = Run.objects.filter(due.still_running(now), team=team,
                                 status=RunStatus.RUNNING).select_related(
        "policy_version__policy"
    ).defer("task", "output", "metadata")  # not shown: up to 400 KB a run
    return list(running.order_by("-started_at")[:limit]), running.count()


@dataclass(frozen=True)
class ChartRange:
    key: str
    label: str  # "Last 24 hours"
    bucket: timedelta  # one bar
    trunc: type[TruncMinute] | type[TruncHour] | type[TruncDay]  # what SQL groups by
    tick: str  # strftime of an x-axis label
    tick_every: int  # a label every so many bars


CHART_RANGES: dict[str, ChartRange] = {
    "1h": ChartRange("1h", "Last hour", timedelta(minutes=5), TruncMinute, "%H:%M", 2),
    "24h": ChartRange("24h", "Last 24 hours", timedelta(hours=1), TruncHour, "%H:00", 3),
    "7d": ChartRange("7d", "Last 7 days", timedelta(hours=6), TruncHour, "%a %H:00", 4),
    "30d": ChartRange("30d", "Last 30 days", timedelta(days=1), TruncDay, "%b %d", 5),
}
DEFAULT_RANGE = "24h"


def chart_range(key: str | None) -> ChartRange:
    return CHART_RANGES.get(key or "", CHART_RANGES[DEFAULT_RANGE])


@dataclass(frozen=True)
class HourlyActivity:
    """Runs started and stopped per bucket (an hour for the default range)."""

    hours: list[datetime]  # the start of each bucket, oldest first
    started: list[int]
    stops: dict[str, list[int]]  # stop reason -> count per bucket
    tick: str = "%H:00"
    tick_every: int = 3


def _bucket_start(moment: datetime, bucket: timedelta) -> datetime:
    day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    return day + bucket * ((moment - day) // bucket)


def hourly_activity(team: Team, *, now: datetime | None = None, hours: int = 24,
                    span: ChartRange | None = None) -> HourlyActivity:
    """Runs started and runs stopped (by reason) per bucket over the range. SQL groups by the
    truncated time (at most a few hundred rows); Python folds those into the range's bars."""
    now = now or timezone.now()
    span = span or CHART_RANGES[DEFAULT_RANGE]
    count = round(RANGES[span.key] / span.bucket)
    last = _bucket_start(now, span.bucket)
    buckets = [last - span.bucket * (count - 1 - i) for i in range(count)]
    index = {b: i for i, b in enumerate(buckets)}
    since = buckets[0]
    started = [0] * count
    for row in (Run.objects.filter(team=team, started_at__gte=since)
                .annotate(h=span.trunc("started_at")).values("h").annotate(n=Count("pk"))):
        if (i := index.get(_bucket_start(row["h"], span.bucket))) is not None:
            started[i] += row["n"]
    stops: dict[str, list[int]] = {}
    for row in (Run.objects.filter(team=team, ended_at__gte=since, status__in=TERMINAL_STOPS)
                .exclude(stop_reason__isnull=True)
                .annotate(h=span.trunc("ended_at")).values("h", "stop_reason")
                .annotate(n=Count("pk"))):
        if (i := index.get(_bucket_start(row["h"], span.bucket))) is not None:
            stops.setdefault(row["stop_reason"], [0] * count)[i] += row["n"]
    return HourlyActivity(hours=buckets, started=started, stops=dict(sorted(stops.items())),
                          tick=span.tick, tick_every=span.tick_every)


@dataclass(frozen=True)
class LoopVariant:
    repeat_key: str
    args: Any  # the (redacted) args of its latest stop
    stops: int
    runs: int
    last: datetime


@dataclass(frozen=True)
class LoopingTool:
    tool: str
    stops: int
    runs: int
    last: datetime
    variants: list[LoopVariant]


def top_loops(team: Team, *, since: datetime, limit: int = 5, variants: int = 5
              ) -> list[LoopingTool]:
    """The tools most often stopped as loops, each with the argument variants (repeat keys)
    it looped on folded under it."""
    stops = Decision.objects.filter(run__team=team, reason="loop_detected", at__gte=since,
                                    outcome__in=("stop", WOULD_STOP)).exclude(repeat_key="")
    tools = list(stops.values("action_name")
                 .annotate(stops=Count("pk"), runs=Count("run", distinct=True), last=Max("at"))
                 .order_by("-stops", "-last")[:limit])
    rows = list(stops.filter(action_name__in=[t["action_name"] for t in tools])
                .values("action_name", "repeat_key")
                .annotate(stops=Count("pk"), runs=Count("run", distinct=True), last=Max("at"),
                          latest=Max("id"))
                .order_by("-stops", "-last"))
    args = dict(Decision.objects.filter(pk__in=[r["latest"] for r in rows])
                .values_list("pk", "args"))
    return [
        LoopingTool(tool=t["action_name"], stops=t["stops"], runs=t["runs"], last=t["last"],
                    variants=[LoopVariant(r["repeat_key"], args.get(r["latest"]), r["stops"],
                                          r["runs"], r["last"])
                              for r in rows if r["action_name"] == t["action_name"]][:variants])
        for t in tools
    ]


@dataclass(frozen=True)
class WarningOutcomes:
    """SPEC 16: what the agents did after a warning, over the range."""

    warnings: int  # the warnings looked at (at most WARNINGS_LOOKED_AT, the newest)
    changed: int  # the next check of the run was another action
    stopped: int  # the next check of the run was stopped
    capped: bool


WARNINGS_LOOKED_AT = 500


def warning_outcomes(team: Team, *, since: datetime) -> WarningOutcomes:
    """The warnings of the team's runs in the range (an allow carrying a rule, SPEC 16), each
    with the run's next decision: another action (a change of course) or a stop. Bounded: the
    newest WARNINGS_LOOKED_AT warnings, each next decision one probe of `decision_run`."""
    following = Decision.objects.of_run(OuterRef("run_id"), after=OuterRef("id"))
    rows = list(
        Decision.objects.filter(run__team=team, at__gte=since, outcome="allow",
                                rule__isnull=False)
        .annotate(next_outcome=Subquery(following.values("outcome")[:1]),
                  next_key=Subquery(following.values("repeat_key")[:1]))
        .order_by("-id").values_list("repeat_key", "next_outcome", "next_key")
        [:WARNINGS_LOOKED_AT + 1])
    capped = len(rows) > WARNINGS_LOOKED_AT
    rows = rows[:WARNINGS_LOOKED_AT]
    stopped = sum(1 for _, outcome, _ in rows if outcome == "stop")
    changed = sum(1 for key, outcome, nxt in rows
                  if outcome not in (None, "stop") and nxt != key)
    return WarningOutcomes(len(rows), changed, stopped, capped)


def would_stop_count(team: Team, *, since: datetime) -> int:
    """Runs started in the range that a shadow policy would have stopped."""
    return Run.objects.filter(team=team, started_at__gte=since).filter(would_stop_q()).count()


def agent_breakdown(team: Team, *, since: datetime, limit: int = 20) -> list[dict[str, Any]]:
    """Per agent over the range: runs by outcome, shadow would-stops, spend, mean steps."""
    def n(**match: Any) -> Count:
        return Count("pk", filter=Q(**match))

    return list(
        Run.objects.filter(team=team, started_at__gte=since).annotate(ws=would_stop_q())
        .values("agent")
        # One count per status, named by it (running, stopped, killed, completed, failed).
        .annotate(runs=Count("pk"), **{status: n(status=status) for status in RUN_STATUSES},
                  would_stop=n(ws=True), cost=Sum("cost_usd"), steps=Avg("steps"))
        .order_by("-runs", "agent")[:limit]
    )


@dataclass(frozen=True)
class RateLimited:
    waits: int  # checks answered wait (SPEC 12)
    shadow: int  # checks a rate limit would have held back in shadow mode
    tools: list[dict[str, Any]]  # the most held-back action names: action_name, waits, runs


def rate_limited(team: Team, *, since: datetime, limit: int = 5) -> RateLimited:
    """How often rate limits held the team's agents back: the overview's "rate limited"."""
    waits = Decision.objects.filter(run__team=team, outcome="wait", reason="rate_limited",
                                    at__gte=since)
    shadow = Decision.objects.filter(run__team=team, outcome="would_stop", at__gte=since,
                                     answer__shadow__reason="rate_limited")
    tools = list(waits.values("action_name")
                 .annotate(waits=Count("pk"), runs=Count("run", distinct=True))
                 .order_by("-waits", "action_name")[:limit])
    return RateLimited(waits=waits.count(), shadow=shadow.count(), tools=tools)


def switches_covering(team: Team) -> list[KillSwitch]:
    """Engaged kill switches that stop this team's runs (global, team or one of its agents)."""
    return list(KillSwitch.objects.filter(cover.engaged_over_team(team.pk))
                .filter(cover.team_switches(team.pk)).order_by("engaged_at"))


TIMELINE_PAGE = 50


def _timeline_rows(run: Run, *, flagged: bool, after: int | None = None,
                   before: int | None = None, newest_first: bool = False
                   ) -> QuerySet[Decision]:
    # The API's read (runs.audit.selectors.decisions_of: the run's decisions in order) with
    # what only the page needs: the filter and each step's previous decision time.
    rows = Decision.objects.of_run(run.pk, after=after, before=before,
                                   newest_first=newest_first)
    if flagged:  # stops and warnings only: a range of the index `decision_run_flagged`
        rows = rows.filter(FLAGGED)
    # The previous decision of the run (shown or not): a step's duration is the time from it.
    previous = Decision.objects.of_run(OuterRef("run"), before=OuterRef("id"), newest_first=True)
    return rows.annotate(prev_at=Subquery(previous.values("at")[:1]))


def timeline(run: Run, *, after: int = 0, limit: int = 2000, flagged: bool = False
             ) -> list[Decision]:
    """Decisions after ``after``, oldest first (the stream's new rows)."""
    return list(_timeline_rows(run, flagged=flagged, after=after)[:limit])


def timelines(afters: dict[Any, int], *, limit: int = 2000) -> dict[Any, list[Decision]]:
    """`timeline` of many runs in one query: each run's decisions after its ``after``, oldest
    first, at most ``limit`` in all (a run cut short gets the rest on its page's next look).
    The step looks of many run pages' streams share it (runs/dashboard/stream.py)."""
    if not afters:
        return {}
    wanted = Q()
    for run_id, after in afters.items():
        # Each term is a range of `decision_run`, as in `Decision.objects.of_run`.
        wanted |= Q(run_id=run_id, in_run__gt=after)
    previous = Decision.objects.of_run(OuterRef("run"), before=OuterRef("id"), newest_first=True)
    rows = (Decision.objects.alias(in_run=IN_RUN_ORDER).filter(wanted)
            .annotate(prev_at=Subquery(previous.values("at")[:1]))
            .order_by("run_id", IN_RUN_ORDER.asc())[:limit])
    found: dict[Any, list[Decision]] = {run_id: [] for run_id in afters}
    for row in rows:
        found.setdefault(row.run_id, []).append(row)
    return found


def with_children(runs: Collection[Run]) -> set[str]:
    """Which of these runs have a child run (SPEC 20), in one read of `run_parent` (each
    within its own team): a run page that showed no tree learns of its run's first child."""
    if not runs:
        return set()
    return {str(parent) for parent in Run.objects.filter(
        team_id__in={run.team_id for run in runs}, parent_run_id__in=[run.pk for run in runs])
        .order_by().values_list("parent_run_id", flat=True).distinct()}


def timeline_page(run: Run, *, before: int | None = None, flagged: bool = False,
                  size: int = TIMELINE_PAGE) -> tuple[list[Decision], bool]:
    """The ``size`` decisions before ``before`` (default: the last ones), oldest first, and
    whether there are earlier ones: a long run's page shows its end, earlier steps on demand."""
    found = list(_timeline_rows(run, flagged=flagged, before=before, newest_first=True)
                 [:size + 1])
    return found[:size][::-1], len(found) > size


def resume_floor(run: Run, after: int) -> int | None:
    """Where a run page's stream starts when asked to resume further back than a page of
    the timeline: at the decision just before the run's newest TIMELINE_PAGE decisions after
    ``after`` (one range of `decision_run`, a page and one entries read); None when at most
    a page follows ``after``. A stream's first look sends at most a page of rows, whatever
    id it is asked to resume from (found by an attacker: a viewer's streams with
    ``Last-Event-ID: 0`` on a run of 2,100 steps of 58 KB each rendered all of them at each
    reconnect, and another team's check p99 rose 13 to 15x)."""
    found = list(Decision.objects.of_run(run.pk, after=after, newest_first=True)
                 .values_list("id", flat=True)[TIMELINE_PAGE:TIMELINE_PAGE + 1])
    return found[0] if found else None


def latest_decision_id(run: Run) -> int:
    """The run's newest decision id (0: none yet), where its page's stream resumes."""
    return Decision.objects.of_run(run.pk, newest_first=True).values_list(
        "id", flat=True).first() or 0


def running_on_old_versions(team: Team, policy: Policy) -> int:
    """Running runs that keep an older version of this policy (runs pin their version)."""
    return (
        Run.objects.filter(team=team, status=RunStatus.RUNNING, policy_version__policy=policy)
        .exclude(policy_version_id=policy.current_id)
        .count()
    )


# --- A run's tree (SPEC 20) -------------------------------------------------------------------

# A run page lists at most this many children (a tree is bounded in depth, not in width).
CHILDREN_SHOWN = 50


def children_of(run: Run) -> list[Run]:
    """A run's children, the first started first (the index of child runs by parent)."""
    return list(Run.objects.filter(team_id=run.team_id, parent_run_id=run.pk)
                .select_related("policy_version").order_by("started_at", "pk")
                [:CHILDREN_SHOWN])


def runs_by_id(team_id: int, ids: list[Any]) -> dict[Any, Run]:
    """The team's runs of these ids (None ids ignored), by id."""
    wanted = [i for i in ids if i is not None]
    if not wanted:
        return {}
    return {run.pk: run for run in Run.objects.filter(team_id=team_id, pk__in=wanted)
            .select_related("policy_version")}
