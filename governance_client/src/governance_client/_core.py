"""What the sync and the async clients share: retry policy, bodies, answers, a run's memory.

Nothing here does I/O: ``client.py`` (httpx.Client) and ``aio.py`` (httpx.AsyncClient) send
what this builds and feed back what they receive, so the two cannot drift apart.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import logging
import math
import numbers
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal

import httpx
import tenacity

from . import rules
from .decision import GOVERNANCE_UNAVAILABLE, Decision
from .errors import (
    ApiError,
    GovernanceError,
    GovernanceUnavailable,
    InvalidRequest,
    RunClosed,
    api_error,
    masked_key,
)
from .keys import canonical_args, normalize_text
from .local import LocalLedger, LocalLimits, make_check

logger = logging.getLogger("governance_client")

# Optional (the `otel` extra): without it, no trace context is sent. Typed Any: mypy reads
# the module's type where the package is installed, and None would not fit it.
_otel_propagate: Any
try:
    from opentelemetry import propagate as _otel_propagate
except ImportError:  # pragma: no cover - exercised where opentelemetry-api is absent
    _otel_propagate = None

FailMode = Literal["closed", "open"]
ActionType = Literal["tool", "llm", "other"]
FinishStatus = Literal["completed", "failed", "stopped"]

#: Answers worth another attempt: the service said it did nothing (429, 503) or a gateway
#: may have lost the answer (502, 504; safe to resend only with a check_id or external_id).
RETRY_STATUSES = frozenset({429, 502, 503, 504})
BODY_LIMIT = 64 * 1024  # SPEC 5.3: a check body over 64 KiB answers 413
BODY_MARGIN = 2048  # room for the fields added after sizing (deadline_ms, check_id)
TEXT_LIMIT = 2000  # SPEC 5.2: error and summary are at most 2,000 characters
DIGEST_LIMIT = 128
PROGRESS_LIMIT = 256
# An upload of local decisions is one body of at most 1,000 entries and 1 MiB on the service
# (README "Local decisions"); the client sends them in as many bodies as it takes, each with
# room to spare (its size is measured as sent, in compact UTF-8 JSON).
UPLOAD_MAX_ENTRIES = 1000
UPLOAD_MAX_BYTES = 768 * 1024
OVERSIZE_KEY = "oversize_args"
MAX_POLL_S = 60  # SPEC 11: ?wait is at most 60 s
#: The least time a long poll's answer may take past its ``wait``: a loaded service answers
#: a poll it held for 60 s a few seconds late, which is no outage (found by a newcomer: with
#: the 2 s of the default deadline, such a poll read as one, and the approval was lost).
POLL_MARGIN_S = 10.0

#: The prefix of the external_id the client makes for a start that has none of its own.
AUTO_EXTERNAL_ID = "client-"

UNAVAILABLE_NEXT_ACTION = (
    "Do not run this action: return the partial response and try again later, once the "
    "governance service is reachable."
)
# Words for the end user (Decision.user_notice); the error itself goes to Decision.detail
# and the log, never to the user.
UNAVAILABLE_MESSAGE = "The governance service is unreachable, so this action was not run."
UNAVAILABLE_APPROVAL = ("{name} needs an operator's approval, which cannot be asked for while "
                        "the governance service is unreachable, so it was not run.")
# The same outage when the service was reached but did not answer within the deadline: it is
# slow, not gone, and the developer's fix is another (``deadline``), so it is said apart.
LATE_MESSAGE = ("The governance service did not answer within {seconds} s, so this action was "
                "not run.")
LATE_APPROVAL = ("{name} needs an operator's approval, which could not be asked for: the "
                 "governance service did not answer within {seconds} s, so it was not run.")
LATE_NEXT_ACTION = ("Do not run this action: return the partial response and try again later, "
                    "once the governance service answers in time.")
APPROVAL_GIVEN_UP = ("{name} needs an operator's approval, and none was given within "
                     "{seconds} s, so it was not run.")
APPROVAL_GIVEN_UP_NEXT = "Try again once an operator has approved it."
RATE_GIVEN_UP = ("{name} was run too often (a rate limit of the policy), and the limit did not "
                 "clear within {seconds} s, so it was not run.")
RATE_LIMITED_NOW = "{name} was run too often (a rate limit of the policy), so it was not run."
RATE_GIVEN_UP_NEXT = "Try again in {retry} s."


@dataclass(frozen=True)
class Settings:
    """A client's configuration, validated once (see ``GovernanceClient`` for the meaning)."""

    base_url: str
    # Not in the printed form: a settings object in a log or a traceback must not show it.
    api_key: str = field(repr=False)
    deadline: float = 2.0
    attempts: int = 3
    backoff: float = 0.1
    max_backoff: float = 1.0
    fail_mode: FailMode = "closed"
    local_limits: LocalLimits | None = None
    wait_for_rate_limits: bool = True
    wait_budget: float = 30.0
    approval_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.fail_mode not in ("closed", "open"):
            raise ValueError(f"fail_mode must be 'closed' or 'open', not {self.fail_mode!r}")
        if self.deadline <= 0:
            raise ValueError("deadline must be > 0 seconds")
        if self.attempts < 1 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("attempts must be >= 1, backoff and max_backoff >= 0")
        if self.wait_budget < 0 or (self.approval_timeout is not None
                                    and self.approval_timeout < 0):
            raise ValueError("wait_budget and approval_timeout must be >= 0")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "Accept": "application/json"}


