"""Request and response shapes of the agent API (SPEC section 5).

They validate requests and generate /api/v1/openapi.json, so the document and the behaviour
cannot disagree. Unknown request fields are ignored, as the contract says.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Annotated, Any, Literal
from uuid import UUID

from ninja import Field, Schema
from pydantic import AfterValidator, BaseModel, StrictFloat, StrictInt, StrictStr

from governance.text import text_problem
from governance_client import rules

MAX_DEPTH = 32
MICRO_USD = Decimal("0.000001")  # costs are counted in millionths of a dollar


def _json_problem(value: Any, containers: int = 1) -> str | None:
    """Why a parsed JSON object cannot be stored as given (too deep, unstorable text, a
    number too large to be finite), or None. One walk, bounded by MAX_DEPTH."""
    if containers > MAX_DEPTH:
        return f"must not nest deeper than {MAX_DEPTH} levels"
    items: Any
    if isinstance(value, dict):
        for key in value:
            problem = text_problem(str(key))
            if problem is not None:
                return problem
        items = value.values()
    else:
        items = value
    for item in items:
        if isinstance(item, str):
            problem = text_problem(item)
        elif isinstance(item, float):
            # 1e400 parses to inf, which no JSON column accepts.
            problem = None if math.isfinite(item) else "must contain finite numbers only"
        elif isinstance(item, dict | list):
            problem = _json_problem(item, containers + 1)
        else:
            problem = None
        if problem is not None:
            return problem
    return None


def _storable_json(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None:
        problem = _json_problem(value)
        if problem is not None:
            raise ValueError(problem)
    return value


def _storable_text(value: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


METADATA_MAX_BYTES = 16 * 1024


def _small_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    # Stored with the run and shown on every run page: a label set, not a document store.
    if value is not None and len(json.dumps(value, ensure_ascii=False).encode()) > \
            METADATA_MAX_BYTES:
        raise ValueError(f"must be at most {METADATA_MAX_BYTES // 1024} KiB as JSON")
    return value


def _finite(value: float | int) -> float | int:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Number = Annotated[StrictInt | StrictFloat, AfterValidator(_finite)]
# Bounds on each branch, not on the union: only there do they reach the OpenAPI document as
# minimum/maximum (on a union pydantic emits raw "ge"/"le", which JSON Schema ignores).
Money = (Annotated[StrictInt, Field(ge=0, le=1_000_000)]
         | Annotated[StrictFloat, Field(ge=0, le=1_000_000)])
JsonObject = Annotated[dict[str, Any] | None, AfterValidator(_storable_json)]
# Every free-text field: what is accepted must be storable on every database.
Text = Annotated[StrictStr, AfterValidator(_storable_text)]
AGENT_PATTERN = f"^{rules.AGENT_NAME_PATTERN}$"
# runs.models.RunStatus, spelled out for the OpenAPI schema (tests/test_vocabulary.py).
RunStatusName = Literal["running", "stopped", "killed", "completed", "failed"]


class ErrorBody(Schema):
    code: str
    message: str
    fields: dict[str, str] = {}


class ErrorOut(Schema):
    error: ErrorBody


class RunStartIn(Schema):
    agent: Annotated[StrictStr, Field(pattern=AGENT_PATTERN)]
    policy: Annotated[Text, Field(min_length=1, max_length=50)] | None = None
    task: Annotated[Text, Field(max_length=10_000)] | None = None
    metadata: Annotated[JsonObject, AfterValidator(_small_metadata),
                        Field(description="Any JSON object, at most 16 KiB as JSON.")] = None
    external_id: Annotated[Text, Field(min_length=1, max_length=200)] | None = None


class LimitsOut(Schema):
    max_steps: int
    max_repeat_action: int
    no_progress_window: int
    max_seconds: float | None
    max_usd: float | None
    max_tool_calls: int | None


class StepLimitsOut(Schema):
    max_steps: int
    max_repeat_action: int
    no_progress_window: int


class BudgetsOut(Schema):
    max_seconds: float | None
    max_usd: float | None
    max_tool_calls: int | None


class PolicyOut(Schema):
    name: str
    version: int
    mode: Literal["enforce", "shadow"]
    step_limits: StepLimitsOut
    budgets: BudgetsOut
    # What the client's fail-open mode needs to decide with the same rules (its tool lists,
    # repeat key and repeated-error handling); not in SPEC 5.1's list, added for the client.
    tools: dict[str, Any] | None = None
    repeat_key: dict[str, Any] | None = None
    on_repeated_error: dict[str, Any] | None = None


class RunStartOut(Schema):
    run_id: UUID
    status: str
    agent: str
    started_at: datetime
    policy: PolicyOut


class RunOut(Schema):
    run_id: UUID
    agent: str
    status: RunStatusName
    stop_reason: str | None
    steps: int
    tool_calls: int
    cost_usd: float
    elapsed_s: float
    started_at: datetime
    ended_at: datetime | None
    policy: PolicyOut
    task: str
    output: str


class RunsOut(Schema):
    runs: list[RunOut]


# The check's input models are plain pydantic models: ninja's Schema wraps every nested object
# in a getter for Django model attributes, which a JSON body never needs, and made validating
# a check body take about 35 µs instead of 13 (docs/performance.md).
class ActionIn(BaseModel):
    name: Annotated[Text, Field(min_length=1, max_length=200)]
    args: JsonObject = None
    type: Literal["tool", "llm", "other"] = "tool"


class LastResultIn(BaseModel):
    status: Literal["ok", "error"]
    digest: Annotated[Text, Field(max_length=128)] | None = None
    error: Annotated[Text, Field(max_length=2000)] | None = None
    summary: Annotated[Text, Field(max_length=2000)] | None = None


class CheckIn(BaseModel):
    action: ActionIn
    progress: Annotated[Text, Field(max_length=256)] | Number | None = None
    last_result: LastResultIn | None = None
    cost_usd: Money | None = None
    check_id: Annotated[Text, Field(min_length=1, max_length=100)] | None = None
    # How long the agent waits for this answer, counted from the moment the server receives
    # the check (README "Deadlines"): past it the check is audited `expired` and not counted.
    deadline_ms: (Annotated[StrictInt, Field(ge=1, le=600_000)]
                  | Annotated[StrictFloat, Field(ge=1, le=600_000)] | None) = None

    def to_check(self) -> rules.Check:
        """The check as the rules take it, which is the shape the services decide and audit
        it in: no other request object on the way (the deadline is the transport's, passed
        beside it). The cost becomes exact millionths of a dollar, rounded half up."""
        last = self.last_result
        return rules.Check(
            name=self.action.name, type=self.action.type, args=self.action.args or {},
            progress=self.progress,
            last_result=None if last is None else rules.LastResult(
                status=last.status, digest=last.digest, error=last.error,
                summary=last.summary),
            cost_usd=Decimal(str(self.cost_usd or 0)).quantize(MICRO_USD,
                                                               rounding=ROUND_HALF_UP),
            check_id=self.check_id,
        )


class LocalDecisionIn(BaseModel):
    """One decision the client made by itself while the service was unreachable."""

    check_id: Annotated[Text, Field(min_length=1, max_length=100)]
    action: ActionIn
    progress: Annotated[Text, Field(max_length=256)] | Number | None = None
    last_result: LastResultIn | None = None
    cost_usd: Money | None = None
    decision: Literal["allow", "stop"]
    reason: Annotated[Text, Field(min_length=1, max_length=50)]
    message: Annotated[Text, Field(max_length=2000)] | None = None
    at: datetime | None = None


class LocalDecisionsIn(BaseModel):
    decisions: Annotated[list[LocalDecisionIn], Field(min_length=1, max_length=1000)]


class LocalDecisionsOut(Schema):
    recorded: int
    skipped: int
    run: RunOut


class UsageOut(Schema):
    steps: int
    tool_calls: int
    cost_usd: float
    elapsed_s: float


class DirectiveOut(Schema):
    type: Literal["inject_message"]
    role: Literal["user"]
    content: str


class ShadowOut(Schema):
    reason: str
    message: str | None = None


class ApprovalRefOut(Schema):
    """The ``approval`` field of a check answer (SPEC 11): the request this check opened or
    settled; ``decided_by`` is in final answers only."""

    id: UUID
    status: Literal["pending", "approved", "denied", "expired", "cancelled"]
    expires_at: datetime
    decided_by: str | None = None


class CheckOut(Schema):
    """Every field is present in every answer, null where it does not apply (SPEC 15)."""

    decision: Literal["allow", "stop", "pending", "wait"] = Field(
        description="Run the action only on allow. wait: send the same check again after "
        "retry_after_s; pending: an operator must approve it first.")
    reason: str
    decision_id: int
    step: int
    repeat_key: str
    repeat_count: int
    message: str | None
    next_action: str | None
    usage: UsageOut
    limits: LimitsOut
    directive: DirectiveOut | None
    shadow: ShadowOut | None
    approval: ApprovalRefOut | None = Field(
        description="The approval request this check opened or settled (SPEC 11).")
    retry_after_s: float | None = Field(
        description="A wait only: seconds (> 0, to the millisecond) until every matching "
        "rate limit has room.")


class FinishIn(Schema):
    status: Literal["completed", "failed", "stopped"]
    output: Annotated[Text, Field(max_length=100_000)] | None = None


class DecisionActionOut(Schema):
    name: str
    type: str
    args: dict[str, Any] | None


class DecisionOut(Schema):
    id: int
    step: int
    outcome: Literal["allow", "stop", "would_stop", "pending", "wait", "expired"]
    reason: str
    action: DecisionActionOut | None
    repeat_key: str
    repeat_count: int
    # An addition to SPEC 5.1: the progress value the agent reported with this check (null
    # when it sent none), so a no_progress stop can be explained from the API alone.
    progress: str | float | int | None = None
    at: datetime
    local: bool = False


class DecisionsOut(Schema):
    decisions: list[DecisionOut]


class RunsFilter(Schema):
    status: RunStatusName | None = None
    # The agent-name pattern, not only a length: a NUL would reach the database as a 503.
    agent: Annotated[str, Field(pattern=AGENT_PATTERN)] | None = None
    limit: Annotated[int, Field(ge=1, le=500)] = 50


class DecisionsFilter(Schema):
    after: Annotated[int, Field(ge=0)] = 0
    limit: Annotated[int, Field(ge=1, le=1000)] = 100


class ApprovalActionOut(Schema):
    name: str
    type: str
    args: dict[str, Any]


class ApprovalOut(Schema):
    """GET /api/v1/approvals/{id} (SPEC 11): ``decision`` is null while pending, else the
    check's final answer, the same object the check answers."""

    id: UUID
    run_id: UUID
    status: Literal["pending", "approved", "denied", "expired", "cancelled"]
    action: ApprovalActionOut
    requested_at: datetime
    expires_at: datetime
    decided_at: datetime | None
    decided_by: str | None
    note: str | None
    decision: CheckOut | None


class ApprovalWait(Schema):
    wait: Annotated[int, Field(ge=0, le=60)] = 0
