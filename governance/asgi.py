"""ASGI entry point. Serves every route, like the WSGI one; see docs/serving.md for which
the production command uses and why."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")
application = get_asgi_application()
