"""`govctl`: the operator API (SPEC 17) from a shell, a CI job or a chat bot.

    govctl [--url URL] [--token TOKEN] policies apply FILE.yaml [--dry-run] [--note TEXT]
                                                                 [--confirm-stops]
    govctl policies export --team SLUG
    govctl killswitch engage|release --scope global|team|agent|run [--team SLUG]
                                     [--agent NAME] [--run UUID] --reason TEXT
    govctl runs list --team SLUG [--status running] [--agent NAME] [--limit N] [--after RUN]
                     [--json]
    govctl approvals list --team SLUG [--status pending]
    govctl approvals decide ID approve|deny [--note TEXT]

``--url`` and ``--token`` default to ``GOVERNANCE_URL`` and ``GOVERNANCE_OPERATOR_TOKEN``.
Every refusal of the server (its SPEC 5.3 error: code, message, fields) is printed on stderr
and ends the command with exit status 1, as does an answer that is not the operator API's (a
proxy's sign-in page, an object without the fields read), said in one line; a usage error
is argparse's exit status 2. Only a busy server's 429 is sent again (after its Retry-After,
a few times); nothing else is retried or guessed.
Texts of the server's (an agent's action names and reasons, a refusal's message) are printed
with every control, format and bidi character escaped (``\\x1b``, ``\\u202e``): a terminal
shows them and never acts on them; ``--json`` is the server's data, which JSON escapes.

A policy file has the format of ``manage.py apply_policies`` and the dashboard's export
(SPEC 3): ``apply`` saves every policy of the file's teams through
``PUT /api/v1/teams/{slug}/policies/{name}`` (the server says whether each one changed),
``--dry-run`` saves nothing and prints, for each policy that would change, the diff against
the current version and the backtest of the draft on the team's recorded runs (SPEC 13).
Reading YAML needs PyYAML (``pip install './governance_client[cli]'`` from a checkout); a JSON
file needs nothing more.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import time
import unicodedata
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import httpx

from governance_client.errors import secret_form_problem

TIMEOUT_S = 30.0
# A backtest's request waits for a worker's replay, up to the server's
# BACKTEST_API_WAIT_SECONDS (120 by default; then it answers 503 saying so): longer than that.
BACKTEST_TIMEOUT_S = 150.0

# A policy file's bounds, the server's own (SPEC 10; docs/policies.md, "Bounds of a
# document"): what the server would refuse is refused here before this process walks it or
# encodes it as JSON, where nine aliases of nine aliases would be billions of values.
MAX_FILE_BYTES = 256 * 1024
MAX_DEPTH = 16
MAX_VALUES = 50_000


class Refused(Exception):
    """The server refused (or could not be reached): the reason, for stderr and exit 1;
    the answer's status when the server gave one."""

    def __init__(self, reason: str, *, status: int | None = None):
        super().__init__(reason)
        self.status = status


class NotTheApi(Refused):
    """An answer none of the operator API's: the server at --url is another one, and that
    ends the command, whatever else it would have gone on to ask."""


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - the cli extra installs it
        raise Refused("reading or writing YAML needs PyYAML, which the client's [cli] extra "
                      "installs, from a checkout of the repository: "
                      "pip install './governance_client[cli]' (or pip install pyyaml)") from None
    return yaml


