"""Operator tokens (SPEC 17): bearer tokens a person makes for automation (CI, chat bots).

A token acts as its owner, with the lesser of the owner's role and its own, and on its team
only when one is given. It is shown once and stored hashed, like an agent key
(policies/services.py): the prefix finds the row, the SHA-256 of the whole token is compared
in constant time. It may expire and may be revoked; every action taken with it is an
operator-audit event naming it (``acting``: `policies.services.audit` adds the token to each
event written while it acts).

Tokens start ``gov_op_``; an agent key starts ``gov_`` and a hex prefix, so the two kinds are
told apart by their shape alone, without a lookup: an agent key on an operator endpoint, or a
token on an agent endpoint, is refused 403 ``wrong_credential_kind`` (nothing is checked,
so that answer tells nothing about the credential).
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.validators import slug_re
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from governance.errors import AppError

from .access import role_in
from .models import ROLE_RANK, Membership, OperatorToken, Role, Team
from .services import TOUCH_EVERY, _hash, acting_token, audit

TOKEN_START = "gov_op_"
MAX_EXPIRES_DAYS = 3650
# A person's live tokens (neither revoked nor expired) at most, and the ended ones their
# account page lists beside them (the latest). Any signed-in person may make tokens, and the
# account page (of no team, so paced with none) listed every one they ever made, each with a
# query: found by an attacker, a viewer's 10,000 tokens (made in 100 s at the form) made the
# page 6.6 MB and 10 s, and four tabs of it held every dashboard thread (another team's
# page 30 s) and raised another team's check median from 6 to 219 ms.
MAX_LIVE_TOKENS = 100
ENDED_TOKENS_SHOWN = 50



def is_operator_token(token: str | None) -> bool:
    return bool(token) and token.startswith(TOKEN_START)  # type: ignore[union-attr]


def token_label(token: OperatorToken) -> str:
    """Who acted, as the audit log and a kill switch's row name it."""
    return f"{token.user.get_username()} (token {token.name})"[:150]


@contextmanager
def acting(token: OperatorToken) -> Iterator[None]:
    handle = acting_token.set(token)
    try:
        yield
    finally:
        acting_token.reset(handle)


@dataclass(frozen=True)
class NewToken:
    token: OperatorToken
    secret: str


class TokenError(AppError):
    """A token that cannot be made as asked (422, a field named)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(422, "invalid_request", message, {field: message})


def operator_token_create(*, user: AbstractBaseUser, name: str, role: str,
                          team: Team | None = None, expires_days: int | None = None,
                          actor: AbstractBaseUser | None = None) -> NewToken:
    """A new token for ``user``; the secret is returned once and only its hash is stored.
    Its team must be one of the owner's (a superuser's: any)."""
    name = (name or "").strip()
    if not name or len(name) > 100:
        raise TokenError("name", "a name of 1 to 100 characters is required")
    try:
        role = Role(role)
    except ValueError:
        raise TokenError("role", "one of viewer, operator, admin") from None
    if team is not None and role_in(user, team) is None:
        raise TokenError("team", f"{user.get_username()} is not a member of team {team.slug}")
    if expires_days is not None and not 1 <= expires_days <= MAX_EXPIRES_DAYS:
        raise TokenError("expires_days", f"1 to {MAX_EXPIRES_DAYS} days, or none")
    prefix = secrets.token_hex(6)
    secret = f"{TOKEN_START}{prefix}_{secrets.token_urlsafe(32)}"
    now = timezone.now()
    expires_at = now + timedelta(days=expires_days) if expires_days else None
    with transaction.atomic():
        # The owner's row locked: two tokens made at once are counted one after the other.
        get_user_model().objects.select_for_update().filter(pk=user.pk).values_list(
            "pk").first()
        if _live(OperatorToken.objects.filter(user=user), now).count() >= MAX_LIVE_TOKENS:
            raise TokenError("tokens", f"{user.get_username()} has {MAX_LIVE_TOKENS} live "
                             "tokens, as many as a person may: revoke one no longer used "
                             "first.")
        token = OperatorToken.objects.create(
            user=user, name=name, team=team, role=role, prefix=prefix,
            token_hash=_hash(secret), expires_at=expires_at)
        audit(actor=actor or user, action="token.create", team=team, target=name,
              detail={"prefix": prefix, "owner": user.get_username(), "role": role.value,
                      "team": team.slug if team else None,
                      "expires_at": expires_at.isoformat() if expires_at else None})
    return NewToken(token=token, secret=secret)


def _live(tokens: QuerySet[OperatorToken], now: Any) -> QuerySet[OperatorToken]:
    return tokens.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now),
                         revoked_at__isnull=True)


def operator_token_revoke(*, token: OperatorToken, actor: AbstractBaseUser | None) -> bool:
    updated = OperatorToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now())
    if updated:
        audit(actor=actor, action="token.revoke", team=token.team, target=token.name,
              detail={"prefix": token.prefix, "owner": token.user.get_username()})
    return bool(updated)


def token_prefix(secret: str) -> str | None:
    """The prefix a token's shape names (hex, 12 characters), or None."""
    if not is_operator_token(secret):
        return None
    prefix, sep, _ = secret[len(TOKEN_START):].partition("_")
    if not sep or len(prefix) != 12 or not all(c in "0123456789abcdef" for c in prefix):
        return None
    return prefix


# What the holder of a dead token does next (a CI job's log is often all anyone reads).
NEW_TOKEN = ("Its owner makes a new one on the Tokens page (/accounts/tokens/), or an "
             "administrator with `manage.py create_operator_token`.")


