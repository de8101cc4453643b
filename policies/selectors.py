"""Reads for the dashboard's policy, key, member and audit screens. Every one is scoped by team."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import yaml
from django.contrib.auth import get_user_model
from django.core.paginator import Page, Paginator
from django.db.models import Exists, OuterRef, Q, TextField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Length
from django.http import Http404
from django.utils.functional import cached_property

from .egress import masked_url
from .models import (
    GLOBAL_EVENT_ACTIONS,
    AgentKey,
    Invitation,
    Membership,
    OperatorEvent,
    Policy,
    PolicyVersion,
    Role,
    Team,
)

AUDIT_PER_PAGE = 50


def policies_of(team: Team) -> list[Policy]:
    return list(Policy.objects.filter(team=team).select_related("current__created_by")
                .order_by("name"))


def policy_of(team: Team, name: str) -> Policy:
    policy = Policy.objects.filter(team=team, name=name).select_related("current").first()
    if policy is None or policy.current is None:
        raise Http404("No such policy.")
    return policy


def versions_of(policy: Policy, *, before: int | None = None, limit: int = 100,
                documents: bool = True) -> tuple[list[PolicyVersion], bool]:
    """A policy's newest ``limit`` versions (older than version ``before`` when given),
    newest first, and whether older ones remain: a policy saved every minute by a CI job has
    thousands, each with its whole document, and a read must not grow with them (SPEC 10).
    ``documents=False`` leaves the documents unread (the history page lists the others)."""
    versions = policy.versions.select_related("created_by").order_by("-version")
    if before is not None:
        versions = versions.filter(version__lt=before)
    if not documents:
        versions = versions.defer("document")
    page = list(versions[:limit + 1])
    return page[:limit], len(page) > limit


def version_before(policy: Policy, version: PolicyVersion) -> PolicyVersion | None:
    return policy.versions.filter(version__lt=version.version).order_by("-version").first()


def version_of(policy: Policy, number: Any) -> PolicyVersion | None:
    try:
        return policy.versions.filter(version=int(number)).first()
    except (TypeError, ValueError):
        return None


# libyaml's emitter where PyYAML was built with it (its wheels are): the pure-Python one's
# text (but where a long double-quoted line folds), about 5x faster. The audit page and a
# policy's history dump two documents per diff, and 50 diffs of 1,280-pattern documents took
# 2.4 s of one thread a view, raising other teams' check p99 (found by an attacker; such a
# document's dump 19 ms, 3.6 ms in C).
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def policy_yaml(document: dict[str, Any] | None) -> str:
    if document is None:
        return ""
    return yaml.dump(document, Dumper=_DUMPER, sort_keys=False, default_flow_style=False,
                     allow_unicode=True)


@dataclass(frozen=True)
class DiffLine:
    kind: str  # add | del | hunk | ctx | head
    text: str


def yaml_diff(before: dict[str, Any] | None, after: dict[str, Any] | None, *,
              before_label: str, after_label: str) -> list[DiffLine]:
    """A unified diff of two policy documents as their YAML: what an operator would review."""
    lines = difflib.unified_diff(
        policy_yaml(before).splitlines(), policy_yaml(after).splitlines(),
        fromfile=before_label, tofile=after_label, lineterm="", n=3,
    )
    out = []
    for line in lines:
        if line.startswith(("---", "+++")):
            kind = "head"
        elif line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+"):
            kind = "add"
        elif line.startswith("-"):
            kind = "del"
        else:
            kind = "ctx"
        out.append(DiffLine(kind, line))
    return out


def team_document(team: Team, *, reveal: bool) -> dict[str, Any]:
    """The team in the `apply_policies` format (SPEC 3): applying it back changes nothing.
    ``reveal``: the webhook URL whole (its reader is a team admin), else masked as every page
    shows it to the others (a Slack or Discord URL is a credential); applying the masked
    URL back keeps the stored one (`policy_apply`)."""
    return {
        "teams": [{
            "slug": team.slug,
            "name": team.name,
            "webhook_url": team.webhook_url if reveal or not team.webhook_url
            else masked_url(team.webhook_url),
            "policies": [p.current.document for p in policies_of(team) if p.current],
        }]
    }


def team_yaml(team: Team, *, reveal: bool) -> str:
    return yaml.dump(team_document(team, reveal=reveal), Dumper=_DUMPER, sort_keys=False,
                     allow_unicode=True)


def keys_of(team: Team) -> list[AgentKey]:
    return list(AgentKey.objects.filter(team=team).select_related("created_by")
                .order_by("revoked_at", "-created_at"))


def key_of(team: Team, key_id: int) -> AgentKey:
    key = AgentKey.objects.filter(team=team, pk=key_id).select_related("team").first()
    if key is None:
        raise Http404("No such key.")
    return key


def _invited(team: Team) -> Exists:
    """Memberships made with an account for a waiting invitation: listed with the other
    waiting invitations, not as members, until their person chooses a password (an
    invitation for an existing account has no membership until it is answered)."""
    return Exists(Invitation.objects.filter(team=team, user=OuterRef("user"),
                                            accepted_at__isnull=True, new_account=True))


def members_of(team: Team) -> list[Membership]:
    return list(Membership.objects.filter(team=team).exclude(_invited(team))
                .select_related("user").order_by("user__username"))


def invitations_of(team: Team) -> list[Invitation]:
    """The team's waiting invitations, oldest first: both kinds, shown alike."""
    return list(Invitation.objects.filter(team=team, accepted_at__isnull=True)
                .select_related("user", "created_by").order_by("created_at", "pk"))


