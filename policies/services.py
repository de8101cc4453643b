"""Writes for teams, policies, agent keys and memberships. Each one is transactional and
leaves an operator audit event."""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.contrib.auth.tokens import PasswordResetTokenGenerator, default_token_generator
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from .document import (
    MAX_POLICIES_PER_TEAM,
    MAX_RATE_RULES_PER_TEAM,
    DocumentError,
    default_policy,
    parse_document,
)
from .egress import MASK, ascii_url, masked_url
from .models import (
    AgentKey,
    Invitation,
    Membership,
    OperatorEvent,
    Policy,
    PolicyVersion,
    Role,
    Team,
)
from .selectors import admins_besides

KEY_PREFIX = "gov"

# The operator token acting in this request (policies/tokens.py `acting`, set by the operator
# API around each view): every audit event written meanwhile names it (SPEC 17).
acting_token: contextvars.ContextVar[Any] = contextvars.ContextVar("acting_token", default=None)


def audit(
    *, actor: AbstractBaseUser | None, action: str, team: Team | None, target: str = "",
    detail: dict[str, Any] | None = None, actor_label: str | None = None,
) -> OperatorEvent:
    label = actor_label or (actor.get_username() if actor is not None else "system")
    token = acting_token.get()
    if token is not None:
        detail = {**(detail or {}), "token": {"name": token.name, "prefix": token.prefix}}
        if "(token " not in label:
            label = f"{label} (token {token.name})"
    label = label[:150]
    return OperatorEvent.objects.create(
        team=team, actor=actor, actor_label=label, action=action, target=target,
        detail=detail or {},
    )


def _new_version(
    policy: Policy, document: dict[str, Any], *, actor: AbstractBaseUser | None, source: str,
    note: str = "",
) -> PolicyVersion:
    last = policy.current.version if policy.current_id else 0
    version = PolicyVersion.objects.create(
        policy=policy, version=last + 1, document=document, created_by=actor, source=source,
        note=note[:500],
    )
    policy.current = version
    policy.save(update_fields=["current"])
    return version


def _has_room(team: Team) -> None:
    """The team's cap on policies, for a new one (DocumentError past it)."""
    if Policy.objects.filter(team=team).count() >= MAX_POLICIES_PER_TEAM:
        raise DocumentError({"name": f"a team has at most {MAX_POLICIES_PER_TEAM} "
                                     "policies: change or reuse one"})


def _rules_fit(team: Team, document: dict[str, Any]) -> None:
    """The team's cap on rate-limit rules across its current policies, with this document
    in its policy's place (DocumentError past it, naming ``rate_limits``)."""
    mine = document.get("rate_limits") or []
    if not mine:
        return
    others = (Policy.objects.filter(team=team).exclude(name=document["name"])
              .values_list("current__document__rate_limits", flat=True))
    rules = {_rule_identity(rule) for listed in [mine, *others] if isinstance(listed, list)
             for rule in listed if isinstance(rule, dict)}
    if len(rules) > MAX_RATE_RULES_PER_TEAM:
        raise DocumentError({"rate_limits": (
            f"a team's policies have at most {MAX_RATE_RULES_PER_TEAM} distinct rate-limit "
            f"rules in all; with this one they would have {len(rules)}: reuse the rules of "
            "the team's other policies (the same match, per, max and window_s) or remove "
            "some")})


def _rule_identity(rule: dict[str, Any]) -> tuple[Any, ...]:
    return (rule.get("match"), rule.get("per"), rule.get("max"), rule.get("window_s"))


def policy_would_save(*, team: Team, document: dict[str, Any]
                      ) -> tuple[PolicyVersion | None, bool]:
    """What `policy_save` would do, saving nothing (a dry run): the current version (None
    for a new policy) and whether a new version would be made; refused as the save would
    be (DocumentError past the team's cap on policies)."""
    policy = Policy.objects.filter(team=team, name=document["name"]).select_related(
        "current__created_by").first()
    if policy is None:
        _has_room(team)
    _rules_fit(team, document)
    current = policy.current if policy is not None and policy.current_id else None
    return current, current is None or current.document != document