def _load(path: str) -> Any:
    """The file's data, read within the server's bounds; a refusal names the file."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise Refused(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise Refused(f"{path} is over {MAX_FILE_BYTES // 1024} KiB, the most a policy "
                      "document may be")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused(f"{path} is not UTF-8 text") from None
    kind = "JSON" if path.endswith(".json") else "YAML"
    try:
        if kind == "JSON":
            data = json.loads(text)
        else:
            yaml = _yaml()
            from .yaml_keys import unique_keys, yaml_problem  # PyYAML's: the cli extra

            try:
                # Safe (no tag runs code), a key written twice refused, as the server reads it.
                data = yaml.load(text, Loader=unique_keys(yaml.SafeLoader))
            except yaml.YAMLError as exc:
                raise Refused(f"{path} is not valid YAML: {yaml_problem(exc, text)}") from None
    except RecursionError:
        raise Refused(f"{path} nests more than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSON's errors, and a value YAML cannot build (2024-02-30)
        raise Refused(f"{path} is not valid {kind}: {exc}") from None
    _bounded(data, path)
    return data


def _bounded(data: Any, path: str) -> None:
    """Counts the values (a pair is two) and levels without recursion, stopping at the first
    one past the bounds: an alias is counted as often as it is used, and one inside its own
    value (an endless value) ends at the depth bound."""
    pending: list[tuple[Any, int]] = [(data, 1)]
    values = 1
    while pending:
        value, depth = pending.pop()
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise Refused(f"{path} nests more than {MAX_DEPTH} levels")
        values += 2 * len(value) if isinstance(value, dict) else len(value)
        if values > MAX_VALUES:
            raise Refused(f"{path} holds more than {MAX_VALUES} values (an alias counts as "
                          "the values it repeats)")
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        pending.extend((item, depth + 1) for item in items)


# What a terminal acts on, or draws other than as written, instead of showing it: C0 and C1
# controls and DEL (ESC starts the sequences that move the cursor and erase), format
# characters (the bidi overrides and isolates U+202A-U+202E and U+2066-U+2069, zero-width
# ones), line and paragraph separators, and lone surrogates (which no encoding writes).
# Found by a tester: an agent's action "pay.\x1b[4Dsearch.docs ..." was listed for approval
# as "search.docs ...".
_UNSHOWABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _unshowable(text: str) -> bool:
    return not text.isprintable() and any(unicodedata.category(ch) in _UNSHOWABLE
                                          for ch in text)


def _shown(value: Any, *, keep: str = "") -> str:
    """``value`` as text a terminal shows as written: each character of ``_UNSHOWABLE``
    (but those in ``keep``) as its escape, ``\\x1b``, ``\\u202e``. A line break is one too
    unless kept, so that a value stays within its line of a table."""
    text = str(value)
    if text.isprintable():  # nearly always: the walk below is for the rest
        return text
    return "".join(ch if ch in keep or unicodedata.category(ch) not in _UNSHOWABLE
                   else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def _for_terminal(data: Any) -> Any:
    """An answer with every text in it (keys too) ``_shown``: what tables and sentences are
    made of. ``--json`` and policy documents keep the server's data (their encoders escape)."""
    if isinstance(data, dict):
        return {_for_terminal(k): _for_terminal(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_for_terminal(v) for v in data]
    return _shown(data) if isinstance(data, str) else data


class _Terminal:
    """Where govctl prints (stdout, stderr): every text ``_shown`` with its line breaks kept,
    the net under the tables' own escaping (a server's message, an httpx error, a YAML
    dump), and the token ``_masked`` (a server quoting it back, into a CI job's log). JSON
    and the YAML dumper's output hold nothing it changes."""

    def __init__(self, stream: Any, *, token: str | None = None):
        self.stream = stream
        self.token = token

    def write(self, text: str) -> int:
        if self.token:
            text = _masked(text, self.token)
        text = _shown(text, keep="\n")
        try:
            return int(self.stream.write(text))
        except UnicodeEncodeError:
            # A stream that cannot write every character (a pipe in a legacy code page):
            # those characters as escapes, not a traceback.
            encoding = getattr(self.stream, "encoding", None) or "ascii"
            return int(self.stream.write(
                text.encode(encoding, "backslashreplace").decode(encoding)))

    def flush(self) -> None:
        self.stream.flush()


@cache
def _dumper(yaml: Any) -> Any:
    """PyYAML's safe dumper, a scalar holding a character of ``_UNSHOWABLE`` written double
    quoted with it escaped (``"a\\u202Eb"``): it reads back the same, and shows what it is.
    PyYAML's own writes bidi and zero-width characters as they are."""

    class Dumper(yaml.SafeDumper):  # type: ignore[misc]
        allow_unicode: bool  # the emitter's, set by dump()

        def analyze_scalar(self, scalar: str) -> Any:
            analysis = super().analyze_scalar(scalar)
            if _unshowable(scalar):
                analysis.allow_flow_plain = analysis.allow_block_plain = False
                analysis.allow_single_quoted = analysis.allow_block = False
            return analysis

        def write_double_quoted(self, text: str, split: bool = True) -> None:
            # allow_unicode off escapes every character past ASCII, these scalars' only.
            allow: bool = self.allow_unicode
            self.allow_unicode = allow and not _unshowable(text)
            try:
                super().write_double_quoted(text, split)
            finally:
                self.allow_unicode = allow

    return Dumper


def _json(data: Any, **options: Any) -> str:
    """``data`` as JSON a person reads: accents, scripts and emoji as written (a run's
    agent "café-bot", not "caf\\u00e9-bot"), every character of ``_UNSHOWABLE`` as its JSON
    escape, so the text stays valid JSON that a terminal shows as written (the terminal's
    own net would write ``\\x1b``, which no JSON reader takes)."""
    text = json.dumps(data, ensure_ascii=False, **options)
    return "".join(_json_escape(ch) if ch != "\n" and unicodedata.category(ch) in _UNSHOWABLE
                   else ch for ch in text)


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # past the first plane (a tag character): as a surrogate pair
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _dump(data: Any, *, sort_keys: bool = False) -> str:
    try:
        yaml = _yaml()
    except Refused:
        return _json(data, indent=2, sort_keys=sort_keys) + "\n"
    return str(yaml.dump(data, Dumper=_dumper(yaml), sort_keys=sort_keys,
                         default_flow_style=False, allow_unicode=True))


# What may stand in a path segment of the API: a team's slug, a policy's name, an
# approval's id. Anything else (`..`, `/`, `?`, `#`, `%`) would make a file's name into
# another endpoint's path: `name: "../../../approvals/ID/decide?"` turned a dry run's
# backtest into an approval decided with the CI job's token.
_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_SLUG = re.compile(r"[a-z0-9-]{1,50}")  # a team's slug (SPEC 3), as policies/document.py


def _run_id(value: str) -> str:
    """A run's whole id: the dashboard and `approvals list` show its first 8 characters,
    which the API does not take (found by a newcomer: "No such run.")."""
    if re.fullmatch(r"[0-9a-fA-F]{1,31}", value):  # 32 digits is a whole id too
        raise Refused(f"the run id {value!r} is part of one: give the whole id (36 "
                      "characters, 8-4-4-4-12), as `govctl runs list` prints it")
    return _segment(value, "the run id")


def _segment(value: str, what: str) -> str:
    if not _SEGMENT.fullmatch(value):
        raise Refused(f"{what} {value!r} is not a name the API has (letters, digits, "
                      "'-', '_', '.')")
    return value


TOKEN_START = "gov_op_"  # policies/tokens.py: gov_op_<12 hex>_<URL-safe base64>
_TOKEN_PREFIX = re.compile(r"gov_op_[0-9a-f]{12}_")


def _token_problem(token: str) -> str | None:
    """What makes ``token`` no operator token, said without showing it; None when it may be
    one. Refused, not stripped: a space or line break around a token is a copy gone wrong in
    the secret store or variable it came from, which every other program reading it gets
    wrong too (found by a tester: httpx's "Illegal header value b'Bearer gov_op_...'" was
    printed as the reason, the whole token in it)."""
    if token.lower().startswith("bearer "):
        return "the token is given with 'Bearer ' before it: give the token alone"
    bad = secret_form_problem(token, "the token")
    if bad is not None:  # an HTTP header's value is visible ASCII, and so is every token
        return (f"{bad}: an operator token is gov_op_ then letters, digits, '_' and '-'; "
                "copy it again without it")
    if not token.startswith(TOKEN_START) or token == TOKEN_START:
        return ("the token is not an operator token: one starts gov_op_ (an agent's key "
                "gov_... is refused by the operator API); its owner makes one on the Tokens "
                "page, or an administrator with `manage.py create_operator_token`")
    return None


def _masked(text: str, token: str) -> str:
    """``text`` with ``token`` shown as its part that is no secret, the prefix the Tokens page
    and the audit log show (gov_op_3f9c0a1b2c4d_...)."""
    public = _TOKEN_PREFIX.match(token)
    return text.replace(token, (public.group() if public else TOKEN_START) + "...")


API_PREFIX = "/api/v1"
# A 429 is sent again this many times at most, after its Retry-After if that is this short.
RETRIES_429 = 3
MOST_RETRY_AFTER_S = 60


class Api:
    def __init__(self, url: str, token: str, *, transport: httpx.BaseTransport | None = None):
        base = url.rstrip("/")
        # The API's own prefix given with the server's address (a newcomer's first try) is
        # the same server: each call adds the prefix.
        if base.endswith(API_PREFIX):
            base = base[:-len(API_PREFIX)]
        # A reason, not a traceback, for what no server could be asked with (found by an
        # attacker: an unclosed IPv6 bracket; a token pasted with a non-ASCII character).
        problem = _token_problem(token)
        if problem:
            raise Refused(problem)
        try:
            self.http = httpx.Client(base_url=base, timeout=TIMEOUT_S,
                                     headers={"Authorization": f"Bearer {token}"},
                                     transport=transport)
        except httpx.InvalidURL as exc:
            raise Refused(f"the server's URL {url!r} is not a URL: {exc}") from None
        self.last: httpx.Response | None = None  # the last answer read

    def call(self, method: str, path: str, body: Any = None, *, params: Any = None,
             allow: Sequence[int] = (), timeout: float = TIMEOUT_S) -> tuple[int, Any]:
        for attempt in range(RETRIES_429 + 1):
            try:
                response = self.http.request(method, f"{API_PREFIX}{path}", json=body,
                                             params=params, timeout=timeout)
            except httpx.HTTPError as exc:
                # An https URL on a port that speaks http answers TLS with plain HTTP: the
                # SSL error's words alone did not say so (found by a newcomer).
                hint = (": is the server plain http? (try --url http://...)"
                        if "WRONG_VERSION_NUMBER" in str(exc) else "")
                raise Refused(f"cannot reach {self.http.base_url}: {exc}{hint}") from None
            # A busy server's 429 (a team's share of its time, a token's calls in progress:
            # docs/serving.md) says when to come back; nothing was done, so the call is sent
            # again, as the agents' client does.
            # ASCII digits only: "²".isdigit() is true, and int() refuses it (found by a
            # tester, a traceback).
            wait = response.headers.get("Retry-After", "")
            if (response.status_code != 429 or attempt == RETRIES_429
                    or not re.fullmatch(r"[0-9]{1,4}", wait) or int(wait) > MOST_RETRY_AFTER_S):
                break
            time.sleep(int(wait))
        self.last = response
        try:
            data = response.json()
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            data = None
        answered = response.status_code < 300 or response.status_code in allow
        # Every answer of the operator API is an object, and every refusal holds its
        # "error" (SPEC 5.3): anything else is another server's, a proxy's login page or a
        # gateway's error (found by a tester: tracebacks).
        if not isinstance(data, dict) or not (answered or isinstance(data.get("error"), dict)):
            raise NotTheApi(self.not_the_api())
        if answered:
            return response.status_code, data
        raise Refused(_reason(response.status_code, data), status=response.status_code)

    def not_the_api(self) -> str:
        """The last answer read, said to be none of the operator API's."""
        assert self.last is not None
        kind = self.last.headers.get("Content-Type", "").partition(";")[0].strip()
        return (f"the server at {self.http.base_url} answered something that is not the "
                f"operator API (HTTP {self.last.status_code}, {kind[:80] or 'no Content-Type'})"
                ": is --url right? (GOVCTL_DEBUG=1 shows where govctl stopped reading it)")


def _reason(status: int, data: Any) -> str:
    data = _for_terminal(data)  # a server's words, on one line each
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return f"HTTP {status}"
    message = str(error.get("message", ""))
    if error.get("code") == "confirmation_required":
        # The API's own instruction names its JSON field; govctl's flag is said below.
        message = message.replace(' Send it again with "confirm_stops": true to save it.', "")
    text = f"{error.get('code', 'error')} ({status}): {message}"
    fields = error.get("fields") or {}
    # Listed as they come when not the API's object (found by a tester: a list of them was
    # an AttributeError).
    for problem in (f"{k}: {v}" for k, v in fields.items()) if isinstance(fields, dict) \
            else fields if isinstance(fields, list) else [fields]:
        text += f"\n  {problem}"
    # The impacts are the message's own numbers (`policies.impact.Impact.sentence`): listed
    # only when a server sends no message (found by a newcomer: each count printed twice, in
    # other words, read as yet another count).
    impacts = error.get("impacts") if not message.strip() else None
    for item in impacts if isinstance(impacts, list) else []:
        if not isinstance(item, dict):
            continue
        reasons = item.get("by_reason") or {}
        listed = ", ".join(f"{k} {v}" for k, v in reasons.items()) \
            if isinstance(reasons, dict) else str(reasons)
        text += (f"\n  {item.get('policy')}: would stop {item.get('stopped_at_once')} of "
                 f"{item.get('runs')} recent runs at once ({listed})")
    if error.get("code") == "confirmation_required":
        text += "\n  govctl: run it again with --confirm-stops to save it"
    return text


def _teams_of(document: Any) -> list[dict[str, Any]]:
    teams = document.get("teams") if isinstance(document, dict) else None
    if not isinstance(teams, list) or not teams:
        raise Refused("the file must be a policy document: a mapping with a 'teams' list")
    # The document's own rules (SPEC 3, `manage.py apply_policies`), which no one PUT of a
    # policy can see: a slug as teams have them, each team once, each of its policies once
    # (found by an attacker: a file that apply_policies refuses was saved, the last of three
    # policies of one name winning, and a bad slug was "nothing changed").
    slugs: set[str] = set()
    for i, team in enumerate(teams):
        if not isinstance(team, dict) or not isinstance(team.get("slug"), str) \
                or not isinstance(team.get("policies", []), list):
            raise Refused(f"teams[{i}] needs a 'slug' and a 'policies' list")
        if not _SLUG.fullmatch(team["slug"]):
            raise Refused(f"teams[{i}].slug {team['slug']!r} is not a team slug (1 to 50 "
                          "lowercase letters, digits and '-')")
        if team["slug"] in slugs:
            raise Refused(f"teams[{i}].slug {team['slug']!r}: team slugs must be unique in "
                          "the file")
        slugs.add(team["slug"])
        names: set[str] = set()
        for j, policy in enumerate(team.get("policies", [])):
            if not isinstance(policy, dict) or not isinstance(policy.get("name"), str):
                raise Refused(f"teams[{i}].policies[{j}] needs a 'name'")
            _segment(policy["name"], f"teams[{i}].policies[{j}].name")
            if policy["name"] in names:
                raise Refused(f"teams[{i}].policies[{j}].name {policy['name']!r}: policy "
                              "names must be unique in a team")
            names.add(policy["name"])
    unknown = _unknown_keys(document, teams)
    if unknown:
        raise Refused("\n".join(unknown))
    return teams


# A document's and a team's keys (SPEC 3; policies/document.py's Document and TeamDoc) are
# govctl's to read, so it refuses any other, as `manage.py apply_policies` does. A policy's are
# the server's to check (the dry run's PUT names each unknown one, nothing saved), all but the
# keys govctl sends beside them, which the server reads as the request's (operator_api's
# PolicyPutIn and BacktestIn): found by a tester, a policy's `dry_run: true` made the save a
# dry run, and govctl printed "version 1" of a policy saved nowhere.
DOCUMENT_KEYS = frozenset({"teams"})
TEAM_KEYS = frozenset({"slug", "name", "webhook_url", "policies"})
REQUEST_KEYS = frozenset({"note", "confirm_stops", "dry_run", "since", "limit"})
FLAGS = {"note": "--note", "confirm_stops": "--confirm-stops", "dry_run": "--dry-run"}


def _unknown_keys(document: dict[Any, Any], teams: list[dict[str, Any]]) -> list[str]:
    """Each unknown key's path and why, as the server names one (SPEC 3)."""
    found = [(str(key), key) for key in document if key not in DOCUMENT_KEYS]
    for i, team in enumerate(teams):
        found += [(f"teams[{i}].{key}", key) for key in team if key not in TEAM_KEYS]
        for j, policy in enumerate(team.get("policies", [])):
            found += [(f"teams[{i}].policies[{j}].{key}", key) for key in policy
                      if key in REQUEST_KEYS]
    return [f"{path}: unknown field" + (f" (it is govctl's {FLAGS[key]}, given on its "
                                        "command line)" if key in FLAGS else "")
            for path, key in found]


def _note_team_fields(api: Api, out: Any, team: dict[str, Any]) -> None:
    """A team's name and webhook URL are not govctl's to change (the team settings page's,
    or `manage.py apply_policies`'): where the file's differ from the server's, say so, so a
    repository's new webhook URL is not taken for applied (found by a platform engineer: the
    apply said "nothing changed" and the old URL kept receiving the kill switches)."""
    fields = [f for f in ("name", "webhook_url") if f in team]
    if not fields:
        return
    try:
        _, listing = api.call("GET", f"/teams/{team['slug']}/policies")
    except NotTheApi:
        raise
    except Refused:
        return  # the policies' own calls say why
    current = listing.get("team") or {}
    wanted = {**team, "name": team.get("name") or team["slug"]}  # apply_policies' default
    differ = [f for f in fields if wanted[f] != current.get(f)
              # A URL exported masked (by a reader who is not an admin) stands for the
              # stored one, as it does for apply_policies.
              and not (f == "webhook_url" and "\u2022" in str(wanted[f]))]
    if differ:
        print(f"team {team['slug']}: {' and '.join(differ)} in the file "
              f"differ{'s' if len(differ) == 1 else ''} from the server's and "
              f"{'is' if len(differ) == 1 else 'are'} not changed by govctl: change "
              f"{'it' if len(differ) == 1 else 'them'} on the team's settings page, or with "
              "`manage.py apply_policies FILE`", file=out)


def _diff(before: Any, after: Any, *, label: str) -> str:
    # Keys sorted on both sides: the server's documents and a file order them differently,
    # and an unchanged field must not show as removed and added again.
    lines = difflib.unified_diff(_dump(before, sort_keys=True).splitlines() if before else [],
                                 _dump(after, sort_keys=True).splitlines(),
                                 fromfile=f"{label} (current)", tofile=f"{label} (file)",
                                 lineterm="")
    return "\n".join(lines)


def policies_apply(api: Api, args: argparse.Namespace, out: Any) -> None:
    """All or nothing: every policy of the file is first sent as a dry run (validated, its
    confirmation asked for, saved nowhere); any refusal is printed, with every other, and
    nothing is saved. Only then are they saved, one by one. With --dry-run the changes are
    shown, and the refusals after them (exit 1: the real apply would be refused)."""
    teams = _teams_of(_load(args.file))
    note = args.note or f"govctl policies apply {Path(args.file).name}"
    # The policies the apply would save; and, for a dry run, every change to show: those,
    # and the changes refused only for want of --confirm-stops, which are refusals and
    # never counted as saved (found by a newcomer: one such policy was "1 of 2 refused").
    planned: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = []
    shown: list[tuple[str, str, dict[str, Any], dict[str, Any], bool]] = []
    refusals: list[str] = []
    for team in teams:
        slug = team["slug"]
        _note_team_fields(api, out, team)
        for policy in team.get("policies", []):
            name = policy["name"]
            body = {**policy, "note": note, "confirm_stops": bool(args.confirm_stops)}
            try:
                status, would = api.call("PUT", f"/teams/{slug}/policies/{name}",
                                         {**body, "dry_run": True}, allow=(409,))
                if status == 409:
                    refusal = _reason(status, would)
                    if args.dry_run and (would or {}).get("error", {}).get("code") == \
                            "confirmation_required":
                        # A dry run shows the change all the same, then what the apply
                        # needs (found by a newcomer: it showed the refusal alone).
                        _, would = api.call("PUT", f"/teams/{slug}/policies/{name}",
                                            {**body, "dry_run": True, "confirm_stops": True})
                        shown.append((slug, name, body, would, True))
                        if would.get("changed") and would.get("version") != 1:
                            refusal += SAVES_OWN_COUNT
                    refusals.append(f"policy {slug}/{name}: {refusal}")
                    continue
            except NotTheApi:
                raise
            except Refused as refused:
                refusal = f"policy {slug}/{name}: {refused}"
                if refused.status == 404:
                    # A PUT creates a missing policy, so the 404 is the team's: one that does
                    # not exist or that the token does not see (found by a newcomer, who had
                    # no hint where to go).
                    refusal += (f"\n  the token sees no team {slug!r}, and govctl does not "
                                "create teams: an admin creates it (`manage.py apply_policies "
                                "FILE` creates the file's teams), or give it a token of the "
                                "team")
                refusals.append(refusal)
                continue
            planned.append((slug, name, body, would))
            shown.append((slug, name, body, would, False))
    if args.dry_run:
        _dry_run(api, out, shown, refused=bool(refusals))
    if refusals:
        # Each policy of the file once: refused, or one the apply would save.
        total = len(refusals) + len(planned)
        raise Refused("\n".join(refusals) + f"\nnothing saved: {len(refusals)} of {total} "
                      f"polic{'y' if total == 1 else 'ies'} refused")
    if args.dry_run:
        return
    changed = 0
    for slug, name, body, would in planned:
        if not would["changed"]:
            continue
        _, saved = api.call("PUT", f"/teams/{slug}/policies/{name}", body)
        if saved["changed"]:
            changed += 1
            print(f"policy {slug}/{name}: version {_shown(saved['version'])}", file=out)
            if _denies_every_tool(saved.get("document")):
                print(DENIES_EVERY_TOOL, file=out)
    if not changed:
        print("nothing changed", file=out)


def _dry_run(api: Api, out: Any,
             shown: list[tuple[str, str, dict[str, Any], dict[str, Any], bool]],
             *, refused: bool) -> None:
    changed = to_confirm = 0
    for slug, name, body, would, confirm in shown:
        if not would["changed"]:
            continue
        if confirm:
            to_confirm += 1
        else:
            changed += 1
        _show_change(api, out, slug, name, body, would)
    if not changed and not to_confirm:
        if not refused:  # else the refusals say what the apply would do
            print("nothing changed (dry run)", file=out)
        return
    said = [f"{n} polic{'y' if n == 1 else 'ies'} would change{suffix}"
            for n, suffix in ((changed, ""), (to_confirm, " only with --confirm-stops"))
            if n]
    print("; ".join(said) + " (dry run: nothing saved)", file=out)


def _denies_every_tool(document: Any) -> bool:
    tools = document.get("tools") if isinstance(document, dict) else None
    return isinstance(tools, dict) and tools.get("allow") == []


# A dry run's backtest: the same window and bound as the server's defaults for it (SPEC 13).
BACKTEST_SINCE = "30d"
BACKTEST_SINCE_WORDS = "30 days"
BACKTEST_LIMIT = 1000

# A change to confirm is counted by the save itself, on fewer runs than the backtest and at
# another moment (`backtests/impact.py`: the newest ended runs, their first steps): its
# numbers need not be the backtest's, and a dry run shows both.
SAVES_OWN_COUNT = ("\n  (that count is the save's own check, on the policy's most recent "
                   "ended runs when it was asked; the backtest above replays every ended "
                   "run of the window whole, so its counts can differ)")

# An empty allow list denies every tool of every run: said out loud, as the editor does
# (found by a newcomer: a dry run showed it as one line of the diff).
DENIES_EVERY_TOOL = ("  note: tools.allow is [] (empty): every tool of every run of this "
                     "policy is denied; to allow every tool but some, remove allow (null) "
                     "and list those under deny")


def _show_change(api: Api, out: Any, slug: str, name: str, body: dict[str, Any],
                 would: dict[str, Any]) -> None:
    label = f"{slug}/{name}"
    if would["version"] == 1:
        print(f"policy {label}: new (version 1)\n{_dump(would['document'])}", file=out)
        if _denies_every_tool(would["document"]):
            print(DENIES_EVERY_TOOL, file=out)
        return
    _, current = api.call("GET", f"/teams/{slug}/policies/{name}")
    policy = {k: v for k, v in body.items() if k not in REQUEST_KEYS}
    # The window and bound the line below names, sent rather than left to the server's
    # defaults, so that what it says the count is of is what was asked.
    _, report = api.call("POST", f"/teams/{slug}/policies/{name}/backtest",
                         {**policy, "since": BACKTEST_SINCE, "limit": BACKTEST_LIMIT},
                         timeout=BACKTEST_TIMEOUT_S)
    report = _for_terminal(report)
    print(f"policy {label}: would change (version {_shown(current['version'])} -> "
          f"{_shown(would['version'])})", file=out)
    print(_diff(current["document"], would["document"], label=label), file=out)
    if _denies_every_tool(would["document"]):
        print(DENIES_EVERY_TOOL, file=out)
    # by_reason counts the changed runs by the draft's stop; `none`: the draft does not stop
    # them (SPEC 15), said in words here (a newcomer read "(none 3)" as nothing).
    # The count first: "stopped by max_steps 18" read as the limit's value (a newcomer).
    reasons = ", ".join(f"{v} {'no longer stopped' if k == 'none' else 'stopped by ' + k}"
                        for k, v in report.get("by_reason", {}).items())
    # What the count is of, said (found by a newcomer: three lines, three run counts).
    # The summary's "N of M runs" is of the same M runs; its parts add up to the changes.
    print(f"backtest: {report['changed']} of the {report['runs']} ended runs of {label} "
          f"started within {BACKTEST_SINCE_WORDS} (the newest {BACKTEST_LIMIT:,} at most), "
          "replayed whole, would change" + (f" ({reasons})" if reasons else "") + ".",
          file=out)
    if report.get("summary"):
        print(f"backtest: {report['summary']}", file=out)


def policies_export(api: Api, args: argparse.Namespace, out: Any) -> None:
    _, listing = api.call("GET", f"/teams/{_segment(args.team, '--team')}/policies")
    team = listing["team"]
    document = {"teams": [{"slug": team["slug"], "name": team["name"],
                           "webhook_url": team.get("webhook_url"),
                           "policies": [p["document"] for p in listing["policies"]]}]}
    out.write(_dump(document))


def _when(stamp: str | None) -> str:
    """An API timestamp as people read it in a table, to the second and in UTC (the API's
    own, with microseconds, stays in --json)."""
    try:
        moment = datetime.fromisoformat(stamp or "")
    except ValueError:
        return str(stamp)
    if moment.utcoffset() is None:
        return str(stamp)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def killswitch(api: Api, args: argparse.Namespace, out: Any) -> None:
    body = {"action": args.action, "scope": args.scope, "reason": args.reason,
            "team": args.team, "agent": args.agent, "run": args.run}
    _, state = api.call("POST", "/killswitch", {k: v for k, v in body.items() if v is not None})
    state = _for_terminal(state)
    where = " ".join(f"{k} {state[k]}" for k in ("team", "agent", "run") if state.get(k))
    what = f"{state['scope']} kill switch" + (f" ({where})" if where else "")
    if args.action == "engage":
        switch = state.get("switch") or {}
        if state["changed"]:
            print(f"{what}: engaged", file=out)
        elif switch.get("engaged_by") and not switch.get("released_at"):
            # Whose switch it is and why: this command's reason was not recorded.
            print(f"{what}: already engaged by {switch['engaged_by']} at "
                  f"{_when(switch.get('engaged_at'))}: {switch.get('reason')}; nothing changed",
                  file=out)
        else:
            print(f"{what}: {state.get('message') or 'already engaged'}", file=out)
    else:
        print(f"{what}: {'released' if state['changed'] else 'not engaged, nothing to release'}",
              file=out)


def runs_list(api: Api, args: argparse.Namespace, out: Any) -> None:
    params = {k: v for k, v in (("status", args.status), ("agent", args.agent),
                                ("limit", args.limit), ("after", args.after)) if v is not None}
    _, data = api.call("GET", f"/teams/{_segment(args.team, '--team')}/runs", params=params)
    # A page stops at --limit runs or at about 4 MB of JSON (long outputs): the server names
    # where the next one starts. On stderr with --json, whose stdout stays the runs alone.
    following = data.get("next_after")
    more = (f"more runs follow: add --after {_for_terminal(str(following))}"
            if following else None)
    if args.json:
        print(_json(data["runs"], indent=2), file=out)
        if more:
            print(more, file=sys.stderr)
        return
    runs = _for_terminal(data["runs"])
    if not runs:
        print("no runs", file=out)
    for run in runs:
        why = f" ({run['stop_reason']})" if run.get("stop_reason") else ""
        parent = f"  child of {run['parent_run_id']}" if run.get("parent_run_id") else ""
        print(f"{run['run_id']}  {run['status'] + why:<24} {run['agent']}  "
              f"steps {run['steps']}  ${run['cost_usd']:g}  started {_when(run['started_at'])}"
              f"{parent}", file=out)
    if more:
        print(more, file=out)


def runs_show(api: Api, args: argparse.Namespace, out: Any) -> None:
    _, run = api.call("GET", f"/teams/{_segment(args.team, '--team')}/runs/"
                      f"{_run_id(args.run)}")
    print(_json(run, indent=2), file=out)


def _why(rule: dict[str, Any] | None) -> str:
    """A decision's rule in a few words: its limit and what was observed (SPEC 16)."""
    if not rule:
        return ""
    parts = [", ".join(f"{k}={v}" for k, v in (rule.get(part) or {}).items())
             for part in ("limit", "observed")]
    scope = rule.get("scope")
    where = f" of ancestor {scope}" if scope not in (None, "run") else ""
    return f"  [{rule['name']}{where}: limit {parts[0] or '-'}; observed {parts[1] or '-'}]"


def _sub_agents_hint(api: Api, args: argparse.Namespace, out: Any) -> None:
    """Where a run with no decisions of its own had its steps: its sub-agents' checks count
    on it (SPEC 20) but are their runs' decisions (found by a newcomer: "no decisions" of a
    root whose four steps were all its sub-agents')."""
    _, run = api.call("GET", f"/teams/{_segment(args.team, '--team')}/runs/"
                      f"{_run_id(args.run)}")
    run = _for_terminal(run)
    children = [str(c) for c in run.get("children") or []]
    if children:
        print(f"its steps ({run.get('steps', 0)}) are its sub-agents' checks; their runs: "
              f"{', '.join(children[:5])}" + (f" and {len(children) - 5} more"
                                               if len(children) > 5 else "")
              + f" (govctl runs decisions --team {args.team} RUN)", file=out)


def runs_decisions(api: Api, args: argparse.Namespace, out: Any) -> None:
    params = {k: v for k, v in (("after", args.after), ("limit", args.limit)) if v is not None}
    _, data = api.call("GET", f"/teams/{_segment(args.team, '--team')}/runs/"
                       f"{_run_id(args.run)}/decisions", params=params)
    if args.json:
        print(_json(data["decisions"], indent=2), file=out)
        return
    decisions = _for_terminal(data["decisions"])
    if not decisions:
        print("no decisions" + (f" after {args.after}" if args.after else ""), file=out)
        if not args.after:
            _sub_agents_hint(api, args, out)
    for decision in decisions:
        action = decision["action"]["name"] if decision.get("action") else "-"
        print(f"{decision['id']}  step {decision['step']:<4} {decision['outcome']:<10} "
              f"{decision['reason']:<18} {action}{_why(decision.get('rule'))}", file=out)


def approvals_list(api: Api, args: argparse.Namespace, out: Any) -> None:
    params = {"status": args.status} if args.status != "all" else {}
    _, data = api.call("GET", f"/teams/{_segment(args.team, '--team')}/approvals",
                       params=params)
    if args.json:
        print(_json(data["approvals"], indent=2), file=out)
        return
    if not data["approvals"]:
        print(f"no {args.status if args.status != 'all' else ''} approvals".replace("  ", " "),
              file=out)
    for raw in data["approvals"]:
        # The arguments as JSON, every character a terminal would act on escaped.
        args_json = _json(raw["action"]["args"], sort_keys=True)
        approval = _for_terminal(raw)
        print(f"{approval['id']}  {approval['status']:<9} run {approval['run_id'][:8]}  "
              f"{approval['action']['name']} {args_json}  "
              f"expires {_when(approval['expires_at'])}", file=out)


def approvals_decide(api: Api, args: argparse.Namespace, out: Any) -> None:
    _, approval = api.call("POST", f"/approvals/{_segment(args.id, 'the approval id')}/decide",
                           {"decision": args.decision, "note": args.note or ""})
    approval = _for_terminal(approval)
    print(f"{approval['id']}: {approval['status']}", file=out)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="govctl", description=(
        "Operate the agent governance control plane with an operator token (SPEC 17)."))
    top.add_argument("--url", default=os.environ.get("GOVERNANCE_URL"),
                     help="the server's address, http://host:port (default: $GOVERNANCE_URL)")
    top.add_argument("--token", default=os.environ.get("GOVERNANCE_OPERATOR_TOKEN"),
                     help="an operator token gov_op_... (default: $GOVERNANCE_OPERATOR_TOKEN)")
    groups = top.add_subparsers(dest="group", required=True)

    policies = groups.add_parser("policies").add_subparsers(dest="command", required=True)
    apply = policies.add_parser("apply", help="save every policy of a file's teams")
    apply.add_argument("file")
    apply.add_argument("--dry-run", action="store_true",
                       help="save nothing; print each change's diff and backtest")
    apply.add_argument("--note", help="the versions' note (default: the command line)")
    apply.add_argument("--confirm-stops", action="store_true",
                       help="confirm changes that would stop most recent runs at once")
    apply.set_defaults(handler=policies_apply)
    export = policies.add_parser("export", help="a team's policies as a policy file")
    export.add_argument("--team", required=True)
    export.set_defaults(handler=policies_export)

    switch = groups.add_parser("killswitch")
    switch.add_argument("action", choices=["engage", "release"])
    switch.add_argument("--scope", required=True, choices=["global", "team", "agent", "run"])
    switch.add_argument("--team")
    switch.add_argument("--agent")
    switch.add_argument("--run", help="the run's id (run scope)")
    switch.add_argument("--reason", required=True)
    switch.set_defaults(handler=killswitch)

    runs = groups.add_parser("runs").add_subparsers(dest="command", required=True)
    runs_listing = runs.add_parser("list", help="a team's newest runs")
    runs_listing.add_argument("--team", required=True)
    runs_listing.add_argument("--status", choices=["running", "completed", "stopped", "killed",
                                                   "failed"])
    runs_listing.add_argument("--agent")
    runs_listing.add_argument("--limit", type=int, help="at most this many (default 50, "
                              "at most 500)")
    runs_listing.add_argument("--after", help="only runs after this one (the run id a page "
                              "says more follow after)")
    runs_listing.add_argument("--json", action="store_true")
    runs_listing.set_defaults(handler=runs_list)
    show = runs.add_parser("show", help="one run: its counters, parent, children and tree usage")
    show.add_argument("run")
    show.add_argument("--team", required=True)
    show.set_defaults(handler=runs_show)
    decisions = runs.add_parser("decisions", help="a run's decisions in order, with their rules")
    decisions.add_argument("run")
    decisions.add_argument("--team", required=True)
    decisions.add_argument("--after", type=int, help="only decisions after this id (a page's "
                           "last)")
    decisions.add_argument("--limit", type=int, help="at most this many (default 100, at most "
                           "1000)")
    decisions.add_argument("--json", action="store_true")
    decisions.set_defaults(handler=runs_decisions)

    approvals = groups.add_parser("approvals").add_subparsers(dest="command", required=True)
    listing = approvals.add_parser("list", help="a team's approval requests")
    listing.add_argument("--team", required=True)
    listing.add_argument("--status", default="pending",
                         choices=["pending", "approved", "denied", "expired", "cancelled", "all"])
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=approvals_list)
    decide = approvals.add_parser("decide", help="approve or deny a request")
    decide.add_argument("id")
    decide.add_argument("decision", choices=["approve", "deny"])
    decide.add_argument("--note", help="required to deny: the agent reads it")
    decide.set_defaults(handler=approvals_decide)
    return top


