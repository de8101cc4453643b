"""Which team each agent key is, learned in this process when the key was checked and found
right (a check's locking read, or the API's bearer auth), so the ASGI application can give a
team, not each of its keys, its share of the API's threads (governance/pools.py `FairPool`;
found by an attacker: one team's flood over 8 keys, each under its share, made another team's
check p99 10.8x, against 2.6x from one key). Keyed by the token's digest, as the ASGI
application names a caller, so only a right key can join its team's line. Bounded (cleared
when full): a key not known yet is a caller of its own until its first call is answered.

Small on purpose: the ASGI application (governance/asgi.py) imports it without the check.
"""

from __future__ import annotations

_TEAMS: dict[str, int] = {}
_TEAMS_MAX = 50_000
CREDENTIAL = "token:"  # how governance/asgi.py `_credential` names a bearer token's digest


def remember(digest: str, team_id: int) -> None:
    """A key (its token's SHA-256, hex) found right, and its team."""
    if _TEAMS.get(digest) != team_id:
        if len(_TEAMS) >= _TEAMS_MAX:
            _TEAMS.clear()
        _TEAMS[digest] = team_id


def caller_of(credential: str) -> str:
    """The caller a request's credential shares the API's threads as: its key's team once
    this process knows it, else the credential itself."""
    team = _TEAMS.get(credential[len(CREDENTIAL):]) if credential.startswith(CREDENTIAL) \
        else None
    return credential if team is None else f"team:{team}"


# Operator credentials (as the ASGI application names them) found to see a team (its slug;
# "" for a live token: governance/asgi.py `learn_operator`), and dashboard sessions
# ("session:" and their cookie's digest) found to be a member's (`Application.page`). Only
# these are paced as the team's (`_paced_caller`); any other operator call waits with the
# calls not known yet, and any other page is served unpaced.
_OPERATOR_TEAMS: set[tuple[str, str]] = set()


def remember_operator(credential: str, team: str) -> None:
    """``credential`` is a live operator token that sees ``team`` (its slug; "": live)."""
    if (credential, team) not in _OPERATOR_TEAMS:
        if len(_OPERATOR_TEAMS) >= _TEAMS_MAX:
            _OPERATOR_TEAMS.clear()
        _OPERATOR_TEAMS.add((credential, team))


def operator_known(credential: str, team: str) -> bool:
    return (credential, team) in _OPERATOR_TEAMS


def forget_operator(credential: str, team: str) -> None:
    """``credential`` may no longer see ``team`` (a session signed out, a member removed):
    its next call is looked up again."""
    _OPERATOR_TEAMS.discard((credential, team))