@transaction.atomic
def policy_save(
    *, team: Team, document: dict[str, Any], actor: AbstractBaseUser | None, source: str,
    note: str = "",
) -> PolicyVersion | None:
    """Store one normalized policy; a new version only when something changed. ``note`` is
    the saver's reason, kept on the version and in the audit event."""
    mine = Policy.objects.select_for_update().filter(team=team, name=document["name"])
    policy = mine.first()
    if policy is None:
        # The team's row lock: two new policies cannot both pass the count.
        Team.objects.select_for_update(no_key=True).filter(pk=team.pk).values_list("pk").first()
        # Looked for again under it: a save of the same new name may have made it while this
        # one waited (found by an attacker: concurrent PUTs of one new name broke the unique
        # name, a 503 and a traceback). A new statement sees what committed meanwhile.
        policy = mine.first()
    if policy is None:
        _has_room(team)
        policy = Policy.objects.create(team=team, name=document["name"])
    if policy.current_id:
        previous = policy.current.document
        if previous == document:
            return None
    else:
        previous = None
    if document.get("rate_limits"):
        # The team's row lock: two saves cannot both pass the team's cap on rules.
        Team.objects.select_for_update(no_key=True).filter(pk=team.pk).values_list("pk").first()
        _rules_fit(team, document)
    version = _new_version(policy, document, actor=actor, source=source, note=note)
    audit(
        actor=actor, action="policy.version", team=team, target=policy.name,
        detail={"version": version.version, "before": previous, "after": document,
                "source": source, "note": version.note},
    )
    return version


@transaction.atomic
def team_ensure(*, slug: str, name: str | None = None, actor: AbstractBaseUser | None = None,
                with_default: bool = True) -> tuple[Team, bool]:
    """Get or create a team; with ``with_default``, give it the default policy if it has none."""
    team, created = Team.objects.get_or_create(
        slug=slug, defaults={"name": name or slug, "webhook_secret": secrets.token_hex(32)}
    )
    if created:
        audit(actor=actor, action="team.create", team=team, target=slug)
    if with_default and not Policy.objects.filter(team=team, name="default").exists():
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
        # The file's own `default`, if it names one, is the team's first version of it.
        team, created = team_ensure(slug=doc["slug"], name=doc.get("name"), actor=actor,
                                    with_default=False)
        if created:
            changes.append(f"team {team.slug}: created")
        # What the file leaves out, an existing team keeps (found by a newcomer: applying the
        # README's example, which names no webhook, cleared the one set in Settings); what
        # it names, even null, it says.
        name = (doc.get("name") or doc["slug"]) if "name" in doc else team.name
        webhook_url = team.webhook_url
        if "webhook_url" in doc:
            # The document's validation refused a host with no IDNA form already.
            webhook_url = ascii_url(doc["webhook_url"]) if doc["webhook_url"] else None
            if team.webhook_url and doc["webhook_url"] and MASK in doc["webhook_url"] \
                    and doc["webhook_url"] == masked_url(team.webhook_url):
                # A file exported by someone who may not see the URL whole: it names the
                # stored one, masked (selectors.team_document), and keeps it.
                webhook_url = team.webhook_url
        if (team.name, team.webhook_url) != (name, webhook_url):
            before = {"name": team.name, "webhook_url": team.webhook_url}
            said = [f"name {team.name!r} -> {name!r}"] if team.name != name else []
            if team.webhook_url != webhook_url:
                said.append("webhook " + (f"set to {masked_url(webhook_url)}" if webhook_url
                                          else "cleared"))
            team.name, team.webhook_url = name, webhook_url
            team.save(update_fields=["name", "webhook_url"])
            after = {"name": name, "webhook_url": team.webhook_url}
            audit(actor=actor, action="team.update", team=team, target=team.slug,
                  detail={"before": before, "after": after})
            if not created:
                changes.append(f"team {team.slug}: " + ", ".join(said))
        for policy in doc["policies"]:
            version = policy_save(team=team, document=policy, actor=actor, source=source)
            if version is not None:
                changes.append(f"policy {team.slug}/{policy['name']}: version {version.version}")
        # A team the file gives no `default` gets one with the defaults (SPEC 3): a change
        # like any other, so it is said too (SPEC 8, "prints what changed").
        had_default = Policy.objects.filter(team=team, name="default").exists()
        team_ensure(slug=team.slug, actor=actor)
        if not had_default:
            changes.append(f"policy {team.slug}/default: version 1 (the defaults)")
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


@dataclass(frozen=True, slots=True)
class KeyClaim:
    """A bearer token that has the shape of an agent key: the prefix that finds its row and
    the hash that row must hold. Parsing needs no database, so the check can look the key up
    in the same statement that locks the run (runs/check/check_store.py)."""

    prefix: str
    digest: str


