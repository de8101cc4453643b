"""The operator API (SPEC 17): under /api/v1/, in the agent API's OpenAPI document with its own
security scheme (`OperatorTokenAuth`), answering the JSON errors of SPEC 5.3.

Every view is thin: it finds the team the token may see (404 for any other, as the dashboard's
`team_view`), checks the role of SPEC 7 the dashboard's view of the same action asks for
(403 ``forbidden``), and calls the very service or selector that view calls: policies
(`policies.services.policy_save`, the save's confirmation `policies.impact`), the backtest
(`backtests.services.backtest_start`: a worker replays, as for the editor), the kill switch
(`runs.killswitch.services`, who may release from `runs.killswitch.selectors.may_release`),
approvals (`runs.approvals.services.approval_decide`) and the runs' reads
(`runs.audit.selectors`, after the look of `runs.first_look`). No rule is written twice
here: the refusals (422, 409) are the services'.

Each request runs in its own copy of the context, in which the token is the acting one
(`policies.tokens.acting`): every audit event the services write names it, and a read writes
one event of its own (``token.read``), so every use of a token is in the audit log.

Serving: these paths run on the server's operator pool, never on the agents' API pool
(`governance.pools.pool_name`), so an operator call never takes a check's thread (SPEC 21);
a backtest waits for its replay on a pool of its own, so it never takes a kill switch's.
"""

from __future__ import annotations

import contextvars
import json
import re
import uuid
from collections.abc import Callable
from functools import wraps
from typing import Annotated, Any, ClassVar, Literal

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from ninja import NinjaAPI, Query, Router, Schema
from ninja.security import HttpBearer
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_validator,
)

from backtests.inputs import MAX_LIMIT, InputError, parse_since
from backtests.models import Status as BacktestStatus
from backtests.services import Busy, backtest_start, backtest_wait
from governance.errors import AppError
from governance.text import text_problem
from policies import impact
from policies import selectors as policy_reads
from policies.access import can
from policies.document import POLICY_NAME, SLUG, DocumentError, parse_policy
from policies.egress import masked_url
from policies.models import OperatorRelease, Policy, PolicyVersion, Role, Team
from policies.services import agent_key_claim, audit, policy_save, policy_would_save
from policies.tokens import (
    acting_token,
    is_operator_token,
    operator_token_authenticate,
    token_is_superuser,
    token_label,
    token_role,
    token_teams,
)
from runs import due, first_look
from runs.approvals import selectors as approval_reads
from runs.approvals.services import approval_decide
from runs.audit import selectors as run_reads
from runs.check.edge import bearer_token
from runs.check.schemas import DecisionsFilter, ErrorOut, RunsFilter
from runs.killswitch import selectors as switches
from runs.killswitch.services import (
    a_switch,
    killswitch_engage,
    killswitch_release,
    resolve_target,
)
from runs.models import Approval, ApprovalStatus, KillSwitch, Run, Scope

# --- Authentication ----------------------------------------------------------------------------

class OperatorTokenAuth(HttpBearer):
    """``Authorization: Bearer gov_op_...``: an operator token (policies/tokens.py)."""

    openapi_description = ("An operator token (`gov_op_...`), made on the account page or "
                           "with `manage.py create_operator_token`. Agent keys are refused "
                           "(403 `wrong_credential_kind`).")

    def __call__(self, request: HttpRequest) -> Any:
        token = bearer_token(request.META.get("HTTP_AUTHORIZATION"))
        if token is None:
            raise AppError(401, "unauthorized",
                           "An operator token is required (Authorization: Bearer gov_op_...).")
        return self.authenticate(request, token.strip())

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        if not is_operator_token(token) and agent_key_claim(token) is not None:
            # Told by its shape: nothing is looked up, so the answer says nothing of the key.
            raise AppError(403, "wrong_credential_kind",
                           "This is an agent key: the operator API takes operator tokens "
                           "(gov_op_...).")
        found = operator_token_authenticate(token)  # 401 with its code otherwise
        acting_token.set(found)  # in this request's own context (`_own_context`)
        return found


def _own_context(view: Callable[..., Any]) -> Callable[..., Any]:
    """The view in a copy of the context: the acting token set by the authentication ends
    with the request, whatever thread served it."""
    @wraps(view)
    def run(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return contextvars.copy_context().run(view, request, *args, **kwargs)

    return run


router = Router(auth=OperatorTokenAuth(), tags=["operator"])
router.add_decorator(_own_context, mode="view")

# 413: the API's middleware refuses a body over the upload limit before any view runs
# (governance/middleware.py `JsonApiErrorsMiddleware`), an operator call's too.
ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut,
          413: ErrorOut, 422: ErrorOut, 429: ErrorOut, 503: ErrorOut}