def main(argv: Sequence[str] | None = None, *, out: Any = None,
         transport: httpx.BaseTransport | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.url or not args.token:
        return _fail("--url and --token (or GOVERNANCE_URL and GOVERNANCE_OPERATOR_TOKEN) "
                     "are required")
    try:
        api = Api(args.url, args.token, transport=transport)
    except Refused as refused:
        return _fail(str(refused))
    # A token of the right form from here, masked wherever it would be printed.
    out = _Terminal(out or sys.stdout, token=args.token)
    err = _Terminal(sys.stderr, token=args.token)
    try:
        args.handler(api, args, out)
    except Refused as refused:
        return _fail(str(refused), err)
    except ANSWER_MISREAD:
        # An object without a field the command reads, or with one of another type: not
        # the operator API's answer, whatever its status. Before any answer was read, the
        # mistake is govctl's own, and its traceback is the report.
        # GOVCTL_DEBUG=1 tells the two apart after one: an answer of another form, or a
        # mistake of govctl's reading of the API's own answer (the traceback says which).
        if api.last is None or os.environ.get("GOVCTL_DEBUG", "") not in ("", "0"):
            raise
        return _fail(api.not_the_api(), err)
    return 0


# What reading an answer of another form raises: a field missing (KeyError), of another
# type (TypeError, AttributeError, ValueError of a format), nested past Python's stack.
ANSWER_MISREAD = (KeyError, TypeError, AttributeError, ValueError, IndexError,
                  RecursionError)


def _fail(reason: str, err: _Terminal | None = None) -> int:
    print(f"govctl: {reason}", file=err or _Terminal(sys.stderr))
    return 1


def run() -> NoReturn:  # the console script
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    run()
