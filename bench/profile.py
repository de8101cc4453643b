"""Where a check's CPU goes in a server worker: `python -m bench.profile`.

Runs checks in process through the ASGI application `manage.py serve` runs
(governance/asgi.py: the request made from an ASGI scope, the middleware, the view, the
answer sent as ASGI messages), against the benchmark's PostgreSQL database, with its thread
pools replaced by an executor that runs the work on the calling thread, so that one profiler
sees a whole check. What it leaves out is what no Python profiler sees: granian's Rust code,
the hand-offs between the event loop and the pool threads, the socket.

    python -m bench.profile                    # cProfile: the breakdown by layer
    python -m bench.profile --timing           # CPU per check only (process time)
    valgrind --tool=callgrind python -m bench.profile --timing --checks 100
                                               # instructions, stable on a loaded machine

Like the checks-only points of the benchmark: a few long runs, already started, each check
with distinct args, progress and result, so that no rule stops them.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import cProfile
import json
import pstats
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from . import agents as ag
from . import stack

# (label, how to find the function in the profile: file suffix, function name): parts of a
# check, by their cumulative CPU time.
VIEW = ("runs/check/api.py", "check_operation")
PARTS: list[tuple[str, str, str]] = [
    ("ASGI: the request object from the scope", "django/core/handlers/asgi.py",
     "create_request"),
    ("ASGI: the answer sent as messages", "django/core/handlers/asgi.py", "send_response"),
    ("Django: request_started, request_finished", "django/dispatch/dispatcher.py", "send"),
    ("Django: URL resolution", "django/urls/resolvers.py", "resolve"),
    ("check view: body parsed and validated (CheckIn)", "runs/check/api.py",
     "_check_payload"),
    ("check view: run_check (lock, rules, write)", "runs/check/services.py", "run_check"),
    ("  of which psycopg execute (both round trips)", "psycopg/cursor.py", "execute"),
    ("  of which rules.evaluate", "governance_client/rules.py", "evaluate"),
    ("check view: HttpResponse made", "django/http/response.py", "__init__"),
    ("check view: metrics", "runs/check/metrics.py", "check_answered"),
]


# The one chain every request ran before /api/ had its own (governance/settings.py).
ONE_CHAIN = [
    "governance.middleware.ApiJsonMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "governance.middleware.StaticFilesMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "governance.middleware.SecurityHeadersMiddleware",
    "governance.middleware.SignInThrottleMiddleware",
    "governance.middleware.JsonApiErrorsMiddleware",
]


class InlineExecutor(concurrent.futures.Executor):
    """Runs each submitted call at once on the calling thread (the event loop's)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting coroutine
            future.set_exception(exc)
        return future


class InlineFair:
    """A fair pool (governance/pools.py `FairPool`) that runs each job at once, on the calling
    thread: the pool's own lock is held while it starts a job, so its threads cannot be
    replaced by InlineExecutor (that hung the profile), and with one caller at a time there
    is nothing to be fair about."""

    def submit(self, caller: Any, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        return InlineExecutor().submit(job)

    def heavy(self, caller: Any) -> bool:
        """No caller's checks are paced here: the profile measures their work, not a wait."""
        return False


def _scope(method: str, path: str, token: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": method, "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {token}".encode()),
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
    }


async def call(app: Any, method: str, path: str, token: str, payload: Any
               ) -> tuple[int, bytes]:
    body = json.dumps(payload).encode()
    sent: list[dict[str, Any]] = []
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Future()  # the client stays: the disconnect listener waits
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(_scope(method, path, token, body), receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", type=int, default=2000, help="checks measured")
    parser.add_argument("--runs", type=int, default=32, help="runs they are spread over")
    parser.add_argument("--timing", action="store_true",
                        help="no profiler: print the process CPU time per check")
    parser.add_argument("--one-chain", action="store_true",
                        help="every middleware on every request, as before the API had a "
                             "chain of its own (the comparison of docs/performance.md)")
    parser.add_argument("--top", type=int, default=0,
                        help="also print the N functions of most own time")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import os

    os.environ.update(stack.base_env())
    # The pools' work runs on the event loop's thread here (InlineExecutor), on purpose:
    # Django's guard against database calls from async code would refuse it.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    stack.fresh_database()
    stack.manage("migrate", "--noinput", "-v0")
    stack.setup_django()
    if args.one_chain:
        from django.conf import settings

        settings.MIDDLEWARE = ONE_CHAIN

    from governance import asgi, pools

    from . import scenarios as sc

    for name in ("api", "dashboard"):
        pools._pools[name] = InlineExecutor()  # type: ignore[assignment]
        pools._fair[name] = InlineFair()  # type: ignore[assignment]
    sc.reset_runs()
    team = sc.seed_team("bench-profile", policy=sc.LONG_POLICY)
    app = asgi.application

    async def start_runs() -> list[str]:
        ids = []
        for i in range(args.runs):
            status, body = await call(app, "POST", "/api/v1/runs", team.token,
                                      {"agent": f"profile-{i}", "task": "profile"})
            assert status == 201, (status, body)
            ids.append(json.loads(body)["run_id"])
        return ids

    loop = asyncio.new_event_loop()
    run_ids = loop.run_until_complete(start_runs())
    seeds = [uuid.uuid4().hex for _ in run_ids]
    step = [0] * len(run_ids)

    async def checks(n: int) -> None:
        for k in range(n):
            r = k % len(run_ids)
            status, body = await call(app, "POST", f"/api/v1/runs/{run_ids[r]}/check",
                                      team.token, ag.long_body(seeds[r], step[r]))
            step[r] += 1
            if status != 200 or b'"allow"' not in body:
                raise SystemExit(f"check answered {status}: {body[:300]!r}")

    loop.run_until_complete(checks(min(200, args.checks)))  # warm: connections, statements
    if args.timing:
        started = time.process_time()
        loop.run_until_complete(checks(args.checks))
        spent = time.process_time() - started
        print(f"{args.checks} checks: {spent / args.checks * 1e6:.0f} us of CPU per check")
        return 0
    # CPU time, not wall time: a check's waits for PostgreSQL are not the worker's CPU, and
    # other processes on a loaded machine would otherwise count as the check's.
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    loop.run_until_complete(checks(args.checks))
    profiler.disable()
    report(pstats.Stats(profiler), args.checks, top=args.top)
    return 0


def _cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
    total = 0.0
    for (filename, _, function), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if function == name and filename.endswith(suffix):
            total = max(total, cumulative)
    return total


def _key(fn: Any) -> tuple[str, int, str]:
    code = fn.__code__
    return (code.co_filename, code.co_firstlineno, code.co_name)


def middleware_layers(stats: pstats.Stats) -> list[tuple[str, float]]:
    """(middleware class, seconds of its own work), outermost first, as configured.

    A class with its own ``__call__``: that call's cumulative time minus the time of the
    inner chain it called (Django wraps every layer's ``get_response`` in the ``inner`` of
    django/core/handlers/exception.py). A ``MiddlewareMixin`` class shares the mixin's
    ``__call__`` with the others, so its own work is its ``process_*`` hooks (the mixin's
    dispatch is reported apart)."""
    from django.conf import settings
    from django.core.handlers import exception
    from django.utils.deprecation import MiddlewareMixin
    from django.utils.module_loading import import_string

    rows: dict[tuple[str, int, str], Any] = stats.stats  # type: ignore[attr-defined]
    inner_key = next((k for k in rows if k[0] == exception.__file__ and k[2] == "inner"),
                     None)
    if inner_key is None:  # the check took the direct path (governance/direct.py): no chain
        return []
    inner_callers = rows[inner_key][4]
    found = []
    configured = [*settings.MIDDLEWARE, *getattr(settings, "API_MIDDLEWARE", [])]
    for path in dict.fromkeys(configured):
        cls = import_string(path)
        own = 0.0
        mro = [c for c in cls.__mro__ if c not in (object, MiddlewareMixin)]
        calls = [c.__dict__["__call__"] for c in mro if "__call__" in c.__dict__]
        if calls:
            own = rows.get(_key(calls[0]), (0, 0, 0, 0.0))[3]
            for fn in calls:
                own -= inner_callers.get(_key(fn), (0, 0, 0, 0.0))[3]
        else:
            for name in ("process_request", "process_view", "process_response"):
                fn = next((c.__dict__[name] for c in mro if name in c.__dict__), None)
                if fn is not None:
                    own += rows.get(_key(fn), (0, 0, 0, 0.0))[3]
        if own:
            found.append((path.rsplit(".", 1)[1], own))
    mixin = rows.get(_key(MiddlewareMixin.__call__), (0, 0, 0.0, 0.0))[2]
    found.append(("(MiddlewareMixin dispatch, every such layer)", mixin))
    return found


def report(stats: pstats.Stats, checks: int, *, top: int) -> None:
    per = 1e6 / checks
    whole = stats.total_tt  # type: ignore[attr-defined]
    print(f"{checks} checks through governance.asgi.application, cProfile (its overhead "
          f"inflates every figure alike; read the shares):")
    print(f"  {'whole check':58s} {whole * per:8.0f} us  100%")
    chain = (_cumulative(stats, "django/core/handlers/base.py", "get_response")
             - _cumulative(stats, "django/core/handlers/base.py", "_get_response"))
    print(f"  {'the middleware, all layers (get_response - _get_response)':58s} "
          f"{chain * per:8.0f} us  {chain / whole:4.0%}")
    print("  middleware, each layer's own cost (its __call__ minus the layers inside it):")
    view = _cumulative(stats, *VIEW)
    for name, own in middleware_layers(stats):
        print(f"    {name:56s} {own * per:8.0f} us  {own / whole:4.0%}")
    print(f"  {'view (the check operation)':58s} {view * per:8.0f} us  {view / whole:4.0%}")
    direct = _cumulative(stats, "governance/direct.py", "respond")
    if direct:  # the check's direct path: the middleware's work without the chain
        own = direct - view
        print(f"  {'direct path around the view (governance/direct.py)':58s} "
              f"{own * per:8.0f} us  {own / whole:4.0%}")
    for label, suffix, name in PARTS:
        value = _cumulative(stats, suffix, name)
        print(f"    {label:56s} {value * per:8.0f} us  {value / whole:4.0%}")
    if top:
        stats.sort_stats("cumulative").print_stats(top)
        stats.sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
