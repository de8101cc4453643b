from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.minimal.settings"
application = get_asgi_application()