def agent_key_claim(token: str) -> KeyClaim | None:
    """The claim a token makes, or None when it cannot be a key at all."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or len(parts[1]) != 12:
        return None
    if not all(c in "0123456789abcdef" for c in parts[1]):
        # Prefixes are hex; anything else (a NUL, say) is no key and must not reach a query.
        return None
    return KeyClaim(prefix=parts[1], digest=_hash(token))


def agent_key_matches(claim: KeyClaim, key_hash: str) -> bool:
    """Constant-time comparison, so response timing says nothing about the stored hash."""
    return hmac.compare_digest(key_hash, claim.digest)


def _auth_query() -> tuple[str, list[str], list[str]]:
    """The key-and-team SELECT of agent_key_authenticate, from the models' own columns."""
    key_fields = [f.attname for f in AgentKey._meta.concrete_fields]
    team_fields = [f.attname for f in Team._meta.concrete_fields]
    columns = [f"k.{AgentKey._meta.get_field(n).column}" for n in key_fields] + \
        [f"t.{Team._meta.get_field(n).column}" for n in team_fields]
    sql = (f"SELECT {', '.join(columns)} FROM {AgentKey._meta.db_table} k "
           f"JOIN {Team._meta.db_table} t ON t.id = k.team_id "
           "WHERE k.prefix = %s AND k.revoked_at IS NULL")
    return sql, key_fields, team_fields


_AUTH_QUERY = _auth_query()


def agent_key_authenticate(token: str) -> AgentKey | None:
    """The live key (its team loaded) for a bearer token, or None. Not cached: a revocation
    holds on the very next request in every process.

    One plain SELECT rather than a queryset: every API request but the check (which looks
    the key up in its locking statement) starts here, and building the ORM query cost more
    than running it (docs/performance.md)."""
    claim = agent_key_claim(token)
    if claim is None:
        return None
    sql, key_fields, team_fields = _AUTH_QUERY
    with connection.cursor() as cursor:
        cursor.execute(sql, [claim.prefix])
        row = cursor.fetchone()
    if row is None:
        return None
    # What the ORM's converters would do here: SQLite hands back naive UTC datetimes.
    values = [v.replace(tzinfo=UTC) if isinstance(v, datetime) and v.tzinfo is None else v
              for v in row]
    key = AgentKey.from_db(connection.alias, key_fields, values[:len(key_fields)])
    if not agent_key_matches(claim, key.key_hash):
        return None
    key.team = Team.from_db(connection.alias, team_fields, values[len(key_fields):])
    return key


TOUCH_EVERY = timedelta(seconds=60)


def agent_key_touch(key_id: int, last_used_at: datetime | None) -> None:
    """Record use at most once a minute, so the hot path rarely writes for it. The condition
    is repeated in the UPDATE so that processes racing on a stale value write once."""
    now = timezone.now()
    if last_used_at is not None and now - last_used_at <= TOUCH_EVERY:
        return
    AgentKey.objects.filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - TOUCH_EVERY), pk=key_id
    ).update(last_used_at=now)


# --- Memberships -----------------------------------------------------------------------------

class LastAdmin(ValueError):
    """The change would leave the team without an admin (only a superuser could manage it
    again)."""


def _keep_an_admin(team: Team, membership: Membership, role: str | None) -> None:
    """Refuse (LastAdmin) a change of ``membership`` to ``role`` (None: its removal) that
    leaves the team no admin. Under the team's row lock, the roles read again: two admins
    demoting or removing each other at once both passed a count made before either wrote,
    and the team was left with none (found by an attacker). An invited admin who has not
    chosen a password yet manages nothing, so does not count."""
    Team.objects.select_for_update(no_key=True).filter(pk=team.pk).values_list("pk").first()
    current = Membership.objects.filter(pk=membership.pk).values_list("role", flat=True).first()
    if current != Role.ADMIN or role == Role.ADMIN:
        return
    if not admins_besides(team, membership):
        raise LastAdmin(f"The team's last admin cannot be {'demoted' if role else 'removed'}.")


@transaction.atomic
def membership_set(*, team: Team, user: AbstractBaseUser, role: str,
                   actor: AbstractBaseUser | None) -> Membership:
    """Add ``user`` to the team with ``role``, or change their role; LastAdmin when that
    would leave the team without an admin."""
    role = Role(role)
    membership, created = Membership.objects.get_or_create(
        team=team, user=user, defaults={"role": role}
    )
    if not created and membership.role != role:
        _keep_an_admin(team, membership, role)
        before = membership.role
        membership.role = role
        # A role set by hand is the hand's from now on: SSO sign-ins leave it alone.
        membership.from_sso = False
        membership.save(update_fields=["role", "from_sso"])
        audit(actor=actor, action="member.role", team=team, target=user.get_username(),
              detail={"before": before, "after": role})
    elif created:
        audit(actor=actor, action="member.add", team=team, target=user.get_username(),
              detail={"role": role})
    return membership


