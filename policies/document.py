"""The policy document of SPEC section 3: reading, validation and normalization, no I/O.

The YAML command, the browser editor and its import all go through `load_yaml` (text) and
`parse_document` / `parse_policy`, so the three produce identical versions and identical error
messages. Both are bounded before anything walks the document (SPEC 10, "Bounded work per
request"): what a request costs follows from its size, whatever shape it has.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from governance_client.rules import DEFAULT_REDACT, default_warning, glob_set_span
from governance_client.yaml_keys import unique_keys, yaml_problem
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
    model_validator,
)

from governance.text import first_text_problem

from .egress import RefusedTarget, check_webhook_url

SLUG = r"^[a-z0-9-]{1,50}$"
POLICY_NAME = r"^[a-z0-9_-]{1,50}$"

# The bounds of a document (docs/policies.md). A real one nests 7 levels (teams, a team, its
# policies, a policy, rate_limits, a rule, a value) and a hundred teams of five policies each,
# every field written out, are about 170 KiB and 20,000 values.
MAX_DOCUMENT_BYTES = 256 * 1024
MAX_DEPTH = 16
MAX_VALUES = 50_000
MAX_NUMBER_CHARS = 32  # no limit of SPEC 3 needs more than 14 (1000000.000001)
_NUMBER_LIMIT = 10**MAX_NUMBER_CHARS


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
# Every check matches the action against each pattern of its policy's lists, on the thread
# pool every team's checks share: a list's length is a bound on a check's work (SPEC 10,
# bounded work per request). 40,000 deny patterns (a 720 KB document before the size bound)
# took 5 to 7 s a check, and past 32,768 thrashed fnmatch's process-wide cache of compiled
# patterns, every team's. Far above any real policy (a few dozen).
MAX_PATTERNS = 256
Patterns = Annotated[list[Pattern], Field(max_length=MAX_PATTERNS)]
# A team's policies: every policy's rate-limit rules count each action of the team (SPEC 12),
# so their number bounds a check's rate-limit write.
MAX_POLICIES_PER_TEAM = 100
# ...and the rules themselves, across the team's current policies (distinct by match, per,
# max and window): every counted action of the team is matched against each registered
# rule and bumps the count of each it matches, so a team's rules are a check's write (found
# by an attacker: 40 policies of 50 rules made the team's checks take 1 to 5 s and another
# team's p99 rise 15x). 50 a policy times 100 policies was 5,000.
MAX_RATE_RULES_PER_TEAM = 200
# ...and the patterns' text, all lists of a policy together (tools.allow, tools.deny,
# approvals.tools, rate_limits[].match): a process compiles a policy's patterns at its first
# check of each version it keeps (rules.Policy.matches), 3 to 8 us a character, so this
# bounds that first check's work at about 50 to 130 ms where 768 patterns of 200 characters
# took 1.3 s (found by an attacker, with versions enough to push them out of every cache).
# Sixteen times a policy of a few dozen tool names.
MAX_PATTERN_CHARS = 16_384
# ...and the code points their sets' ranges span, all lists together: compiling a range costs
# each of its code points, whatever its length (`rules.glob_set_span`), so 16,384 characters
# of sets like "[\u0100-\uffff\u0101-\uffff...]" made a version's first check in a process
# compile for 15 to 20 s, past the database's idle-transaction timeout, and another team's
# p99 rise 8 to 10 times (found by an attacker, a new version per save). 65,536 is one whole
# [\u0000-\uffff], about 5 ms; "[a-z]" spans 26.
MAX_SET_SPAN = 65_536


class Tools(_Strict):
    allow: Patterns | None = None
    deny: Patterns = []


class RepeatKey(_Strict):
    ignore_args: Patterns = []


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

    tools: Patterns = []
    timeout_s: Annotated[StrictInt, Field(ge=1, le=86400)] = 900


class Warnings(_Strict):
    """SPEC 16: warn the agent before a stop; each optional, null = off. A new policy gets
    these values; versions made before the block existed have it null (policies/0008)."""

    repeat_action: Annotated[StrictInt, Field(ge=1, le=999)] | None = 2
    no_progress: Annotated[StrictInt, Field(ge=1, le=999)] | None = 3
    budget_fraction: Annotated[Number, Field(gt=0, lt=1)] | None = 0.8


class PolicyDoc(_Strict):
    name: Annotated[StrictStr, Field(pattern=POLICY_NAME)]
    mode: Literal["enforce", "shadow"] = "enforce"
    step_limits: StepLimits
    budgets: Budgets = Budgets()
    tools: Tools = Tools()
    repeat_key: RepeatKey = RepeatKey()
    on_repeated_error: OnRepeatedError = OnRepeatedError()
    redact_args: Patterns = list(DEFAULT_REDACT)
    rate_limits: Annotated[list[RateLimitDoc], Field(max_length=50)] = []
    approvals: Approvals = Approvals()
    # SPEC 16. Null (no warnings) on versions made before it existed.
    warnings: Warnings | None = Warnings()

    @model_validator(mode="after")
    def _patterns_bounded(self) -> PolicyDoc:
        lists = (self.tools.allow or [], self.tools.deny, self.approvals.tools,
                 [rule.match for rule in self.rate_limits])
        total = pattern_chars(*lists)
        if total > MAX_PATTERN_CHARS:
            raise _FieldErrors({"tools": (
                f"the policy's patterns (tools.allow, tools.deny, approvals.tools and "
                f"rate_limits[].match together) are {total:,} characters; at most "
                f"{MAX_PATTERN_CHARS:,}: a check compiles them")})
        spans = sum(glob_set_span(pattern) for patterns in lists for pattern in patterns)
        if spans > MAX_SET_SPAN:
            raise _FieldErrors({"tools": (
                f"the ranges of the policy's sets ([a-z] in tools.allow, tools.deny, "
                f"approvals.tools and rate_limits[].match together) span {spans:,} "
                f"characters; at most {MAX_SET_SPAN:,}: a check compiles each of them")})
        return self

    @model_validator(mode="after")
    def _warn_below_limits(self) -> PolicyDoc:
        """A warning at or past its limit would never come before the stop: refused, naming
        the warning's field (SPEC 16)."""
        warnings, steps = self.warnings, self.step_limits
        if warnings is None:
            return self
        for field, limit_field in WARNED_LIMITS:
            value, limit = getattr(warnings, field), getattr(steps, limit_field)
            if field not in warnings.model_fields_set and value is not None and value >= limit:
                # An omitted warning takes its default where it fits, else the last count
                # before the stop (none for a limit of 1): a policy written before warnings
                # existed, with max_repeat_action: 2, stays valid (docs/policies.md).
                setattr(warnings, field, default_warning(field, limit))
        problems = warnings_past_limits(self.model_dump(include={"warnings", "step_limits"}))
        if problems:
            raise _FieldErrors(problems)
        return self


