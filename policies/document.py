"""The policy document of SPEC section 3: validation and normalization, no I/O.

The YAML command, the browser editor and its import all go through `parse_document` /
`parse_policy`, so the three produce identical versions and identical error messages.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from governance_client.rules import DEFAULT_REDACT
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from governance.text import first_text_problem

from .egress import RefusedTarget, check_webhook_url

SLUG = r"^[a-z0-9-]{1,50}$"
POLICY_NAME = r"^[a-z0-9_-]{1,50}$"


class DocumentError(Exception):
    """An invalid document: ``errors`` maps a field path to what is wrong with it."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


def _is_http_url(value: str) -> bool:
    """An absolute http(s) URL with a host: something a notification can be POSTed to."""
    if not value.startswith(("http://", "https://")) or any(c.isspace() for c in value):
        return False
    try:
        return bool(urlsplit(value).hostname)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return False


def _six_decimals(value: float | int | None) -> float | None:
    if value is not None and Decimal(str(value)).as_tuple().exponent < -6:
        raise ValueError("must have at most 6 decimals")
    # Money is always a float: the form's "1" and the YAML's 1.0 are one document, so a save
    # from the form does not show a spurious "max_usd: 1.0 -> 1" in the history.
    return None if value is None else float(value)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StepLimits(_Strict):
    max_steps: Annotated[StrictInt, Field(ge=1, le=10000)]
    max_repeat_action: Annotated[StrictInt, Field(ge=1, le=1000)]
    no_progress_window: Annotated[StrictInt, Field(ge=1, le=1000)]


Number = StrictInt | StrictFloat


class Budgets(_Strict):
    max_seconds: Annotated[Number, Field(gt=0, le=31_536_000)] | None = 45
    max_usd: Annotated[Number, Field(gt=0, le=1_000_000), AfterValidator(_six_decimals)] | None = (
        1.0
    )
    max_tool_calls: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = None
    # SPEC 14. Versions stored before this field existed read it as null (never): the
    # migration policies/0002 wrote that into them, so an export shows it.
    max_idle_seconds: Annotated[Number, Field(gt=0, le=31_536_000)] | None = 3600


Pattern = Annotated[StrictStr, Field(min_length=1, max_length=200)]


class Tools(_Strict):
    allow: list[Pattern] | None = None
    deny: list[Pattern] = []


class RepeatKey(_Strict):
    ignore_args: list[Annotated[StrictStr, Field(min_length=1, max_length=200)]] = []


class OnRepeatedError(_Strict):
    threshold: Annotated[StrictInt, Field(ge=1, le=1000)] = 3
    action: Literal["nudge", "stop"] = "nudge"


class RateLimitDoc(_Strict):
    """One rule of ``rate_limits`` (SPEC 12)."""

    match: Pattern
    per: Literal["run", "agent", "team"]
    max: Annotated[StrictInt, Field(ge=1, le=100_000)]
    window_s: Annotated[StrictInt, Field(ge=1, le=86_400)]


class Approvals(_Strict):
    """SPEC 11: actions whose name matches one of ``tools`` wait for an operator's decision,
    for at most ``timeout_s`` seconds."""

    tools: list[Pattern] = []
    timeout_s: Annotated[StrictInt, Field(ge=1, le=86400)] = 900


class PolicyDoc(_Strict):
    name: Annotated[StrictStr, Field(pattern=POLICY_NAME)]
    mode: Literal["enforce", "shadow"] = "enforce"
    step_limits: StepLimits
    budgets: Budgets = Budgets()
    tools: Tools = Tools()
    repeat_key: RepeatKey = RepeatKey()
    on_repeated_error: OnRepeatedError = OnRepeatedError()
    redact_args: list[Annotated[StrictStr, Field(min_length=1, max_length=200)]] = list(
        DEFAULT_REDACT
    )
    rate_limits: Annotated[list[RateLimitDoc], Field(max_length=50)] = []
    approvals: Approvals = Approvals()


class TeamDoc(_Strict):
    slug: Annotated[StrictStr, Field(pattern=SLUG)]
    name: Annotated[StrictStr, Field(min_length=1, max_length=200)] | None = None
    webhook_url: Annotated[StrictStr, Field(max_length=500)] | None = None
    policies: list[PolicyDoc] = []

    @field_validator("webhook_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not _is_http_url(value):
            raise ValueError("must be an http:// or https:// URL with a host")
        if value is not None:
            try:
                check_webhook_url(value)
            except RefusedTarget as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("policies")
    @classmethod
    def _unique_names(cls, value: list[PolicyDoc]) -> list[PolicyDoc]:
        names = [p.name for p in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"policy names must be unique in a team, repeated: {dupes}")
        return value


class Document(_Strict):
    teams: list[TeamDoc]

    @field_validator("teams")
    @classmethod
    def _unique_slugs(cls, value: list[TeamDoc]) -> list[TeamDoc]:
        slugs = [t.slug for t in value]
        dupes = sorted({s for s in slugs if slugs.count(s) > 1})
        if dupes:
            raise ValueError(f"team slugs must be unique, repeated: {dupes}")
        return value


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) in {"int", "float", "constrained-int", "constrained-float"} or "[" in str(
            part
        ):
            continue  # pydantic names the union branch; the field is what people need
        else:
            out += f".{part}" if out else str(part)
    return out or "document"


def _errors(exc: ValidationError, prefix: str = "") -> dict[str, str]:
    errors: dict[str, str] = {}
    for err in exc.errors():
        if len(err["loc"]) > 1 and err["loc"][-1] == "int" and err["type"] == "int_type":
            # The integer branch of a number field: the float branch's "a valid number" is the
            # rule people need, not "a valid integer" for an amount that may have decimals.
            continue
        path = _path(err["loc"])
        if prefix:
            path = f"{prefix}.{path}" if path != "document" else prefix
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        errors.setdefault(path, msg)
    return errors


def _storable(data: Any) -> None:
    """A text PostgreSQL cannot hold (a YAML "\\0" escape gives a NUL) is the document's
    error, named by its path, not a failure of the save."""
    found = first_text_problem(data)
    if found is not None:
        path, problem = found
        raise DocumentError({path or "document": problem})


def parse_document(data: Any) -> list[dict[str, Any]]:
    """Validate a whole document; return its teams, each policy normalized (defaults filled)."""
    if not isinstance(data, dict):
        raise DocumentError({"document": "must be a mapping with a 'teams' list"})
    _storable(data)
    try:
        doc = Document.model_validate(data)
    except ValidationError as exc:
        raise DocumentError(_errors(exc)) from None
    return [team.model_dump() for team in doc.teams]


def parse_policy(data: Any) -> dict[str, Any]:
    """Validate one policy (the browser editor); return it normalized."""
    if not isinstance(data, dict):
        raise DocumentError({"policy": "must be a mapping"})
    _storable(data)
    try:
        return PolicyDoc.model_validate(data).model_dump()
    except ValidationError as exc:
        raise DocumentError(_errors(exc)) from None


def default_policy(name: str = "default") -> dict[str, Any]:
    """The defaults a new policy gets (SPEC 3, from the seeds)."""
    return parse_policy(
        {
            "name": name,
            "step_limits": {"max_steps": 18, "max_repeat_action": 3, "no_progress_window": 4},
        }
    )