def traced_headers(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with the current OpenTelemetry context's ``traceparent`` (and
    ``tracestate``, baggage: whatever the configured propagators write) when
    opentelemetry-api is installed and a span is active, so the service's span for this
    request is its child (SPEC 18): the decision nests under the framework's tool span."""
    if _otel_propagate is None:
        return headers
    carrier: dict[str, str] = {}
    try:
        _otel_propagate.inject(carrier)
    except Exception:  # a broken propagator must not break a check
        logger.debug("could not read the OpenTelemetry context", exc_info=True)
        return headers
    return {**headers, **carrier} if carrier else headers


# -- Retries ----------------------------------------------------------------------------------

class Retryable(Exception):
    """One attempt failed in a way another attempt may fix."""

    def __init__(self, failure: str, retry_after: float | None = None,
                 *, timed_out: bool = False) -> None:
        super().__init__(failure)
        self.failure = failure
        self.retry_after = retry_after
        #: The service was reached and did not answer in time (not a refused connection).
        self.timed_out = timed_out


class _WaitRetryAfterOrFullJitter(tenacity.wait.wait_base):
    """The server's ``Retry-After`` when it gave one, else full jitter (uniform between 0 and
    the exponential backoff), so that agents knocked off together do not retry together."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.jitter = tenacity.wait_random_exponential(multiplier=initial, max=maximum)

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, Retryable) and exc.retry_after is not None:
            return exc.retry_after
        return float(self.jitter(retry_state))


def retry_policy(settings: Settings, deadline: float) -> dict[str, Any]:
    """tenacity arguments: at most ``attempts`` tries, and no sleep that would end past the
    deadline (``stop_before_delay``), so a check never outlives its deadline by a backoff."""
    return {
        "stop": tenacity.stop_after_attempt(settings.attempts)
        | tenacity.stop_before_delay(deadline),
        "wait": _WaitRetryAfterOrFullJitter(settings.backoff, settings.max_backoff),
        "retry": tenacity.retry_if_exception_type(Retryable),
        "reraise": True,
    }


def constant(body: Any) -> Callable[[float], Any]:
    """A request body that does not depend on the time left."""
    return lambda _remaining: body


def retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def classify_error(exc: httpx.TransportError, *, replay_safe: bool, secret: str) -> Exception:
    """The exception an attempt ends with for a transport error, to raise as it is: its
    cause is ``exc``, unless ``exc`` names ``secret`` (the agent key: httpx names a header it
    cannot send by its value), whose text and chain then show the masked key only."""
    if secret and secret in str(exc):
        text = str(exc).replace(secret, masked_key(secret))
        try:
            clean = type(exc)(text)
        except TypeError:  # a transport's own error class, made otherwise
            clean = httpx.TransportError(text)
        failure = _classified(clean, replay_safe=replay_safe)
        failure.__suppress_context__ = True  # as `raise ... from None`
        return failure
    failure = _classified(exc, replay_safe=replay_safe)
    failure.__cause__ = exc  # as `raise ... from exc`
    return failure


def _classified(exc: httpx.TransportError, *, replay_safe: bool) -> Exception:
    failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    # Never sent: no connection, or none free in time (the pool).
    not_sent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)
    # A timeout is a service too slow for the deadline; a refused connection, an unknown
    # host, a reset, one that is not there.
    timed_out = isinstance(exc, httpx.TimeoutException)
    if replay_safe or not_sent:
        return Retryable(failure, timed_out=timed_out)
    return GovernanceUnavailable(failure, timed_out=timed_out)


def classify_response(response: httpx.Response, *, replay_safe: bool) -> Exception | None:
    """None when the answer stands; else the exception the attempt ends with."""
    status = response.status_code
    if status in RETRY_STATUSES:
        # 429 and 503 are the service saying it did nothing; a 502/504 may hide a success.
        if replay_safe or status in (429, 503):
            return Retryable(f"HTTP {status}", retry_after_s(response))
        return GovernanceUnavailable(f"HTTP {status}")
    if status >= 500:
        return GovernanceUnavailable(f"HTTP {status}")
    return None


def gave_up(method: str, path: str, exc: BaseException, attempts: int,
            deadline: float) -> GovernanceUnavailable:
    detail = exc.failure if isinstance(exc, Retryable) else str(exc)
    timed_out = bool(getattr(exc, "timed_out", False))
    if timed_out:
        return GovernanceUnavailable(
            f"{method} {path} failed after {attempts} attempt(s): {detail}: no answer within "
            f"the deadline of {_seconds(deadline)} s (a slow service, not a refused "
            "connection: raise GovernanceClient(deadline=...) if it is often this slow)",
            timed_out=True, deadline=deadline)
    return GovernanceUnavailable(f"{method} {path} failed after {attempts} attempt(s): {detail}",
                                 deadline=deadline)


def poll_deadline(settings: Settings, wait: float) -> float:
    """The deadline of a long poll that the service holds ``wait`` seconds: that, plus the
    client's deadline, and never less than ``POLL_MARGIN_S`` on top."""
    return wait + max(settings.deadline, POLL_MARGIN_S)