def _storable(value: str | None) -> str | None:
    """What is accepted must be storable on every database (a NUL is refused), as the agent
    API's text fields (runs/check/schemas.py); the published schema says so."""
    problem = text_problem(value) if value is not None else None
    if problem is not None:
        raise ValueError(problem)
    return value


_NO_NUL = {"not": {"pattern": "\\u0000"}}
Storable = AfterValidator(_storable)


def _forbidden(needed: str) -> AppError:
    return AppError(403, "forbidden", f"This needs the {needed} role.")


def _team(request: HttpRequest, slug: str, needed: Role = Role.VIEWER) -> tuple[Team, Role]:
    """The team and the token's role in it: 404 for a team it does not see (another team is
    as absent as a missing one), 403 for a role below ``needed``."""
    token = request.auth  # type: ignore[attr-defined]
    # A path segment no slug can be (a NUL, which PostgreSQL refuses in a query: a 503
    # otherwise) is as absent as a missing team, and costs no query.
    team = Team.objects.filter(slug=slug).first() if re.fullmatch(SLUG, slug) else None
    role = token_role(token, team) if team is not None else None
    if team is None or role is None:
        raise AppError(404, "not_found", "No such team.")
    # Said to the server's pacing (governance/asgi.py `shared_request`), as `team_view` says
    # it of a page: this call found the token the team's; one that did not (its token dead,
    # its owner no longer a member) is no longer paced as the team's.
    request.role = role  # type: ignore[attr-defined]
    if not can(role, needed):
        raise _forbidden(needed.label)
    return team, role


def _read(request: HttpRequest, team: Team | None, action: str = "token.read") -> None:
    """A use of a token that no service audits, in the audit log (SPEC 17: every use names
    the token): a read, or a write that changed nothing (``token.unchanged``)."""
    audit(actor=request.auth.user, action=action, team=team,  # type: ignore[attr-defined]
          target=f"{request.method} {request.get_full_path()}"[:200])


# --- Teams and policies ------------------------------------------------------------------------

class TeamOut(Schema):
    slug: str
    name: str
    role: str


class TeamsOut(Schema):
    teams: list[TeamOut]


@router.get("/teams", response={200: TeamsOut, **ERRORS}, summary="The teams the token sees",
            operation_id="operator_list_teams")
def list_teams(request: HttpRequest) -> dict[str, Any]:
    token = request.auth  # type: ignore[attr-defined]
    teams = []
    for team in token_teams(token):
        role = token_role(token, team)
        if role is not None:
            teams.append({"slug": team.slug, "name": team.name, "role": role.value})
    _read(request, None)
    return {"teams": teams}


class PolicyVersionOut(Schema):
    name: str
    version: int
    created_at: str
    created_by: str | None
    source: str
    note: str
    document: dict[str, Any]


class PolicySavedOut(PolicyVersionOut):
    changed: bool | None = None
    dry_run: bool = False


class PoliciesOut(Schema):
    team: dict[str, Any]
    policies: list[PolicyVersionOut]


class VersionsOut(Schema):
    versions: list[PolicyVersionOut]
    # Older versions remain: ask again with `?before=<the last one's version>`.
    more: bool = False


def version_json(name: str, version: PolicyVersion) -> dict[str, Any]:
    return {"name": name, "version": version.version,
            "created_at": approval_reads.iso(version.created_at),
            "created_by": version.created_by.get_username() if version.created_by else None,
            "source": version.source, "note": version.note, "document": version.document}


def _policy(team: Team, name: str) -> Policy:
    if not re.fullmatch(POLICY_NAME, name):  # as `_team`: no query for what no name can be
        raise AppError(404, "not_found", "No such policy.")
    policy = Policy.objects.filter(team=team, name=name).select_related(
        "current__created_by").first()
    if policy is None or policy.current is None:
        raise AppError(404, "not_found", "No such policy.")
    return policy


@router.get("/teams/{slug}/policies", response={200: PoliciesOut, **ERRORS},
            summary="A team's policies, current versions", operation_id="operator_list_policies")
