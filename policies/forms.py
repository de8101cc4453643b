"""Dashboard forms. They only translate between HTML fields and the policy document / service
arguments; validation of a policy is `policies.document.parse_policy`, so the browser shows the
same messages as `apply_policies` does for the same mistake."""

from __future__ import annotations

import re
from typing import Any

from django import forms

from governance_client import rules

from .document import (
    MAX_DOCUMENT_BYTES,
    MAX_NUMBER_CHARS,
    DocumentError,
    denies_every_tool,
    load_yaml,
    parse_policy,
)
from .egress import RefusedTarget, ascii_url, check_webhook_url
from .models import OperatorRelease, Role

# Form field -> path of the value in the policy document (and of its errors).
FIELD_PATHS = {
    "name": "name",
    "mode": "mode",
    "max_steps": "step_limits.max_steps",
    "max_repeat_action": "step_limits.max_repeat_action",
    "no_progress_window": "step_limits.no_progress_window",
    "max_seconds": "budgets.max_seconds",
    "max_usd": "budgets.max_usd",
    "max_tool_calls": "budgets.max_tool_calls",
    "max_idle_seconds": "budgets.max_idle_seconds",
    "tools_allow": "tools.allow",
    "tools_deny": "tools.deny",
    "ignore_args": "repeat_key.ignore_args",
    "error_threshold": "on_repeated_error.threshold",
    "error_action": "on_repeated_error.action",
    "redact_args": "redact_args",
    "rate_limits": "rate_limits",
    "approval_tools": "approvals.tools",
    "approval_timeout_s": "approvals.timeout_s",
    "warn_repeat_action": "warnings.repeat_action",
    "warn_no_progress": "warnings.no_progress",
    "warn_budget_fraction": "warnings.budget_fraction",
}
# SPEC 16: the warnings block, one box each; an empty box is null (that warning off), and
# three empty boxes are a null block.
WARNING_FIELDS = {"warn_repeat_action": "repeat_action", "warn_no_progress": "no_progress",
                  "warn_budget_fraction": "budget_fraction"}
OPTIONAL_NUMBERS = {"max_seconds", "max_usd", "max_tool_calls", "max_idle_seconds"}
RATE_LINE = "match per max window_s, e.g. http.* agent 10 60"
# ASCII digits only, as YAML reads them: `\d` took "٣" (Arabic-Indic 3), which int() reads,
# so the form saved 3 where a file is refused (found by an attacker).
INT_RE = re.compile(r"^[+-]?[0-9]+$", re.ASCII)
FLOAT_RE = re.compile(r"^[+-]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][+-]?[0-9]+)?$", re.ASCII)


def _number(raw: str) -> Any:
    """What YAML would read for this text: an int, a float, or (left to the validator to
    refuse with its own message) the string itself."""
    text = raw.strip()
    if INT_RE.match(text):
        return int(text)
    if FLOAT_RE.match(text):
        return float(text)
    return text


def _top_level_commas(pattern: str) -> list[int]:
    """Where ``pattern`` has a comma outside a glob's set: a comma inside one (`db.[a,b]*`)
    is a member of the set, as fnmatch reads it."""
    found, i = [], 0
    while i < len(pattern):
        if pattern[i] == "[" and (end := rules.glob_set_end(pattern, i + 1)) >= 0:
            i = end + 1
            continue
        if pattern[i] == ",":
            found.append(i)
        i += 1
    return found


def _lines(raw: str) -> list[str]:
    """A list box's items: one per line, or several on a line apart by commas, save a comma
    in a glob's set (a save of `db.[a,b]*` kept it as two patterns, `db.[a` and `b]*`)."""
    items = []
    for line in raw.splitlines():
        start = 0
        for comma in [*_top_level_commas(line), len(line)]:
            if item := line[start:comma].strip():
                items.append(item)
            start = comma + 1
    return items