def attempt_timeout(remaining: float, attempts_left: int, hold: float = 0.0) -> float:
    """One attempt's share of what is left: a connection that hangs (a stuck worker, a dead
    peer) leaves time for another attempt on a fresh one, but never less than half a second,
    so that a slow answer is not abandoned too early. The body still carries the whole of
    what is left (``deadline_ms``): an attempt given up on but decided in time is replayed
    by its ``check_id``.

    ``hold`` is how long the service keeps the request open on purpose (a long poll's
    ``wait``): every attempt gets it on top of its share of the rest. Shared out like the
    rest, a 60 s poll's attempts would end after 20 s each while the service still waited as
    asked, and an approval nobody decided within a minute would read as an outage."""
    if hold > 0:
        return min(remaining, hold + attempt_timeout(max(remaining - hold, 0.0), attempts_left))
    return min(remaining, max(remaining / max(attempts_left, 1), 0.5))


def server_budget_ms(remaining: float) -> int:
    """The deadline sent with a check: what is left, less a margin for the answer's way back,
    so that the service gives up (and audits ``expired``) before the client does."""
    margin = max(0.05, remaining * 0.1)
    return max(1, int((remaining - margin) * 1000))


API_PREFIX = "/api/v1"


def service_root(base_url: str) -> str:
    """The service's address as the client joins paths to it. The API is "under /api/v1/"
    (SPEC 5), so a base URL given with that prefix is taken as the service's root rather
    than sending ``/api/v1/api/v1/runs`` (a bare 404)."""
    root = base_url.rstrip("/")
    if root.endswith(API_PREFIX):
        root = root[: -len(API_PREFIX)]
    return root


def expect(response: httpx.Response, *ok: int) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code not in ok:
        error = api_error(response.status_code, body)
        if error.code == f"http_{response.status_code}" and not error.fields:
            # Not the service's JSON error (SPEC 5.3): say where it came from, usually a
            # base URL that is not the service (a page of the dashboard, a proxy's path).
            try:
                where = f"{response.request.method} {response.request.url}"
            except RuntimeError:
                where = "the request"
            error = ApiError(response.status_code, error.code,
                             f"unexpected error response to {where}: is the client's base "
                             "URL the governance service's address?")
        raise error
    if not isinstance(body, dict):
        raise ApiError(response.status_code, "invalid_response", "expected a JSON object")
    return body


def start_body(
    agent: str,
    *,
    task: str | None,
    policy: str | None,
    metadata: Mapping[str, Any] | None,
    external_id: str | None,
    parent_run_id: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"agent": agent}
    optional = {"task": task, "policy": policy, "metadata": metadata,
                "parent_run_id": parent_run_id}
    body.update({k: v for k, v in optional.items() if v is not None})
    # Without the author's own id, one of the client's: the start can then be sent again
    # after any failure within its deadline (the service answers a known external_id with
    # the run it started), never making two runs.
    body["external_id"] = external_id if external_id is not None \
        else f"{AUTO_EXTERNAL_ID}{uuid.uuid4().hex}"
    return body


_WARNED_BOUND: set[str] = set()


def subagent_fallback(exc: ApiError, *, parent_agent: str | None, name: str
                      ) -> dict[str, Any] | None:
    """A framework's sub-agent whose child run the service refused because the key may only
    start runs of one agent (SPEC 5: an agent-bound key, so an agent kill switch cannot be
    dodged by renaming): the metadata of the child to start instead, under the parent's
    agent, which the key may start, with the sub-agent's name. None for any other refusal.
    Said once per process and agent, so a log says why the sub-agent's runs are named so."""
    if not (isinstance(exc, InvalidRequest) and "agent" in exc.fields and parent_agent
            and name != parent_agent):
        return None
    if parent_agent not in _WARNED_BOUND:
        _WARNED_BOUND.add(parent_agent)
        logger.warning("this key may only start runs of agent %r: sub-agent %r (and any "
                       "other) runs as a child run of agent %r, its name in the run's "
                       "metadata ('subagent')", parent_agent, name, parent_agent)
    return {"subagent": name}