_GLOB = re.compile(r"[*?\[]")


def pattern_chars(*lists: list[str]) -> int:
    """The characters of a policy's patterns, every list together (`MAX_PATTERN_CHARS`)."""
    return sum(len(pattern) for patterns in lists for pattern in patterns)


def denies_every_tool(allow: list[str] | None, deny: list[str]) -> str | None:
    """Why these tool rules deny every action (SPEC 4.4 rule 3), in words, else None: an empty
    allow list, a deny pattern that matches every name, or every allow pattern covered by a
    deny pattern. Only what is certain: a deny pattern covers an allow pattern when they are
    the same, when it matches the allowed name itself (no wildcard in it), or when it is a
    literal prefix and `*` and every name the allow pattern matches starts with that prefix.
    A deny-all saved by a pattern, where the empty allow list was already refused, stopped
    every run of a policy without a word (found by a newcomer: allow search.docs, deny
    search.*; then deny *)."""
    if allow == []:
        return "the allow list is empty"
    for pattern in deny:
        if pattern and set(pattern) == {"*"}:
            return f"the deny pattern {pattern!r} matches every tool"
    if allow is None:
        return None
    covered = []
    # The literal prefix of each deny pattern that is one and `*` (worked out once).
    literal_of = {pattern: pattern[:-1] for pattern in deny
                  if pattern.endswith("*") and not _GLOB.search(pattern[:-1])}
    for allowed in allow:
        wildcard = _GLOB.search(allowed)
        prefix = allowed[:wildcard.start()] if wildcard else allowed
        by = next((pattern for pattern in deny if pattern == allowed
                   or (wildcard is None and fnmatchcase(allowed, pattern))
                   or (pattern in literal_of and prefix.startswith(literal_of[pattern]))),
                  None)
        if by is None:
            return None
        covered.append(f"{allowed} by {by}")
    # A few are named: 256 patterns of 200 characters made a refusal of 100 KB.
    more = f" and {len(covered) - 5} more" if len(covered) > 5 else ""
    return "every allowed tool is denied too: " + ", ".join(covered[:5]) + more


# Each count warning (SPEC 16) and the step limit it must stay below.
WARNED_LIMITS = (("repeat_action", "max_repeat_action"), ("no_progress", "no_progress_window"))


