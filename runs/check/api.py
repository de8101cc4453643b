"""The agent HTTP API (SPEC section 5): thin views over runs/check/services.py (the check),
runs/check/lifecycle.py (start, finish) and runs/check/local.py (local decisions).

django-ninja is used for one reason: the pydantic schemas that validate each request also
generate /api/v1/openapi.json, so the published contract is the code. Its own error shapes
are replaced by the SPEC 5.3 envelope in the handlers below.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import Any

from django.conf import settings
from django.core.exceptions import SuspiciousOperation, TooManyFieldsSent
from django.db import DatabaseError, InterfaceError, OperationalError
from django.http import Http404, HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.utils import timezone
from django.views.decorators.http import require_safe
from ninja import NinjaAPI, Query, Status
from ninja.decorators import decorate_view
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser
from ninja.security import HttpBearer
from pydantic import ValidationError as PydanticValidationError

from governance import fastjson
from governance.errors import AppError
from policies.services import agent_key_authenticate, agent_key_claim, agent_key_touch
from policies.tokens import is_operator_token
from runs import first_look, telemetry
from runs.approvals import selectors as approvals
from runs.approvals.waits import (
    approval_waits,
    off_the_api_pool,
)
from runs.audit import selectors
from runs.check import callers, edge, metrics
from runs.check import schemas as s
from runs.check.edge import bearer_token, error, run_busy
from runs.check.lifecycle import run_finish, run_start
from runs.check.local import run_local_decisions
from runs.check.services import run_check

log = logging.getLogger(__name__)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


class StrictJsonParser(Parser):
    def parse_body(self, request: HttpRequest) -> Any:
        # NaN and Infinity are not JSON; Python's json would accept them.
        return json.loads(request.body, parse_constant=_reject_constant)


def wrong_kind() -> AppError:
    """An operator token on an agent endpoint (SPEC 17): told by its shape, nothing looked up."""
    return AppError(403, "wrong_credential_kind",
                    "This is an operator token (gov_op_...): the agent API takes agent keys.")


class AgentKeyAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Any:
        if is_operator_token(token):
            raise wrong_kind()
        key = agent_key_authenticate(token)
        if key is not None:
            agent_key_touch(key.pk, key.last_used_at)
            claim = agent_key_claim(token)
            if claim is not None:  # its team's share of the API's threads (runs/check/callers.py)
                callers.remember(claim.digest, key.team_id)
        return key


# The OpenAPI document's bytes, by the path it is served at (the one the API is mounted
# at, in practice). django-ninja builds the document from the code on every request: 71 KB,
# 150 to 190 ms of a thread's CPU, and anonymous (found by an attacker: two clients looping
# on it made another team's check p99 10 to 20x). It changes only with the code, so a
# process builds it once, on its first request, and serves the same bytes after.
_documents: dict[str, bytes] = {}
_documents_lock = threading.Lock()


def _document_once(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """django-ninja's document view (answering GET and HEAD only), built once per process
    and path: concurrent first requests wait for the one build rather than each make it."""

    @require_safe
    def document(request: HttpRequest, **kwargs: Any) -> HttpResponse:
        content = _documents.get(request.path)
        if content is None:
            with _documents_lock:
                content = _documents.get(request.path)
                if content is None:
                    made = view(request, **kwargs)
                    if made.status_code != 200:
                        return made
                    content = _documents[request.path] = made.content
        return HttpResponse(content, content_type="application/json")

    return document


api = NinjaAPI(
    title="Agent governance API",
    version="1",
    description="Check every agent action before it runs: allow or stop, with a reason.",
    urls_namespace="api",
    docs_url=None,
    openapi_url="/openapi.json",
    docs_decorator=_document_once,
    parser=StrictJsonParser(),
    auth=AgentKeyAuth(),
)


def _field_path(loc: list[Any] | tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in {"body", "query", "path"}:
        parts = parts[1:]
    if parts and parts[0] in {"payload", "filters"}:
        parts = parts[1:]
    # pydantic names union branches ("str", "constrained-str", "int"...): drop them.
    kept = [p for p in parts if not (p.islower() and "-" in p) and p not in
            {"str", "int", "float"}
            and not p.startswith(("function-", "union["))]
    return ".".join(kept) or "body"


@api.exception_handler(ValidationError)
def _on_validation(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    fields: dict[str, str] = {}
    for err in exc.errors:
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        path = _field_path(err.get("loc", ()))
        if err.get("type") == s.LOCAL_DECISION_UNKNOWN:  # placed on the entry by pydantic
            path += ".decision"
        fields.setdefault(path, msg)
    if "body" in fields and fields["body"].lower().startswith("field required"):
        fields["body"] = "a JSON object body is required"
    return error(422, "invalid_request", "The request is not valid.", fields)


@api.exception_handler(AuthenticationError)
def _on_auth(request: HttpRequest, exc: Exception) -> HttpResponse:
    return error(401, "unauthorized", "A valid agent key is required (Authorization: Bearer).")


@api.exception_handler(HttpError)
def _on_http(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if exc.status_code == 400:
        cause = exc.__cause__
        if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
            # Valid JSON all the same: Python refuses to read an integer past 4,300 digits
            # (a guard against quadratic-time parsing), so the body cannot be taken.
            return error(400, "invalid_json", "A number in the request body has more than "
                         f"{sys.get_int_max_str_digits()} digits.")
        if isinstance(cause, RecursionError):
            # Valid JSON too, nested past what the parser reads: said so, not "not JSON".
            return error(400, "invalid_json", "The request body nests too deeply to be read.")
        return error(400, "invalid_json", "The request body is not valid JSON.")
    return error(exc.status_code, "error", str(exc))


# PostgreSQL's lock_not_available: a lock wait past lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"


@api.exception_handler(Http404)
def _on_404(request: HttpRequest, exc: Exception) -> HttpResponse:
    # What was not found, where the code said ("No such decision."; found by a newcomer).
    return error(404, "not_found", str(exc) or "Not found.")


@api.exception_handler(SuspiciousOperation)
def _on_suspicious(request: HttpRequest, exc: SuspiciousOperation) -> HttpResponse:
    """Django's refusals of a request's shape as it reads it (found by an attacker: 1,001
    query parameters answered 500 on every endpoint that reads a query)."""
    if isinstance(exc, TooManyFieldsSent):
        return error(422, "invalid_request", "The request has too many parameters.", {
            "query": f"at most {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} parameters"})
    return error(400, "bad_request", f"The request was refused: {exc}")


@api.exception_handler(AppError)
def _on_refusal(request: HttpRequest, exc: AppError) -> HttpResponse:
    """Whatever the services refuse, in the SPEC 5.3 envelope (governance/errors.py)."""
    refused = error(exc.status, exc.code, exc.message, exc.fields)
    if exc.retry_after_s is not None:
        refused["Retry-After"] = str(exc.retry_after_s)
    return refused


@api.exception_handler(Exception)
def _on_exception(request: HttpRequest, exc: Exception) -> HttpResponse:
    if getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE:
        # The check's bounded wait for its run's lock ran out (check_store.BEGIN_CHECK):
        # another request of the run holds it. Nothing was decided; the client retries.
        return run_busy()
    if isinstance(exc, OperationalError | InterfaceError):
        log.warning("store unavailable: %s", exc)
        return error(503, "unavailable", "A store is unavailable; retry later. Nothing decided.")
    if isinstance(exc, DatabaseError):
        # Not an outage, but nothing was committed either: never let it look like an allow.
        log.exception("database refused a write")
        return error(503, "unavailable", "The store refused the write; nothing was decided.")
    log.exception("unexpected error in the agent API")
    return error(500, "internal", "Internal error.")


# 429 is `too_many_failures`: a key that keeps failing from one address (governance/throttle.py);
# for the approval long poll, `too_many_waits` too (runs/approvals/waits.py).
# 403 is `wrong_credential_kind`: an operator token (SPEC 17).
ERRORS = {400: s.ErrorOut, 401: s.ErrorOut, 403: s.ErrorOut, 404: s.ErrorOut, 409: s.ErrorOut,
          413: s.ErrorOut, 422: s.ErrorOut, 429: s.ErrorOut, 503: s.ErrorOut}


def _run_uuid(run_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(run_id)
    except ValueError:
        raise AppError(404, "not_found", "No such run.") from None


# OpenAPI links: a started run's id feeds the run's other operations, so clients and
# stateful API testers (tests/test_api_schema.py) can follow a run through its life.
_RUN_LINKS = {
    name: {"operationId": operation, "parameters": {"run_id": "$response.body#/run_id"}}
    for name, operation in [("GetRun", "get_run"), ("ListDecisions", "list_decisions"),
                            ("Check", "check"), ("FinishRun", "finish_run")]
}


# A schema-valid start can still be refused: `policy` names one of the key's team's policies,
# which no schema can list. The document says so, so that a client (or a fuzzer) reading it
# expects the 422 rather than taking it for a break of the contract.
_START_422 = ("`invalid_request`, `fields` naming each field at fault: the body breaks the "
              "schema, or `policy` names no policy of the key's team (`fields.policy`: "
              "\"no policy named 'x' in this team\"), or `agent` is not the agent an "
              "agent-bound key is limited to (`fields.agent`), or `parent_run_id` names a "
              "run at the deepest level of its tree (SPEC 20: 5 below the root). A "
              "`parent_run_id` of no run of the key's team answers 404 naming the field; a "
              "parent that is over, 409 `parent_finished`.")


@api.post("/runs", response={200: s.RunStartOut, 201: s.RunStartOut, **ERRORS},
          summary="Start a run", operation_id="start_run",
          openapi_extra={"responses": {200: {"links": _RUN_LINKS},
                                       201: {"links": _RUN_LINKS},
                                       422: {"description": _START_422}}})
def start_run(request: HttpRequest, payload: s.RunStartIn) -> Status:
    with telemetry.span("governance.start", meta=request.META,
                        attributes={"governance.agent": payload.agent,
                                    "gen_ai.agent.name": payload.agent}) as span:
        run, created = run_start(
            key=request.auth, agent=payload.agent, policy=payload.policy, task=payload.task,
            metadata=payload.metadata, external_id=payload.external_id,
            parent_run_id=payload.parent_run_id,
        )
        body = selectors.run_json(run)
        if span is not None:
            telemetry.annotate(span, _run_attributes(request, body, created=created))
    started = {k: body[k] for k in ("run_id", "agent", "started_at", "policy",
                                    "parent_run_id", "root_run_id")}
    return Status(201 if created else 200, {**started, "status": run.status})


@api.get("/runs", response={200: s.RunsOut, **ERRORS}, summary="List runs",
         operation_id="list_runs")
def list_runs(request: HttpRequest, filters: Query[s.RunsFilter]) -> HttpResponse:
    first_look.look(request.auth.team)  # whoever looks first settles (SPEC 11, 14), a share
    return HttpResponse(selectors.runs_page(
        request.auth.team, status=filters.status, agent=filters.agent, limit=filters.limit,
        after=filters.after, key_agent=request.auth.agent,
    ), content_type="application/json; charset=utf-8")


@api.get("/runs/{run_id}", response={200: s.RunOut, **ERRORS}, summary="Get a run",
         operation_id="get_run")
def get_run(request: HttpRequest, run_id: str) -> dict[str, Any]:
    return selectors.run_tree_json(_looked_at_run(request, run_id),
                                   key_agent=request.auth.agent)


def _looked_at_run(request: HttpRequest, run_id: str) -> Any:
    """The key's run, what is due on it settled first (whoever looks first, SPEC 11, 14)."""
    return first_look.look_at_run(selectors.run_for_team(
        request.auth.team, _run_uuid(run_id), key_agent=request.auth.agent))


