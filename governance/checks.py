"""System checks of this project's own settings (`manage.py check --deploy`)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Tags, Warning, register


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