def warnings_past_limits(policy: Any) -> dict[str, str]:
    """The count warnings of a policy (validated, or as sent) at or past their step limits,
    by path. Also read from a policy as sent when other fields are refused, so that one
    answer names each bad field (SPEC 17), not this one only once the others are fixed
    (found by a tester). A value that is not a valid count is left to the field's own
    validation."""
    if not isinstance(policy, dict):
        return {}
    warnings, steps = policy.get("warnings"), policy.get("step_limits")
    if not isinstance(warnings, dict) or not isinstance(steps, dict):
        return {}
    problems = {}
    for field, limit_field in WARNED_LIMITS:
        value, limit = warnings.get(field), steps.get(limit_field)
        if not all(type(n) is int and 1 <= n <= 1000 for n in (value, limit)):
            continue
        if value >= limit:
            name = f"step_limits.{limit_field}"
            problems[f"warnings.{field}"] = (
                f"must be below {name} ({limit}) so the warning comes before the stop; "
                f"between 1 and {limit - 1}, or null for no warning" if limit > 1 else
                f"must be null: {name} is 1, so no warning can come before the stop")
    return problems


class _FieldErrors(ValueError):
    """Errors of fields that a whole-policy rule found, each named by its path."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


class TeamDoc(_Strict):
    slug: Annotated[StrictStr, Field(pattern=SLUG)]
    name: Annotated[StrictStr, Field(min_length=1, max_length=200)] | None = None
    webhook_url: Annotated[StrictStr, Field(max_length=500)] | None = None
    policies: Annotated[list[PolicyDoc], Field(max_length=MAX_POLICIES_PER_TEAM)] = []

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
        found = (err.get("ctx") or {}).get("error")
        if isinstance(found, _FieldErrors):
            # A rule over the whole policy: each error at its field's own path.
            base = _path(err["loc"]) if err["loc"] else ""
            for field, message in found.errors.items():
                errors.setdefault(f"{base}.{field}" if base else field, message)
            continue
        path = _path(err["loc"])
        if prefix:
            path = f"{prefix}.{path}" if path != "document" else prefix
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        errors.setdefault(path, msg)
    return errors


# libyaml when installed: the scan and the load below then read the text at C speed.
_PARSER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_LOADER: Any = unique_keys(_PARSER)  # a key written twice is refused (yaml_keys says why)
_NUMBER_TAGS = frozenset({"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"})


def _refused(problem: str, event: Any = None) -> DocumentError:
    mark = getattr(event, "start_mark", None)
    where = f": line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return DocumentError({"document": problem + where})


def _scan(text: str) -> None:
    """Refuse, from YAML's event stream and before anything is built, what would make the
    document cost more than its size. An alias repeats its anchor's value without repeating
    its text (nine aliases of nine aliases of ... are a few hundred bytes and billions of
    values to every walk after the load), so each alias counts as the values and levels of
    what it repeats, and one inside its own anchor's value (an endless value) is refused.
    Deep nesting would exhaust the recursion of the builder and of every later walk; a long
    number costs quadratic time to convert (Python refuses past 4,300 digits, with an error
    of its own)."""
    resolver = yaml.resolver.Resolver()
    done: dict[str, tuple[int, int]] = {}  # anchor -> (values, levels) of its value
    # One frame per open collection: its anchor, the count of values before it, and the
    # deepest level reached inside it.
    frames: list[tuple[str | None, int, int]] = []
    depth = values = 0

    def reach(levels: int, event: Any) -> None:
        if levels > MAX_DEPTH:
            raise _refused(f"may nest at most {MAX_DEPTH} levels", event)
        if frames and levels > frames[-1][2]:
            frames[-1] = (frames[-1][0], frames[-1][1], levels)

    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.AliasEvent):
            if event.anchor not in done:
                raise _refused(f"may use the alias *{event.anchor} only after the whole "
                               f"value of its anchor &{event.anchor}", event)
            repeated, levels = done[event.anchor]
            values += repeated
            if values > MAX_VALUES:
                raise _refused(f"may hold at most {MAX_VALUES} values (counting each "
                               "alias as the values it repeats)", event)
            reach(depth + levels, event)
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, before, deepest = frames.pop()
            if anchor is not None:
                done[anchor] = (values - before, deepest - depth + 1)
            depth -= 1
            if frames:
                reach(deepest, event)
        elif isinstance(event, yaml.NodeEvent):
            values += 1
            if values > MAX_VALUES:
                raise _refused(f"may hold at most {MAX_VALUES} values", event)
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                reach(depth, event)
                frames.append((event.anchor, values - 1, depth))
                continue
            if event.anchor is not None:
                done[event.anchor] = (1, 0)
            if isinstance(event, yaml.ScalarEvent) and len(event.value) > MAX_NUMBER_CHARS:
                tag = event.tag
                if tag is None or tag == "!":
                    tag = resolver.resolve(yaml.ScalarNode, event.value, event.implicit)
                if tag in _NUMBER_TAGS:
                    raise _refused(f"may not hold a number of more than {MAX_NUMBER_CHARS} "
                                   "characters", event)


def load_yaml(source: str | bytes) -> Any:
    """The data of a YAML (or JSON) policy document, read within the bounds above. Raises
    DocumentError at ``document`` with a message that completes "The document ...": "is
    not valid YAML: ...", "may nest at most 16 levels: line 3, column 9".
    A caller reading a file or an upload reads at most MAX_DOCUMENT_BYTES + 1 bytes of it."""
    size = len(source) if isinstance(source, bytes) else len(source.encode("utf-8", "replace"))
    if size > MAX_DOCUMENT_BYTES:
        raise _refused(f"may be at most {MAX_DOCUMENT_BYTES // 1024} KiB")
    if isinstance(source, bytes):
        try:
            source = source.decode("utf-8")
        except UnicodeDecodeError:
            raise _refused("is not UTF-8 text") from None
    try:
        _scan(source)
        return yaml.load(source, Loader=_LOADER)  # CSafeLoader or SafeLoader: no tags run code
    except yaml.YAMLError as exc:
        raise _refused(f"is not valid YAML: {yaml_problem(exc, source)}") from None
    except (ValueError, OverflowError) as exc:
        # A scalar YAML reads but Python cannot build, e.g. the date 2024-02-30.
        raise _refused(f"holds a value that cannot be read: {exc}") from None


def _bounded(data: Any, where: str) -> None:
    """The same bounds for data that did not come through `load_yaml` (a form, JSON, a
    structure built in Python), checked without recursion and stopping at the first value
    past them: neither depth nor shared parts make this walk, or any after it, unbounded."""
    pending: list[tuple[Any, int]] = [(data, 1)]
    values = 1  # every value counted once, as YAML counts nodes: a pair is two
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict | list | tuple):
            if depth > MAX_DEPTH:
                raise DocumentError({where: f"may nest at most {MAX_DEPTH} levels"})
            values += 2 * len(value) if isinstance(value, dict) else len(value)
            if values > MAX_VALUES:
                raise DocumentError({where: f"may hold at most {MAX_VALUES} values"})
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            pending.extend((item, depth + 1) for item in items
                           if isinstance(item, dict | list | tuple | int))
        elif isinstance(value, int) and not -_NUMBER_LIMIT < value < _NUMBER_LIMIT:
            raise DocumentError({where: f"may not hold a number of more than "
                                        f"{MAX_NUMBER_CHARS} digits"})


def _storable(data: Any) -> None:
    """A text PostgreSQL cannot hold (a YAML "\\0" escape gives a NUL) is the document's
    error, named by its path, not a failure of the save."""
    found = first_text_problem(data)
    if found is not None:
        path, problem = found
        raise DocumentError({path or "document": problem})


def parse_document(data: Any) -> list[dict[str, Any]]:
    """Validate a whole document; return its teams, each policy normalized (defaults filled).
    A team's `name` and `webhook_url` are in its dict only when the file names them: an
    existing team keeps what the file leaves out (`policy_apply`)."""
    if not isinstance(data, dict):
        raise DocumentError({"document": "must be a mapping with a 'teams' list"})
    _bounded(data, "document")
    _storable(data)
    try:
        doc = Document.model_validate(data)
    except ValidationError as exc:
        raise DocumentError({**_warnings_past_limits_in(data), **_errors(exc)}) from None
    teams = []
    for team in doc.teams:
        dumped = team.model_dump()
        for field in ("name", "webhook_url"):
            if field not in team.model_fields_set:
                del dumped[field]
        teams.append(dumped)
    return teams


def _warnings_past_limits_in(data: dict[str, Any]) -> dict[str, str]:
    """`warnings_past_limits` of each policy of a document as sent, by its path."""
    found = {}
    teams = data.get("teams")
    for i, team in enumerate(teams if isinstance(teams, list) else []):
        policies = team.get("policies") if isinstance(team, dict) else None
        for j, policy in enumerate(policies if isinstance(policies, list) else []):
            for path, message in warnings_past_limits(policy).items():
                found[f"teams[{i}].policies[{j}].{path}"] = message
    return found


def parse_policy(data: Any) -> dict[str, Any]:
    """Validate one policy (the browser editor); return it normalized."""
    if not isinstance(data, dict):
        raise DocumentError({"policy": "must be a mapping"})
    _bounded(data, "policy")
    _storable(data)
    try:
        return PolicyDoc.model_validate(data).model_dump()
    except ValidationError as exc:
        raise DocumentError({**warnings_past_limits(data), **_errors(exc)}) from None


def default_policy(name: str = "default") -> dict[str, Any]:
    """The defaults a new policy gets (SPEC 3, from the seeds)."""
    return parse_policy(
        {
            "name": name,
            "step_limits": {"max_steps": 18, "max_repeat_action": 3, "no_progress_window": 4},
        }
    )
