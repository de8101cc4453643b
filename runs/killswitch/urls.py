"""Kill switch screens, in the ``runs`` namespace like the dashboard's pages
(governance/urls.py)."""

from django.urls import path

from runs.killswitch import views

TEAM = "teams/<slug:slug>/"  # a team's pages are under its slug

urlpatterns = [
    path(TEAM + "killswitch/", views.killswitch_page, name="killswitch"),
    path(TEAM + "killswitch/stream", views.killswitch_stream, name="killswitch-stream"),
    path(TEAM + "killswitch/engage", views.killswitch_engage_view, name="killswitch-engage"),
    path(TEAM + "killswitch/release", views.killswitch_release_view, name="killswitch-release"),
    path(TEAM + "killswitch/webhook-test", views.webhook_test_view, name="webhook-test"),
    path(TEAM + "runs/<uuid:run_id>/kill", views.killswitch_run_view, name="killswitch-run"),
    path("killswitch/", views.killswitch_global_page, name="killswitch-global"),
    path("killswitch/engage", views.killswitch_global_engage, name="killswitch-global-engage"),
    path("killswitch/release", views.killswitch_global_release,
         name="killswitch-global-release"),
]
