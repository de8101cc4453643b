"""Single sign-on's accounts (SPEC 17): the role map, and what an SSO sign-in does to the
person's account and memberships. The protocol (discovery, the redirect, the ID token's
checks) is policies/sso_views.py's; this module trusts the claims it is given.

A person is their (issuer, sub): never found by e-mail or username. At each sign-in their
SSO-given memberships (``Membership.from_sso``) are recomputed from the groups claim through
``OIDC_ROLE_MAP``; memberships given by hand are left alone, and a team where the person has
one keeps it as it is. Every change is an operator-audit event.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from governance.text import text_problem

from .models import ROLE_RANK, Membership, Role, SsoIdentity, Team
from .services import audit

ANY_TEAM = "*"
SSO_ACTOR = "sso"  # the audit events' actor: the sign-in, on the person's behalf


@dataclass(frozen=True)
class RoleMapEntry:
    group: str
    team: str  # a slug, or ANY_TEAM
    role: Role


class RoleMapError(ValueError):
    """A bad OIDC_ROLE_MAP; the message names the entry (its position and its text)."""


def parse_role_map(raw: str | list[Any]) -> list[RoleMapEntry]:
    """The map's entries, or RoleMapError naming the first bad one. Team slugs are only
    checked for their shape here; whether each team exists needs the database
    (``unknown_teams``)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise RoleMapError(f"OIDC_ROLE_MAP is not JSON: {exc}") from None
    if not isinstance(raw, list):
        raise RoleMapError("OIDC_ROLE_MAP must be a JSON list of "
                           '{"group": ..., "team": ..., "role": ...} entries')
    entries = []
    # Entries are counted from 1, as people count them (found by a newcomer: "entry 2" in
    # docs/sso.md named the third).
    for index, item in enumerate(raw, start=1):
        where = f"OIDC_ROLE_MAP entry {index} ({json.dumps(item)[:200]})"
        if not isinstance(item, dict):
            raise RoleMapError(f"{where} is not an object")
        extra = set(item) - {"group", "team", "role"}
        if extra:
            raise RoleMapError(f"{where} has unknown keys: {', '.join(sorted(extra))}")
        group, team, role = item.get("group"), item.get("team"), item.get("role")
        if not isinstance(group, str) or not group:
            raise RoleMapError(f"{where}: 'group' must be a non-empty string")
        if not isinstance(team, str) or not (team == ANY_TEAM or re.fullmatch(r"[-\w]+", team)):
            raise RoleMapError(f"{where}: 'team' must be a team's slug or \"*\"")
        if role not in Role.values:
            raise RoleMapError(f"{where}: unknown role {role!r} (viewer, operator or admin)")
        entries.append(RoleMapEntry(group=group, team=team, role=Role(role)))
    return entries


def unknown_teams(entries: list[RoleMapEntry]) -> list[tuple[int, RoleMapEntry]]:
    """The entries (with their positions) naming a team that does not exist."""
    slugs = {entry.team for entry in entries if entry.team != ANY_TEAM}
    known = set(Team.objects.filter(slug__in=slugs).values_list("slug", flat=True))
    return [(index, entry) for index, entry in enumerate(entries, start=1)
            if entry.team != ANY_TEAM and entry.team not in known]


def groups_of(claims: dict[str, Any]) -> list[str]:
    """The groups claim (OIDC_GROUPS_CLAIM) as a list of strings: a list, or one string."""
    value = claims.get(settings.OIDC_GROUPS_CLAIM)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str)]
    return []


def roles_for(entries: list[RoleMapEntry], groups: list[str],
              teams: list[Team]) -> dict[int, Role]:
    """Team id -> role the groups give: per team the highest mapped role wins; "*" maps
    every team there is."""
    member_of = set(groups)
    by_slug = {team.slug: team for team in teams}
    roles: dict[int, Role] = {}
    for entry in entries:
        if entry.group not in member_of:
            continue
        targets = teams if entry.team == ANY_TEAM else [by_slug[entry.team]]
        for team in targets:
            current = roles.get(team.pk)
            if current is None or ROLE_RANK[entry.role] > ROLE_RANK[current]:
                roles[team.pk] = entry.role
    return roles


