"""Request and response shapes of the agent API (SPEC section 5).

They validate requests and generate /api/v1/openapi.json, so the document and the behaviour
cannot disagree. Unknown request fields are ignored, as the contract says.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal, Union
from uuid import UUID

import annotated_types
from ninja import Field, Schema
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Discriminator,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    TypeAdapter,
)
from pydantic.json_schema import GetJsonSchemaHandler, JsonSchemaValue
from pydantic_core import PydanticCustomError, PydanticUseDefault, core_schema
from typing_extensions import TypeAliasType

from governance.text import text_problem
from governance_client import rules

MAX_DEPTH = 32
# What the API refuses, stated in the OpenAPI document too, so that a client (or a schema
# fuzzer) reading it knows before sending: "not": {"pattern": "\u0000"}, no NUL anywhere in
# the text. (The equivalent "^[^\u0000]*$" made generating a 100,000-character output from
# the document twenty times slower.)
NUL_PATTERN = "\\u0000"


def no_nul() -> dict[str, Any]:
    return {"not": {"pattern": NUL_PATTERN}}


# PostgreSQL keeps a JSON number as a numeric and writes it back in full, never with an
# exponent: 5e-324 (6 bytes sent) is read back as 325 characters, 1e308 as 309. So a 64 KiB
# check of 9,000 such numbers was a decision of 2.9 MB every read sends (the run's decisions,
# its timeline, an approval, an audit export), and one read of a run's 300 decisions was
# 885 MB, leaving its worker at 2 GB (found by an attacker; 1,000 of them, 3 GB). The
# characters a body's numbers gain that way, all of them together, are bounded: far above
# any real arguments (a float between 1e-6 and 1e16 gains nothing).
NUMBERS_WRITTEN_OUT_MAX = 16 * 1024


def _written_out(number: float) -> int:
    """The characters PostgreSQL writes ``number`` with beyond its JSON text (repr)."""
    if number == 0 or 1e-6 <= abs(number) < 1e16:
        return 0
    text = repr(number)
    return max(0, len(format(Decimal(text), "f")) - len(text))


def _json_problem(value: Any, containers: int = 1, grown: list[int] | None = None
                  ) -> str | None:
    """Why a parsed JSON object cannot be stored as given (too deep, unstorable text, a
    number too large to be finite, numbers that would be stored many times their size), or
    None. One walk, bounded by MAX_DEPTH."""
    if grown is None:
        grown = [0]
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
        kind = type(item)
        if kind is int or kind is bool or item is None:
            # JSON's plain values, told apart by their exact type first: the generic tests
            # of each of a check's 30,000 numbers took 9 ms of CPU (SPEC 10).
            continue
        if isinstance(item, str):
            problem = text_problem(item)
        elif isinstance(item, float):
            # 1e400 parses to inf, which no JSON column accepts.
            problem = None if math.isfinite(item) else "must contain finite numbers only"
            if problem is None:
                grown[0] += _written_out(item)
                if grown[0] > NUMBERS_WRITTEN_OUT_MAX:
                    problem = (f"must not hold numbers that, written out in full as the "
                               f"database stores them (5e-324 is 325 characters), grow by "
                               f"more than {NUMBERS_WRITTEN_OUT_MAX:,} characters")
        elif isinstance(item, dict | list):
            problem = _json_problem(item, containers + 1, grown)
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


PROGRESS_MAX_CHARS = 256


def _progress(value: Any) -> Any:
    # One message for every wrong kind (a union's first branch said "a valid string" for
    # `{}` or `true`). SPEC 5.2 takes any number: an integer is kept exactly, bounded by the
    # body's 64 KiB and the JSON parser's 4,300 digits (a 400), as in `args`.
    if isinstance(value, str):
        if len(value) > PROGRESS_MAX_CHARS:
            raise PydanticCustomError(
                "progress", "String should have at most {max} characters",
                {"max": PROGRESS_MAX_CHARS})
        return _storable_text(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise PydanticCustomError(
        "progress", "Input should be a string of at most {max} characters or a finite number",
        {"max": PROGRESS_MAX_CHARS})


# The declared union is what the OpenAPI document shows; the validator decides alone.
Progress = Annotated[Annotated[StrictStr, Field(max_length=PROGRESS_MAX_CHARS,
                                               json_schema_extra=no_nul())]
                     | StrictInt | StrictFloat, BeforeValidator(_progress)]


DEADLINE_MS_MAX = 600_000


def _deadline_ms(value: Any) -> Any:
    # One message for every wrong value; the union of an integer and a float said "a valid
    # integer" even for 0.5, whose problem is the minimum.
    if isinstance(value, int | float) and not isinstance(value, bool) \
            and 1 <= value <= DEADLINE_MS_MAX:
        return value
    raise PydanticCustomError(
        "deadline_ms", "Input should be a number of milliseconds from 1 to {max}",
        {"max": DEADLINE_MS_MAX})


DeadlineMs = Annotated[Annotated[StrictInt, Field(ge=1, le=DEADLINE_MS_MAX)]
                       | Annotated[StrictFloat, Field(ge=1, le=DEADLINE_MS_MAX)],
                       BeforeValidator(_deadline_ms)]


def _money(value: Any) -> Any:
    # A number, an integer or not, and nothing else (no string, no boolean): checked here with
    # one message, rather than by a union of an integer and a float, whose first error, "a
    # valid integer", was what the agent read for `"cost_usd": "0.1"`.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("money", "Input should be a number (US dollars)")
    return value


# RFC 3339's date-time, which the OpenAPI document's "date-time" means: with a time and an
# offset. (Python's own parsing, afterwards, refuses a month 13 or a day 32.)
RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def _date_time_text(value: Any) -> Any:
    # Pydantic alone would also take a number (seconds since 1970), "0", a date without a
    # time or a time without an offset: none of them is the date-time string the schema says.
    if not isinstance(value, str) or RFC3339.fullmatch(value) is None:
        raise PydanticCustomError(
            "date_time", "Input should be an RFC 3339 date-time string with an offset, "
            "e.g. 2026-05-01T12:00:00Z")
    return value


DateTimeText = Annotated[datetime, BeforeValidator(_date_time_text)]


# The bounds before the check of the type, so that they reach the OpenAPI document as the
# minimum and maximum of a number (wrapped by the validator, pydantic emits raw "ge"/"le").
Money = Annotated[float, annotated_types.Interval(ge=0, le=1_000_000), BeforeValidator(_money)]


class _NoNulText:
    """Every free-text field: what is accepted must be storable on every database (a NUL is
    refused, governance.text), and the published schema says so (`no_nul`). Its
    length goes before it (`Annotated[StrictStr, Field(max_length=N), Storable]`): after a
    validator, pydantic checks a length generically ("at most N items") instead of as a
    string's characters."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(_storable_text, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {**handler(schema), **no_nul()}