@api.get("/runs/{run_id}/decisions", response={200: s.DecisionsOut, **ERRORS},
         summary="A run's decisions, in order", operation_id="list_decisions")
def list_decisions(request: HttpRequest, run_id: str, filters: Query[s.DecisionsFilter]
                   ) -> HttpResponse:
    run = _looked_at_run(request, run_id)
    return HttpResponse(selectors.decisions_page(run, after=filters.after, limit=filters.limit),
                        content_type="application/json")


@api.get("/decisions/{decision_id}", response={200: s.DecisionDetailOut, **ERRORS},
         summary="One decision and the rule that made it", operation_id="get_decision")
def get_decision(request: HttpRequest, decision_id: str) -> HttpResponse:
    """SPEC 16: another team's or (for an agent-bound key) another agent's decision answers
    404, like one that does not exist."""
    found = selectors.decision_for_key(request.auth.team, decision_id,
                                       key_agent=request.auth.agent)
    return HttpResponse(selectors.decision_detail_body(found), content_type="application/json")


def _check_payload(request: HttpRequest) -> s.CheckIn:
    """The body validated by the CheckIn schema, with ninja's errors for bad input (400 for
    a body that is not JSON, 422 naming the fields), but without ninja's per-request models."""
    if not request.body:
        raise ValidationError([{"type": "missing", "loc": ("body", "payload"),
                                "msg": "Field required"}])
    try:
        data = json.loads(request.body, parse_constant=_reject_constant)
    except Exception as exc:  # as ninja: anything that fails to parse is a 400
        raise HttpError(400, "Cannot parse request body") from exc
    try:
        return s.CheckIn.model_validate(data)
    except PydanticValidationError as exc:
        raise ValidationError([
            {"type": e["type"], "loc": ("body", "payload", *e["loc"]), "msg": e["msg"]}
            for e in exc.errors(include_url=False)
        ]) from None


