"""The agent HTTP API (SPEC section 5): thin views over runs/services.py.

django-ninja is used for one reason: the pydantic schemas that validate each request also
generate /api/v1/openapi.json, so the published contract is the code. Its own error shapes
are replaced by the SPEC 5.3 envelope in the handlers below.
"""

from __future__ import annotations

import json
import logging
import uuid
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError
from django.http import Http404, HttpRequest, HttpResponse
from django.utils import timezone
from ninja import NinjaAPI, Query, Status
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser
from ninja.security import HttpBearer

from policies.services import agent_key_authenticate, agent_key_touch

from . import schemas as s
from . import selectors
from .services import CheckRequest, ServiceError, run_check, run_finish, run_start

log = logging.getLogger(__name__)
MICRO = Decimal("0.000001")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


class StrictJsonParser(Parser):
    def parse_body(self, request: HttpRequest) -> Any:
        # NaN and Infinity are not JSON; Python's json would accept them.
        return json.loads(request.body, parse_constant=_reject_constant)


class AgentKeyAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Any:
        key = agent_key_authenticate(token)
        if key is not None:
            agent_key_touch(key)
        return key


api = NinjaAPI(
    title="Agent governance API",
    version="1",
    description="Check every agent action before it runs: allow or stop, with a reason.",
    urls_namespace="api",
    docs_url=None,
    openapi_url="/openapi.json",
    parser=StrictJsonParser(),
    auth=AgentKeyAuth(),
)


def error(status: int, code: str, message: str, fields: dict[str, str] | None = None
          ) -> HttpResponse:
    body = {"error": {"code": code, "message": message, "fields": fields or {}}}
    return HttpResponse(json.dumps(body), status=status, content_type="application/json")


def _field_path(loc: list[Any] | tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in {"body", "query", "path"}:
        parts = parts[1:]
    if parts and parts[0] in {"payload", "filters"}:
        parts = parts[1:]
    # pydantic names union branches ("str", "constrained-str", "int"...): drop them.
    kept = [p for p in parts if not (p.islower() and "-" in p) and p not in
            {"str", "int", "float", "function-after[_finite(), union[int,float]]"}
            and not p.startswith(("function-", "union["))]
    return ".".join(kept) or "body"


@api.exception_handler(ValidationError)
def _on_validation(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    fields: dict[str, str] = {}
    for err in exc.errors:
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        fields.setdefault(_field_path(err.get("loc", ())), msg)
    if "body" in fields and fields["body"].lower().startswith("field required"):
        fields["body"] = "a JSON object body is required"
    return error(422, "invalid_request", "The request is not valid.", fields)


@api.exception_handler(AuthenticationError)
def _on_auth(request: HttpRequest, exc: Exception) -> HttpResponse:
    return error(401, "unauthorized", "A valid agent key is required (Authorization: Bearer).")


@api.exception_handler(HttpError)
def _on_http(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if exc.status_code == 400:
        return error(400, "invalid_json", "The request body is not valid JSON.")
    return error(exc.status_code, "error", str(exc))


@api.exception_handler(Http404)
def _on_404(request: HttpRequest, exc: Exception) -> HttpResponse:
    return error(404, "not_found", "Not found.")


@api.exception_handler(ServiceError)
def _on_service(request: HttpRequest, exc: ServiceError) -> HttpResponse:
    return error(exc.status, exc.code, exc.message, exc.fields)


@api.exception_handler(Exception)
def _on_exception(request: HttpRequest, exc: Exception) -> HttpResponse:
    if isinstance(exc, OperationalError | InterfaceError):
        log.warning("store unavailable: %s", exc)
        return error(503, "unavailable", "A store is unavailable; retry later. Nothing decided.")
    if isinstance(exc, DatabaseError):
        # Not an outage, but nothing was committed either: never let it look like an allow.
        log.exception("database refused a write")
        return error(503, "unavailable", "The store refused the write; nothing was decided.")
    log.exception("unexpected error in the agent API")
    return error(500, "internal", "Internal error.")


ERRORS = {400: s.ErrorOut, 401: s.ErrorOut, 404: s.ErrorOut, 409: s.ErrorOut, 413: s.ErrorOut,
          422: s.ErrorOut, 503: s.ErrorOut}


def _run_uuid(run_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(run_id)
    except ValueError:
        raise ServiceError(404, "not_found", "No such run.") from None


@api.post("/runs", response={200: s.RunStartOut, 201: s.RunStartOut, **ERRORS},
          summary="Start a run", operation_id="start_run")
def start_run(request: HttpRequest, payload: s.RunStartIn) -> Status:
    run, created = run_start(
        key=request.auth, agent=payload.agent, policy=payload.policy, task=payload.task,
        metadata=payload.metadata, external_id=payload.external_id,
    )
    body = selectors.run_json(run)
    started = {k: body[k] for k in ("run_id", "agent", "started_at", "policy")}
    return Status(201 if created else 200, {**started, "status": run.status})


@api.get("/runs", response={200: s.RunsOut, **ERRORS}, summary="List runs",
         operation_id="list_runs")
def list_runs(request: HttpRequest, filters: Query[s.RunsFilter]) -> dict[str, Any]:
    runs = selectors.runs_for_team(
        request.auth.team, status=filters.status, agent=filters.agent, limit=filters.limit
    )
    return {"runs": [selectors.run_json(r) for r in runs]}


@api.get("/runs/{run_id}", response={200: s.RunOut, **ERRORS}, summary="Get a run",
         operation_id="get_run")
def get_run(request: HttpRequest, run_id: str) -> dict[str, Any]:
    return selectors.run_json(selectors.run_for_team(request.auth.team, _run_uuid(run_id)))


@api.get("/runs/{run_id}/decisions", response={200: s.DecisionsOut, **ERRORS},
         summary="A run's decisions, in order", operation_id="list_decisions")
def list_decisions(request: HttpRequest, run_id: str, filters: Query[s.DecisionsFilter]
                   ) -> dict[str, Any]:
    run = selectors.run_for_team(request.auth.team, _run_uuid(run_id))
    rows = selectors.decisions_of(run, after=filters.after, limit=filters.limit)
    return {"decisions": [selectors.decision_json(d) for d in rows]}


@api.post("/runs/{run_id}/check", response={200: s.CheckOut, **ERRORS},
          summary="Check the agent's next action", operation_id="check")
def check(request: HttpRequest, run_id: str, payload: s.CheckIn) -> dict[str, Any]:
    cost = Decimal(str(payload.cost_usd or 0)).quantize(MICRO, rounding=ROUND_HALF_UP)
    req = CheckRequest(
        name=payload.action.name, type=payload.action.type, args=payload.action.args or {},
        progress=payload.progress,
        last_result=payload.last_result.model_dump(exclude_none=True)
        if payload.last_result else None,
        cost_usd=cost, check_id=payload.check_id,
    )
    return run_check(team=request.auth.team, run_id=_run_uuid(run_id), req=req)


@api.post("/runs/{run_id}/finish", response={200: s.RunOut, **ERRORS}, summary="Finish a run",
          operation_id="finish_run")
def finish(request: HttpRequest, run_id: str, payload: s.FinishIn) -> dict[str, Any]:
    run = run_finish(team=request.auth.team, run_id=_run_uuid(run_id), status=payload.status,
                     output=payload.output)
    return selectors.run_json(run, now=timezone.now())