class _NoNulKeys:
    """The schema of a JSON object whose keys are free text: a key holds no NUL either."""

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {**handler(schema), "propertyNames": no_nul()}


class _SchemaOf:
    """Publishes another type's schema for a field validated otherwise: `args` and `metadata`
    stay validated as any object walked once (`_storable_json`), as the check's path was
    measured (docs/performance.md), not value by value against a recursive type."""

    def __init__(self, published: Any) -> None:
        self.schema = TypeAdapter(published).core_schema

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return handler(self.schema)


Storable = _NoNulText()
# Any JSON value without NUL in a string or a key, as the document publishes it.
StorableJsonValue = TypeAliasType(
    "StorableJsonValue",
    # Union[...]: `|` cannot join the names of a type not defined yet.
    Union[Annotated[str, Storable], int, float, bool,  # noqa: UP007
          list["StorableJsonValue"],
          Annotated[dict[str, "StorableJsonValue"], _NoNulKeys()], None],
)
JsonObject = Annotated[
    dict[str, Any] | None, AfterValidator(_storable_json),
    _SchemaOf(Annotated[dict[str, StorableJsonValue], _NoNulKeys()] | None),
]
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
    policy: Annotated[StrictStr, Field(min_length=1, max_length=50), Storable] | None = Field(
        default=None, description="The name of one of the key's team's policies (default: "
        "`default`). A name the team has no policy of is refused with 422 `invalid_request`.")
    task: Annotated[StrictStr, Field(max_length=10_000), Storable] | None = None
    metadata: Annotated[JsonObject, AfterValidator(_small_metadata),
                        Field(description="Any JSON object, at most 16 KiB as JSON.")] = None
    external_id: Annotated[StrictStr, Field(min_length=1, max_length=200), Storable] | None = None
    parent_run_id: UUID | None = Field(
        default=None, description="SPEC 20: start this run as a sub-agent of a running run "
        "of the team (404 naming the field if there is none, 409 `parent_finished` if it "
        "is over, 422 past depth 5). Its policy defaults to the parent's.")


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
    # SPEC 14's budget: the agent learns how long it may stay silent before its run is
    # abandoned (null: never). A version stored before it existed reads null.
    max_idle_seconds: float | None = None


