from django.urls import path

from . import views

T = "teams/<slug:slug>/"

urlpatterns = [
    path(T + "policies/<slug:name>/backtest", views.backtest_policy, name="backtest_policy"),
    path(T + "policies-import/backtest", views.backtest_import, name="backtest_import"),
    path(T + "backtests/<uuid:job_id>/", views.backtest_detail, name="backtest"),
]