class SignInRefused(Exception):
    """An SSO sign-in refused after the provider vouched for the person (no mapped group, a
    map naming an unknown team, a disabled account): a page with ``status`` says so."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class SignIn:
    user: AbstractBaseUser | None
    refusal: SignInRefused | None = None
    changes: list[str] = field(default_factory=list)  # the audit actions written


# The columns of SsoIdentity (policies/models.py).
SUBJECT_MAX = SsoIdentity._meta.get_field("subject").max_length or 255
ISSUER_MAX = SsoIdentity._meta.get_field("issuer").max_length or 300


def sign_in(*, issuer: str, subject: str, claims: dict[str, Any]) -> SignIn:
    """The account of (issuer, subject), made if new, with its SSO memberships recomputed.

    Refusals are returned, not raised, so that their audit events (and a known person's
    revoked memberships) are committed: no mapped group refuses with 403, and makes no
    account for a new person."""
    if text_problem(issuer) or text_problem(subject):
        return SignIn(None, SignInRefused(
            "The identity provider sent a subject (sub) that no account can be kept under "
            "(a NUL character or broken Unicode). Ask an administrator to check the provider.",
            400))
    if len(subject) > SUBJECT_MAX or len(issuer) > ISSUER_MAX:
        # OpenID Connect caps `sub` at 255 characters; a longer one was a 500 (found by an
        # attacker with a provider of their own).
        return SignIn(None, SignInRefused(
            f"The identity provider sent a subject (sub) longer than the {SUBJECT_MAX} "
            "characters OpenID Connect allows. Ask an administrator to check the provider.",
            400))
    claims = _storable(claims)
    try:
        entries = parse_role_map(settings.OIDC_ROLE_MAP)  # the system check refuses a bad one
    except RoleMapError as exc:  # a server started with --skip-checks
        return SignIn(None, SignInRefused(f"Single sign-on is misconfigured: {exc}", 503))
    try:
        return _sign_in(issuer, subject, claims, entries)
    except IntegrityError:
        # The same person's first sign-in in two tabs at once: the other made the account.
        return _sign_in(issuer, subject, claims, entries)


def _storable(claims: dict[str, Any]) -> dict[str, Any]:
    """The claims with what the sign-in keeps (names, e-mail, groups) storable: a value
    PostgreSQL cannot hold (a NUL, a lone surrogate) is left out, a group of that kind too,
    so a provider's odd claim is a name not shown, never a 500."""
    kept = dict(claims)
    for name in ("preferred_username", "email", "given_name", "family_name"):
        if isinstance(kept.get(name), str) and text_problem(kept[name]):
            kept.pop(name)
    groups = kept.get(settings.OIDC_GROUPS_CLAIM)
    if isinstance(groups, str) and text_problem(groups):
        kept.pop(settings.OIDC_GROUPS_CLAIM)
    elif isinstance(groups, list):
        kept[settings.OIDC_GROUPS_CLAIM] = [
            g for g in groups if not (isinstance(g, str) and text_problem(g))]
    return kept