def list_policies(request: HttpRequest, slug: str) -> dict[str, Any]:
    team, role = _team(request, slug)
    _read(request, team)
    # Whole for an admin only, as every page shows it (docs/killswitch.md): a Slack or
    # Discord URL is a credential.
    url = team.webhook_url if can(role, Role.ADMIN) or not team.webhook_url \
        else masked_url(team.webhook_url)
    return {"team": {"slug": team.slug, "name": team.name, "webhook_url": url},
            "policies": [version_json(p.name, p.current) for p in policy_reads.policies_of(team)
                         if p.current is not None]}


class VersionQuery(Schema):
    version: int | None = Field(default=None, ge=1)


class VersionsQuery(Schema):
    before: int | None = Field(default=None, ge=1)
    limit: int = Field(default=50, ge=1, le=200)


@router.get("/teams/{slug}/policies/{name}", response={200: PolicyVersionOut, **ERRORS},
            summary="A policy: its current version, or `?version=N`",
            operation_id="operator_get_policy")
def get_policy(request: HttpRequest, slug: str, name: str, query: Query[VersionQuery]
               ) -> dict[str, Any]:
    team, _ = _team(request, slug)
    policy = _policy(team, name)
    version = policy.current
    if query.version is not None:
        version = policy.versions.select_related("created_by").filter(
            version=query.version).first()
        if version is None:
            raise AppError(404, "not_found", f"Policy {name} has no version {query.version}.")
    _read(request, team)
    return version_json(policy.name, version)


@router.get("/teams/{slug}/policies/{name}/versions", response={200: VersionsOut, **ERRORS},
            summary="A policy's versions, newest first (`?limit=`, `?before=N`: older pages)",
            operation_id="operator_list_versions")
def list_versions(request: HttpRequest, slug: str, name: str, query: Query[VersionsQuery]
                  ) -> dict[str, Any]:
    team, _ = _team(request, slug)
    policy = _policy(team, name)
    versions, more = policy_reads.versions_of(policy, before=query.before, limit=query.limit)
    _read(request, team)
    return {"versions": [version_json(policy.name, v) for v in versions], "more": more}


class PolicyPutIn(BaseModel):  # pydantic's own: ninja's Schema drops the extra fields
    """One policy as the YAML document's policy object (its `name` may be left out, and must
    equal the URL's when given), with the change's `note`; `confirm_stops: true` confirms a
    change that would stop most recent runs at once (docs/policies.md); `dry_run: true`
    answers what the save would (the version it would make, or a refusal) and saves nothing:
    `govctl policies apply` checks every policy of a file so before it saves any."""

    model_config = ConfigDict(extra="allow")
    note: Annotated[str, Field(min_length=1, max_length=500, json_schema_extra=_NO_NUL),
                    Storable]
    confirm_stops: bool = False
    dry_run: bool = False

    @model_validator(mode="wrap")
    @classmethod
    def _every_bad_field(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A 422 names each bad field (SPEC 17): when the request's own fields (``note``,
        ``confirm_stops``...) are bad, the policy's bad fields are named with them, not only
        once the note is right (found by a review: a body without its note and with a bad
        limit named the note alone, and the limit at the next try)."""
        try:
            return handler(data)
        except ValidationError as exc:
            if not isinstance(data, dict):
                raise
            policy = {k: v for k, v in data.items() if k not in cls.model_fields}
            problems = _policy_problems(policy) if policy or cls.policy_required else {}
            if not problems:
                raise
            own: dict[str, str] = {}
            for err in exc.errors():
                path = ".".join(str(p) for p in err["loc"]) or "body"
                own.setdefault(path, str(err["msg"]).removeprefix("Value error, "))
            # AppError is no ValueError: pydantic lets it through, to the API's handler.
            raise AppError(422, "invalid_request", "The request is not valid.",
                           {**own, **problems}) from None

    #: Whether a body without any policy field is a policy missing (a PUT), or the current
    #: version (a backtest).
    policy_required: ClassVar[bool] = True


def _policy_problems(policy: dict[str, Any]) -> dict[str, str]:
    """The bad fields of a body's policy as SPEC 3 names them (the URL's name is checked by
    the view, once the request's own fields are right)."""
    try:
        parse_policy({"name": "default", **policy})
    except DocumentError as exc:
        return exc.errors
    return {}


