"""System checks of this project's own settings (`manage.py check --deploy`)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register


@register(Tags.security, deploy=True)
def embedded_secret_key(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """Django's own check (security.W009) finds nothing wrong with the generated key, which is
    long and random; what matters for a deployment is that it was not configured."""
    if settings.SECRET_KEY_FILE is None:
        return []
    return [Warning(
        f"SECRET_KEY is not set: the embedded default's key from {settings.SECRET_KEY_FILE} "
        "is in use.",
        hint="Set SECRET_KEY from your secret store, the same value on every server; on "
             "PostgreSQL (the production stack) the server refuses to start without it.",
        id="governance.W001",
    )]


@register("sso")
def sso_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """A bad OIDC_ROLE_MAP (not JSON, an unknown role, a bad entry) stops every start
    (`serve`, `migrate`, any command), naming the entry (SPEC 17)."""
    from policies.sso import RoleMapError, parse_role_map

    errors = []
    try:
        parse_role_map(settings.OIDC_ROLE_MAP)
    except RoleMapError as exc:
        errors.append(Error(str(exc), hint="docs/sso.md shows the map's form.",
                            id="governance.E001"))
    if settings.OIDC_ISSUER and not settings.OIDC_CLIENT_ID:
        errors.append(Error("OIDC_ISSUER is set but OIDC_CLIENT_ID is not.",
                            id="governance.E002"))
    if settings.OIDC_ISSUER and not settings.OIDC_ISSUER.startswith(("https://", "http://")):
        errors.append(Error(f"OIDC_ISSUER must be a URL (https://...), not "
                            f"{settings.OIDC_ISSUER!r}.", id="governance.E003"))
    return errors


@register(Tags.security, deploy=True)
def sso_over_https(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    if not settings.OIDC_ISSUER.startswith("http://"):
        return []
    return [Warning("OIDC_ISSUER is a plain http:// URL: the provider's keys and tokens travel "
                    "unprotected.", hint="Use the provider's https:// issuer.",
                    id="governance.W002")]


@register(Tags.database)
def sso_role_map_teams(app_configs: Any = None, databases: Any = None,
                       **kwargs: Any) -> list[Error]:
    """The teams OIDC_ROLE_MAP names must exist. It needs the database, so it runs where
    Django runs the database checks: `migrate` and `check --database default`; a sign-in
    while a named team is missing is refused with a page naming the entry
    (policies/sso.py)."""
    if not databases:
        return []
    from django.db import DatabaseError

    from policies.sso import RoleMapError, parse_role_map, unknown_teams

    try:
        entries = parse_role_map(settings.OIDC_ROLE_MAP)
    except RoleMapError:
        return []  # the check above says so
    try:
        unknown = unknown_teams(entries)
    except DatabaseError:
        return []  # before the first migrate: no teams table yet
    return [Error(f"OIDC_ROLE_MAP entry {index} names the team {entry.team!r}, which does not "
                  "exist.", hint="Create the team (apply_policies) or correct the map.",
                  id="governance.E004") for index, entry in unknown]
