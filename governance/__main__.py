"""`python -m governance` and the `agent-governance` command: manage.py for an installed
server (migrate, createsuperuser, serve, killswitch, ...)."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