class PolicyOut(Schema):
    name: str
    version: int
    mode: Literal["enforce", "shadow"]
    step_limits: StepLimitsOut
    budgets: BudgetsOut
    # What the client's fail-open mode needs to decide with the same rules (its tool lists,
    # repeat key and repeated-error handling, and which actions need an operator, never
    # allowed locally); not in SPEC 5.1's list, added for the client.
    tools: dict[str, Any] | None = None
    repeat_key: dict[str, Any] | None = None
    on_repeated_error: dict[str, Any] | None = None
    approvals: dict[str, Any] | None = None
    # SPEC 16's warnings, so a fail-open client's local decisions warn as the server's do
    # (null: a version saved before warnings existed, which warns of nothing).
    warnings: dict[str, Any] | None = None


class RunStartOut(Schema):
    run_id: UUID
    status: str
    agent: str
    started_at: datetime
    policy: PolicyOut
    # SPEC 20: a sub-agent's start says where in its tree it is (null for a root), as every
    # read of the run does (found by a newcomer, whose script read them from the start).
    parent_run_id: UUID | None = None
    root_run_id: UUID | None = None


class TreeUsageOut(Schema):
    steps: int
    tool_calls: int
    cost_usd: float


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
    parent_run_id: UUID | None = None
    root_run_id: UUID | None = None
    # SPEC 20, on `GET /api/v1/runs/{id}` only: the children's ids and the usage of the run
    # and its descendants.
    # Strings as the database's ids gave them, not UUIDs: made into UUIDs and written back, a
    # thousand children were most of the read's 10 ms (as many as one key sends, SPEC 10).
    children: list[Annotated[str, Field(json_schema_extra={"format": "uuid"})]] | None = None
    # True when the run has more children than `children` lists (the first 1,000).
    children_more: bool | None = None
    tree_usage: TreeUsageOut | None = None


class RunsOut(Schema):
    runs: list[RunOut]
    next_after: UUID | None = Field(None, description=(
        "Set when more runs follow this page: the `after` of the next one (this page's last "
        "run's id); null on the last page. A page stops at `limit` runs or at 4 MiB of JSON, "
        "whichever comes first (a run bigger than that alone)."))


# The check's input models are plain pydantic models: ninja's Schema wraps every nested object
# in a getter for Django model attributes, which a JSON body never needs, and made validating
# a check body take about 35 µs instead of 13 (docs/performance.md).
class ActionIn(BaseModel):
    name: Annotated[StrictStr, Field(min_length=1, max_length=200), Storable]
    args: JsonObject = None
    type: Literal["tool", "llm", "other"] = "tool"


class LastResultIn(BaseModel):
    status: Literal["ok", "error"]
    digest: Annotated[StrictStr, Field(max_length=128), Storable] | None = None
    error: Annotated[StrictStr, Field(max_length=2000), Storable] | None = None
    summary: Annotated[StrictStr, Field(max_length=2000), Storable] | None = None