def local_start(agent: str) -> dict[str, Any]:
    return {"run_id": f"local-{uuid.uuid4().hex}", "status": "running", "agent": agent}


def parse_time(value: Any) -> float | None:
    """An ISO-8601 time as seconds since the epoch (None when absent or unreadable)."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


# -- One check --------------------------------------------------------------------------------

@dataclass
class PreparedCheck:
    name: str
    args: dict[str, Any]
    body: dict[str, Any]
    check: rules.Check
    check_id: str
    call_id: str | None
    #: when the client decided at least once: the time the action's decision was made
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    def with_deadline(self, remaining: float) -> dict[str, Any]:
        budget_ms = server_budget_ms(remaining)
        # Both forms: deadline_ms runs from when the service reads the check, deadline_at
        # from now, so a check left queued in a frozen service expires all the same.
        at = datetime.now(UTC) + timedelta(milliseconds=budget_ms)
        return {**self.body, "deadline_ms": budget_ms,
                "deadline_at": at.isoformat(timespec="milliseconds")}


def _size(body: Any) -> int:
    return len(json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=str)
               .encode("utf-8"))


def oversize_digest(args: Mapping[str, Any], ignore_args: tuple[str, ...]) -> dict[str, Any]:
    """What a check sends instead of args too big for the service (SPEC 5.3's 64 KiB).

    The digest is the SHA-256 of the canonical args (the policy's ``ignore_args`` removed, as
    the repeat key does), so the same big call gives the same repeat key and loops are still
    caught; the sizes and the top-level names let operators see what was called.
    """
    try:
        data = canonical_args(args, ignore_args)
    except (TypeError, ValueError):
        data = repr(sorted(args.items(), key=lambda kv: str(kv[0]))).encode("utf-8")
    names = sorted(str(k)[:100] for k in args)[:50]
    return {OVERSIZE_KEY: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                           "keys": names}}


def _fit_progress(progress: str | int | float | None) -> str | int | float | None:
    # What the service takes (SPEC 5.2), said here: a wrong kind would be refused online and,
    # decided locally during an outage, refused in the upload after the action ran.
    if isinstance(progress, bool) or not isinstance(progress, str | int | float | None):
        raise TypeError(f"progress must be a string or a number, not {type(progress).__name__}")
    if isinstance(progress, float) and not math.isfinite(progress):
        raise ValueError(f"progress must be a finite number, not {progress}")
    if isinstance(progress, str) and len(progress) > PROGRESS_LIMIT:
        return "sha256:" + hashlib.sha256(progress.encode("utf-8")).hexdigest()
    return progress


def _json_problem(value: Any, path: str) -> tuple[type[Exception], str] | None:
    """Where ``value`` holds what a JSON body cannot carry (a ``datetime``, a ``Path``, a
    NaN), said the way the author wrote it: ``args['when'] is a datetime``."""
    if value is None or isinstance(value, str | bool | int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (
            ValueError, f"{path} is {value}, which JSON cannot carry")
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str | int | float | bool) and key is not None:
                return TypeError, f"{path} has a key of type {type(key).__name__}"
            found = _json_problem(item, f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _json_problem(item, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return TypeError, f"{path} is a {type(value).__name__}, which JSON cannot carry"


def _fit_args(name: str, args: Mapping[str, Any] | None) -> dict[str, Any]:
    # The args go out as JSON: said here, naming the value, rather than by the JSON encoder
    # deep in the send ("Object of type datetime is not JSON serializable").
    if args is None:
        return {}
    if not isinstance(args, Mapping):
        raise TypeError(f"args of {name} must be a dict (a JSON object), "
                        f"not {type(args).__name__}")
    plain = dict(args)
    try:
        json.dumps(plain, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        found = _json_problem(plain, "args")
        kind, where = found if found is not None else (TypeError, "args")
        raise kind(f"args of {name} must be JSON: {where} "
                   "(convert it to a string or a number first)") from None
    return plain


#: The most one check may add to a run's cost, as the service takes it (runs/check/schemas.py).
MAX_COST_USD = 1_000_000


def _fit_cost(cost_usd: Any) -> int | float | None:
    # A JSON number (SPEC 5.2). Money is often a Decimal: sent as the number it is.
    if cost_usd is None:
        return None
    if isinstance(cost_usd, bool) or not isinstance(cost_usd, numbers.Number) \
            or isinstance(cost_usd, complex):
        raise TypeError(f"cost_usd must be a number, not {type(cost_usd).__name__}")
    number: Any = cost_usd
    value: int | float = number if type(number) in (int, float) else float(number)
    if not math.isfinite(value):
        raise ValueError(f"cost_usd must be a finite number, not {cost_usd}")
    if not 0 <= value <= MAX_COST_USD:
        # The service refuses it (422, SPEC 5.2: a number >= 0), but the fake took it, and a
        # fail-open run decided locally with it: a negative spend took the run's cost down,
        # under max_usd (found by a new agent author).
        raise ValueError(f"cost_usd is the spend since the previous check, from 0 to "
                         f"{MAX_COST_USD:,}: not {cost_usd}")
    return value


class RunCore:
    """A run's memory on the agent's side, shared by ``Run`` and ``AsyncRun``."""

    def __init__(self, settings: Settings, data: Mapping[str, Any], *, local: bool) -> None:
        self.settings = settings
        self.data: dict[str, Any] = dict(data)
        self.id = str(data["run_id"])
        self.agent: str | None = data.get("agent")
        self.status: str = str(data.get("status") or "running")
        self.local = local
        self.output: str | None = None
        self.stop_decision: Decision | None = None
        self.last_decision: Decision | None = None
        self.finished = False
        self.closed = False
        limits = settings.local_limits or LocalLimits()
        self.ledger = LocalLedger(limits.policy(data.get("policy")))
        # Tool results reported and not yet sent, oldest first, by tool call id: parallel
        # calls each keep their own result, and each check carries one (SPEC 5.2 has one
        # last_result per check).
        self.pending: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Decisions made locally during an outage, to upload once the service answers.
        self.unsynced: list[dict[str, Any]] = []
        # A run started locally: what it decided, as an upload sends it. It has no run on the
        # service to send them to; a run started there later for the same work may take them
        # over (``adopt``) and upload them.
        self.kept: list[dict[str, Any]] = []
        self.upload_cap = UPLOAD_MAX_ENTRIES
        # A check whose approval wait the client gave up (an outage, or the author's
        # approval_timeout): its action and check_id. The same action checked again resumes
        # that request (SPEC 11: the same check_id answers the same thing) instead of being
        # refused 409 approval_pending as another check.
        self.awaiting: tuple[str, str] | None = None
        # A sub-agent's stop that this run's agent ended with (an integration says so: a
        # handoff's receiver stopped, a subgraph's stop ended the graph), and the notice the
        # user got. A child's stop does not stop its parent on the service (SPEC 20), but
        # the agent is over all the same: the run is finished stopped with that notice, not
        # completed with no output (found by a newcomer). A later check of this run or a new
        # sub-agent (its agent went on after all) forgets it.
        self.subagent_stop: Decision | None = None
        self.subagent_notice: str | None = None
        # Checks of one run are serialized, as on the server (the ledger is one sequence): by
        # this lock in threads (report takes it too), by ``alock`` in a coroutine.
        self.lock = threading.RLock()
        self.alock = asyncio.Lock()

    @property
    def policy(self) -> rules.Policy:
        return self.ledger.policy

    def ensure_open(self) -> None:
        if self.closed:
            raise RunClosed(f"run {self.id} is finished: start a new run for new work")

    def prepare(
        self,
        name: str,
        args: Mapping[str, Any] | None,
        *,
        type: ActionType,
        progress: str | int | float | None,
        last_result: Mapping[str, Any] | None,
        cost_usd: float | Decimal | None,
        call_id: str | None,
    ) -> PreparedCheck:
        self.ensure_open()
        self.went_on()
        plain = _fit_args(name, args)
        progress = _fit_progress(progress)
        cost_usd = _fit_cost(cost_usd)
        if last_result is not None:
            result: dict[str, Any] | None = dict(last_result)
        elif self.pending:
            # A result describes one action: sent (or lost to an outage), it is not sent again.
            result = self.pending.popitem(last=False)[1]
        else:
            result = None
        body: dict[str, Any] = {
            "check_id": uuid.uuid4().hex,
            "action": {"name": name, "args": plain, "type": type},
        }
        if progress is not None:
            body["progress"] = progress
        if result is not None:
            body["last_result"] = result
        if cost_usd is not None:
            body["cost_usd"] = cost_usd
        sent_args = plain
        if _size(body) > BODY_LIMIT - BODY_MARGIN:
            sent_args = oversize_digest(plain, self.policy.ignore_args)
            body["action"] = {**body["action"], "args": sent_args}
            logger.info("args of %s are over 64 KiB: sending their digest", name)
        check = make_check(name, sent_args, type=type, progress=progress, last_result=result,
                           cost_usd=cost_usd)
        if self.awaiting is not None and self.awaiting[0] == self._action_of(check):
            body["check_id"] = self.awaiting[1]
        return PreparedCheck(name=name, args=sent_args, body=body, check=check,
                             check_id=body["check_id"], call_id=call_id)

    def answered(self, prepared: PreparedCheck, decision: Decision) -> Decision:
        if self.awaiting is not None and self.awaiting[1] == prepared.check_id \
                and decision.decision in ("allow", "stop") \
                and decision.reason != GOVERNANCE_UNAVAILABLE:
            self.awaiting = None  # the request was settled
        self.ledger.record(prepared.check, decision)
        return self.remember(decision)

    def subagent_stopped(self, decision: Decision, notice: str | None) -> None:
        """This run's agent ends with ``decision``, a sub-agent's stop (``subagent_stopped``)."""
        self.subagent_stop = decision
        self.subagent_notice = notice

    def went_on(self) -> None:
        """The run's agent acts again (a check, a new sub-agent): a sub-agent's stop it met
        earlier did not end it."""
        self.subagent_stop = self.subagent_notice = None

    def _action_of(self, check: rules.Check) -> str:
        return f"{check.type}:{self.ledger.key(check.name, check.args)}"

    def gave_up_waiting(self, prepared: PreparedCheck) -> None:
        """The approval of this check is still pending, but the client stops waiting."""
        self.awaiting = (self._action_of(prepared.check), prepared.check_id)

    def awaiting_approval(self, prepared: PreparedCheck) -> None:
        """The check is answered ``pending``: remember it before the wait begins, so that a
        wait cut short from outside (a framework's timeout cancelling the coroutine, Ctrl-C)
        leaves the same action resumable, as a wait the client gives up does; ``answered``
        forgets it once the request is settled (found by an agent author: the same action
        checked again was refused 409 approval_pending)."""
        self.gave_up_waiting(prepared)

    def approval_given_up(self, prepared: PreparedCheck, pending: Decision,
                          seconds: float) -> Decision:
        """The pending decision returned when the client stops waiting for the operator: the
        user is told what was not run and why; the service's words (how to go on waiting
        through the API) are the developer's, in ``detail``."""
        self.gave_up_waiting(prepared)
        return replace(
            pending, message=APPROVAL_GIVEN_UP.format(name=prepared.name,
                                                      seconds=_seconds(seconds)),
            next_action=APPROVAL_GIVEN_UP_NEXT, detail=_joined(pending))

    def wait_given_up(self, prepared: PreparedCheck, wait: Decision, waited: float) -> Decision:
        """The wait decision returned when a rate limit outlasts the client's wait budget
        (``waited``: the seconds slept for it, 0 without waiting)."""
        retry = math.ceil(wait.retry_after_s or 1)
        message = RATE_GIVEN_UP.format(name=prepared.name, seconds=_seconds(waited)) \
            if waited > 0 else RATE_LIMITED_NOW.format(name=prepared.name)
        return replace(wait, message=message, next_action=RATE_GIVEN_UP_NEXT.format(retry=retry),
                       detail=_joined(wait))

    def local_decision(self, prepared: PreparedCheck, detail: str,
                       *, allow_local: bool = True, timed_out: bool = False) -> Decision:
        """The decision when the service could not be reached. ``detail`` (the failure) is
        the developer's: logged and kept in ``Decision.detail``, never in the user's text.
        ``timed_out``: it was reached but did not answer within the deadline (slow, not
        gone): the same decision, in words that say so."""
        why = "fail_mode='closed' stops every action until it answers again."
        seconds = _seconds(self.settings.deadline)
        if timed_out:
            outage = f"did not answer within {seconds} s"
            told = (f"The governance service did not answer within the deadline ({seconds} s; "
                    f"raise GovernanceClient(deadline=...) if it is this slow under load) "
                    f"({detail})")
        else:
            outage = "unreachable"
            told = f"The governance service is unreachable ({detail})"
        message = LATE_MESSAGE.format(seconds=seconds) if timed_out else UNAVAILABLE_MESSAGE
        approval = LATE_APPROVAL if timed_out else UNAVAILABLE_APPROVAL
        if self.settings.fail_mode == "open" and allow_local:
            logger.warning("governance %s, deciding %s locally: %s", outage, prepared.name,
                           detail)
            # A run the service had already ended answers its end again: nothing to upload.
            running = self.ledger.stop is None and self.ledger.state.status == rules.RUNNING
            local = self.ledger.decide(prepared.check)
            if local is not None:
                decision = _with_ids(local, prepared)
                if running and not self.local:
                    self.unsynced.append(self._upload_entry(prepared, decision))
                return self.remember(decision)
            why = (f"{prepared.name} needs an operator's approval (the policy's "
                   "approvals.tools), which is never given locally; the next check asks the "
                   "service again.")
            message = approval.format(name=prepared.name, seconds=seconds)
        elif not allow_local:
            message = approval.format(name=prepared.name, seconds=seconds)
        logger.warning("governance %s, %s not run: %s", outage, prepared.name, detail)
        return self.remember(Decision(
            decision="stop",
            reason=GOVERNANCE_UNAVAILABLE,
            message=message,
            next_action=LATE_NEXT_ACTION if timed_out else UNAVAILABLE_NEXT_ACTION,
            local=True,
            check_id=prepared.check_id,
            call_id=prepared.call_id,
            detail=f"{told}; {why}",
        ))

    def decide_offline(self, prepared: PreparedCheck) -> Decision | None:
        """A decision without asking: the run was started locally, or a local stop ended it."""
        if self.local or self.ledger.stop is not None:
            # Only what the ledger decides afresh is kept: a stop answered again is no action.
            running = self.ledger.stop is None and self.ledger.state.status == rules.RUNNING
            decision = self.ledger.decide(prepared.check)
            if decision is None:  # an action that needs an operator: refused, as in an outage
                return self.local_decision(prepared, "the run was started locally")
            decision = _with_ids(decision, prepared)
            if self.local and running:
                self.kept.append(self._upload_entry(prepared, decision))
            return self.remember(decision)
        return None

    def adopt(self, local: RunCore) -> None:
        """Take over ``local``, a run started locally because the service was unreachable,
        now that this run was started on the service for the same work (the MCP gateway's
        session, which outlives an outage at its start): what ``local`` decided is uploaded,
        marked local, before this run's next check and at its finish, as an outage's
        decisions are; the results it did not send go with this run's next checks; its stop
        stays the run's stop (``exit_status``). The service decides from here on, a local
        stop included: the upload records it, and the service answers the next check."""
        # Shared, not copied: a check of ``local`` already under way still lands here.
        local.kept.extend(self.unsynced)
        self.unsynced = local.kept
        local.pending.update(self.pending)
        self.pending = local.pending
        if local.ledger.state.status == rules.RUNNING:
            # The actions that ran count in this run's copy too, for a later outage (the
            # service's answers correct it); its time counts from this run's start.
            self.ledger.state = replace(local.ledger.state.copy(),
                                        started_at=self.ledger.state.started_at)
        if local.stop_decision is not None:
            self.remember(local.stop_decision)
        self.last_decision = self.last_decision or local.last_decision

    def _upload_entry(self, prepared: PreparedCheck, decision: Decision) -> dict[str, Any]:
        body = prepared.body
        entry: dict[str, Any] = {
            "check_id": prepared.check_id,
            "action": body["action"],
            "decision": decision.decision,
            "reason": decision.reason,
            "at": prepared.at,
        }
        for name in ("progress", "last_result", "cost_usd"):
            if name in body:
                entry[name] = body[name]
        if decision.message:
            entry["message"] = decision.message
        if decision.directive and decision.allowed:
            # What the agent was told with the allow (SPEC 16): the audit records it.
            entry["directive"] = decision.directive
        return entry

    def upload_body(self) -> dict[str, Any] | None:
        """The next upload: the oldest local decisions, as many as the service takes in one
        body (UPLOAD_MAX_ENTRIES, UPLOAD_MAX_BYTES); the rest go in the next ones."""
        batch: list[dict[str, Any]] = []
        size = len('{"decisions": []}')
        for entry in self.unsynced[:self.upload_cap]:
            entry_size = _size(entry) + 2
            if batch and size + entry_size > UPLOAD_MAX_BYTES:
                break
            batch.append(entry)
            size += entry_size
        return {"decisions": batch} if batch else None

    def uploaded(self, count: int, answer: Mapping[str, Any]) -> None:
        """The service took the first ``count`` local decisions; its answer has the run."""
        del self.unsynced[:count]
        run = answer.get("run")
        if isinstance(run, Mapping):
            self.data.update(run)

    def refused(self, count: int, error: GovernanceError) -> bool:
        """The service refused an upload of the first ``count`` local decisions. A 413 halves
        the batch; a 422 that names entries (``decisions.3.progress``) drops those alone; both
        send the rest again (True). Anything else drops all ``count``. Dropped entries are
        logged: their actions ran, but the service will not count them."""
        if not isinstance(error, ApiError):
            logger.warning("local decisions of run %s not sent, %d dropped: %s", self.id, count,
                           error)
            del self.unsynced[:count]
            return False
        if error.status == 413 and count > 1:
            # Larger than measured (an older httpx escapes non-ASCII text): halve the batch.
            self.upload_cap = max(1, count // 2)
            return True
        bad: set[int] = set()
        if error.status == 422:
            for name in error.fields:
                parts = str(name).split(".")
                if len(parts) > 1 and parts[0] == "decisions" and parts[1].isdigit():
                    bad.add(int(parts[1]))
        if not bad or max(bad) >= count:
            logger.warning("local decisions of run %s refused, %d dropped: %s", self.id, count,
                           error)
            del self.unsynced[:count]
            return False
        for index in sorted(bad, reverse=True):
            entry = self.unsynced.pop(index)
            logger.warning("local decision %s of run %s (%s) refused, dropped: %s", index,
                           self.id, entry["action"].get("name"), {
                               k: v for k, v in error.fields.items()
                               if str(k).startswith(f"decisions.{index}.")
                               or k == f"decisions.{index}"})
        return True

    def report(
        self,
        result: Any,
        *,
        error: BaseException | str | None,
        summary: str | None,
        digest: str | None,
        call_id: str | None,
    ) -> dict[str, Any]:
        self.ensure_open()
        entry: dict[str, Any] = {"status": "ok" if error is None else "error"}
        if error is not None:
            text = str(error)
            if not text and isinstance(error, BaseException):
                text = type(error).__name__
            entry["error"] = normalize_text(text)[:TEXT_LIMIT]
        if digest is None and error is None and result is not None:
            digest = result_digest(result)
        if digest is not None and len(digest) > DIGEST_LIMIT:
            digest = hashlib.sha256(digest.encode()).hexdigest()
        if digest is not None:
            entry["digest"] = digest
        if summary is not None:
            entry["summary"] = summary[:TEXT_LIMIT]
        key = call_id if call_id is not None else "\0last"
        with self.lock:
            # A second report of the same call (an error handler, then a hook) replaces the
            # first and keeps its place in line.
            self.pending[key] = entry
        return entry

    def remember(self, decision: Decision) -> Decision:
        self.last_decision = decision
        if decision.decision == "stop" and self.stop_decision is None \
                and decision.reason != GOVERNANCE_UNAVAILABLE:
            self.stop_decision = decision
            if decision.reason != "run_finished":
                self.status = "killed" if decision.reason == "killed" else "stopped"
        return decision

    def exit_status(self, *, failed: bool) -> FinishStatus:
        # The last check not allowed (a stop, or a wait for an operator or a rate limit the
        # client gave up on), or a sub-agent's stop the agent ended with: the agent stopped
        # there, its work is not complete.
        if self.stop_decision is not None or self.subagent_stop is not None or (
            self.last_decision is not None and not self.last_decision.allowed
        ):
            return "stopped"
        return "failed" if failed else "completed"

    def finish_body(self, status: FinishStatus, output: str | None) -> dict[str, Any]:
        if output is not None:
            self.output = output
        if self.output is None and status == "stopped":
            # The author set no output: the run still says why it stopped, in the user's words.
            last = self.stop_decision or self.last_decision
            if self.stop_decision is None and self.subagent_stop is not None:
                self.output = self.subagent_notice or self.subagent_stop.user_notice()
            elif last is not None and not last.allowed:
                self.output = last.user_notice()
        body: dict[str, Any] = {"status": status}
        if self.output is not None:
            body["output"] = self.output
        return body

    def finished_with(self, status: str, data: Mapping[str, Any] | None) -> None:
        self.finished = True
        self.closed = True
        if data:
            self.status = str(data.get("status") or status)
            self.data.update(data)
        elif self.status == "running":
            self.status = status


def _with_ids(decision: Decision, prepared: PreparedCheck) -> Decision:
    return replace(decision, check_id=prepared.check_id, call_id=prepared.call_id)


def _seconds(value: float) -> str:
    """Seconds as a person reads them: whole from 10 on, else to a tenth ("1.1", not the
    "1.06416" of a measured wait)."""
    return f"{value:.0f}" if value >= 10 else f"{round(value, 1):g}"


def _joined(decision: Decision) -> str | None:
    """The service's own words of a decision, for its developer."""
    text = " ".join(t for t in (decision.message, decision.next_action) if t)
    return text or None


def approval_limit(settings: Settings, decision: Decision, started: float) -> float:
    """Until when (time.monotonic) a pending check waits for its operator."""
    limit = float("inf")
    expires = parse_time((decision.approval or {}).get("expires_at"))
    if expires is not None:
        # A little past the expiry: whoever looks first after it settles it (SPEC 11), and
        # the final answer (approval_expired) is worth having.
        limit = started + max(0.0, expires - time.time()) + 5.0
    if settings.approval_timeout is not None:
        limit = min(limit, started + settings.approval_timeout)
    return limit


def approval_final(body: Mapping[str, Any], prepared: PreparedCheck) -> Decision | None:
    """The final decision in a GET /approvals/{id} answer, once it is no longer pending."""
    if body.get("status") == "pending":
        return None
    final = body.get("decision")
    if isinstance(final, Mapping):
        return Decision.from_response(final, check_id=prepared.check_id, call_id=prepared.call_id)
    return None


def result_digest(result: Any) -> str:
    """SHA-256 hex of a stable serialization: the same output always gives the same digest.

    Text is hashed as UTF-8, bytes as is, anything else as sorted-keys JSON (dataclasses and
    objects with ``model_dump`` as their fields). Pass ``digest=`` to ``report`` for objects
    whose ``str`` is not stable.
    """
    import dataclasses

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.asdict(value)
        model_dump = getattr(value, "model_dump", None)
        if callable(model_dump):
            return model_dump()
        if isinstance(value, set | frozenset):
            return sorted(value, key=repr)
        return str(value)

    if isinstance(result, bytes | bytearray):
        data = bytes(result)
    elif isinstance(result, str):
        data = result.encode("utf-8")
    else:
        try:
            text = json.dumps(
                result, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=plain
            )
        except (TypeError, ValueError):
            text = repr(result)
        data = text.encode("utf-8")
    return hashlib.sha256(data).hexdigest()