def _draft(name: str, extra: dict[str, Any] | None) -> dict[str, Any]:
    """The policy of a body, validated as SPEC 3 (422 naming each bad field)."""
    data = dict(extra or {})
    given = data.get("name", name)
    if given != name:
        raise AppError(422, "invalid_request", "The policy's name must be the URL's.",
                       {"name": f"must be {name!r} (the URL's) or left out"})
    data["name"] = name
    try:
        return parse_policy(data)
    except DocumentError as exc:
        raise AppError(422, "invalid_request", "The policy is not valid.", exc.errors) from None


def _confirmation_required(impacts: list[impact.Impact]) -> HttpResponse:
    body = {"error": {
        "code": "confirmation_required",
        "message": " ".join(i.sentence() for i in impacts)
        + " Send it again with \"confirm_stops\": true to save it.",
        "fields": {},
        "impacts": [{"policy": i.policy, "runs": i.runs, "stopped_at_once": i.stopped_at_once,
                     "by_reason": i.by_reason, "since_days": i.since_days} for i in impacts],
    }}
    return HttpResponse(json.dumps(body), status=409, content_type="application/json")


@router.put("/teams/{slug}/policies/{name}", response={200: PolicySavedOut, **ERRORS},
            summary="Save a policy (a new version when something changed)",
            operation_id="operator_put_policy")
def put_policy(request: HttpRequest, slug: str, name: str, payload: PolicyPutIn) -> Any:
    team, _ = _team(request, slug, Role.ADMIN)
    document = _draft(name, payload.model_extra)
    if not payload.confirm_stops:
        # The same rule and numbers as the editor's Save (policies/impact.py).
        impacts = impact.impacts_to_confirm(team, [document])
        if impacts:
            return _confirmation_required(impacts)
    try:
        if payload.dry_run:
            return _would_save(request, team, document, payload.note)
        version = policy_save(team=team, document=document, actor=request.auth.user,
                              source="api", note=payload.note)
    except DocumentError as exc:  # the team's cap on policies
        raise AppError(422, "invalid_request", "The policy cannot be saved.", exc.errors) \
            from None
    if version is not None:
        # The version this save made, not the policy's current one read again after the
        # commit: a PUT committed meanwhile made that one (found by an attacker: two of 16
        # concurrent PUTs both answered version 5, and no answer named version 4).
        return {**version_json(document["name"], version), "changed": True}
    _read(request, team, "token.unchanged")
    policy = _policy(team, name)
    return {**version_json(policy.name, policy.current), "changed": False}


def _would_save(request: HttpRequest, team: Team, document: dict[str, Any], note: str
                ) -> dict[str, Any]:
    """A PUT's answer without the save (`policy_would_save`): the version it would make, or
    the current one, unchanged."""
    current, changed = policy_would_save(team=team, document=document)
    _read(request, team, "token.dry_run")
    if current is not None and not changed:
        return {**version_json(document["name"], current), "changed": False, "dry_run": True}
    return {"name": document["name"], "version": current.version + 1 if current else 1,
            "created_at": approval_reads.iso(timezone.now()),
            "created_by": request.auth.user.get_username(),  # type: ignore[attr-defined]
            "source": "api", "note": note, "document": document, "changed": True,
            "dry_run": True}


class BacktestIn(PolicyPutIn):
    policy_required: ClassVar[bool] = False  # no policy in the body: the current version
    note: Annotated[str, Field(max_length=500, json_schema_extra=_NO_NUL), Storable] = ""
    since: Annotated[str, Field(max_length=50, json_schema_extra=_NO_NUL), Storable] = "30d"
    limit: int = Field(default=1000, ge=1, le=MAX_LIMIT)


@router.post("/teams/{slug}/policies/{name}/backtest", response={200: dict, **ERRORS},
             summary="Backtest a draft of the policy on recorded runs (SPEC 13)",
             operation_id="operator_backtest_policy")
