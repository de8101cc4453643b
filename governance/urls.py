from django.urls import include, path

from runs.api import api

from . import views

urlpatterns = [
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("api/v1/", api.urls),
    path("", include("runs.killswitch_urls")),
    path("", include("runs.urls")),
    path("", include("policies.urls")),
]
