"""Request and response shapes of the agent API (SPEC section 5).

They validate requests and generate /api/v1/openapi.json, so the document and the behaviour
cannot disagree. Unknown request fields are ignored, as the contract says.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from ninja import Field, Schema
from pydantic import AfterValidator, StrictFloat, StrictInt, StrictStr

MAX_DEPTH = 32


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def _shallow(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None and _depth(value) > MAX_DEPTH:
        raise ValueError(f"must not nest deeper than {MAX_DEPTH} levels")
    return value


def _finite(value: float | int) -> float | int:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Number = Annotated[StrictInt | StrictFloat, AfterValidator(_finite)]
JsonObject = Annotated[dict[str, Any] | None, AfterValidator(_shallow)]
AGENT_PATTERN = r"^[A-Za-z0-9._-]{1,100}$"


class ErrorBody(Schema):
    code: str
    message: str
    fields: dict[str, str] = {}


class ErrorOut(Schema):
    error: ErrorBody


class RunStartIn(Schema):
    agent: Annotated[StrictStr, Field(pattern=AGENT_PATTERN)]
    policy: Annotated[StrictStr, Field(min_length=1, max_length=50)] | None = None
    task: Annotated[StrictStr, Field(max_length=10_000)] | None = None
    metadata: JsonObject = None
    external_id: Annotated[StrictStr, Field(min_length=1, max_length=200)] | None = None


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


class RunStartOut(Schema):
    run_id: UUID
    status: str
    agent: str
    started_at: datetime
    policy: PolicyOut


class RunOut(Schema):
    run_id: UUID
    agent: str
    status: Literal["running", "stopped", "killed", "completed", "failed"]
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


class ActionIn(Schema):
    name: Annotated[StrictStr, Field(min_length=1, max_length=200)]
    args: JsonObject = None
    type: Literal["tool", "llm", "other"] = "tool"


class LastResultIn(Schema):
    status: Literal["ok", "error"]
    digest: Annotated[StrictStr, Field(max_length=128)] | None = None
    error: Annotated[StrictStr, Field(max_length=2000)] | None = None
    summary: Annotated[StrictStr, Field(max_length=2000)] | None = None


class CheckIn(Schema):
    action: ActionIn
    progress: Annotated[StrictStr, Field(max_length=256)] | Number | None = None
    last_result: LastResultIn | None = None
    cost_usd: Annotated[Number, Field(ge=0, le=1_000_000)] | None = None
    check_id: Annotated[StrictStr, Field(min_length=1, max_length=100)] | None = None


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


class CheckOut(Schema):
    decision: Literal["allow", "stop"]
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


class FinishIn(Schema):
    status: Literal["completed", "failed", "stopped"]
    output: Annotated[StrictStr, Field(max_length=100_000)] | None = None


class DecisionActionOut(Schema):
    name: str
    type: str
    args: dict[str, Any] | None


class DecisionOut(Schema):
    id: int
    step: int
    outcome: Literal["allow", "stop", "would_stop"]
    reason: str
    action: DecisionActionOut | None
    repeat_key: str
    repeat_count: int
    at: datetime


class DecisionsOut(Schema):
    decisions: list[DecisionOut]