def backtest_policy(request: HttpRequest, slug: str, name: str,
                    payload: BacktestIn | None = None) -> dict[str, Any]:
    team, _ = _team(request, slug)  # a viewer may backtest, as on the editor's panel
    policy = _policy(team, name)
    # No body, like `{}`: the current version, over the last 30 days (docs/automation.md).
    payload = payload or BacktestIn()
    extra = {k: v for k, v in (payload.model_extra or {}).items()}
    document = _draft(name, extra) if extra else policy.current.document
    try:
        since = parse_since(payload.since, name="since")
    except InputError as exc:
        raise AppError(422, "invalid_request", str(exc), {"since": str(exc)}) from None
    # Replayed by a worker on the bulk queue, as the dashboard's backtests are (eagerly, in
    # this thread, on the embedded default); this thread, of the backtest pool, only waits.
    try:
        job = backtest_start(team=team, user=request.auth.user,
                             drafts=[{"policy": policy.name, "document": document}],
                             source="api", since=since, limit=payload.limit)
    except Busy:
        raise AppError(429, "too_many_backtests",
                       f"This team already runs {settings.BACKTEST_MAX_PER_TEAM} backtests, "
                       "as many as it may: try again when one has finished.",
                       retry_after_s=5) from None
    job = backtest_wait(job, seconds=settings.BACKTEST_API_WAIT_SECONDS)
    if job.status != BacktestStatus.DONE or not job.results:
        if job.status == BacktestStatus.FAILED:
            why = f"The backtest failed: {job.error}"
        else:
            why = (f"The backtest did not finish within {settings.BACKTEST_API_WAIT_SECONDS} "
                   f"s ({job.done} of {job.total} runs replayed); it goes on, and its page "
                   f"shows the result: {reverse('backtest', args=[team.slug, job.pk])}. A "
                   "smaller limit or since answers sooner.")
        raise AppError(503, "unavailable", why, retry_after_s=30)
    _read(request, team)
    result = job.results[0]
    # The draft as it would be saved (defaults filled): what `govctl --dry-run` diffs.
    return {**result["report"], "summary": result["summary"], "draft": document}


# --- Kill switch -------------------------------------------------------------------------------

class KillSwitchIn(Schema):
    action: Literal["engage", "release"]
    scope: Literal["global", "team", "agent", "run"]
    team: Annotated[str, Field(max_length=50, json_schema_extra=_NO_NUL), Storable] | None = None
    agent: Annotated[str, Field(max_length=100, json_schema_extra=_NO_NUL), Storable] | None = None
    run: Annotated[str, Field(max_length=36, json_schema_extra=_NO_NUL), Storable] | None = None
    reason: Annotated[str, Field(min_length=1, max_length=1000, json_schema_extra=_NO_NUL),
                      Storable]


class KillSwitchOut(Schema):
    scope: str
    team: str | None
    agent: str | None
    run: str | None
    engaged: bool
    changed: bool
    # What happened, in words (SPEC 6: releasing a switch that is not engaged "says so").
    message: str
    switch: dict[str, Any] | None


def _switch_json(switch: KillSwitch | None) -> dict[str, Any] | None:
    if switch is None:
        return None
    return {"id": switch.pk, "reason": switch.reason, "engaged_at": approval_reads.iso(
        switch.engaged_at), "engaged_by": switch.engaged_by_label,
        "released_at": approval_reads.iso(switch.released_at),
        "released_by": switch.released_by_label or None,
        "release_reason": switch.release_reason or None}


def _switch_team(request: HttpRequest, slug: str, action: str) -> tuple[Team, Role]:
    """The team of a team, agent or run switch and the token's role in it, refused below
    what the action needs: engaging needs an operator; releasing an admin, or an operator
    where the team's `operator_release` lets operators release (SPEC 7), so a viewer is told
    the role that would release here, not the engaging one."""
    team, role = _team(request, slug)
    if can(role, Role.OPERATOR):
        return team, role
    if action == "release" and team.operator_release == OperatorRelease.NONE:
        raise _forbidden(Role.ADMIN.label)
    raise _forbidden(Role.OPERATOR.label)


@router.post("/killswitch", response={200: KillSwitchOut, **ERRORS},
             summary="Engage or release a kill switch (SPEC 6)",
             operation_id="operator_killswitch")