def _serve_check(request: HttpRequest, run_id: str, received: float | None = None
                 ) -> HttpResponseBase:
    # META: request.headers would build a mapping of every header for this one.
    token = bearer_token(request.META.get("HTTP_AUTHORIZATION"))
    claim = agent_key_claim(token) if token else None
    if claim is None:
        if is_operator_token(token):
            raise wrong_kind()
        raise AuthenticationError()
    try:
        payload = _check_payload(request)
        run_uuid = _run_uuid(run_id)
    except Exception:
        # The key is only looked up with the run, so a refusal of the body or the run id
        # checks it first: an unknown or revoked key answers 401 before anything else.
        if agent_key_authenticate(token or "") is None:
            raise AuthenticationError() from None
        raise
    request.auth = claim  # type: ignore[attr-defined]
    request.governance_received = received  # type: ignore[attr-defined]
    return _check(request, run_uuid, payload)


def _without_ninja_validation(run: Any) -> Any:
    """Replaces ninja's handling of the check (its Operation.run; see decorate_view).

    The check is on the path of every agent step. What this skips: the bearer auth's own
    database lookup (the key is looked up in the check's locking statement instead), the
    request models wrapping the body, and the validation and re-encoding of the answer
    against CheckOut, which run_check already builds in that shape: together about 0.1 ms
    of Python per check (the benchmark's in-process phase, docs/performance.md) on top of a
    query. The operation stays declared as usual, so /api/v1/openapi.json still documents
    CheckIn, CheckOut, the errors and the bearer scheme from the schemas.
    """
    def run_check_operation(request: HttpRequest, **path: Any) -> HttpResponseBase:
        return check_operation(request, path["run_id"])

    return run_check_operation