@transaction.atomic
def membership_remove(*, membership: Membership, actor: AbstractBaseUser | None) -> None:
    """Remove a member; LastAdmin when they are the team's last admin."""
    _keep_an_admin(membership.team, membership, None)
    audit(actor=actor, action="member.remove", team=membership.team,
          target=membership.user.get_username(), detail={"role": membership.role})
    membership.delete()


# --- Team settings ---------------------------------------------------------------------------

@transaction.atomic
def team_update_webhook(*, team: Team, webhook_url: str | None,
                        actor: AbstractBaseUser | None) -> bool:
    """Set the URL kill-switch notifications are POSTed to. Returns False when unchanged."""
    team = Team.objects.select_for_update().get(pk=team.pk)
    webhook_url = ascii_url(webhook_url) if webhook_url else None
    if team.webhook_url == webhook_url:
        return False
    before = team.webhook_url
    team.webhook_url = webhook_url
    team.save(update_fields=["webhook_url"])
    audit(actor=actor, action="team.webhook", team=team, target=team.slug,
          detail={"before": before, "after": webhook_url})
    return True


@transaction.atomic
def team_set_operator_release(*, team: Team, value: str,
                              actor: AbstractBaseUser | None) -> bool:
    """Who besides admins may release the team's kill switches (OperatorRelease). Returns
    False when unchanged."""
    team = Team.objects.select_for_update().get(pk=team.pk)
    if team.operator_release == value:
        return False
    before, team.operator_release = team.operator_release, value
    team.save(update_fields=["operator_release"])
    audit(actor=actor, action="team.operator_release", team=team, target=team.slug,
          detail={"before": before, "after": value})
    return True


def webhook_secret_id(secret: str) -> str:
    """A short public name for a signing secret (not the secret): the settings page and the
    delivery log show it, so a receiver can tell which secret signed a delivery."""
    if not secret:
        return ""
    return "whsec_" + hashlib.sha256(secret.encode()).hexdigest()[:10]


@transaction.atomic
def team_rotate_webhook_secret(*, team: Team, actor: AbstractBaseUser | None) -> str:
    """A new signing secret for the team's webhooks, returned once (the caller shows it to
    the admin once); deliveries signed from now on use it, retries included."""
    team = Team.objects.select_for_update().get(pk=team.pk)
    before = webhook_secret_id(team.webhook_secret)
    secret = secrets.token_hex(32)
    team.webhook_secret = secret
    team.webhook_secret_shown_at = timezone.now()  # the caller shows it, this once
    team.save(update_fields=["webhook_secret", "webhook_secret_shown_at"])
    audit(actor=actor, action="team.webhook_secret", team=team, target=team.slug,
          detail={"before": before, "after": webhook_secret_id(secret)})
    return secret


@transaction.atomic
def team_show_webhook_secret(*, team: Team, actor: AbstractBaseUser | None) -> str | None:
    """The team's current signing secret if it was never shown (the one the team was made
    with, until someone sees it), else None: like a rotated one, it is shown once. Two
    admins asking at the same moment: the conditional UPDATE lets exactly one of them see
    it, and the row it wrote stays locked until the read, so a rotation cannot slip in."""
    shown = Team.objects.filter(pk=team.pk, webhook_secret_shown_at__isnull=True).exclude(
        webhook_secret="").update(webhook_secret_shown_at=timezone.now())
    if not shown:
        return None
    secret = Team.objects.values_list("webhook_secret", flat=True).get(pk=team.pk)
    audit(actor=actor, action="team.webhook_secret.shown", team=team, target=team.slug,
          detail={"secret": webhook_secret_id(secret)})
    return secret


# --- Invitations ---------------------------------------------------------------------------

class InvitationTokens(PasswordResetTokenGenerator):
    """The token of an invitation for an account that exists. Its shape is the password-reset
    token's, which an invitation for a new account carries (so the two links look alike), but
    it is no password-reset token: it is salted apart, and hashed over the invitation, so it
    is void once the invitation is answered or cancelled, or after PASSWORD_RESET_TIMEOUT."""

    key_salt = "policies.services.InvitationTokens"

    def __init__(self, invitation: Invitation) -> None:
        super().__init__()
        self.invitation = invitation

    def _make_hash_value(self, user: AbstractBaseUser, timestamp: int) -> str:
        invitation = self.invitation
        return (f"{invitation.pk}:{invitation.key}:{invitation.team_id}:{user.pk}:"
                f"{invitation.accepted_at}:{timestamp}")