def _glob_lines(patterns: list[str]) -> str:
    """Glob patterns for a list box, one per line, a comma outside a set written as the set
    `[,]` (the same names match) so that `_lines` reads each back as one pattern."""
    def kept(pattern: str) -> str:
        commas = set(_top_level_commas(pattern))
        return "".join("[,]" if i in commas else c for i, c in enumerate(pattern))
    return "\n".join(kept(p) for p in patterns)


def _rate_rules(raw: str) -> tuple[list[dict[str, Any]], list[str]]:
    """One rule per line, `match per max window_s` (the pattern may contain spaces: the last
    three words are the others), apart by spaces or commas. Returns the rules and the lines
    that are not rules."""
    found, bad = [], []
    for number, line in enumerate(raw.splitlines(), start=1):
        words = line.split()
        if not words:
            continue
        if len(words) < 4:
            # Which parts are missing, and a `per` that is none of its three values, where
            # "write a rule as ..." alone left a newcomer to guess (`http.* agnt 10`).
            parts = ("match", "per", "max", "window_s")
            missing = " and ".join(parts[len(words):])
            per = f"; per is run, agent or team, not {words[1]!r}" \
                if len(words) > 1 and words[1] not in rules.SCOPES else ""
            bad.append(f"line {number}: {missing} missing{per}: write a rule as {RATE_LINE}")
            continue
        # Commas between the parts, as the list boxes take them ("http.*, agent, 10, 60"),
        # are separators too (found by a newcomer: per "agent," and max "10," were refused).
        match, per, most, window = (part.rstrip(",").rstrip()
                                    for part in line.strip().rstrip(",").rsplit(None, 3))
        if max(len(most), len(window)) > MAX_NUMBER_CHARS:
            # Read as a number, the text's digits would cost quadratic time (and Python
            # refuses past 4,300 of them): refused here, like the other number boxes' length.
            bad.append(f"line {number}: a number may have at most {MAX_NUMBER_CHARS} "
                       "characters")
            continue
        found.append({"match": match, "per": per, "max": _number(most),
                      "window_s": _number(window)})
    return found, bad


def rate_rule_line(rule: dict[str, Any]) -> str:
    return f"{rule['match']} {rule['per']} {rule['max']} {rule['window_s']}"


def _number_box(label: str) -> forms.CharField:
    """A number's box: text, converted and judged by `document()` and `parse_policy`."""
    return forms.CharField(label=label, required=False, max_length=MAX_NUMBER_CHARS)


def _lines_box(label: str, *, rows: int) -> forms.CharField:
    """A box of lines (a list, or the rate limits' rules)."""
    return forms.CharField(label=label, required=False,
                           widget=forms.Textarea(attrs={"rows": rows}))


