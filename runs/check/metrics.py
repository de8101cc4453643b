"""Prometheus metrics of the check, served at /metrics (docs/performance.md, "Metrics").

Off unless `METRICS_TOKEN` is set: then prometheus_client is imported, every check records
its decision and timings, and /metrics answers a scraper that sends
`Authorization: Bearer <METRICS_TOKEN>` (401 otherwise; 404 while metrics are off, so an
unconfigured deployment exposes nothing).

Several worker processes answer requests, so the numbers live in prometheus_client's
multiprocess files: `manage.py serve` points PROMETHEUS_MULTIPROC_DIR at a fresh directory
when metrics are on, and any worker's /metrics adds up every worker's files. A server started
another way without that variable gets per-process numbers, which only say what the process
that answered the scrape saw.

Exported:
- governance_decisions_total{team, outcome, reason}: decisions audited by the check;
- governance_rate_limit_waits_total{team, rule, per, outcome}: checks a rate limit held
  back (SPEC 12), by the rule that held them longest (its `match` pattern and `per`
  scope); outcome `wait`, or `would_stop` in shadow mode;
- governance_check_seconds: time to answer a check, in the view (validation included);
- governance_check_db_seconds: of which spent waiting for the database;
- governance_kill_switches_engaged{scope}: engaged switches, read from the database when
  scraped (the switch rows are the authority, no process keeps a copy);
- governance_approvals_pending{team}: approval requests waiting for a decision, counted in
  the database when scraped;
- governance_approval_decision_seconds{team, status}: from request to settlement (approved,
  denied, expired, cancelled), observed by the process that settled it;
- governance_telemetry_dropped_spans_total{reason}: OpenTelemetry spans dropped (SPEC 18,
  runs/telemetry.py): `queue_full` (the bounded queue of spans waiting for the exporter) or
  `export_failed` (in a batch the collector did not take);
- governance_telemetry_failed_exports_total{signal}: OTLP batches (`traces`, `metrics`) the
  collector did not take (down, slow past the export timeout, or refusing); dropped.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_safe

from runs.check.edge import bearer_token

log = logging.getLogger(__name__)

# Check latencies sit around a millisecond or two on an idle server and tens under load.
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
DB_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
SCOPES = ("global", "team", "agent", "run")
# People decide in seconds to minutes; the default timeout is 15 minutes, the longest a day.
APPROVAL_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 14400, 86400)


class _Metrics:
    """The metric objects, created on first use so that with metrics off prometheus_client
    is never imported and recording costs one settings lookup."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.decisions = Counter("governance_decisions", "Check decisions, as audited.",
                                 ["team", "outcome", "reason"])
        self.rate_waits = Counter("governance_rate_limit_waits",
                                  "Checks held back by a rate limit, by team and rule.",
                                  ["team", "rule", "per", "outcome"])
        self.check_seconds = Histogram("governance_check_seconds",
                                       "Time to answer a check, in the view.",
                                       buckets=LATENCY_BUCKETS)
        self.check_db_seconds = Histogram("governance_check_db_seconds",
                                          "Time a check spent waiting for the database.",
                                          buckets=DB_BUCKETS)
        self.approval_seconds = Histogram("governance_approval_decision_seconds",
                                          "Time from an approval request to its settlement.",
                                          ["team", "status"], buckets=APPROVAL_BUCKETS)
        self.telemetry_spans = Counter("governance_telemetry_dropped_spans",
                                       "OpenTelemetry spans dropped, by reason.", ["reason"])
        self.telemetry_exports = Counter("governance_telemetry_failed_exports",
                                         "OTLP export batches the collector did not take.",
                                         ["signal"])


_metrics: _Metrics | None = None
_lock = threading.Lock()


def _get() -> _Metrics | None:
    global _metrics
    if not settings.METRICS_TOKEN:
        return None
    if _metrics is None:
        with _lock:  # a worker's threads answer their first checks at once
            if _metrics is None:
                _metrics = _Metrics()
    return _metrics


