from django.contrib.auth import views as auth_views
from django.urls import path

from . import sso_views, views

TEAM = "teams/<slug:slug>/"  # a team's pages are under its slug

urlpatterns = [
    path("", views.home, name="home"),
    path("accounts/login/", sso_views.SignInView.as_view(), name="login"),
    # Single sign-on (SPEC 17, docs/sso.md): 404 while OIDC_ISSUER is unset.
    path("accounts/sso/login/", sso_views.SsoLoginView.as_view(), name="sso_login"),
    path("accounts/sso/callback/", sso_views.sso_callback, name="sso_callback"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    # An invitation link (policies.services.member_invite) has a password-reset link's shape.
    path("accounts/reset/<uidb64>/<token>/", views.InvitationView.as_view(),
         name="password_reset_confirm"),
    path("accounts/reset/done/", auth_views.PasswordResetCompleteView.as_view(),
         name="password_reset_complete"),
    path("accounts/password/", auth_views.PasswordChangeView.as_view(),
         name="password_change"),
    path("accounts/password/done/", auth_views.PasswordChangeDoneView.as_view(),
         name="password_change_done"),
    path("accounts/tokens/", views.operator_tokens, name="operator_tokens"),
    path("accounts/tokens/<int:token_id>/revoke", views.operator_token_revoke,
         name="operator_token_revoke"),
    path(TEAM + "policies/", views.policies, name="policies"),
    path(TEAM + "policies.yaml", views.policies_export, name="policies_export"),
    path(TEAM + "policies-import", views.policies_import, name="policies_import"),
    path(TEAM + "policies-new", views.policy_new, name="policy_new"),
    # The inline validation of a policy not saved yet: at an address of its own, since any
    # word in the place of a name below is a policy's name ("-" too).
    path(TEAM + "policies-new/validate", views.policy_validate, {"name": None},
         name="policy_new_validate"),
    path(TEAM + "policies/<slug:name>/", views.policy_detail, name="policy"),
    path(TEAM + "policies/<slug:name>/save", views.policy_save_view, name="policy_save"),
    path(TEAM + "policies/<slug:name>/validate", views.policy_validate, name="policy_validate"),
    path(TEAM + "policies/<slug:name>/history", views.policy_history, name="policy_history"),
    path(TEAM + "policies/<slug:name>/restore/<int:version>", views.policy_restore,
         name="policy_restore"),
    path(TEAM + "keys/", views.keys, name="keys"),
    path(TEAM + "keys/<int:key_id>/revoke", views.key_revoke, name="key_revoke"),
    path(TEAM + "members/", views.members, name="members"),
    path(TEAM + "members/invite", views.member_invite_view, name="member_invite"),
    path(TEAM + "members/invitations/<int:invitation_id>/cancel", views.invitation_cancel_view,
         name="invitation_cancel"),
    path(TEAM + "members/<int:membership_id>/role", views.member_role, name="member_role"),
    path(TEAM + "members/<int:membership_id>/remove", views.member_remove, name="member_remove"),
    path(TEAM + "settings/", views.team_settings, name="team_settings"),
    path(TEAM + "settings/webhook-secret", views.webhook_secret_rotate,
         name="webhook_secret_rotate"),
    path(TEAM + "settings/webhook-secret/show", views.webhook_secret_show,
         name="webhook_secret_show"),
    path(TEAM + "audit/", views.audit_log, name="audit"),
]