def invitation_of(team: Team, invitation_id: int) -> Invitation:
    invitation = (Invitation.objects.filter(team=team, pk=invitation_id, accepted_at__isnull=True)
                  .select_related("user", "team").first())
    if invitation is None:
        raise Http404("No such invitation.")
    return invitation


def invitation_by_key(key: str) -> Invitation | None:
    """The waiting invitation an invitation link names."""
    return (Invitation.objects.filter(key=key, accepted_at__isnull=True)
            .select_related("user", "team").first())


def addable_user(actor: Any, username: str) -> Any:
    """The active account of `username` that `actor` may add to a team directly, or None. An
    account in no team is in the pool a superuser made for admins to place; one in a team is
    added by a superuser or by an admin of one of its teams (whose Members page lists it).
    Anyone else is None, exactly like a username nobody has, so the Members page tells an
    admin nothing of other teams' people: they invite instead (`member_invite`)."""
    users = get_user_model().objects.filter(username=username, is_active=True)
    if not actor.is_superuser:
        administered = Membership.objects.filter(user=actor, role=Role.ADMIN).values("team")
        anywhere = Membership.objects.filter(user=OuterRef("pk"))
        users = users.filter(is_superuser=False).filter(
            ~Exists(anywhere) | Exists(anywhere.filter(team__in=administered)))
    return users.first()


def membership_of(team: Team, membership_id: int) -> Membership:
    membership = (Membership.objects.filter(team=team, pk=membership_id)
                  .select_related("user", "team").first())
    if membership is None:
        raise Http404("No such member.")
    return membership


def admins_besides(team: Team, membership: Membership) -> int:
    # An invited admin who has not chosen a password yet manages nothing.
    return (Membership.objects.filter(team=team, role="admin").exclude(pk=membership.pk)
            .exclude(_invited(team)).count())


# Events without a team show on every team's page only when they concern every team
# (GLOBAL_EVENT_ACTIONS): a person's (a token for all of its owner's teams reading) told each
# team who else works where, and how often (found by an attacker: a viewer's token read 200
# times a second into every team's log).
# A page's work is bounded whatever the log's size (SPEC 10): its count stops here (the
# pager says "200+" pages), the filter's choices come from the newest events, and an event's
# detail larger than AUDIT_DETAIL_SHOWN characters is summarised, not read (a policy
# version's before and after may be hundreds of KB each: 50 of them made a viewer's page
# take 18 s of a dashboard thread).
AUDIT_COUNT_CAP = 10_000
AUDIT_CHOICES_FROM = 5_000
AUDIT_DETAIL_SHOWN = 20_000


def _audit_events(team: Team) -> Any:
    return OperatorEvent.objects.filter(
        Q(team=team) | Q(team__isnull=True, action__in=GLOBAL_EVENT_ACTIONS))


class _CappedPaginator(Paginator):
    """Counts at most AUDIT_COUNT_CAP rows of ``counted``, the page's rows without their
    annotations (which a count of the annotated rows computed for each row counted: the
    length of every detail, up to 10,000 of them a page view)."""

    def __init__(self, object_list: Any, per_page: int, *, counted: Any) -> None:
        super().__init__(object_list, per_page)
        self.counted = counted

    @cached_property
    def count(self) -> int:
        return self.counted.order_by()[:AUDIT_COUNT_CAP].count()

    @property
    def capped(self) -> bool:
        return self.count >= AUDIT_COUNT_CAP


def audit_page(team: Team, *, action: str = "", actor: str = "", page: Any = 1) -> Page:
    """One page of the team's operator audit log, newest first. Each event's ``detail`` is
    read only when it is at most AUDIT_DETAIL_SHOWN characters, else it is None and
    ``detail_chars``, ``detail_version`` and ``detail_source`` say what it was."""
    events = _audit_events(team)
    if action:
        events = events.filter(action=action)
    if actor:
        events = events.filter(actor_label=actor)
    # The page's ids first, then its rows: an offset skips rows of the bare index order,
    # not rows whose detail was measured.
    found = _CappedPaginator(events.order_by("-at", "-id").values_list("pk", flat=True),
                             AUDIT_PER_PAGE, counted=events).get_page(page)
    rows = list(OperatorEvent.objects.filter(pk__in=list(found.object_list))
                .select_related("team").defer("detail").annotate(
                    detail_chars=Length(Cast("detail", output_field=TextField())),
                    detail_version=KT("detail__version"), detail_source=KT("detail__source"))
                .order_by("-at", "-id"))
    found.object_list = rows
    small = [e.pk for e in rows if (e.detail_chars or 0) <= AUDIT_DETAIL_SHOWN]
    details = dict(OperatorEvent.objects.filter(pk__in=small).values_list("pk", "detail"))
    for event in rows:
        event.detail = details.get(event.pk)
    return found


def audit_choices(team: Team) -> dict[str, list[str]]:
    """The filter's actions and people: those of the newest AUDIT_CHOICES_FROM events."""
    recent = list(_audit_events(team).order_by("-at", "-id")
                  .values_list("action", "actor_label")[:AUDIT_CHOICES_FROM])
    return {
        "actions": sorted({action for action, _ in recent}),
        "actors": sorted({actor for _, actor in recent}),
    }
