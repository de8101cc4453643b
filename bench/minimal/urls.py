from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [
    path("readyz", views.ready),
    path("runs/<str:run_id>/bare", views.bare),
    path("runs/<str:run_id>/durable", views.durable),
    path("runs/<str:run_id>/fast", views.fast_durable),
]
