"""Kill switch screens. Their own URL module (and the ``runs`` namespace) so the run pages'
module can change without touching these: the run page links to ``runs:killswitch-run``."""

from django.urls import path

from runs.killswitch import views

app_name = "runs"

T = "teams/<slug:slug>/"

urlpatterns = [
    path(T + "killswitch/", views.killswitch_page, name="killswitch"),
    path(T + "killswitch/engage", views.killswitch_engage_view, name="killswitch-engage"),
    path(T + "killswitch/release", views.killswitch_release_view, name="killswitch-release"),
    path(T + "runs/<uuid:run_id>/kill", views.killswitch_run_view, name="killswitch-run"),
    path("killswitch/", views.killswitch_global_page, name="killswitch-global"),
    path("killswitch/engage", views.killswitch_global_engage, name="killswitch-global-engage"),
    path("killswitch/release", views.killswitch_global_release,
         name="killswitch-global-release"),
]