def check_operation(request: HttpRequest, run_id: str) -> HttpResponseBase:
    """The check, answered: called by ninja (above) or, under `manage.py serve`, by the ASGI
    application without Django's handler (governance/direct.py, registered below). Every
    error becomes its answer here."""
    started = time.perf_counter()
    received = time.monotonic()
    with telemetry.check_span(request.META) as trace:
        try:
            response = _serve_check(request, run_id, received)
        except Exception as exc:
            response = api.on_exception(request, exc)
        if trace is not None:
            _traced_answer(request, trace, response)
    metrics.check_answered(time.perf_counter() - started)
    return response


def _traced_answer(request: HttpRequest, trace: telemetry.CheckTrace,
                   response: HttpResponseBase) -> None:
    """The check's answer (or its refusal's code) on its span (SPEC 18)."""
    answer = getattr(request, "governance_answer", None)
    code = None
    if answer is None and isinstance(response, HttpResponse):
        try:
            code = json.loads(response.content).get("error", {}).get("code")
        except Exception:
            code = None
    telemetry.check_answered(trace, name=getattr(request, "governance_action", None),
                             status=response.status_code, answer=answer, error_code=code)


@api.post("/runs/{run_id}/check", response={200: s.CheckOut, **ERRORS},
          summary="Check the agent's next action", operation_id="check")