class CheckIn(BaseModel):
    action: ActionIn
    progress: Progress | None = None
    last_result: LastResultIn | None = None
    cost_usd: Money | None = None
    check_id: Annotated[StrictStr, Field(min_length=1, max_length=100), Storable] | None = None
    # How long the agent waits for this answer, counted from the moment the server receives
    # the check (README "Deadlines"): past it the check is audited `expired` and not counted.
    deadline_ms: DeadlineMs | None = None
    # The moment the agent stops waiting, by its own clock (ISO-8601; without an offset, UTC).
    # A check read late (a frozen or swamped server: it waited in the socket's queue, where
    # deadline_ms does not run yet) expires by it, give or take CHECK_CLOCK_SKEW_MS.
    deadline_at: datetime | None = None

    def to_check(self) -> rules.Check:
        """The check as the rules take it, which is the shape the services decide and audit
        it in: no other request object on the way (the deadline is the transport's, passed
        beside it). The cost becomes exact millionths of a dollar, rounded half up
        (`rules.make_check`, as for uploaded local decisions)."""
        last = self.last_result
        return rules.make_check(
            self.action.name, self.action.args, type=self.action.type, progress=self.progress,
            last_result=None if last is None else dict(last), cost_usd=self.cost_usd,
            check_id=self.check_id,
        )


class _LocalDecision(BaseModel):
    """One decision the client made by itself while the service was unreachable. Its reason
    is one the client's local rules can give (`rules.evaluate` without rate windows or
    approvals, without a kill): an allow's is `step_ok`, a stop's one of SPEC 4.4's but
    `killed`, which becomes the run's stop reason."""

    check_id: Annotated[StrictStr, Field(min_length=1, max_length=100), Storable]
    action: ActionIn
    progress: Progress | None = None
    last_result: LastResultIn | None = None
    cost_usd: Money | None = None
    message: Annotated[StrictStr, Field(max_length=2000), Storable] | None = None
    at: DateTimeText | None = None


class LocalDirectiveIn(BaseModel):
    """The warning a fail-open client gave its agent with a local allow (SPEC 16)."""

    type: Literal["inject_message"]
    role: Literal["user"]
    code: Literal[rules.WARNING_CODES]  # type: ignore[valid-type]  # the tuple's values
    content: Annotated[StrictStr, Field(min_length=1, max_length=2000), Storable]


class LocalAllowIn(_LocalDecision):
    decision: Literal["allow"]
    reason: Literal["step_ok"]
    directive: LocalDirectiveIn | None = None


# A kill is the service's alone (an operator's kill switch): a local stop never says it, and
# an agent must not be able to make its run look killed by somebody.
LOCAL_STOP_REASONS = tuple(reason for reason in rules.REASONS if reason != rules.KILLED)


class LocalStopIn(_LocalDecision):
    decision: Literal["stop"]
    reason: Literal[LOCAL_STOP_REASONS]  # type: ignore[valid-type]  # the tuple's values


def _local_kind(value: Any) -> str | None:
    decision = value.get("decision") if isinstance(value, dict) else getattr(
        value, "decision", None)
    # Tags in pydantic's error locations; lowercase with a dash, so _field_path drops them.
    return f"local-{decision}" if decision in ("allow", "stop") else None


# The error type of an entry whose `decision` names neither branch: pydantic places it on the
# entry, and the API's error envelope names the entry's `decision` field for it.
LOCAL_DECISION_UNKNOWN = "local_decision"
LocalDecisionIn = Annotated[
    Annotated[LocalAllowIn, Tag("local-allow")] | Annotated[LocalStopIn, Tag("local-stop")],
    Discriminator(_local_kind, custom_error_type=LOCAL_DECISION_UNKNOWN,
                  custom_error_message="decision should be 'allow' or 'stop'"),
]


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
    code: Literal["repeat_action", "no_progress", "budget", "repeated_error"] = Field(
        description="Which warning (SPEC 16): put content in front of the model.")
    content: str


