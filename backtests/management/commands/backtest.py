"""`manage.py backtest --team SLUG --policy NAME [--file DRAFT.yaml] [--since 7d] [--limit N]
[--json]` (SPEC 13): what a draft would have done to the team's recorded runs. Writes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from backtests import inputs, selectors
from policies.document import MAX_DOCUMENT_BYTES
from policies.models import Team


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--team", required=True, help="the team's slug")
        parser.add_argument("--policy", required=True, help="the policy whose runs to replay")
        parser.add_argument("--file", help="a YAML document with the draft (the apply_policies "
                            "format, or one policy); default: the policy's current version")
        parser.add_argument("--since", default=inputs.DEFAULT_SINCE,
                            help="runs started within this window: 30d (default), 12h, 2w...")
        parser.add_argument("--limit", type=int, default=inputs.DEFAULT_LIMIT,
                            help=f"at most this many runs, newest first (default "
                                 f"{inputs.DEFAULT_LIMIT})")
        parser.add_argument("--json", action="store_true",
                            help="print the result as one line of JSON")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            since = inputs.parse_since(options["since"])
            limit = inputs.check_limit(options["limit"])
        except inputs.InputError as exc:
            raise CommandError(str(exc)) from None
        team = Team.objects.filter(slug=options["team"]).first()
        if team is None:
            raise CommandError(f"no team {options['team']!r}")
        policy = selectors.policy_of(team, options["policy"])
        if policy is None or policy.current is None:
            raise CommandError(f"team {team.slug!r} has no policy {options['policy']!r}")
        if options["file"]:
            path = Path(options["file"])
            try:
                with path.open("rb") as stream:
                    # One byte past the bound is enough to refuse it: the rest is never read.
                    raw = stream.read(MAX_DOCUMENT_BYTES + 1)
            except OSError as exc:
                raise CommandError(f"cannot read the draft {path}: {exc}") from None
            try:
                document = inputs.draft_policy(inputs.load_draft(raw), team=team.slug,
                                               policy=policy.name)
            except inputs.InputError as exc:
                raise CommandError(f"{path}: {exc}") from None
            source = str(path)
        else:
            document = policy.current.document
            source = f"the current version {policy.current.version}"
        report = selectors.backtest(team, policy, document, since=since, limit=limit)
        if options["json"]:
            self.stdout.write(json.dumps(report.as_json(), separators=(",", ":")))
            return
        self.stdout.write(table(report, team=team.slug, source=source, since=options["since"],
                                limit=limit))


def table(report: selectors.Report, *, team: str, source: str, since: str, limit: int) -> str:
    lines = [
        f"Backtest of policy {report.policy} (team {team}) with {source}",
        report.summary,
        f"{report.runs} ended run{'s' if report.runs != 1 else ''} replayed (started within "
        f"{since}, newest first, at most {limit}; {report.decisions} recorded decisions): "
        f"{report.changed} would change.",
    ]
    if report.changed:
        lines.append("By the draft's stop reason: " + ", ".join(
            f"{reason} {count}" for reason, count in report.by_reason.items()))
    lines.append("Not simulated: " + ", ".join(report.as_json()["not_simulated"])
                 + " (recorded approval outcomes, waits, kills and abandonments are replayed "
                   "as recorded; the draft's rate-limit waits and approval requests are "
                   "estimated from the recorded times).")
    lines.extend(estimate_lines(report))
    if report.key_fallbacks:
        lines.append(f"{report.key_fallbacks} check(s) kept their recorded repeat key: a "
                     "redacted arg was part of it (docs/backtest.md).")
    if report.changes:
        lines.append("")
        lines.append(f"{'run':36}  {'recorded':34}  draft")
        for change in report.changes:
            rec, draft = change.recorded, change.draft
            recorded = f"{rec['status']}" + (f" ({rec['stop_reason']})" if rec["stop_reason"]
                                             else "") + f", {rec['steps']} steps"
            would = ("not stopped" if draft["status"] is None else
                     f"{draft['status']} ({draft['stop_reason']}) at step {draft['step']}")
            lines.append(f"{change.run_id:36}  {recorded:34}  {would}")
    return "\n".join(lines)


def estimate_lines(report: selectors.Report) -> list[str]:
    """The estimated waits and approval requests per agent and per hour (docs/backtest.md):
    the agents by name, the hours in time order; only those with any."""
    estimate = report.as_json()["estimate"]
    if not (estimate["rate_limit_waits"] or estimate["approval_requests"]):
        return []
    recorded = estimate["recorded"]
    lines = [f"Estimated from the recorded times (recorded: {recorded['rate_limit_waits']} "
             f"wait(s), {recorded['approval_requests']} approval request(s)):"]
    for title, rows in (("agent", estimate["by_agent"]), ("hour (UTC)", estimate["by_hour"])):
        lines.append(f"  {title:26}  {'waits':>7}  {'wait s':>10}  {'approvals':>9}")
        for key, tally in rows.items():
            lines.append(f"  {key:26}  {tally['rate_limit_waits']:>7}  "
                         f"{tally['wait_s']:>10,.1f}  {tally['approval_requests']:>9}")
    return lines