@decorate_view(_without_ninja_validation)
def check(request: HttpRequest, run_id: str, payload: s.CheckIn) -> HttpResponse:
    # Declared for the schema; _serve_check, which replaces ninja's handling, calls _check.
    return _check(request, _run_uuid(run_id), payload)


edge.serve_directly("api:check", check_operation)


def _check(request: HttpRequest, run_id: uuid.UUID, payload: s.CheckIn) -> HttpResponse:
    request.governance_action = payload.action.name  # type: ignore[attr-defined]
    answer = run_check(claim=request.auth, run_id=run_id, check=payload.to_check(),
                       deadline=_deadline(request, payload.deadline_ms, payload.deadline_at))
    request.governance_answer = answer  # type: ignore[attr-defined]
    return HttpResponse(fastjson.dumps(answer), content_type="application/json")


def _deadline(request: HttpRequest, deadline_ms: float | None,
              deadline_at: datetime | None = None) -> float | None:
    """The monotonic time past which the agent stops waiting, the earlier of two.

    ``deadline_ms`` counts from when the check was received, on the server's clock alone,
    so skew between hosts does not matter; but "received" is when the server read it: a
    check that sat in the socket's queue of a frozen or swamped server would get its whole
    budget again, and be decided (an allow audited) after the agent gave up. So
    ``deadline_at``, the agent's own moment, bounds it too, with CHECK_CLOCK_SKEW_MS of
    allowance for the agent's clock being behind the server's."""
    ends = []
    if deadline_ms is not None:
        received = getattr(request, "governance_received", None) or time.monotonic()
        ends.append(float(received) + deadline_ms / 1000)
    if deadline_at is not None:
        if deadline_at.tzinfo is None:
            deadline_at = deadline_at.replace(tzinfo=UTC)
        left = (deadline_at - datetime.now(UTC)).total_seconds()
        ends.append(time.monotonic() + left + settings.CHECK_CLOCK_SKEW_MS / 1000)
    return min(ends) if ends else None


@api.post("/runs/{run_id}/local-decisions", response={200: s.LocalDecisionsOut, **ERRORS},
          summary="Upload the decisions a fail-open client made while the service was down",
          operation_id="upload_local_decisions")
def upload_local_decisions(request: HttpRequest, run_id: str, payload: s.LocalDecisionsIn
                           ) -> dict[str, Any]:
    entries = []
    for entry in payload.decisions:
        data = entry.model_dump()
        data["action"]["args"] = data["action"].get("args") or {}
        if data["last_result"] is not None:
            data["last_result"] = {k: v for k, v in data["last_result"].items() if v is not None}
        at = data.get("at")
        if at is not None and at.tzinfo is None:
            data["at"] = at.replace(tzinfo=UTC)
        entries.append(data)
    run, recorded, skipped = run_local_decisions(team=request.auth.team, run_id=_run_uuid(run_id),
                                                 entries=entries, key_agent=request.auth.agent)
    return {"recorded": recorded, "skipped": skipped,
            "run": selectors.run_json(run, now=timezone.now())}


@api.post("/runs/{run_id}/finish", response={200: s.RunOut, **ERRORS}, summary="Finish a run",
          operation_id="finish_run")
