"""Settings, read from environment variables (SPEC section 9).

With nothing set, the project runs on its embedded default: a SQLite file under the project,
no Redis, Celery tasks run eagerly. Values that are set but wrong stop the process with a
message rather than being guessed at.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import tempfile
from pathlib import Path

import dj_database_url
from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
# Where the embedded default keeps its files (the SQLite database, collected static files,
# audit exports): DATA_DIR, else the source checkout when run from one (manage.py beside the
# packages), else the current directory, as for a server installed with `pip install .`.
DATA_DIR = Path(os.environ.get("DATA_DIR") or (
    BASE_DIR if (BASE_DIR / "manage.py").exists() else Path.cwd()))


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (true/false), not {raw!r}")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, not {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, not {raw!r}") from None


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_networks(name: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Comma-separated addresses or CIDRs ("10.0.0.0/8, ::1"); a wrong entry stops the start."""
    networks = []
    for item in env_list(name, []):
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ImproperlyConfigured(
                f"{name} must list IP addresses or CIDRs, not {item!r}") from None
    return networks


def installation_secret(path: Path) -> str:
    """The embedded default's SECRET_KEY: made on first run, then read from ``path``.

    Written to a temporary file and linked into place, so that processes starting together
    (granian's workers) all end up with the one key that won, never a half-written file."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".secret-key-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as handle:
                handle.write(secrets.token_urlsafe(50) + "\n")
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    key = path.read_text(encoding="ascii").strip()
    if len(key) < 50:
        raise ImproperlyConfigured(
            f"{path} does not hold a secret key: delete it, or set SECRET_KEY")
    return key


DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "governance",
    "policies",
    "runs",
    "backtests",
]

# The pages' middleware. A request under /api/ leaves it at the first entry for the API's
# own chain below (governance/middleware.py ApiRouteMiddleware): sessions, CSRF, sign-in,
# messages, htmx, frame options, static files and the sign-in throttle serve only people in
# a browser, and were about half of what the middleware cost a check (docs/performance.md).
MIDDLEWARE = [
    "governance.middleware.ProbeMiddleware",  # /healthz, /readyz: whatever the Host, plain HTTP
    "governance.middleware.ApiRouteMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "governance.middleware.StaticFilesMiddleware",  # WhiteNoise, sync and async
    # Before the session and the user are read: the whole page is within the deadline.
    "governance.middleware.ReadDeadlineMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "governance.middleware.StorableInputMiddleware",  # no NUL reaches a form or filter
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "governance.middleware.SecurityHeadersMiddleware",
    "governance.middleware.SignInThrottleMiddleware",
]
# The API's chain (/api/), in the same order as they stood in the one chain before; each
# must run in both the sync and the async chain.
API_MIDDLEWARE = [
    # First, so that it sees the answers Django makes before anything else runs.
    "governance.middleware.ApiJsonMiddleware",
    "django.middleware.security.SecurityMiddleware",  # nosniff, HSTS, the HTTPS redirect
    "django.middleware.common.CommonMiddleware",  # the Host check (ALLOWED_HOSTS)
    "governance.middleware.SecurityHeadersMiddleware",
    "governance.middleware.JsonApiErrorsMiddleware",
]

ROOT_URLCONF = "governance.urls"
# Only the benchmark sets this, on the server it starts, to add its baseline endpoints
# (bench/urls.py); nothing but a bench URLconf is accepted.
_bench_urlconf = os.environ.get("BENCH_URLCONF") or ""
if _bench_urlconf:
    if not _bench_urlconf.startswith("bench."):
        raise ImproperlyConfigured("BENCH_URLCONF may only name a module of the bench package")
    ROOT_URLCONF = _bench_urlconf
WSGI_APPLICATION = "governance.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],  # each app has its templates; the layout is the governance app's
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database --------------------------------------------------------------------------------
DATABASE_URL = os.environ.get("DATABASE_URL") or f"sqlite:///{DATA_DIR / 'db.sqlite3'}"
try:
    _db = dj_database_url.parse(DATABASE_URL)
except Exception as exc:  # the library raises a bare ValueError/KeyError on unknown schemes
    raise ImproperlyConfigured(f"DATABASE_URL is not a database URL: {exc}") from None
# What stands between the server and PostgreSQL: "" or "none" (PostgreSQL itself, or a pooler
# in session mode: a server connection for each client connection), or "transaction" (a pooler
# such as PgBouncer in transaction mode, where consecutive transactions of one connection may
# run on different server connections, so nothing may be kept in the session).
DATABASE_POOLER = (os.environ.get("DATABASE_POOLER") or "none").strip().lower()
if DATABASE_POOLER not in {"none", "session", "transaction"}:
    raise ImproperlyConfigured(
        f"DATABASE_POOLER must be none, session or transaction, not {DATABASE_POOLER!r}")
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # BEGIN IMMEDIATE makes SQLite take its write lock when a transaction starts, which
    # serializes the checks of a run (SPEC 4.5) across threads and processes instead of
    # failing one of two racing read-then-write transactions with "database is locked".
    _db["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # Tests share the database with server processes they start, so it must be a file.
    _db["TEST"] = {"NAME": os.environ.get("TEST_SQLITE_PATH") or str(DATA_DIR / ".test-db.sqlite3")}
elif _db["ENGINE"] == "django.db.backends.postgresql":
    _db["CONN_HEALTH_CHECKS"] = True
    # A fast connect timeout is what lets a check answer 503 quickly when PostgreSQL is down.
    _db.setdefault("OPTIONS", {})["connect_timeout"] = env_int("DB_CONNECT_TIMEOUT", 2)
    # A host that vanishes without closing sockets must not hang checks for the kernel's
    # retransmission timeout (~15 min): keepalives and a TCP user timeout bound it, and an
    # abandoned transaction cannot hold a run's lock for long.
    _db["OPTIONS"].update({
        "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 2, "keepalives_count": 3,
        "tcp_user_timeout": 2000,
    })
    if DATABASE_POOLER != "transaction":
        _db["OPTIONS"]["options"] = "-c idle_in_transaction_session_timeout=10000"
    else:
        # Behind a pooler in transaction mode (docs/deploy.md "PgBouncer"): nothing may live
        # in the session, which the next transaction may not have. PgBouncer refuses the
        # `options` startup parameter (its `idle_transaction_timeout` bounds an abandoned
        # transaction instead); Django's iterator() must not keep a cursor WITH HOLD across
        # transactions; the check sends its statements whole instead of preparing them
        # (runs/check/check_store.py), and the dashboard's read deadline is off
        # (governance/deadlines.py).
        _db["DISABLE_SERVER_SIDE_CURSORS"] = True
else:
    raise ImproperlyConfigured("DATABASE_URL must be a sqlite:// or postgres:// URL")
# Each server thread keeps its connection, on both databases: opening one per request
# (Django's default, 0) made a sequential check on SQLite cost 16-32 ms instead of 10-13 ms on
# the 2-core machine (docs/serving.md). An idle connection holds no lock in autocommit mode.
_db["CONN_MAX_AGE"] = env_int("DB_CONN_MAX_AGE", 60)
DATABASES = {"default": _db}

# --- SECRET_KEY --------------------------------------------------------------------------------
# Production is PostgreSQL: there SECRET_KEY must come from the environment (every server of a
# deployment must share it, and nothing may be signed with a key anyone can read). The embedded
# default (SQLite) makes a key of its own on first run, kept beside the database file
# (`<database>.secret-key`, git-ignored), so that no installation signs with a key written in
# the code; `check --deploy` says when that key is in use (governance/checks.py).
SECRET_KEY = os.environ.get("SECRET_KEY") or ""
SECRET_KEY_FILE: Path | None = None
if not SECRET_KEY:
    if _db["ENGINE"] != "django.db.backends.sqlite3":
        raise ImproperlyConfigured(
            "SECRET_KEY must be set when running on PostgreSQL (the production stack)")
    SECRET_KEY_FILE = Path(f"{_db['NAME']}.secret-key")
    SECRET_KEY = installation_secret(SECRET_KEY_FILE)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis and Celery ------------------------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL") or None
CELERY_BROKER_URL = REDIS_URL or "memory://localhost/"
CELERY_RESULT_BACKEND = None
CELERY_TASK_ALWAYS_EAGER = REDIS_URL is None
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# With late acks a task at work still counts against the prefetch window, so a multiplier of 1
# means a worker takes a message only for a free process: it never holds a fan-out behind a
# long task while another worker of its queue is idle.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Every broker call is bounded (kombu's Redis default is to wait for ever): a hung Redis
# costs a worker's publish or ack seconds, never the process. Requests never publish on their
# own thread (runs/publisher.py). The consumer's BRPOP is read only once its socket is
# readable, so these do not cut its long wait short.
BROKER_TIMEOUT_S = 2.0
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 60),
                                   "socket_timeout": BROKER_TIMEOUT_S,
                                   "socket_connect_timeout": BROKER_TIMEOUT_S}
CELERY_BROKER_CONNECTION_TIMEOUT = BROKER_TIMEOUT_S
# A publish that meets a dead connection reconnects and tries again twice, then fails (the
# caller's task is retried, or the sweep restarts the work): at most about 3 x 2 x 2 s.
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0,
                                    "interval_step": 0.2, "interval_max": 0.5}
# Queues (docs/reliability.md, "Worker pools"): the kill switch's fan-out, its sweep and the
# approvals' expiry (short, bounded, and it stops runs) go to `killswitch`, which a worker of
# its own consumes, so no backtest, prune or webhook receiver ever holds the process a kill
# waits for. Every webhook delivery (kill switches', approvals', tests) goes to `webhooks`,
# a worker of its own too: a receiver that is slow or down holds only that worker's
# processes, each for at most one attempt's deadline. Backtests and the audit prune go to
# `bulk`, the idle sweep (its rate-limit prune grows with traffic) to `default`, both served
# by the third worker (the Makefile's `worker`, the README). Names, not patterns: a task added
# later lands on `default`, never on the kill switch's pool by accident.
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_ROUTES = {
    "runs.tasks.killswitch_fanout": {"queue": "killswitch"},
    "runs.tasks.killswitch_sweep": {"queue": "killswitch"},
    "runs.tasks.approvals_expire": {"queue": "killswitch"},
    "runs.tasks.webhook_deliver": {"queue": "webhooks"},
    # The same queue, a lower priority (the Redis transport keeps one list per step of
    # priority and a worker takes from the first that is not empty): an approval's or a
    # test's delivery never goes before a kill switch's (runs/webhooks/tasks.py).
    "runs.tasks.webhook_deliver_routine": {"queue": "webhooks", "priority": 6},
    "backtests.tasks.backtest_run": {"queue": "bulk"},
    "policies.tasks.prune_audit": {"queue": "bulk"},
}
# Dashboard backtests (docs/backtest.md) a team may run at once, and how long a backtest
# whose task stopped reporting progress still counts as running.
BACKTEST_MAX_PER_TEAM = env_int("BACKTEST_MAX_PER_TEAM", 2)
BACKTEST_STALE_SECONDS = env_int("BACKTEST_STALE_SECONDS", 300)
# How often beat's kill-switch sweep runs, and how long a fan-out may stay unfinished or a
# delivery unattempted before it restarts them (docs/killswitch.md). It is how a fan-out lost
# with a worker killed between taking its message and recording it comes back: Redis has
# already handed that message out, so no visibility timeout ever returns it.
KILLSWITCH_SWEEP_SECONDS = env_int("KILLSWITCH_SWEEP_SECONDS", 60)
if KILLSWITCH_SWEEP_SECONDS < 1:
    raise ImproperlyConfigured("KILLSWITCH_SWEEP_SECONDS must be at least 1")
# Audit retention (docs/reliability.md): `celery -A governance beat` runs the prune daily,
# at a quiet hour; exports (JSON lines, one directory per team) go to AUDIT_EXPORT_DIR.
CELERY_BEAT_SCHEDULE = {
    "prune-audit-daily": {"task": "policies.tasks.prune_audit",
                          "schedule": crontab(hour=3, minute=30)},
    # Restarts kill-switch fan-outs and webhook deliveries that an outage left behind.
    "killswitch-sweep": {"task": "runs.tasks.killswitch_sweep",
                         "schedule": float(KILLSWITCH_SWEEP_SECONDS)},
    # Ends abandoned runs (SPEC 14) and prunes rate-limit counts older than any window
    # (SPEC 12).
    "idle-sweep": {"task": "runs.tasks.idle_sweep",
                   "schedule": float(env_int("IDLE_SWEEP_SECONDS", 60))},
    # Settles approvals past their expiry that nobody looked at (SPEC 11).
    "approvals-expire": {"task": "runs.tasks.approvals_expire", "schedule": 10.0},
    # Deletes expired sign-in sessions (a visitor's unfinished SSO sign-in lives 10 minutes).
    "clear-sessions": {"task": "policies.tasks.clear_sessions",
                       "schedule": float(env_int("SESSION_PURGE_SECONDS", 600))},
}
AUDIT_EXPORT_DIR = Path(os.environ.get("AUDIT_EXPORT_DIR") or DATA_DIR / "exports")
# The longest a check waits for its rate-limit rules' locks (SPEC 10, 12); past it the check
# answers `wait` with a short retry_after_s instead of holding its thread (PostgreSQL).
RATE_LIMIT_LOCK_WAIT_MS = env_int("RATE_LIMIT_LOCK_WAIT_MS", 500)

# Redis is never on a check's critical path, and no call to it may hold a request for long
# (SPEC 10): 100 ms to connect or to answer, whatever uses it. Celery publishes are off the
# request path altogether (runs/publisher.py).
REDIS_TIMEOUT_S = 0.1
if REDIS_URL:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                          "LOCATION": REDIS_URL, "KEY_PREFIX": "governance",
                          "OPTIONS": {"socket_timeout": REDIS_TIMEOUT_S,
                                      "socket_connect_timeout": REDIS_TIMEOUT_S}}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- Auth, sessions, security ----------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

# --- Single sign-on, OpenID Connect (SPEC 17, docs/sso.md) -------------------------------------
# Off while OIDC_ISSUER is unset: the login page is the password form alone, as before. The
# provider's endpoints are discovered from <issuer>/.well-known/openid-configuration at the
# first SSO sign-in (policies/sso_views.py), never at import: a provider that is down cannot
# stop the server from starting, only SSO sign-ins, with a page that says so.
OIDC_ISSUER = (os.environ.get("OIDC_ISSUER") or "").strip().rstrip("/")
OIDC_CLIENT_ID = os.environ.get("OIDC_CLIENT_ID") or ""
OIDC_CLIENT_SECRET = os.environ.get("OIDC_CLIENT_SECRET") or ""
# JSON list of {"group", "team": slug | "*", "role"}; checked at start (governance/checks.py).
OIDC_ROLE_MAP = os.environ.get("OIDC_ROLE_MAP") or "[]"
OIDC_GROUPS_CLAIM = os.environ.get("OIDC_GROUPS_CLAIM") or "groups"
OIDC_PASSWORD_LOGIN = (os.environ.get("OIDC_PASSWORD_LOGIN") or
                       ("superusers" if OIDC_ISSUER else "all")).strip().lower()
if OIDC_PASSWORD_LOGIN not in {"all", "superusers", "off"}:
    raise ImproperlyConfigured("OIDC_PASSWORD_LOGIN must be all, superusers or off")
# Every call to the provider (discovery, token, keys, userinfo) gives up after this long.
OIDC_TIMEOUT = env_float("OIDC_TIMEOUT", 5.0)
# The algorithm the provider signs ID tokens with; anything else is refused.
OIDC_RP_SIGN_ALGO = os.environ.get("OIDC_SIGN_ALGO") or "RS256"
# What mozilla-django-oidc reads (the request view and the backend of policies/sso_views.py).
OIDC_RP_CLIENT_ID = OIDC_CLIENT_ID
OIDC_RP_CLIENT_SECRET = OIDC_CLIENT_SECRET
OIDC_RP_SCOPES = "openid email profile"
OIDC_USE_PKCE = True
OIDC_USE_NONCE = True
OIDC_AUTHENTICATION_CALLBACK_URL = "sso_callback"
# Accepted difference between the provider's clock and ours when checking an ID token's times.
OIDC_CLOCK_SKEW_S = 60
AUTHENTICATION_BACKENDS = [
    # ModelBackend, less the equalising hash past an address's bound (SPEC 10).
    "governance.passwords.PasswordBackend",
    # Signs in nobody by itself: the SSO callback calls it (policies/sso_views.py).
    "policies.sso_views.SsoBackend",
]

SECURE_HSTS_SECONDS = 0 if DEBUG else env_int("SECURE_HSTS_SECONDS", 31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_SECURE = env_bool("SECURE_COOKIES", False)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
CSRF_COOKIE_HTTPONLY = False  # htmx reads no cookie: the token travels in hx-headers
SECURE_CONTENT_TYPE_NOSNIFF = True
# Scripts only from our own static files (no inline script, no eval); styles may be inline
# because server-rendered SVG charts and htmx's indicator styles use them.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self'; object-src 'none'; "
    "base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)
# Failed authentications are counted per source and credential (governance/throttle.py).
# The source is the TCP peer, or, when the peer is one of TRUSTED_PROXIES (unset: none), the
# client named by its X-Forwarded-For header.
TRUSTED_PROXIES = env_networks("TRUSTED_PROXIES")
THROTTLE_WINDOW_SECONDS = env_int("THROTTLE_WINDOW_SECONDS", 60)
THROTTLE_API_KEY_FAILURES = env_int("THROTTLE_API_KEY_FAILURES", 30)
THROTTLE_SIGN_IN_FAILURES = env_int("THROTTLE_SIGN_IN_FAILURES", 10)
# Failed sign-ins from one address whatever the usernames (each costs a password hash, about
# 0.46 s of CPU with the production hasher): 20 a window is 9 s of CPU a minute at most.
THROTTLE_SIGN_IN_FAILURES_PER_ADDRESS = env_int("THROTTLE_SIGN_IN_FAILURES_PER_ADDRESS", 20)
# Passwords checked from one address, right or wrong (a sign-in, a password change's old
# password): past it the address's sign-ins are paced (WEB_SIGN_IN_SHARE), never refused, so
# that signing in to one's own account over and over does not cost a hash without limit.
THROTTLE_SIGN_IN_CHECKS_PER_ADDRESS = env_int("THROTTLE_SIGN_IN_CHECKS_PER_ADDRESS", 60)

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

# The application serves its own static files under any host (WhiteNoise): hashed, compressed
# and cached for a year once collected (`collectstatic`, which `manage.py serve` and
# `make demo` run); before that, from the apps' folders under their own names.
STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT") or DATA_DIR / "staticfiles")
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "governance.storage.StaticFiles"},
}
WHITENOISE_USE_FINDERS = True

# --- The check API ---------------------------------------------------------------------------
CHECK_MAX_BODY_BYTES = 64 * 1024
# Prometheus metrics (runs/check/metrics.py): off when unset; when set, /metrics answers only a
# scraper sending "Authorization: Bearer <METRICS_TOKEN>".
METRICS_TOKEN = os.environ.get("METRICS_TOKEN") or ""
DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024

# --- Serving (docs/serving.md) ----------------------------------------------------------------
# Threads per server process for the synchronous part of requests: the API's pool (`/api/`,
# health) and the dashboard's, apart, so neither can take or queue behind the other's.
# `manage.py serve --threads / --dashboard-threads` set these for the workers it starts.
API_THREADS = env_int("WEB_THREADS", 4)
DASHBOARD_THREADS = env_int("WEB_DASHBOARD_THREADS", 4)
# The agents' bulk calls (a run's decisions, local-decision uploads, the runs list) on a pool
# of their own, never a check's thread (governance/pools.py); one agent key holds at most
# AGENT_BULK_THREADS_PER_CREDENTIAL of its threads and one client address
# AGENT_BULK_CALLS_PER_ADDRESS calls, running or queued, past which 429 (the client retries).
AGENT_BULK_THREADS = env_int("WEB_AGENT_BULK_THREADS", 2)
AGENT_BULK_THREADS_PER_CREDENTIAL = env_int("WEB_AGENT_BULK_THREADS_PER_CREDENTIAL",
                                            max(1, AGENT_BULK_THREADS - 1))
AGENT_BULK_CALLS_PER_ADDRESS = env_int("WEB_AGENT_BULK_CALLS_PER_ADDRESS", 8)
# The most of one process's time the agents' bulk calls may take together (governance/
# shares.py): past it the next one waits its turn (at most 10 s, else 429 with Retry-After),
# so one team's heavy reads leave the checks their CPU.
AGENT_BULK_SHARE = env_float("WEB_AGENT_BULK_SHARE", 0.2)
# The most of a process's time one caller's heavy checks take (each more than a few ms of CPU,
# such as 60 KiB of small JSON values to walk; governance/asgi.py `check_in_share`): delayed,
# never refused. 0.25 left another team's check p99 2 to 2.8x under the benchmark's
# `heavy_args` attack, 0.1 1.5 to 1.9x, 0.05 about 1x (docs/serving.md).
HEAVY_CHECKS_SHARE = env_float("WEB_HEAVY_CHECKS_SHARE", 0.1)
# The most of a process's time one team's operator API calls take (the team their path names;
# the kill switch's own pool is never paced): as the agents' bulk calls, docs/serving.md.
OPERATOR_SHARE = env_float("WEB_OPERATOR_SHARE", 0.2)
# The most of a process's time one client address's sign-ins take once it is past
# THROTTLE_SIGN_IN_FAILURES_PER_ADDRESS or THROTTLE_SIGN_IN_CHECKS_PER_ADDRESS (each a password
# hash for a real account): paced as above; one that would wait over 10 s is answered 429.
SIGN_IN_SHARE = env_float("WEB_SIGN_IN_SHARE", 0.1)
# The operator API's own pool (SPEC 17, 21: an operator call never takes a check's thread).
OPERATOR_THREADS = env_int("WEB_OPERATOR_THREADS", 2)
# The operator API's backtests wait for their job on a pool of their own (the replay itself
# runs on the workers' bulk queue, as the dashboard's does): a backtest never holds a thread
# a kill switch or a policy save needs, and never spends a web process's CPU on the replay.
BACKTEST_API_THREADS = env_int("WEB_BACKTEST_THREADS", 2)
# The operator API's kill switch (engage, release) has a pool of its own too: no read, however
# many or slow, stands between an on-call and a switch (found by an attacker: 64 concurrent
# heavy reads of one viewer made another team's engage wait 2 to 4 s).
KILLSWITCH_API_THREADS = env_int("WEB_KILLSWITCH_THREADS", 2)
# One credential (an operator token, or a client without one) may hold at most this many of a
# process's operator threads at once; past it, 429 `too_many_requests`: the pool is shared by
# every team, so no one caller may take all of it.
OPERATOR_THREADS_PER_CREDENTIAL = env_int("WEB_OPERATOR_THREADS_PER_CREDENTIAL",
                                          max(1, OPERATOR_THREADS - 1))
# ...and one client address (TRUSTED_PROXIES applied) this many calls, running or queued, on
# those pools: many tokens of one client (or invalid ones, each a caller until its 401) hold
# no more than one busy automation needs.
OPERATOR_CALLS_PER_ADDRESS = env_int("WEB_OPERATOR_CALLS_PER_ADDRESS", 8)
# How long an operator API backtest waits for its job before answering 503 (the job goes on;
# its page in the dashboard shows the result).
BACKTEST_API_WAIT_SECONDS = env_int("BACKTEST_API_WAIT_SECONDS", 120)
# A request body must have arrived whole within this many seconds (it is read on the event
# loop, holding no thread): later, the request is answered 408 and its connection closed.
REQUEST_BODY_SECONDS = env_int("REQUEST_BODY_SECONDS", 10)
# Connections one source address may hold idle in one server process (sent nothing yet,
# headers unfinished, keep-alive between requests); beyond it the longest silent are closed
# (governance/connections.py). TRUSTED_PROXIES are exempt: a proxy carries many clients.
MAX_IDLE_CONNECTIONS_PER_ADDRESS = env_int("MAX_IDLE_CONNECTIONS_PER_ADDRESS", 100)
# Cheap answers (a failed authentication, a 404 under /api/, a health probe, an API call with
# no credential) one client address (TRUSTED_PROXIES applied) gets from one server process a
# second, after a burst of twice as many; the others are sent once their turn comes, waiting
# on the event loop (at most 10 s each), never refused (governance/pacing.py). A valid key's
# work is never paced.
CHEAP_ANSWERS_PER_ADDRESS = env_int("WEB_CHEAP_ANSWERS_PER_ADDRESS", 20)
# A check's `deadline_at` is the agent's clock: it may be this far behind the server's before
# its checks expire early (README "Deadlines"). Larger trusts poorly synced clocks more, and
# lets a check read that much past the agent's deadline still be decided.
CHECK_CLOCK_SKEW_MS = env_int("CHECK_CLOCK_SKEW_MS", 500)
# How long a check waits on PostgreSQL for its run's lock (and its ancestors'), held by
# another request of the run (a check, an upload of local decisions, a finish); past it the
# check answers 503 with Retry-After, nothing decided (SPEC 10: a lock wait on the check's
# path is bounded, never a thread held for seconds).
CHECK_LOCK_WAIT_MS = env_int("CHECK_LOCK_WAIT_MS", 1000)
if not 1 <= CHECK_LOCK_WAIT_MS <= 60_000:
    raise ImproperlyConfigured("CHECK_LOCK_WAIT_MS must be from 1 to 60000")
if not 0 <= CHECK_CLOCK_SKEW_MS <= 60_000:
    raise ImproperlyConfigured("CHECK_CLOCK_SKEW_MS must be from 0 to 60000")
# The most of one process's time the database looks of the live streams and of the approvals'
# waiting long polls may take together (runs/live/looks.py): however many are open, they share
# it, so screens refresh less often instead of taking CPU from the checks.
DASHBOARD_STREAM_SHARE = env_float("DASHBOARD_STREAM_SHARE", 0.2)
if not 0 < DASHBOARD_STREAM_SHARE <= 1:
    raise ImproperlyConfigured("DASHBOARD_STREAM_SHARE must be in (0, 1]")
if not 0 < AGENT_BULK_SHARE <= 1:
    raise ImproperlyConfigured("WEB_AGENT_BULK_SHARE must be in (0, 1]")
if not 0 < HEAVY_CHECKS_SHARE <= 1:
    raise ImproperlyConfigured("WEB_HEAVY_CHECKS_SHARE must be in (0, 1]")
if not 0 < OPERATOR_SHARE <= 1:
    raise ImproperlyConfigured("WEB_OPERATOR_SHARE must be in (0, 1]")
if not 0 < SIGN_IN_SHARE <= 1:
    raise ImproperlyConfigured("WEB_SIGN_IN_SHARE must be in (0, 1]")
if (REQUEST_BODY_SECONDS < 1 or API_THREADS < 1 or DASHBOARD_THREADS < 1
        or OPERATOR_THREADS < 1 or BACKTEST_API_THREADS < 1 or KILLSWITCH_API_THREADS < 1
        or OPERATOR_THREADS_PER_CREDENTIAL < 1 or OPERATOR_CALLS_PER_ADDRESS < 1
        or AGENT_BULK_THREADS < 1 or AGENT_BULK_THREADS_PER_CREDENTIAL < 1
        or AGENT_BULK_CALLS_PER_ADDRESS < 1
        or BACKTEST_API_WAIT_SECONDS < 1
        or MAX_IDLE_CONNECTIONS_PER_ADDRESS < 1 or CHEAP_ANSWERS_PER_ADDRESS < 1):
    raise ImproperlyConfigured(
        "REQUEST_BODY_SECONDS, the WEB_..._THREADS and WEB_..._PER_... settings, "
        "BACKTEST_API_WAIT_SECONDS and MAX_IDLE_CONNECTIONS_PER_ADDRESS must be at least 1")
# --- Kill-switch webhooks (runs/webhooks/delivery.py, policies/egress.py) ------------------
# Webhooks go to public addresses only; a receiver on an internal network must be listed here
# (host names as written in the URL, or addresses and CIDRs its name resolves to).
WEBHOOK_ALLOWED_HOSTS = env_list("WEBHOOK_ALLOWED_HOSTS", [])

# --- Dashboard live streams (docs/dashboard.md) --------------------------------------------
# A stream holds a server thread under WSGI, so it ends after this many seconds and the
# browser reconnects (resuming with Last-Event-ID).
DASHBOARD_STREAM_SECONDS = env_int("DASHBOARD_STREAM_SECONDS", 60)
# Live streams one signed-in person may hold open per server process (a page holds one or
# two); past it a stream ends at once and its browser retries a minute later.
DASHBOARD_STREAMS_PER_VIEWER = env_int("DASHBOARD_STREAMS_PER_VIEWER", 24)
# How often a stream looks at the database even without a wake-up (lost Redis messages,
# another process's change without Redis, the runs list's durations; a run page's Time
# counter ticks in the browser between its looks).
DASHBOARD_STREAM_LOOK_S = env_int("DASHBOARD_STREAM_LOOK_S", 2)
# A backstop: how often a run page's stream reads the whole page again (the settling of what
# is due, the run's tree, the layout's team-wide parts) even when its step looks found nothing
# that calls for it. Those read the run's new rows, its counters, the approvals count, the
# team's engaged switches and whether the run has a child, many pages in a few queries, and
# take a full look themselves when the run's state, deadline, tree or the banner's switches
# changed (docs/dashboard.md "How live updates work").
DASHBOARD_STREAM_FULL_LOOK_S = env_int("DASHBOARD_STREAM_FULL_LOOK_S", 300)
if DASHBOARD_STREAM_FULL_LOOK_S < DASHBOARD_STREAM_LOOK_S:
    raise ImproperlyConfigured("DASHBOARD_STREAM_FULL_LOOK_S must be at least "
                               "DASHBOARD_STREAM_LOOK_S")
# On PostgreSQL, how long one statement of a page's read (a GET) or of a stream's look may
# run before PostgreSQL cancels it (governance/deadlines.py); 0: no deadline.
DASHBOARD_STATEMENT_TIMEOUT_MS = env_int("DASHBOARD_STATEMENT_TIMEOUT_MS", 2000)
if DASHBOARD_STATEMENT_TIMEOUT_MS < 0:
    raise ImproperlyConfigured("DASHBOARD_STATEMENT_TIMEOUT_MS must be 0 (none) or more")

# --- Approval long polls (docs/approvals.md) ------------------------------------------------
# How many `GET /api/v1/approvals/{id}?wait=N` may wait at once in one server process, per
# agent key and per team; past either, a poll that would wait is answered 429 too_many_waits.
# The team's cap keeps one team's polls to a share of a worker's connections.
APPROVAL_WAITS_PER_KEY = env_int("APPROVAL_WAITS_PER_KEY", 100)
APPROVAL_WAITS_PER_TEAM = env_int("APPROVAL_WAITS_PER_TEAM", 500)
if APPROVAL_WAITS_PER_KEY < 1 or APPROVAL_WAITS_PER_TEAM < 1:
    raise ImproperlyConfigured("APPROVAL_WAITS_PER_KEY and APPROVAL_WAITS_PER_TEAM must be at "
                               "least 1")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # A 403 or 404 is a refusal, not a crash: one warning line, without Django's traceback.
    "filters": {"refusals": {"()": "governance.logfilters.RefusalsWithoutTraceback"}},
    # On the handler too, for the loggers below django.request: a request refused for its
    # Host header (django.security.DisallowedHost, 400) printed the whole traceback.
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["refusals"]}},
    "loggers": {"django.request": {"filters": ["refusals"]}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "WARNING")},
}
