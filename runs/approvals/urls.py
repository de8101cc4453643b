from django.urls import path

from runs.approvals import views

TEAM = "teams/<slug:slug>/"

urlpatterns = [
    path(TEAM + "approvals/", views.approvals_page, name="approvals"),
    path(TEAM + "approvals/stream", views.approvals_stream, name="approvals_stream"),
    path(TEAM + "approvals/<uuid:approval_id>/decide", views.approval_decide_view,
         name="approval_decide"),
]