def finish(request: HttpRequest, run_id: str, payload: s.FinishIn) -> dict[str, Any]:
    with telemetry.span("governance.finish", meta=request.META,
                        attributes={"governance.run.id": run_id}) as span:
        run = run_finish(team=request.auth.team, run_id=_run_uuid(run_id),
                         status=payload.status, output=payload.output,
                         key_agent=request.auth.agent)
        body = selectors.run_json(run, now=timezone.now())
        if span is not None:
            telemetry.annotate(span, _run_attributes(request, body))
    return body


def _run_attributes(request: HttpRequest, body: dict[str, Any], created: bool | None = None
                    ) -> dict[str, Any]:
    """A run's span attributes (SPEC 18), from its API answer."""
    policy = body.get("policy") or {}
    return {"governance.run.id": body.get("run_id"), "governance.agent": body.get("agent"),
            "gen_ai.agent.name": body.get("agent"), "governance.run.status": body.get("status"),
            "governance.team": request.auth.team.slug, "governance.policy.name": policy.get("name"),
            "governance.policy.version": policy.get("version"),
            "governance.run.created": created}


# --- Approvals (SPEC 11) -----------------------------------------------------------------------

def _read_approval_now(key: Any, approval_id: uuid.UUID) -> dict[str, Any] | None:
    approval = approvals.approval_for_key(key, approval_id)
    if approval is None:
        return None
    if first_look.look_at_approval(approval):  # whoever looks first settles (SPEC 11)
        approval = approvals.approval_for_key(key, approval_id)
    return approvals.approval_json(approval) if approval is not None else None


async def _read_approval(key: Any, approval_id: uuid.UUID) -> dict[str, Any] | None:
    """The poll's own look at the approval (settling its expiry if due), on the look lane
    with the team's turn, never on the API pool: a burst of polls (500 agents asking again
    at once after their waits ended) then takes its turns there instead of queueing the
    checks of every team behind it (measured: 12 checks/s instead of 227 in the burst)."""
    return await off_the_api_pool(partial(_read_approval_now, key, approval_id),
                                  viewer=("approvals", key.team_id))


@api.get("/approvals/{approval_id}", response={200: s.ApprovalOut, **ERRORS},
         summary="An approval request, waiting up to `wait` seconds for its decision",
         operation_id="get_approval")
async def get_approval(request: HttpRequest, approval_id: str, filters: Query[s.ApprovalWait]
                       ) -> HttpResponse:
    """A real long poll: answers as soon as the status changes, else after ``wait`` seconds.

    An async view: the poll's own look at the approval (settling what is due) runs on the API
    pool, as any API read; then, while it waits, it holds no thread and costs no work of its
    own: the team's polls in this process share one watcher and one database look per
    wake-up, off the API pool (runs/approvals/waits.py). Past the key's or the team's cap of
    waiting polls it answers 429 ``too_many_waits`` at once. The answer is the approval as
    JSON, its ``decision`` the check's final answer verbatim.
    """
    try:
        wanted = uuid.UUID(approval_id)
    except ValueError:
        raise AppError(404, "not_found", "No such approval.") from None
    key = request.auth
    seen = approval_waits.seen(key.team_id)
    body = await _read_approval(key, wanted)
    if body is None:
        raise AppError(404, "not_found", "No such approval.")
    if body["status"] == "pending" and filters.wait > 0:
        # Over the key's or the team's cap: 429 too_many_waits with a Retry-After.
        with approval_waits.slot(key_id=key.pk, team_id=key.team_id):
            outcome = await approval_waits.wait(
                team_id=key.team_id, approval_id=body["id"], run_id=body["run_id"],
                expires_at=datetime.fromisoformat(body["expires_at"]), seen=seen,
                timeout=filters.wait)
        if outcome is not None:
            if outcome.body is None:  # deleted by retention while waiting
                raise AppError(404, "not_found", "No such approval.")
            body = outcome.body
    return HttpResponse(approvals.dumps(body), content_type="application/json")