def operator_token_authenticate(secret: str) -> OperatorToken:
    """The live token for a bearer secret, its owner loaded; else 401: ``unauthorized``
    (unknown, malformed, or an owner no longer active: the last said so), ``token_revoked``,
    ``token_expired`` (what is said of a token's state is said only to whoever holds the
    whole secret: the hash matched)."""
    prefix = token_prefix(secret)
    token = None
    if prefix is not None:
        token = (OperatorToken.objects.select_related("user", "team")
                 .filter(prefix=prefix).first())
    if token is None or not hmac.compare_digest(token.token_hash, _hash(secret)):
        raise AppError(401, "unauthorized",
                       "A valid operator token is required (Authorization: Bearer gov_op_...).")
    if not token.user.is_active:
        # Said, like a revocation, only to whoever holds the whole secret: "a valid operator
        # token is required" sent a newcomer looking for a typo in a token just made for a
        # deactivated account (found by a newcomer).
        raise AppError(401, "unauthorized",
                       f"The operator token {token.name!r} belongs to a deactivated account "
                       f"({token.user.get_username()}): it works again only once an "
                       "administrator reactivates the account; an active person's token is "
                       "needed meanwhile.")
    if token.revoked_at is not None:
        raise AppError(401, "token_revoked",
                       f"The operator token {token.name!r} was revoked. {NEW_TOKEN}")
    now = timezone.now()
    if token.expires_at is not None and token.expires_at <= now:
        raise AppError(401, "token_expired",
                       f"The operator token {token.name!r} expired at "
                       f"{token.expires_at.isoformat()}. {NEW_TOKEN}")
    if token.last_used_at is None or now - token.last_used_at > TOUCH_EVERY:
        OperatorToken.objects.filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - TOUCH_EVERY), pk=token.pk
        ).update(last_used_at=now)
    return token


def token_role(token: OperatorToken, team: Team) -> Role | None:
    """The role the token acts with in ``team``: the lesser of its owner's and its own; None
    outside its team (or a team its owner is not in), which the API answers 404."""
    if token.team_id is not None and token.team_id != team.pk:
        return None
    return _lesser(role_in(token.user, team), Role(token.role))


def _lesser(owner: Role | None, mine: Role) -> Role | None:
    if owner is None:
        return None
    return owner if ROLE_RANK[owner] <= ROLE_RANK[mine] else mine


def sees_team(secret: str, slug: str) -> bool:
    """Whether the bearer ``secret`` is a live operator token that sees team ``slug`` (""
    for none: live is enough). The server's pacing asks before a call of a token it does not
    know yet (governance/asgi.py). A malformed secret costs no query."""
    try:
        token = operator_token_authenticate(secret)
    except AppError:
        return False
    if not slug:
        return True
    if not slug_re.match(slug):
        return False  # no team has it: a NUL in it would be the store's error (an attacker's)
    team = Team.objects.filter(slug=slug).first()
    return team is not None and token_role(token, team) is not None


def token_is_superuser(token: OperatorToken) -> bool:
    """A superuser's admin token for every team acts as a superuser (the global kill switch,
    every team); bound to one team, or with a lower role, it does not."""
    return bool(token.user.is_superuser) and token.team_id is None \
        and Role(token.role) == Role.ADMIN


def token_teams(token: OperatorToken) -> list[Team]:
    """The teams the token sees."""
    if token.user.is_superuser:
        teams = Team.objects.all()
    else:
        teams = Team.objects.filter(memberships__user=token.user)
    if token.team_id is not None:
        teams = teams.filter(pk=token.team_id)
    return list(teams.order_by("slug"))


def tokens_of(user: AbstractBaseUser) -> tuple[list[OperatorToken], int]:
    """The person's live tokens (at most MAX_LIVE_TOKENS), newest first, then the latest
    ENDED_TOKENS_SHOWN of the revoked or expired ones; and how many older ended ones are left
    out. Each with ``acts_as``: the role a team-bound token acts with now (the lesser of its
    own and its owner's in the team; None for a token of every team, whose role is the
    owner's at most in each), so that the list never shows a role the token does not have
    (found by a newcomer: an operator's "admin" token was refused as an operator). A bounded
    number of queries, whatever the person made."""
    now = timezone.now()
    mine = OperatorToken.objects.filter(user=user).select_related("team")
    live = list(_live(mine, now)[:MAX_LIVE_TOKENS])
    ended_rows = mine.filter(Q(revoked_at__isnull=False) | Q(expires_at__lte=now))
    ended = list(ended_rows[:ENDED_TOKENS_SHOWN])
    left_out = ended_rows.count() - len(ended) if len(ended) == ENDED_TOKENS_SHOWN else 0
    if user.is_superuser:
        roles: dict[int, Role] = {}
    else:
        roles = {team_id: Role(role) for team_id, role in
                 Membership.objects.filter(user=user).values_list("team_id", "role")}
    for token in live + ended:
        owner = Role.ADMIN if user.is_superuser else roles.get(token.team_id)
        token.acts_as = _lesser(owner, Role(token.role)) if token.team_id is not None else None
    return live + ended, left_out


def token_of(user: AbstractBaseUser, token_id: Any) -> OperatorToken | None:
    try:
        return OperatorToken.objects.select_related("team", "user").filter(
            user=user, pk=int(token_id)).first()
    except (TypeError, ValueError):
        return None


def teams_for_tokens(user: AbstractBaseUser) -> list[Team]:
    """The teams a person may bind a token to: theirs (a superuser's: all)."""
    if user.is_superuser:
        return list(Team.objects.order_by("slug"))
    ids = Membership.objects.filter(user=user).values_list("team_id", flat=True)
    return list(Team.objects.filter(pk__in=ids).order_by("slug"))

