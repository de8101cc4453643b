"""Reads for the operator dashboard (SPEC section 7): runs lists, overview figures, timelines.

Every function takes the team first and filters by it, so a view cannot show another team's
rows by passing the wrong id.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.paginator import Page, Paginator
from django.db.models import Count, Max
from django.db.models.functions import TruncHour
from django.utils import timezone

from policies.models import Policy, Team
from runs.audit.selectors import decisions_of
from runs.check.abandon import abandon_idle_runs
from runs.check.rate_limits import prune_hits_now_and_then
from runs.killswitch import cover
from runs.models import Decision, KillSwitch, Run, RunStatus

RUN_STATUSES = tuple(RunStatus.values)
TERMINAL_STOPS = (RunStatus.STOPPED, RunStatus.KILLED)
RUNS_PER_PAGE = 25


@dataclass(frozen=True)
class RunFilters:
    status: str = ""
    agent: str = ""
    stop_reason: str = ""
    page: int = 1

    @classmethod
    def from_query(cls, query: Any) -> RunFilters:
        status = query.get("status", "")
        try:
            page = max(1, int(query.get("page") or 1))
        except ValueError:
            page = 1
        return cls(
            status=status if status in RUN_STATUSES else "",
            agent=(query.get("agent") or "")[:100],
            stop_reason=(query.get("stop_reason") or "")[:50],
            page=page,
        )

    def query(self, *, page: int | None = None) -> str:
        """The query string of these filters (for links and the stream URL)."""
        from urllib.parse import urlencode

        pairs = [("status", self.status), ("agent", self.agent),
                 ("stop_reason", self.stop_reason)]
        number = self.page if page is None else page
        if number > 1:
            pairs.append(("page", str(number)))
        return urlencode([(k, v) for k, v in pairs if v])


def runs_page(team: Team, filters: RunFilters) -> Page:
    abandon_idle_runs(team_id=team.pk)  # SPEC 14: no overdue run is listed as running
    runs = Run.objects.filter(team=team).select_related("policy_version__policy")
    if filters.status:
        runs = runs.filter(status=filters.status)
    if filters.agent:
        runs = runs.filter(agent=filters.agent)
    if filters.stop_reason:
        runs = runs.filter(stop_reason=filters.stop_reason)
    paginator = Paginator(runs.order_by("-started_at", "-pk"), RUNS_PER_PAGE)
    return paginator.get_page(filters.page)


def run_filter_choices(team: Team) -> dict[str, list[str]]:
    runs = Run.objects.filter(team=team)
    return {
        "statuses": list(RUN_STATUSES),
        "agents": sorted(runs.values_list("agent", flat=True).distinct()),
        "stop_reasons": sorted(
            runs.exclude(stop_reason__isnull=True).values_list("stop_reason", flat=True).distinct()
        ),
    }


def running_runs(team: Team, *, limit: int = 10) -> tuple[list[Run], int]:
    abandon_idle_runs(team_id=team.pk)  # SPEC 14: "running now" never counts an idle run
    if not settings.REDIS_URL:
        # The embedded default runs no beat: the overview's reads keep the hits small.
        prune_hits_now_and_then(now=timezone.now())
    running = Run.objects.filter(team=team, status=RunStatus.RUNNING).select_related(
        "policy_version__policy"
    )
    return list(running.order_by("-started_at")[:limit]), running.count()


@dataclass(frozen=True)
class HourlyActivity:
    hours: list[datetime]  # the start of each hour bucket, oldest first
    started: list[int]
    stops: dict[str, list[int]]  # stop reason -> count per hour


def hourly_activity(team: Team, *, now: datetime | None = None, hours: int = 24
                    ) -> HourlyActivity:
    """Runs started and runs stopped (by reason) per hour over the last ``hours`` hours."""
    now = now or timezone.now()
    last = now.replace(minute=0, second=0, microsecond=0)
    buckets = [last - timedelta(hours=hours - 1 - i) for i in range(hours)]
    index = {b: i for i, b in enumerate(buckets)}
    since = buckets[0]
    started = [0] * hours
    for row in (Run.objects.filter(team=team, started_at__gte=since)
                .annotate(h=TruncHour("started_at")).values("h").annotate(n=Count("pk"))):
        if row["h"] in index:
            started[index[row["h"]]] += row["n"]
    stops: dict[str, list[int]] = {}
    for row in (Run.objects.filter(team=team, ended_at__gte=since, status__in=TERMINAL_STOPS)
                .exclude(stop_reason__isnull=True)
                .annotate(h=TruncHour("ended_at")).values("h", "stop_reason")
                .annotate(n=Count("pk"))):
        if row["h"] in index:
            stops.setdefault(row["stop_reason"], [0] * hours)[index[row["h"]]] += row["n"]
    return HourlyActivity(hours=buckets, started=started, stops=dict(sorted(stops.items())))


def top_loops(team: Team, *, since: datetime, limit: int = 5) -> list[dict[str, Any]]:
    """The repeat keys most often stopped as loops: which tools agents get stuck on."""
    return list(
        Decision.objects.filter(run__team=team, reason="loop_detected", at__gte=since)
        .exclude(repeat_key="")
        .values("action_name", "repeat_key")
        .annotate(stops=Count("pk"), runs=Count("run", distinct=True), last=Max("at"))
        .order_by("-stops", "-last")[:limit]
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
    return list(KillSwitch.objects.filter(cover.team_switches(team.pk), active=True)
                .order_by("engaged_at"))


def timeline(run: Run, *, after: int = 0, limit: int = 2000) -> list[Decision]:
    """The run page's decisions: the API's read, with a page's longer limit."""
    return list(decisions_of(run, after=after, limit=limit))


def running_on_old_versions(team: Team, policy: Policy) -> int:
    """Running runs that keep an older version of this policy (runs pin their version)."""
    return (
        Run.objects.filter(team=team, status=RunStatus.RUNNING, policy_version__policy=policy)
        .exclude(policy_version_id=policy.current_id)
        .count()
    )
