from django.urls import include, path

from operator_api.api import mount as mount_operator_api
from runs.approvals import urls as approvals_urls
from runs.check.api import api
from runs.check.metrics import metrics_view
from runs.dashboard import urls as dashboard_urls
from runs.killswitch import urls as killswitch_urls

from . import views

# The operator API (SPEC 17) joins the agent API's document before its URLs are made.
mount_operator_api(api)

urlpatterns = [
    path("favicon.ico", views.favicon, name="favicon"),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("api/v1/", api.urls),
    # Every page of the runs app, the dashboard's and the kill switch's, in one namespace.
    path("", include(([*killswitch_urls.urlpatterns, *dashboard_urls.urlpatterns,
                        *approvals_urls.urlpatterns], "runs"))),
    path("", include("policies.urls")),
    path("", include("backtests.urls")),
]

handler400 = "policies.views.bad_request"
handler403 = "policies.views.permission_denied"