class PolicyForm(forms.Form):
    """One policy. Every field is text on purpose: converting happens in `document()` and
    judging in `parse_policy`, never in Django's field classes, so messages match the YAML's."""

    name = forms.CharField(label="Name", required=False, max_length=100)
    mode = forms.ChoiceField(label="Mode", choices=[("enforce", "enforce"), ("shadow", "shadow")],
                             required=False)
    max_steps = _number_box("Max steps")
    max_repeat_action = _number_box("Max repeat action")
    no_progress_window = _number_box("No-progress window")
    max_seconds = _number_box("Max seconds")
    max_usd = _number_box("Max USD")
    max_tool_calls = _number_box("Max tool calls")
    restrict_tools = forms.BooleanField(label="Only allow the tools listed", required=False)
    # An empty allow list denies every tool of every run: said out loud, never by omission.
    deny_every_tool = forms.BooleanField(label="Deny every tool", required=False)
    tools_allow = _lines_box("Allow", rows=3)
    tools_deny = _lines_box("Deny", rows=3)
    ignore_args = _lines_box("Args ignored in the repeat key", rows=2)
    error_threshold = _number_box("Repeated error threshold")
    error_action = forms.ChoiceField(label="On repeated error",
                                     choices=[("nudge", "nudge"), ("stop", "stop")],
                                     required=False)
    redact_args = _lines_box("Redacted args", rows=2)
    max_idle_seconds = _number_box("Max idle seconds")
    rate_limits = _lines_box("Rules", rows=3)
    approval_tools = _lines_box("Actions needing approval", rows=2)
    approval_timeout_s = _number_box("Approval timeout (seconds)")
    warn_repeat_action = _number_box("Warn at repeat count")
    warn_no_progress = _number_box("Warn at no-progress streak")
    warn_budget_fraction = _number_box("Warn at budget fraction")
    # Not part of the policy: why it changed, kept on the version (required by the save view).
    note = forms.CharField(label="Change note", required=False, max_length=500, strip=True,
                           widget=forms.TextInput(attrs={
                               "placeholder": "what changed and why (shown in the history)",
                               "maxlength": 500}))

    def __init__(self, *args: Any, fixed_name: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # A list box is as tall as its lines (plus one to type in): none hides behind a scroll.
        for name in ("tools_allow", "tools_deny", "ignore_args", "redact_args"):
            value = self.data.get(name) if self.is_bound else self.initial.get(name)
            lines = len(str(value or "").splitlines())
            self.fields[name].widget.attrs["rows"] = max(2, lines + 1)
        self.fixed_name = fixed_name
        self.document_errors: dict[str, str] = {}
        self.normalized: dict[str, Any] | None = None
        self.rate_line_errors: list[str] = []

    @classmethod
    def initial_from(cls, document: dict[str, Any]) -> dict[str, Any]:
        steps, budgets, tools = document["step_limits"], document["budgets"], document["tools"]
        approvals = document.get("approvals") or {}
        warnings = document.get("warnings") or {}

        def text(value: Any) -> str:
            if value is None:
                return ""
            if isinstance(value, float):
                # The shortest text that reads back as this very number: ":g" kept six
                # significant digits, so a save from the editor turned a file's max_usd of
                # 12.345678 into 12.3457 and max_seconds 1234567.5 into 1234570 (SPEC 3: the
                # file and the browser make the same versions). "45.0" is shown as "45".
                shown = repr(value)
                return shown.removesuffix(".0")
            return str(value)

        return {
            "name": document["name"],
            "mode": document["mode"],
            "max_steps": text(steps["max_steps"]),
            "max_repeat_action": text(steps["max_repeat_action"]),
            "no_progress_window": text(steps["no_progress_window"]),
            "max_seconds": text(budgets["max_seconds"]),
            "max_usd": text(budgets["max_usd"]),
            "max_tool_calls": text(budgets["max_tool_calls"]),
            "restrict_tools": tools["allow"] is not None,
            "deny_every_tool": denies_every_tool(tools["allow"], tools["deny"]) is not None,
            "tools_allow": _glob_lines(tools["allow"] or []),
            "tools_deny": _glob_lines(tools["deny"]),
            "ignore_args": "\n".join(document["repeat_key"]["ignore_args"]),
            "error_threshold": text(document["on_repeated_error"]["threshold"]),
            "error_action": document["on_repeated_error"]["action"],
            "redact_args": "\n".join(document["redact_args"]),
            "max_idle_seconds": text(budgets.get("max_idle_seconds")),
            "rate_limits": "\n".join(rate_rule_line(r) for r in document.get("rate_limits", [])),
            # Versions saved before approvals existed have no block: they require none.
            "approval_tools": _glob_lines(approvals.get("tools", [])),
            "approval_timeout_s": text(approvals.get("timeout_s", 900)),
            **{field: text(warnings.get(key)) for field, key in WARNING_FIELDS.items()},
        }

    def document(self) -> dict[str, Any]:
        """The raw policy document these fields describe (not yet validated)."""
        data = self.cleaned_data

        def number(field: str) -> Any:
            # An empty box is YAML's null: "no limit" for a budget, refused for a step limit.
            raw = data.get(field) or ""
            return _number(raw) if raw.strip() else None

        threshold = data.get("error_threshold") or ""
        rate_limits, self.rate_line_errors = _rate_rules(data.get("rate_limits") or "")
        timeout = data.get("approval_timeout_s") or ""
        warnings = {key: number(field) for field, key in WARNING_FIELDS.items()}
        allowed = _lines(data.get("tools_allow") or "")
        denied = _lines(data.get("tools_deny") or "")
        allow = allowed if data.get("restrict_tools") else None
        if data.get("deny_every_tool") and not allowed \
                and denies_every_tool(allow, denied) is None:
            # "Deny every tool" means it on its own (found by a newcomer: ticked alone it
            # saved nothing, "Nothing changed"); with tools listed it is a form error. Where
            # the deny patterns already deny every tool, the ticked box only confirms it.
            allow = []
        return {
            "name": self.fixed_name if self.fixed_name is not None else (data.get("name") or ""),
            "mode": data.get("mode") or "enforce",
            "step_limits": {
                "max_steps": number("max_steps"),
                "max_repeat_action": number("max_repeat_action"),
                "no_progress_window": number("no_progress_window"),
            },
            "budgets": {f: number(f) for f in sorted(OPTIONAL_NUMBERS)},
            "tools": {"allow": allow, "deny": denied},
            "repeat_key": {"ignore_args": _lines(data.get("ignore_args") or "")},
            "on_repeated_error": {
                "threshold": _number(threshold) if threshold.strip() else 3,
                "action": data.get("error_action") or "nudge",
            },
            "redact_args": _lines(data.get("redact_args") or ""),
            "rate_limits": rate_limits,
            "approvals": {
                "tools": _lines(data.get("approval_tools") or ""),
                "timeout_s": _number(timeout) if timeout.strip() else 900,
            },
            "warnings": warnings if any(v is not None for v in warnings.values()) else None,
        }

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        try:
            self.normalized = parse_policy(self.document())
        except DocumentError as exc:
            self.document_errors = exc.errors
            for path, message in exc.errors.items():
                field = field_for_path(path)
                if field in STEP_LIMITS and not (cleaned.get(field) or "").strip():
                    # Not "Input should be a valid integer" for a box left empty (found by a
                    # newcomer): a budget's empty box is "no limit", a step limit's is refused.
                    message = STEP_LIMIT_EMPTY
                if field == "rate_limits" and path != "rate_limits":
                    # rate_limits[1].max -> the line people typed, and the value at fault.
                    index, _, key = path.removeprefix("rate_limits[").partition("]")
                    message = f"line {int(index) + 1}: {key.lstrip('.')}: {message}"
                self.add_error(field, f"{path}: {message}" if field is None else message)
        for message in self.rate_line_errors:
            self.add_error("rate_limits", message)
        tools = (self.normalized or {}).get("tools") or {}
        if cleaned.get("deny_every_tool") and _lines(cleaned.get("tools_allow") or ""):
            self.add_error("tools_allow", DENY_ALL_WITH_TOOLS)
        if tools.get("allow") == [] and not cleaned.get("deny_every_tool"):
            # "Only allow the tools listed below" ticked over an empty list saved a policy
            # that stopped 246 of 259 recorded runs at their first step, without a word.
            self.add_error("tools_allow", DENY_ALL)
        elif tools and not cleaned.get("deny_every_tool") and (
                why := denies_every_tool(tools.get("allow"), tools.get("deny") or [])):
            self.add_error("tools_deny", DENY_ALL_BY_PATTERNS.format(why=why))
        return cleaned


STEP_LIMITS = ("max_steps", "max_repeat_action", "no_progress_window")
STEP_LIMIT_EMPTY = ("Required: a step limit cannot be empty (only a budget's empty box means "
                    "no limit).")
DENY_ALL_WITH_TOOLS = ("\"Deny every tool\" is ticked: empty this list, or untick it to allow "
                       "only the tools listed.")
DENY_ALL_BY_PATTERNS = ("Every tool of every run would be denied: {why}. Change the patterns, "
                        "or tick \"Deny every tool\" to mean it.")
DENY_ALL = ("The list is empty: every tool of every run would be denied. List the tools to "
            "allow, untick \"Only allow\", or tick \"Deny every tool\" to mean it.")


def field_for_path(path: str) -> str | None:
    """The form field that shows an error at this document path (None: the whole form)."""
    for field, prefix in FIELD_PATHS.items():
        if path == prefix or path.startswith(prefix + "[") or path.startswith(prefix + "."):
            return field
    return None


class ImportForm(forms.Form):
    document = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 16}))
    file = forms.FileField(required=False)

    def data_of(self) -> Any:
        """The parsed YAML; raises forms.ValidationError for text that is not YAML or is past
        the bounds of `load_yaml`."""
        upload = self.cleaned_data.get("file")
        # One byte past the bound is enough to refuse an upload: the rest is never read.
        source: str | bytes = upload.read(MAX_DOCUMENT_BYTES + 1) if upload else \
            self.cleaned_data.get("document") or ""
        if not source.strip():
            raise forms.ValidationError("Paste a YAML document or choose a file.")
        try:
            return load_yaml(source)
        except DocumentError as exc:
            raise forms.ValidationError(f"The document {exc.errors['document']}.") from None




class KeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    agent = forms.RegexField(
        regex=f"^{rules.AGENT_NAME_PATTERN}$", required=False, max_length=100,
        help_text="Optional: the key may then only start runs of this agent.",
        error_messages={"invalid": "Letters, digits, dot, dash and underscore only."},
    )


class MemberAddForm(forms.Form):
    username = forms.CharField(max_length=150)
    role = forms.ChoiceField(choices=Role.choices, initial=Role.VIEWER)


class MemberInviteForm(forms.Form):
    username = forms.RegexField(regex=r"^[\w.@+-]{1,150}$", max_length=150, error_messages={
        "invalid": "Letters, digits and @ . + - _ only."})
    role = forms.ChoiceField(choices=Role.choices, initial=Role.VIEWER)


class MemberRoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


class OperatorReleaseForm(forms.Form):
    operator_release = forms.ChoiceField(choices=OperatorRelease.choices,
                                         widget=forms.RadioSelect)


class WebhookForm(forms.Form):
    webhook_url = forms.URLField(required=False, max_length=500, assume_scheme="https")

    def clean_webhook_url(self) -> str | None:
        url = self.cleaned_data.get("webhook_url") or None
        if url is not None and not url.startswith(("http://", "https://")):
            raise forms.ValidationError("must be an http:// or https:// URL")
        if url is not None:
            try:
                url = ascii_url(url)  # saved as HTTP and DNS carry it
                check_webhook_url(url)
            except RefusedTarget as exc:
                raise forms.ValidationError(str(exc)) from None
        return url


class OperatorTokenForm(forms.Form):
    """A new operator token (SPEC 17): its team is one of the person's, or every team."""

    name = forms.CharField(max_length=100)
    role = forms.ChoiceField(choices=Role.choices, initial=Role.VIEWER,
                             help_text="It acts with the lesser of your role and this one.")
    # Not "Empty: ...": the box is a list whose first choice reads "every team" (found by a
    # newcomer, who looked for an empty one).
    team = forms.ChoiceField(required=False, help_text="\"every team\": each team you are a "
                             "member of, with your role there.")
    expires_days = forms.IntegerField(required=False, min_value=1, max_value=3650,
                                      label="Expires after (days)",
                                      help_text="Empty: never (revoke it when done).")

    def __init__(self, *args: Any, teams: list[Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teams = {team.slug: team for team in teams}
        self.fields["team"].choices = [("", "every team")] + [
            (team.slug, team.slug) for team in teams]
