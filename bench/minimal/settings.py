"""Settings of the minimal baseline application: nothing but the database.

No installed apps, no middleware, no templates, no static files: what is left per request is
granian, Django's WSGI handler, URL resolution and the view. The database settings are the
product's own (same URL, same persistent connections, same options), so the durable endpoint
pays exactly what the product's PostgreSQL connection costs.
"""

from __future__ import annotations

import os

import dj_database_url

SECRET_KEY = os.environ.get("SECRET_KEY", "bench-minimal-only")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS: list[str] = []
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "bench.minimal.urls"
USE_TZ = True
TIME_ZONE = "UTC"
LOGGING_CONFIG = None

_db = dj_database_url.parse(os.environ["DATABASE_URL"])
_db["CONN_MAX_AGE"] = int(os.environ.get("DB_CONN_MAX_AGE", "60"))
_db["CONN_HEALTH_CHECKS"] = True
_db.setdefault("OPTIONS", {})["connect_timeout"] = 2
DATABASES = {"default": _db}

# What the product's ASGI application reads (governance/asgi.py, governance/pools.py), from
# the same environment `manage.py serve` sets.
API_THREADS = int(os.environ.get("WEB_THREADS", "4"))
DASHBOARD_THREADS = int(os.environ.get("WEB_DASHBOARD_THREADS", "4"))
OPERATOR_THREADS = int(os.environ.get("WEB_OPERATOR_THREADS", "2"))
BACKTEST_API_THREADS = int(os.environ.get("WEB_BACKTEST_THREADS", "2"))
KILLSWITCH_API_THREADS = int(os.environ.get("WEB_KILLSWITCH_THREADS", "2"))
OPERATOR_THREADS_PER_CREDENTIAL = 1
OPERATOR_CALLS_PER_ADDRESS = 8
REQUEST_BODY_SECONDS = int(os.environ.get("REQUEST_BODY_SECONDS", "10"))
CHECK_MAX_BODY_BYTES = 64 * 1024
TRUSTED_PROXIES: list[object] = []
CHEAP_ANSWERS_PER_ADDRESS = int(os.environ.get("WEB_CHEAP_ANSWERS_PER_ADDRESS", "20"))
