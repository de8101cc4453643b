"""The dashboard's run pages, in the ``runs`` namespace (governance/urls.py)."""

from django.urls import path

from runs.dashboard import views

urlpatterns = [
    path("teams/<slug:slug>/", views.overview, name="overview"),
    path("teams/<slug:slug>/stream", views.overview_stream, name="overview_stream"),
    path("teams/<slug:slug>/live", views.team_stream, name="team_stream"),
    path("teams/<slug:slug>/runs/", views.runs_list, name="runs"),
    path("teams/<slug:slug>/runs/stream", views.runs_stream, name="runs_stream"),
    path("teams/<slug:slug>/runs/<uuid:run_id>/", views.run_detail, name="run"),
    path("teams/<slug:slug>/runs/<uuid:run_id>/timeline", views.run_timeline,
         name="run_timeline"),
    path("teams/<slug:slug>/runs/<uuid:run_id>/stream", views.run_stream, name="run_stream"),
]