class RuleOut(Schema):
    """The rule that decided (SPEC 16): null for a plain allow."""

    name: str = Field(description="The stop reason, or the warning's code.")
    policy: str | None
    version: int | None
    limit: dict[str, Any] = Field(description="The limit's field(s) and value(s).")
    observed: dict[str, Any] = Field(description="The counter(s) observed.")
    scope: str = Field(description='"run", or the id of the ancestor run whose limit it is '
                       "(sub-agent runs).")


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
    rule: RuleOut | None = Field(description="The rule that decided, with its limit and the "
                                 "values observed (SPEC 16); null for a plain allow.")
    trace_id: str | None = Field(
        description="The OpenTelemetry trace (32 hex digits) the check's span "
        "is in, the agent's own when it sent a `traceparent` (SPEC 18); null while tracing "
        "is off on the server.")
    # Only in the replay of a check_id that a fail-open client decided itself and uploaded.
    local: bool | None = Field(default=None, description="True when the client decided this "
                               "check itself during an outage (an uploaded local decision).")
    decided_at: datetime | None = Field(default=None, description="A local decision only: "
                                        "when the client decided it.")
    policy_violation: bool | None = Field(
        default=None, description="A local decision only: true when the client allowed an "
        "action the run's policy forbids (a denied tool, an action needing approval).")
    violation: str | None = Field(default=None, description="A local decision only: why it "
                                  "broke the policy, when it did.")
    after_end: bool | None = Field(default=None, description="A local decision only: true "
                                   "when it was uploaded to a run already over, which it did "
                                   "not count on (SPEC 4.4).")


class FinishIn(Schema):
    status: Literal["completed", "failed", "stopped"]
    output: Annotated[StrictStr, Field(max_length=100_000), Storable] | None = None


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
    policy_violation: bool = Field(
        default=False, description="An uploaded local decision that broke the run's policy "
        "(SPEC 10): the client allowed a denied tool, or an action needing approval. Kept, "
        "since the action ran, and flagged.")
    violation: str | None = Field(default=None, description="What it broke, in words.")
    rule: RuleOut | None = Field(default=None, description="The rule that decided (SPEC 16), "
                                 "null for a plain allow; the same as the decision's own read.")


class DecisionsOut(Schema):
    decisions: list[DecisionOut]


class LastResultOut(Schema):
    status: str | None = None
    digest: str | None = None


class DecisionPolicyOut(Schema):
    name: str
    version: int


class DecisionDetailOut(Schema):
    """One decision and why it was made (SPEC 16): GET /api/v1/decisions/{decision_id}."""

    decision_id: int
    run_id: UUID
    step: int
    outcome: Literal["allow", "stop", "would_stop", "pending", "wait", "expired"]
    reason: str
    rule: RuleOut | None
    directive: DirectiveOut | None
    action: DecisionActionOut | None
    progress: str | float | int | None = None
    last_result: LastResultOut | None
    cost_usd: float
    usage: dict[str, Any] | None = Field(description="The run's counters after this "
                                         "decision (steps, tool_calls, cost_usd, elapsed_s).")
    policy: DecisionPolicyOut
    at: datetime
    local: bool = Field(default=False, description="Decided by a fail-open client during an "
                        "outage and uploaded (SPEC 10).")
    policy_violation: bool = Field(default=False, description="An uploaded local allow that "
                                   "broke the run's policy (SPEC 10): kept, and flagged.")
    violation: str | None = Field(default=None, description="What it broke, in words.")


def _absent_if_empty(value: Any) -> Any:
    if value == "":
        raise PydanticUseDefault()
    return value


# A query parameter left empty (`?status=&limit=`, as a form or a URL template leaves one) is
# the same as an absent one, not a value to refuse.
EmptyIsAbsent = BeforeValidator(_absent_if_empty)


class RunsFilter(Schema):
    status: Annotated[RunStatusName | None, EmptyIsAbsent] = None
    # The agent-name pattern, not only a length: a NUL would reach the database as a 503.
    agent: Annotated[Annotated[str, Field(pattern=AGENT_PATTERN)] | None, EmptyIsAbsent] = None
    limit: Annotated[int, Field(ge=1, le=500), EmptyIsAbsent] = 50
    after: Annotated[UUID | None, EmptyIsAbsent, Field(description=(
        "Only the runs listed after this one (a page's `next_after`): older ones, newest "
        "first. A run the key does not see: 404 naming `after`."))] = None


class DecisionsFilter(Schema):
    after: Annotated[int, Field(ge=0), EmptyIsAbsent] = 0
    limit: Annotated[int, Field(ge=1, le=1000), EmptyIsAbsent] = 100


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
    wait: Annotated[int, Field(ge=0, le=60), EmptyIsAbsent] = 0
