"""`python -m governance` and the `agent-governance` command: manage.py for an installed
server (migrate, createsuperuser, serve, killswitch, ...)."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    # The settings refuse a deployment's missing or bad environment (SECRET_KEY on
    # PostgreSQL, a setting out of its range) with a sentence naming it: that sentence,
    # on one line, not under a traceback of Django's start.
    try:
        from django.conf import settings

        settings.SECRET_KEY  # noqa: B018 (reading a setting runs the settings module)
    except ImproperlyConfigured as exc:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {exc}")
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