def decision_made(*, team: str, outcome: str, reason: str, db_seconds: float) -> None:
    """Called after the decision committed: it must never fail the answer."""
    try:
        m = _get()
        if m is not None:
            m.decisions.labels(team, outcome, reason).inc()
            m.check_db_seconds.observe(db_seconds)
    except Exception:
        log.warning("metrics: could not record a decision", exc_info=True)


def rate_limited(*, team: str, rule: Any, outcome: str) -> None:
    """A rate limit held a check back (``rule`` is a governance_client.rules.RateLimit)."""
    try:
        m = _get()
        if m is not None:
            m.rate_waits.labels(team, rule.match, rule.per, outcome).inc()
    except Exception:
        log.warning("metrics: could not record a rate-limit wait", exc_info=True)


def check_answered(seconds: float) -> None:
    try:
        m = _get()
        if m is not None:
            m.check_seconds.observe(seconds)
    except Exception:
        log.warning("metrics: could not record a check's latency", exc_info=True)


def approval_decided(*, team: str, status: str, seconds: float) -> None:
    """Called after a settlement committed: it must never fail the decision."""
    try:
        m = _get()
        if m is not None:
            m.approval_seconds.labels(team, status).observe(max(0.0, seconds))
    except Exception:
        log.warning("metrics: could not record an approval's latency", exc_info=True)


def telemetry_lost(*, spans: int, batches: int, signal: str, reason: str) -> None:
    """OpenTelemetry dropped spans or batches (runs/telemetry.py); called on its exporting
    threads, and on a request's when the span queue is full."""
    try:
        m = _get()
        if m is not None:
            if spans:
                m.telemetry_spans.labels(reason).inc(spans)
            if batches:
                m.telemetry_exports.labels(signal).inc(batches)
    except Exception:
        log.warning("metrics: could not count dropped telemetry", exc_info=True)


class ApprovalsCollector:
    """Pending approval requests by team, counted in the database at scrape time."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT t.slug, count(a.id) FROM policies_team t LEFT JOIN runs_approval a "
                    "ON a.team_id = t.id AND a.status = 'pending' GROUP BY t.slug")
                counts = cursor.fetchall()
        except DatabaseError:
            log.warning("metrics: could not count pending approvals", exc_info=True)
            return
        family = GaugeMetricFamily("governance_approvals_pending",
                                   "Approval requests waiting for a decision, by team.",
                                   labels=["team"])
        for slug, count in sorted(counts):
            family.add_metric([slug], count)
        yield family


class KillSwitchCollector:
    """Engaged switches by scope, counted in the database at scrape time."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT scope, count(*) FROM runs_killswitch WHERE active GROUP BY scope")
                counts = dict(cursor.fetchall())
        except DatabaseError:
            log.warning("metrics: could not count kill switches", exc_info=True)
            return
        family = GaugeMetricFamily("governance_kill_switches_engaged",
                                   "Kill switches engaged now, by scope.", labels=["scope"])
        for scope in SCOPES:
            family.add_metric([scope], counts.get(scope, 0))
        yield family


_registry: Any = None


def registry() -> Any:
    """What /metrics exposes: every worker's files in multiprocess mode, else this process."""
    global _registry
    if _registry is None:
        from prometheus_client import REGISTRY, CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        _get()  # the metric families exist (at zero) from the first scrape
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            built = CollectorRegistry()
            MultiProcessCollector(built)
        else:
            built = REGISTRY
        built.register(KillSwitchCollector())
        built.register(ApprovalsCollector())
        _registry = built
    return _registry


@csrf_exempt  # a scraper's POST is refused as a method (405), not as a forgery
@never_cache
@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    token = settings.METRICS_TOKEN
    if not token:
        raise Http404("metrics are off")
    given = bearer_token(request.headers.get("Authorization"))
    if given is None or not hmac.compare_digest(given.strip().encode(), token.encode()):
        response = HttpResponse("A valid metrics token is required.\n", status=401,
                                content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)