def killswitch(request: HttpRequest, payload: KillSwitchIn) -> dict[str, Any]:
    token = request.auth  # type: ignore[attr-defined]
    team: Team | None = None
    role: Role | None = None
    run: Run | None = None
    if payload.scope == Scope.GLOBAL:
        if not token_is_superuser(token):
            raise AppError(403, "forbidden", "Only a superuser's admin token for every team "
                           "may engage or release the global kill switch.")
        if payload.team or payload.agent or payload.run:
            raise AppError(422, "invalid_request", "A global switch takes no team, agent or "
                           "run.", {"scope": "global takes no team, agent or run"})
    elif payload.scope == Scope.RUN:
        if not payload.run:
            raise AppError(422, "invalid_request", "A run switch needs the run.",
                           {"run": "required for the run scope"})
        try:
            run_id = uuid.UUID(payload.run)
        except ValueError:
            raise AppError(404, "not_found", "No such run.") from None
        found = Run.objects.select_related("team").filter(pk=run_id).first()
        if found is None or token_role(token, found.team) is None or (
                payload.team and payload.team != found.team.slug):
            raise AppError(404, "not_found", "No such run.")
        team, role = _switch_team(request, found.team.slug, payload.action)
        run = found
    else:
        if not payload.team:
            raise AppError(422, "invalid_request", f"{a_switch(payload.scope)} needs the team.",
                           {"team": f"required for the {payload.scope} scope"})
        if payload.run:
            # Never dropped without a word: a run meant for a run switch would otherwise
            # engage the switch of its whole team (or agent).
            raise AppError(422, "invalid_request", f"{a_switch(payload.scope)} takes no run.",
                           {"run": f"not taken by the {payload.scope} scope: use the run "
                                   "scope to stop one run"})
        team, role = _switch_team(request, payload.team, payload.action)
    target = resolve_target(scope=payload.scope, team=None if run else team,
                            agent=payload.agent or "", run=run)
    label = token_label(token)
    if payload.action == "engage":
        switch = killswitch_engage(scope=target.scope, team=target.team, agent=target.agent,
                                   run=target.run, reason=payload.reason, actor=token.user,
                                   actor_label=label)
        engaged, changed = True, switch.engaged_now
    else:
        engaged_now = switches.engaged_switch(target)
        if engaged_now is not None and target.scope != Scope.GLOBAL and not \
                switches.may_release(engaged_now, team=target.team, user=token.user,
                                     role=role):
            raise AppError(403, "forbidden",
                           switches.release_refusal(engaged_now, team=target.team))
        # Asked again under the switch's lock: another may have been engaged meanwhile.
        may = switches.release_check(team=target.team, user=token.user, role=role) \
            if target.scope != Scope.GLOBAL else None
        switch = killswitch_release(scope=target.scope, team=target.team, agent=target.agent,
                                    run=target.run, reason=payload.reason, actor=token.user,
                                    actor_label=label, may=may)
        engaged, changed = False, switch is not None
    if not changed:
        _read(request, target.team, "token.unchanged")
    what = f"The kill switch over {target.describe()}"
    message = {(True, True): f"{what} is engaged.",
               (True, False): f"{what} was already engaged: nothing changed.",
               (False, True): f"{what} is released.",
               (False, False): f"{what} is not engaged: nothing to release."}[engaged, changed]
    if engaged and not changed and not switch.active:
        # A run switch of a run that is over: its last switch, retired by its fan-out.
        engaged = False
        message = (f"The {target.describe()} is already over: its kill switch did its work; "
                   "nothing changed.")
    return {"scope": target.scope.value, "team": target.team.slug if target.team else None,
            "agent": target.agent or None, "run": str(target.run.pk) if target.run else None,
            "engaged": engaged, "changed": changed, "message": message,
            "switch": _switch_json(switch)}


# --- Approvals ---------------------------------------------------------------------------------

class ApprovalsQuery(Schema):
    status: Literal["pending", "approved", "denied", "expired", "cancelled"] | None = None
    limit: int = Field(default=100, ge=1, le=500)


@router.get("/teams/{slug}/approvals", response={200: dict, **ERRORS},
            summary="A team's approval requests", operation_id="operator_list_approvals")
def list_approvals(request: HttpRequest, slug: str, query: Query[ApprovalsQuery]
                   ) -> HttpResponse:
    team, _ = _team(request, slug)
    now = timezone.now()
    # Whoever looks first settles (SPEC 11), as the approvals page: a bounded share (SPEC 10).
    # What it leaves past its expiry is shown expired, as the agent API answers it, never
    # pending (runs/due.py).
    first_look.look(team, now=now)
    rows = approval_reads.with_args_text(Approval.objects.filter(team=team)
                                         .select_related("run"))
    if query.status == ApprovalStatus.PENDING:
        rows = rows.filter(due.still_pending(now))
    elif query.status == ApprovalStatus.EXPIRED:
        rows = rows.filter(due.expired_by_now(now))
    elif query.status is not None:
        rows = rows.filter(status=query.status)
    order = "expires_at" if query.status == ApprovalStatus.PENDING else "-requested_at"
    _read(request, team)
    shown = due.approvals_as_they_will_be(rows.order_by(order)[:query.limit], now=now)
    return HttpResponse(approval_reads.dumps(
        {"approvals": [approval_reads.approval_json(a) for a in shown]}),
        content_type="application/json")