def _sign_in(issuer: str, subject: str, claims: dict[str, Any],
             entries: list[RoleMapEntry]) -> SignIn:
    unknown = unknown_teams(entries)
    groups = groups_of(claims)
    with transaction.atomic():
        identity = (SsoIdentity.objects.select_for_update().select_related("user")
                    .filter(issuer=issuer, subject=subject).first())
        if unknown:
            index, entry = unknown[0]
            audit(actor=identity.user if identity else None, actor_label=SSO_ACTOR,
                  action="sso.refused", team=None, target=_who(identity, subject),
                  detail={"issuer": issuer, "sub": subject, "reason": "unknown_team",
                          "entry": index, "team": entry.team})
            return SignIn(None, SignInRefused(
                f"Single sign-on is misconfigured: OIDC_ROLE_MAP entry {index} names the team "
                f"{entry.team!r}, which does not exist. Ask an administrator to create the "
                "team or correct the map.", status=503))
        teams = list(Team.objects.all())
        roles = roles_for(entries, groups, teams)
        if not roles and identity is None:
            audit(actor=None, actor_label=SSO_ACTOR, action="sso.refused", team=None,
                  target=_who(None, subject, claims),
                  detail={"issuer": issuer, "sub": subject, "groups": groups[:50],
                          "reason": "no_mapped_group"})
            return SignIn(None, _no_group())
        if identity is None:
            identity = SsoIdentity.objects.create(
                user=_new_user(issuer, subject, claims), issuer=issuer, subject=subject)
            audit(actor=identity.user, actor_label=SSO_ACTOR, action="sso.account", team=None,
                  target=identity.user.get_username(),
                  detail={"issuer": issuer, "sub": subject})
        user = identity.user
        changes = _sync_memberships(user, roles, groups, {team.pk: team for team in teams})
        identity.last_sign_in_at = timezone.now()
        identity.last_groups = groups[:200]
        identity.save(update_fields=["last_sign_in_at", "last_groups"])
        if not roles:
            audit(actor=user, actor_label=SSO_ACTOR, action="sso.refused", team=None,
                  target=user.get_username(),
                  detail={"issuer": issuer, "sub": subject, "groups": groups[:50],
                          "reason": "no_mapped_group"})
            return SignIn(None, _no_group(), changes)
        if not user.is_active:
            return SignIn(None, SignInRefused("This account is disabled."), changes)
        return SignIn(user, None, changes)


def _no_group() -> SignInRefused:
    return SignInRefused(
        "You signed in at the identity provider, but none of your groups gives a role in any "
        "team here. Ask an administrator to add one of your groups to the role map.")


def _sync_memberships(user: AbstractBaseUser, roles: dict[int, Role], groups: list[str],
                      teams: dict[int, Team]) -> list[str]:
    """Make the user's SSO memberships exactly ``roles``, leaving hand-given ones alone."""
    changes = []
    held = {m.team_id: m for m in Membership.objects.select_for_update().filter(user=user)}
    label = user.get_username()
    for team_id, role in roles.items():
        membership = held.get(team_id)
        detail = {"source": "sso", "groups": groups[:50]}
        if membership is None:
            Membership.objects.create(user=user, team_id=team_id, role=role, from_sso=True)
            audit(actor=user, actor_label=SSO_ACTOR, action="member.add", team=teams[team_id],
                  target=label, detail={**detail, "role": role})
            changes.append("member.add")
        elif membership.from_sso and membership.role != role:
            before = membership.role
            membership.role = role
            membership.save(update_fields=["role"])
            audit(actor=user, actor_label=SSO_ACTOR, action="member.role", team=teams[team_id],
                  target=label, detail={**detail, "before": before, "after": role})
            changes.append("member.role")
    for team_id, membership in held.items():
        if membership.from_sso and team_id not in roles:
            audit(actor=user, actor_label=SSO_ACTOR, action="member.remove",
                  team=teams.get(team_id) or membership.team, target=label,
                  detail={"source": "sso", "groups": groups[:50], "role": membership.role})
            membership.delete()
            changes.append("member.remove")
    return changes


def _who(identity: SsoIdentity | None, subject: str, claims: dict[str, Any] | None = None) -> str:
    if identity is not None:
        return identity.user.get_username()
    claims = claims or {}
    return str(claims.get("preferred_username") or claims.get("email") or subject)[:200]


def _new_user(issuer: str, subject: str, claims: dict[str, Any]) -> AbstractBaseUser:
    """A new account for a new person: a username from their claims (only a name to show;
    the account is found by (issuer, sub)), made unique, and no usable password."""
    users = get_user_model()
    wanted = str(claims.get("preferred_username") or claims.get("email") or "")
    base = re.sub(r"[^\w.@+-]", "", wanted)[:80] or "sso"  # with a suffix: within 150
    digest = hashlib.sha256(f"{issuer}\n{subject}".encode()).hexdigest()
    name = base
    for length in (6, 10, 16, 64):
        if not users.objects.filter(username=name).exists():
            break
        name = f"{base}-{digest[:length]}"
    email = claims.get("email") if isinstance(claims.get("email"), str) else ""
    user = users(username=name, email=email[:254],
                 first_name=str(claims.get("given_name") or "")[:150],
                 last_name=str(claims.get("family_name") or "")[:150])
    user.set_unusable_password()
    user.save()
    return user