def invitation_tokens(invitation: Invitation) -> PasswordResetTokenGenerator:
    """What makes and checks the token of the invitation's link: a new account's is Django's
    password-reset token (void once a password is set); an existing account's is its own."""
    return default_token_generator if invitation.new_account else InvitationTokens(invitation)


@dataclass(frozen=True)
class InvitationLink:
    user: Any
    path: str  # the one-time link, relative to the dashboard's address


def member_invite(*, team: Team, username: str, role: str,
                  actor: AbstractBaseUser | None) -> InvitationLink:
    """Invite the person of `username` to the team with `role`. A username nobody has gets its
    account, without a usable password, and its membership; the link lets them choose the
    password. An account that exists joins when its owner, signed in, opens the link and
    confirms. The answer, the audit event and the Members page are the same in both cases,
    and so is the link's first page: an admin cannot tell from them which usernames other
    teams have. The link works once and for PASSWORD_RESET_TIMEOUT (3 days by default).
    Raises ValueError for a member of this team or a waiting invitation, which the Members
    page shows anyway."""
    model = get_user_model()
    # The name as the account would be made (NFKC): looked up raw, a fullwidth spelling of
    # another team's account found nobody, and making it collided with that account, which
    # was answered as a waiting invitation: its existence told (found by an attacker).
    username = model.normalize_username(username)
    user = model.objects.filter(username=username).first()
    if user is not None and Invitation.objects.filter(team=team, user=user,
                                                      accepted_at__isnull=True).exists():
        raise ValueError("An invitation for this username is waiting: cancel it to invite "
                         "again.")
    if user is not None and Membership.objects.filter(team=team, user=user).exists():
        raise ValueError("This username is taken: they are a member of this team already.")
    try:
        with transaction.atomic():
            new_account = user is None
            if new_account:
                user = model.objects.create_user(username)  # no usable password yet
                # No membership_set: its "member.add" would tell the audit log's readers
                # that this account is new. The invitation's event says it for both kinds.
                Membership.objects.create(team=team, user=user, role=Role(role))
            invitation = Invitation.objects.create(
                key=secrets.token_urlsafe(16), team=team, user=user, role=Role(role),
                new_account=new_account, created_by=actor)
            audit(actor=actor, action="member.invite", team=team, target=username,
                  detail={"role": str(role)})
    except IntegrityError:
        # Another admin invited this username at the same moment.
        raise ValueError("An invitation for this username is waiting: cancel it to invite "
                         "again.") from None
    path = reverse("password_reset_confirm", kwargs={
        "uidb64": invitation.key, "token": invitation_tokens(invitation).make_token(user)})
    return InvitationLink(user=user, path=path)


def _waiting(invitation_id: int) -> Invitation | None:
    return (Invitation.objects.select_for_update().select_related("team", "user")
            .filter(pk=invitation_id, accepted_at__isnull=True).first())


@transaction.atomic
def invitation_accept(*, invitation: Invitation) -> bool:
    """The invited person joined: for an existing account, signed in as it and confirming;
    for a new one, by choosing its password. False if it was cancelled or answered before."""
    invitation = _waiting(invitation.pk)  # type: ignore[assignment]
    if invitation is None:
        return False
    invitation.accepted_at = timezone.now()
    invitation.save(update_fields=["accepted_at"])
    if not invitation.new_account:
        # A membership given meanwhile (by an admin who sees the account) keeps its role.
        Membership.objects.get_or_create(team=invitation.team, user=invitation.user,
                                         defaults={"role": invitation.role})
    audit(actor=invitation.user, action="member.join", team=invitation.team,
          target=invitation.user.get_username(), detail={"role": invitation.role})
    return True


@transaction.atomic
def invitation_cancel(*, invitation: Invitation, actor: AbstractBaseUser | None) -> None:
    """Withdraw a waiting invitation. An account made for it goes too, with its membership,
    unless it has been used or belongs elsewhere since."""
    invitation = _waiting(invitation.pk)  # type: ignore[assignment]
    if invitation is None:
        return
    user = invitation.user
    audit(actor=actor, action="member.invite.cancel", team=invitation.team,
          target=user.get_username(), detail={"role": invitation.role})
    invitation.delete()
    if invitation.new_account:
        Membership.objects.filter(team=invitation.team, user=user).delete()
        unused = not user.has_usable_password() and user.last_login is None
        if unused and not Membership.objects.filter(user=user).exists() \
                and not Invitation.objects.filter(user=user).exists():
            user.delete()
