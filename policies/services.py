"""Writes for teams, policies, agent keys and memberships. Each one is transactional and
leaves an operator audit event."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from .document import default_policy, parse_document
from .models import AgentKey, Membership, OperatorEvent, Policy, PolicyVersion, Role, Team

KEY_PREFIX = "gov"


def audit(
    *, actor: AbstractBaseUser | None, action: str, team: Team | None, target: str = "",
    detail: dict[str, Any] | None = None, actor_label: str | None = None,
) -> OperatorEvent:
    label = actor_label or (actor.get_username() if actor is not None else "system")
    return OperatorEvent.objects.create(
        team=team, actor=actor, actor_label=label, action=action, target=target,
        detail=detail or {},
    )


def _new_version(
    policy: Policy, document: dict[str, Any], *, actor: AbstractBaseUser | None, source: str
) -> PolicyVersion:
    last = policy.current.version if policy.current_id else 0
    version = PolicyVersion.objects.create(
        policy=policy, version=last + 1, document=document, created_by=actor, source=source
    )
    policy.current = version
    policy.save(update_fields=["current"])
    return version


@transaction.atomic
def policy_save(
    *, team: Team, document: dict[str, Any], actor: AbstractBaseUser | None, source: str
) -> PolicyVersion | None:
    """Store one normalized policy; a new version only when something changed."""
    policy, _ = Policy.objects.select_for_update().get_or_create(team=team, name=document["name"])
    if policy.current_id:
        previous = policy.current.document
        if previous == document:
            return None
    else:
        previous = None
    version = _new_version(policy, document, actor=actor, source=source)
    audit(
        actor=actor, action="policy.version", team=team, target=policy.name,
        detail={"version": version.version, "before": previous, "after": document,
                "source": source},
    )
    return version


@transaction.atomic
def team_ensure(*, slug: str, name: str | None = None, actor: AbstractBaseUser | None = None
                ) -> tuple[Team, bool]:
    team, created = Team.objects.get_or_create(
        slug=slug, defaults={"name": name or slug, "webhook_secret": secrets.token_hex(32)}
    )
    if created:
        audit(actor=actor, action="team.create", team=team, target=slug)
    if not Policy.objects.filter(team=team, name="default").exists():
        policy_save(team=team, document=default_policy(), actor=actor, source="default")
    return team, created


@transaction.atomic
def policy_apply(
    *, data: Any, actor: AbstractBaseUser | None = None, source: str = "yaml"
) -> list[str]:
    """Apply a policy document (SPEC 3 and 8). Validates everything before writing anything;
    raises DocumentError. Returns a line per change."""
    teams = parse_document(data)
    changes: list[str] = []
    for doc in teams:
        team, created = team_ensure(slug=doc["slug"], name=doc["name"], actor=actor)
        if created:
            changes.append(f"team {team.slug}: created")
        name = doc["name"] or doc["slug"]
        if (team.name, team.webhook_url) != (name, doc["webhook_url"]):
            before = {"name": team.name, "webhook_url": team.webhook_url}
            team.name, team.webhook_url = name, doc["webhook_url"]
            team.save(update_fields=["name", "webhook_url"])
            after = {"name": name, "webhook_url": team.webhook_url}
            audit(actor=actor, action="team.update", team=team, target=team.slug,
                  detail={"before": before, "after": after})
            if not created:
                changes.append(f"team {team.slug}: name/webhook updated")
        for policy in doc["policies"]:
            version = policy_save(team=team, document=policy, actor=actor, source=source)
            if version is not None:
                changes.append(f"policy {team.slug}/{policy['name']}: version {version.version}")
    return changes


# --- Agent keys ------------------------------------------------------------------------------

def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class NewKey:
    key: AgentKey
    token: str


def agent_key_create(
    *, team: Team, name: str, agent: str = "", actor: AbstractBaseUser | None = None
) -> NewKey:
    """A new key; the token is returned once and only its hash is stored."""
    prefix = secrets.token_hex(6)
    token = f"{KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    key = AgentKey.objects.create(
        team=team, name=name, agent=agent, prefix=prefix, key_hash=_hash(token), created_by=actor
    )
    audit(actor=actor, action="key.create", team=team, target=name,
          detail={"prefix": prefix, "agent": agent or None})
    return NewKey(key=key, token=token)


def agent_key_revoke(*, key: AgentKey, actor: AbstractBaseUser | None) -> None:
    updated = AgentKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    if updated:
        audit(actor=actor, action="key.revoke", team=key.team, target=key.name,
              detail={"prefix": key.prefix})


def agent_key_authenticate(token: str) -> AgentKey | None:
    """The live key for a bearer token, or None. Not cached: a revocation holds on the very
    next request in every process."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or len(parts[1]) != 12:
        return None
    if not all(c in "0123456789abcdef" for c in parts[1]):
        # Prefixes are hex; anything else (a NUL, say) is no key and must not reach a query.
        return None
    key = (
        AgentKey.objects.select_related("team")
        .filter(prefix=parts[1], revoked_at__isnull=True)
        .first()
    )
    if key is None or not hmac.compare_digest(key.key_hash, _hash(token)):
        return None
    return key


def agent_key_touch(key: AgentKey) -> None:
    """Record use at most once a minute, so the hot path rarely writes for it."""
    now = timezone.now()
    if key.last_used_at is None or (now - key.last_used_at).total_seconds() > 60:
        AgentKey.objects.filter(pk=key.pk).update(last_used_at=now)


# --- Memberships -----------------------------------------------------------------------------

def membership_set(*, team: Team, user: AbstractBaseUser, role: str,
                   actor: AbstractBaseUser | None) -> Membership:
    role = Role(role)
    membership, created = Membership.objects.get_or_create(
        team=team, user=user, defaults={"role": role}
    )
    if not created and membership.role != role:
        before = membership.role
        membership.role = role
        membership.save(update_fields=["role"])
        audit(actor=actor, action="member.role", team=team, target=user.get_username(),
              detail={"before": before, "after": role})
    elif created:
        audit(actor=actor, action="member.add", team=team, target=user.get_username(),
              detail={"role": role})
    return membership


def membership_remove(*, membership: Membership, actor: AbstractBaseUser | None) -> None:
    audit(actor=actor, action="member.remove", team=membership.team,
          target=membership.user.get_username(), detail={"role": membership.role})
    membership.delete()


# --- Team settings ---------------------------------------------------------------------------

@transaction.atomic
def team_update_webhook(*, team: Team, webhook_url: str | None,
                        actor: AbstractBaseUser | None) -> bool:
    """Set the URL kill-switch notifications are POSTed to. Returns False when unchanged."""
    team = Team.objects.select_for_update().get(pk=team.pk)
    if team.webhook_url == webhook_url:
        return False
    before = team.webhook_url
    team.webhook_url = webhook_url
    team.save(update_fields=["webhook_url"])
    audit(actor=actor, action="team.webhook", team=team, target=team.slug,
          detail={"before": before, "after": webhook_url})
    return True
