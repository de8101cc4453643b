"""The minimal baseline under the product's own ASGI application class (governance/asgi.py),
with the minimal settings: what differs from the product is the application, not the server."""

from __future__ import annotations

import os

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.minimal.settings"

from governance.asgi import application

__all__ = ("application",)