class DecideIn(Schema):
    decision: Literal["approve", "deny"]
    note: Annotated[str, Field(max_length=2000, json_schema_extra=_NO_NUL), Storable] = ""


@router.post("/approvals/{approval_id}/decide", response={200: dict, **ERRORS},
             summary="Approve or deny a request (SPEC 11)",
             operation_id="operator_decide_approval")
def decide_approval(request: HttpRequest, approval_id: str, payload: DecideIn
                    ) -> dict[str, Any]:
    token = request.auth  # type: ignore[attr-defined]
    try:
        wanted = uuid.UUID(approval_id)
    except ValueError:
        raise AppError(404, "not_found", "No such approval.") from None
    approval = Approval.objects.select_related("team").filter(pk=wanted).first()
    if approval is None or token_role(token, approval.team) is None:
        raise AppError(404, "not_found", "No such approval.")
    team, _ = _team(request, approval.team.slug, Role.OPERATOR)
    decided = approval_decide(team=team, approval_id=wanted, decision=payload.decision,
                              note=payload.note, actor=token.user, actor_label=token_label(token))
    return approval_reads.approval_json(decided)


# --- Runs --------------------------------------------------------------------------------------

@router.get("/teams/{slug}/runs", response={200: dict, **ERRORS}, summary="A team's runs",
            operation_id="operator_list_runs")
def list_runs(request: HttpRequest, slug: str, filters: Query[RunsFilter]) -> HttpResponse:
    team, _ = _team(request, slug)
    first_look.look(team)  # whoever looks first settles (SPEC 11, 14)
    page = run_reads.runs_page(team, status=filters.status, agent=filters.agent,
                               limit=filters.limit, after=filters.after)
    _read(request, team)
    return HttpResponse(page, content_type="application/json; charset=utf-8")


def _run(team: Team, run_id: str) -> Run:
    try:
        wanted = uuid.UUID(run_id)
    except ValueError:
        raise AppError(404, "not_found", "No such run.") from None
    return first_look.look_at_run(run_reads.run_for_team(team, wanted))


@router.get("/teams/{slug}/runs/{run_id}", response={200: dict, **ERRORS},
            summary="A team's run", operation_id="operator_get_run")
def get_run(request: HttpRequest, slug: str, run_id: str) -> dict[str, Any]:
    team, _ = _team(request, slug)
    run = _run(team, run_id)
    _read(request, team)
    # As the agent's `GET /api/v1/runs/{id}` (SPEC 17 "as 5.1", 20): with its children and
    # its tree's usage, so automation can walk a tree (found by a newcomer: they were left out).
    return run_reads.run_tree_json(run)


@router.get("/teams/{slug}/runs/{run_id}/decisions", response={200: dict, **ERRORS},
            summary="A team's run's decisions, in order", operation_id="operator_list_decisions")
def list_decisions(request: HttpRequest, slug: str, run_id: str,
                   filters: Query[DecisionsFilter]) -> HttpResponse:
    team, _ = _team(request, slug)
    run = _run(team, run_id)
    page = run_reads.decisions_page(run, after=filters.after, limit=filters.limit)
    _read(request, team)
    return HttpResponse(page, content_type="application/json")


@router.get("/teams/{slug}/decisions/{decision_id}", response={200: dict, **ERRORS},
            summary="One decision of a team's and the rule that made it",
            operation_id="operator_get_decision")
def get_decision(request: HttpRequest, slug: str, decision_id: str) -> HttpResponse:
    """As the agent's `GET /api/v1/decisions/{id}` (SPEC 16), for the team's operators: another
    team's decision answers 404, like one that does not exist."""
    team, _ = _team(request, slug)
    found = run_reads.decision_for_key(team, decision_id)
    _read(request, team)
    return HttpResponse(run_reads.decision_detail_body(found), content_type="application/json")


_mounted: list[NinjaAPI] = []


def mount(api: NinjaAPI) -> None:
    """Add the operator endpoints to the agent API's NinjaAPI: one OpenAPI document, one set
    of error handlers (SPEC 5.3), each API with its own security scheme. Once per API."""
    if api not in _mounted:
        api.add_router("/", router)
        _mounted.append(api)
