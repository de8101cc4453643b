from django.urls import include, path

from runs.check.api import api
from runs.check.metrics import metrics_view

from . import views

urlpatterns = [
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("api/v1/", api.urls),
    path("", include("runs.killswitch.urls")),
    path("", include("runs.dashboard.urls")),
    path("", include("policies.urls")),
]
