"""The benchmark server's URLconf: the product's URLs plus the two baselines and an async
view (the shape of a long poll, for tests/test_availability.py).

Selected by `BENCH_URLCONF=bench.urls`, which only the benchmark sets on the server it starts;
production URLs (governance/urls.py) never include these endpoints. They sit under /api/ so
the same middleware runs for them as for the real check.
"""

from __future__ import annotations

from django.urls import include, path

from . import views

urlpatterns = [
    path("api/bench/runs/<str:run_id>/bare", views.bare, name="bench-bare"),
    path("api/bench/runs/<str:run_id>/durable", views.durable, name="bench-durable"),
    path("api/bench/runs/<str:run_id>/fast", views.fast_durable, name="bench-fast"),
    path("api/bench/runs/<str:run_id>/fast-auth", views.fast_auth, name="bench-fast-auth"),
    path("api/bench/runs/<str:run_id>/fast-valid", views.fast_valid, name="bench-fast-valid"),
    path("api/bench/wait", views.wait, name="bench-wait"),
    path("", include("governance.urls")),
]
