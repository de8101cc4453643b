"""Dashboard screens for people (SPEC section 7): home, policies, keys, members, team settings,
the operator audit log. Every team view goes through `team_view(Role.X)`: outsiders get 404, a
role too low gets 403. Reads are in selectors, writes in services; views only translate."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.tokens import default_token_generator
from django.contrib.auth.views import INTERNAL_RESET_SESSION_TOKEN, PasswordResetConfirmView
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.text import slugify
from django.views.decorators.http import require_http_methods, require_POST, require_safe

from governance.web import page

from . import impact, selectors, tokens
from .access import can, team_view, teams_of
from .document import (
    MAX_DOCUMENT_BYTES,
    DocumentError,
    default_policy,
    denies_every_tool,
    parse_document,
)
from .egress import masked_url
from .forms import (
    FIELD_PATHS,
    ImportForm,
    KeyForm,
    MemberAddForm,
    MemberInviteForm,
    MemberRoleForm,
    OperatorReleaseForm,
    OperatorTokenForm,
    PolicyForm,
    WebhookForm,
)
from .models import Invitation, Policy, Role
from .services import (
    LastAdmin,
    agent_key_create,
    agent_key_revoke,
    invitation_accept,
    invitation_cancel,
    invitation_tokens,
    member_invite,
    membership_remove,
    membership_set,
    policy_apply,
    policy_save,
    team_rotate_webhook_secret,
    team_set_operator_release,
    team_show_webhook_secret,
    team_update_webhook,
    webhook_secret_id,
)

NEW_TOKEN_SESSION_KEY = "dashboard:new-agent-token"
NEW_SECRET_SESSION_KEY = "dashboard:new-webhook-secret"
INVITATION_SESSION_KEY = "dashboard:new-invitation"
# A policy's history page lists its newest versions (without their documents); any two can
# still be compared by number. A CI job saving often makes thousands.
HISTORY_LISTED = 100


def permission_denied(request: HttpRequest, exception: Exception | None = None
                      ) -> HttpResponse:
    """The 403 page inside the layout: the team's navigation stays (team_view leaves the team
    on the request before refusing), so a refused person can go on with what they may do."""
    return page(request, "403.html", {"exception": str(exception or "")}, status=403)


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """The 400 page, saying what was wrong where a person can act on it: a form past Django's
    upload limit (a policy pasted into the Import page, say) was a bare "Bad Request (400)"
    before. Outside the layout: such a request is refused before it has a user."""
    if isinstance(exception, RequestDataTooBig):
        mib = settings.DATA_UPLOAD_MAX_MEMORY_SIZE / (1024 * 1024)
        kib = MAX_DOCUMENT_BYTES // 1024
        message = (f"The form sent more than {mib:g} MiB, more than a page reads at once. "
                   f"A policy document may be at most {kib} KiB: choose it as a file on "
                   "the Import page instead of pasting it.")
    else:
        message = "The request could not be read. Go back and try again."
    return render(request, "400.html", {"message": message}, status=400)


@require_safe
@login_required
def home(request: HttpRequest) -> HttpResponse:
    teams = teams_of(request.user)
    if len(teams) == 1:
        return redirect("runs:overview", slug=teams[0].slug)
    return page(request, "home.html", {"team_list": teams})


# --- Policies ----------------------------------------------------------------------------------

@team_view(Role.VIEWER)
@require_safe
def policies(request: HttpRequest, slug: str) -> HttpResponse:
    # How many running runs keep an older version is the runs app's to say: its template tag.
    return page(request, "policies/list.html", {"policies": selectors.policies_of(request.team)})


def _editor(request: HttpRequest, policy: Policy | None, form: PolicyForm, *,
            status: int = 200, impacts: list[impact.Impact] | None = None,
            confirm_token: str = "") -> HttpResponse:
    return page(request, "policies/edit.html", {
        "policy": policy,
        "form": form,
        # A refused save names its fields at the top of the long form, each a link to its
        # error (found by a newcomer: the page reloaded at the top with nothing to say so).
        "error_fields": [(name, form[name].label) for name in form.errors
                         if name in form.fields],
        "field_paths": FIELD_PATHS,
        "impacts": impacts or [], "confirm_token": confirm_token,
        "confirm_field": impact.CONFIRM_FIELD,
    }, status=status)


@team_view(Role.VIEWER)
@require_safe
def policy_detail(request: HttpRequest, slug: str, name: str) -> HttpResponse:
    policy = selectors.policy_of(request.team, name)
    form = PolicyForm(initial=PolicyForm.initial_from(policy.current.document),
                      fixed_name=policy.name)
    return _editor(request, policy, form)


@team_view(Role.ADMIN)
@require_http_methods(["GET", "HEAD", "POST"])
def policy_save_view(request: HttpRequest, slug: str, name: str) -> HttpResponse:
    policy = selectors.policy_of(request.team, name)
    if request.method != "POST":
        # A refused save leaves this address in the browser's bar (its page is the POST's
        # answer): entered again or bookmarked, it opens the editor, not a 405 (found by a
        # newcomer).
        return redirect("policy", slug=slug, name=policy.name)
    form = PolicyForm(request.POST, fixed_name=policy.name)
    if form.is_valid() and not form.cleaned_data["note"]:
        form.add_error("note", "Say what changed and why: the note is shown in the history.")
    if not form.is_valid():
        return _editor(request, policy, form, status=422)
    # A draft that would stop most recent runs at once is saved only once confirmed, with
    # the backtest's numbers in front of whoever confirms (docs/policies.md).
    impacts, token = impact.stop_confirmation(request.team, [form.normalized],
                                              request.POST.get(impact.CONFIRM_FIELD))
    if impacts:
        return _editor(request, policy, form, status=422, impacts=impacts, confirm_token=token)
    version = policy_save(team=request.team, document=form.normalized, actor=request.user,
                          source="dashboard", note=form.cleaned_data["note"])
    if version is None:
        messages.info(request, "Nothing changed: no new version.")
    else:
        messages.success(request, f"Saved {policy.name} as version {version.version}. New runs "
                                  "use it; running runs keep the version they started with.")
    return redirect("policy", slug=slug, name=policy.name)


@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def policy_new(request: HttpRequest, slug: str) -> HttpResponse:
    if request.method == "POST":
        form = PolicyForm(request.POST)
        if form.is_valid() and Policy.objects.filter(team=request.team,
                                                     name=form.normalized["name"]).exists():
            form.add_error("name", "a policy with this name already exists")
        if not form.is_valid():
            return _editor(request, None, form, status=422)
        try:
            policy_save(team=request.team, document=form.normalized, actor=request.user,
                        source="dashboard", note=form.cleaned_data["note"] or "created")
        except DocumentError as exc:  # the team's cap on policies
            form.add_error("name", exc.errors.get("name", str(exc)))
            return _editor(request, None, form, status=422)
        messages.success(request, f"Created policy {form.normalized['name']}.")
        return redirect("policy", slug=slug, name=form.normalized["name"])
    initial = PolicyForm.initial_from(default_policy("new-policy"))
    initial["name"] = ""
    return _editor(request, None, PolicyForm(initial=initial))


@team_view(Role.ADMIN)
@require_POST
def policy_validate(request: HttpRequest, slug: str, name: str | None) -> HttpResponse:
    """Inline validation for htmx: the field errors of the form as it stands, as out-of-band
    swaps into each field's error slot, so the inputs (and the caret) are left alone."""
    fixed = None if name is None else selectors.policy_of(request.team, name).name
    form = PolicyForm(request.POST, fixed_name=fixed)
    form.is_valid()
    return render(request, "policies/_validation.html", {
        "form": form,
        # Saving an existing policy needs a note (policy_save_view): say so before the save
        # is refused for it.
        "needs_note": fixed is not None and not form.errors and not form.cleaned_data["note"],
        # Every error slot of this editor (an existing policy's has no name field), the
        # note's too: it clears what a refused save left there (the note is checked on save).
        "slots": [(field, form.errors.get(field, [])) for field in (*FIELD_PATHS, "note")
                  if field != "name" or fixed is None],
    })


@team_view(Role.VIEWER)
@require_safe
def policy_history(request: HttpRequest, slug: str, name: str) -> HttpResponse:
    policy = selectors.policy_of(request.team, name)
    versions, more = selectors.versions_of(policy, limit=HISTORY_LISTED, documents=False)
    b = selectors.version_of(policy, request.GET.get("b")) or policy.current
    a = (selectors.version_of(policy, request.GET.get("a")) if request.GET.get("a")
         else selectors.version_before(policy, b))
    diff = selectors.yaml_diff(
        a.document if a else None, b.document,
        before_label=f"version {a.version}" if a else "(nothing)",
        after_label=f"version {b.version}",
    )
    return page(request, "policies/history.html", {
        "policy": policy, "versions": versions, "more": more, "listed": HISTORY_LISTED,
        "a": a, "b": b, "diff": diff,
    })


@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def policy_restore(request: HttpRequest, slug: str, name: str, version: int) -> HttpResponse:
    """Restore an old version: a new version equal to it (history is only added to). Like a
    save it asks first: the change it makes (the diff from the current version), a note, a
    backtest of the old version on recent runs, and a deny-every-tool version said out loud;
    a restore was one click with none of these."""
    policy = selectors.policy_of(request.team, name)
    old = selectors.version_of(policy, version)
    if old is None:
        raise Http404("No such version.")
    if old.document == policy.current.document:
        messages.info(request, f"Version {old.version} is what {policy.name} already says: "
                               "no new version.")
        return redirect("policy_history", slug=slug, name=policy.name)
    errors: dict[str, str] = {}
    impacts: list[impact.Impact] = []
    token = ""
    note = (request.POST.get("note") or "").strip()[:400]
    denies_all = denies_every_tool(old.document["tools"].get("allow"),
                                   old.document["tools"].get("deny") or [])
    if request.method == "POST":
        if not note:
            errors["note"] = "Say why you restore it: the note is shown in the history."
        if denies_all and not request.POST.get("deny_every_tool"):
            errors["deny_every_tool"] = ("Tick \"Deny every tool\" to restore it: every action "
                                         "of every run would be stopped.")
        if not errors:
            impacts, token = impact.stop_confirmation(request.team, [old.document],
                                                      request.POST.get(impact.CONFIRM_FIELD))
            if impacts:
                errors[impact.CONFIRM_FIELD] = "Confirm that it may stop these runs."
        if not errors:
            restored = policy_save(team=request.team, document=old.document,
                                   actor=request.user, source="restore",
                                   note=f"restored version {old.version}: {note}")
            messages.success(request, f"Restored version {old.version} as version "
                                      f"{restored.version if restored else old.version}. "
                                      "New runs use it.")
            return redirect("policy_history", slug=slug, name=policy.name)
    return page(request, "policies/restore.html", {
        "policy": policy, "old": old, "note": note, "errors": errors,
        "impacts": impacts, "confirm_token": token, "confirm_field": impact.CONFIRM_FIELD,
        "denies_all": denies_all,
        "diff": selectors.yaml_diff(policy.current.document, old.document,
                                    before_label=f"version {policy.current.version} (current)",
                                    after_label=f"version {old.version}"),
        # The backtest panel posts the old version as the editor's fields (backtests app).
        "fields": PolicyForm.initial_from(old.document),
    }, status=422 if errors else 200)


@team_view(Role.VIEWER)
@require_safe
def policies_export(request: HttpRequest, slug: str) -> HttpResponse:
    response = HttpResponse(selectors.team_yaml(request.team,
                                                reveal=can(request.role, Role.ADMIN)),
                            content_type="application/yaml; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{slugify(slug)}-policies.yaml"'
    return response


def _foreign_slugs(data: Any, slug: str) -> dict[str, str]:
    """Errors for every team of the document that is not this one: an import here may only
    change this team, whatever the importing admin may do elsewhere."""
    errors: dict[str, str] = {}
    teams = data.get("teams") if isinstance(data, dict) else None
    if isinstance(teams, list):
        for i, entry in enumerate(teams):
            other = entry.get("slug") if isinstance(entry, dict) else None
            if other != slug:
                errors[f"teams[{i}].slug"] = f"this import is for team {slug!r} only"
    return errors


@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def policies_import(request: HttpRequest, slug: str) -> HttpResponse:
    form = ImportForm(request.POST or None, request.FILES or None)
    errors: dict[str, str] = {}
    changes: list[str] | None = None
    impacts: list[impact.Impact] = []
    token = ""
    if request.method == "POST" and form.is_valid():
        try:
            data = form.data_of()
        except forms.ValidationError as exc:
            form.add_error(None, exc)
        else:
            errors = _foreign_slugs(data, slug)
            if not errors:
                try:
                    # The policies it would change, checked like a save's before anything is
                    # applied (the document names this team only, or nothing).
                    drafts = [policy for entry in parse_document(data)
                              for policy in entry["policies"]]
                    impacts, token = impact.stop_confirmation(
                        request.team, drafts, request.POST.get(impact.CONFIRM_FIELD))
                    if not impacts:
                        changes = policy_apply(data=data, actor=request.user, source="import")
                except DocumentError as exc:
                    errors = exc.errors
    if changes is not None:
        messages.success(request, "Imported: " + ("; ".join(changes) or "nothing changed."))
        return redirect("policies", slug=slug)
    status = 422 if request.method == "POST" else 200
    return page(request, "policies/import.html", {
        "form": form, "errors": sorted(errors.items()),
        "example": selectors.team_yaml(request.team, reveal=can(request.role, Role.ADMIN)),
        "impacts": impacts, "confirm_token": token, "confirm_field": impact.CONFIRM_FIELD,
        # A file is not sent again by the browser: the confirmation needs it chosen again.
        "uploaded": bool(request.FILES.get("file")),
    }, status=status)


# --- Agent keys ------------------------------------------------------------------------------

@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def keys(request: HttpRequest, slug: str) -> HttpResponse:
    form = KeyForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        new = agent_key_create(team=request.team, name=form.cleaned_data["name"],
                               agent=form.cleaned_data["agent"] or "", actor=request.user)
        # Shown once on the next page, then gone: the session keeps it for one redirect only.
        request.session[NEW_TOKEN_SESSION_KEY] = {"token": new.token, "name": new.key.name}
        return redirect("keys", slug=slug)
    return page(request, "policies/keys.html", {
        "form": form,
        "keys": selectors.keys_of(request.team),
        "new_token": request.session.pop(NEW_TOKEN_SESSION_KEY, None),
    }, status=422 if request.method == "POST" else 200)


@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def key_revoke(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    """GET asks to confirm (what stops working, for whom); POST revokes."""
    key = selectors.key_of(request.team, key_id)
    if request.method == "GET":
        return page(request, "policies/confirm.html", {
            "title": f"Revoke key {key.name}?",
            "effect": "Agents using this key get 401 from their next request; runs they "
                      "started stay as they are. A revoked key cannot be restored.",
            "detail": f"gov_{key.prefix}_… · agent {key.agent or 'any'}",
            "action": request.path, "button": "Revoke the key",
            "cancel": reverse("keys", args=[slug]),
        })
    agent_key_revoke(key=key, actor=request.user)
    messages.success(request, f"Revoked key {key.name}: agents using it get 401 from now on.")
    return redirect("keys", slug=slug)


# --- Members and team settings -----------------------------------------------------------------

def _members_page(request: HttpRequest, form: MemberAddForm, *, status: int = 200,
                  invite: MemberInviteForm | None = None) -> HttpResponse:
    return page(request, "policies/members.html", {
        "form": form, "members": selectors.members_of(request.team), "roles": Role.choices,
        "invitations": selectors.invitations_of(request.team),
        "invite_form": invite or MemberInviteForm(),
        "invitation": request.session.pop(INVITATION_SESSION_KEY, None),
        "sso_only": _sso_only(),
    }, status=status)


def _sso_only() -> bool:
    """Whether people other than superusers sign in with SSO only (OIDC_PASSWORD_LOGIN not
    ``all``): an invitation then never sets a password, which could not sign in."""
    return settings.OIDC_PASSWORD_LOGIN != "all"


@team_view(Role.ADMIN)
@require_POST
def member_invite_view(request: HttpRequest, slug: str) -> HttpResponse:
    """Invite a person: a one-time link, shown once to the admin, who passes it on. The same
    answer whether the username has an account or not (policies.services.member_invite)."""
    invite = MemberInviteForm(request.POST)
    if invite.is_valid():
        try:
            invitation = member_invite(team=request.team, username=invite.cleaned_data["username"],
                                       role=invite.cleaned_data["role"], actor=request.user)
        except ValueError as exc:
            invite.add_error("username", str(exc))
        else:
            request.session[INVITATION_SESSION_KEY] = {
                "username": invitation.user.get_username(),
                "link": request.build_absolute_uri(invitation.path)}
            return redirect("members", slug=slug)
    return _members_page(request, MemberAddForm(), status=422, invite=invite)


@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def members(request: HttpRequest, slug: str) -> HttpResponse:
    form = MemberAddForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = selectors.addable_user(request.user, form.cleaned_data["username"])
        if user is None:
            # Also for an account of another team: saying it exists would tell this admin
            # who another team's people are.
            form.add_error("username", "No active user you may add has this username: "
                                       "invite them instead.")
        elif request.team.memberships.filter(user=user).exists():
            form.add_error("username", "Already a member: change the role in the list.")
        else:
            membership_set(team=request.team, user=user, role=form.cleaned_data["role"],
                           actor=request.user)
            messages.success(request, f"Added {user.get_username()}.")
            return redirect("members", slug=slug)
    return _members_page(request, form, status=422 if request.method == "POST" else 200)


@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def invitation_cancel_view(request: HttpRequest, slug: str, invitation_id: int) -> HttpResponse:
    """GET asks to confirm; POST withdraws the invitation (its link stops working)."""
    invitation = selectors.invitation_of(request.team, invitation_id)
    name = invitation.user.get_username()
    if request.method == "GET":
        return page(request, "policies/confirm.html", {
            "title": f"Cancel the invitation of {name}?",
            "effect": "Its link stops working; nobody joins the team through it.",
            "detail": f"role: {invitation.role}",
            "action": request.path, "button": "Cancel the invitation",
            "cancel": reverse("members", args=[slug]),
        })
    invitation_cancel(invitation=invitation, actor=request.user)
    messages.success(request, f"Cancelled the invitation of {name}.")
    return redirect("members", slug=slug)


SSO_ONLY_INVITATION = ("People sign in here with single sign-on, not with a password: sign "
                       "in with SSO, then open this link again to join.")


class InvitationView(PasswordResetConfirmView):
    """An invitation's link (policies.services.member_invite), at the password-reset URL:
    ``uidb64`` is the invitation's key. Its first page is the same for both kinds of
    invitation, "choose a password". A new account joins by choosing one; an account that
    exists is never given a password here: its owner signs in and opens the link again,
    and confirms."""

    invitation: Invitation | None = None

    @property
    def token_generator(self) -> Any:  # type: ignore[override]
        if self.invitation is None:
            return default_token_generator
        return invitation_tokens(self.invitation)

    def get_user(self, uidb64: str) -> Any:
        self.invitation = selectors.invitation_by_key(uidb64)
        if self.invitation is None:
            # A link made before invitations had keys names its new account's id; it works
            # as it did, until its PASSWORD_RESET_TIMEOUT is over.
            return super().get_user(uidb64)
        return self.invitation.user

    def _joining(self) -> Invitation | None:
        """The invitation, when its existing account's owner, signed in, opened the link."""
        invitation = self.invitation
        if invitation is not None and not invitation.new_account \
                and self.request.user.pk == invitation.user_id:
            return invitation
        return None

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["sign_in"] = f"{reverse('login')}?{urlencode({'next': self.request.path})}"
        context["sso_only"] = _sso_only()
        # Whom and what the link is for, the same words for both kinds of invitation: the
        # holder is the invitee (found by a newcomer: the page asked for a password and the
        # next one said "sign in with your username", which no page had named).
        context["invitation"] = self.invitation if context.get("validlink") else None
        return context

    def get(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        invitation = self._joining()
        if invitation is not None:
            return page(request, "policies/invitation.html", {"invitation": invitation})
        return super().get(request, *args, **kwargs)

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        invitation = self._joining()
        if invitation is not None:
            if invitation_accept(invitation=invitation):
                request.session.pop(INTERNAL_RESET_SESSION_TOKEN, None)
                messages.success(request, f"You joined {invitation.team.name} as "
                                          f"{invitation.role}.")
            return redirect("runs:overview", slug=invitation.team.slug)
        return super().post(request, *args, **kwargs)

    def form_valid(self, form: Any) -> HttpResponse:
        invitation = self.invitation
        if _sso_only():
            # The same words for both kinds of invitation (the first page's rule): a password
            # set here could not sign in (found by a platform engineer: "Sign in with your
            # username and this password", then the sign-in refused it).
            form.add_error(None, SSO_ONLY_INVITATION)
            return self.form_invalid(form)
        if invitation is not None and not invitation.new_account:
            name = invitation.user.get_username()
            form.add_error(None, f"{name} has a password already: sign in as {name}, then "
                                 "open your link again to join.")
            return self.form_invalid(form)
        response = super().form_valid(form)
        if invitation is not None:
            invitation_accept(invitation=invitation)
        return response


@team_view(Role.ADMIN)
@require_POST
def member_role(request: HttpRequest, slug: str, membership_id: int) -> HttpResponse:
    membership = selectors.membership_of(request.team, membership_id)
    form = MemberRoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose viewer, operator or admin.")
    else:
        try:
            membership_set(team=request.team, user=membership.user,
                           role=form.cleaned_data["role"], actor=request.user)
        except LastAdmin as refused:
            messages.error(request, str(refused))
        else:
            messages.success(request, f"{membership.user.get_username()} is now "
                                      f"{form.cleaned_data['role']}.")
    return redirect("members", slug=slug)


@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def member_remove(request: HttpRequest, slug: str, membership_id: int) -> HttpResponse:
    """GET asks to confirm; POST removes."""
    membership = selectors.membership_of(request.team, membership_id)
    if request.method == "GET":
        name = membership.user.get_username()
        return page(request, "policies/confirm.html", {
            "title": f"Remove {name} from {request.team.name}?",
            "effect": f"{name} loses access to this team's runs, policies and controls at "
                      "once; their account and their other teams are untouched.",
            "detail": f"role: {membership.role}",
            "action": request.path, "button": f"Remove {name}",
            "cancel": reverse("members", args=[slug]),
        })
    try:
        membership_remove(membership=membership, actor=request.user)
    except LastAdmin as refused:
        messages.error(request, str(refused))
    else:
        messages.success(request, f"Removed {membership.user.get_username()}.")
    return redirect("members", slug=slug)


@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def team_settings(request: HttpRequest, slug: str) -> HttpResponse:
    # Two forms on one page; the submit button's name says which was sent.
    release_sent = request.method == "POST" and "operator_release" in request.POST
    form = WebhookForm(request.POST if request.method == "POST" and not release_sent else None,
                       initial={"webhook_url": request.team.webhook_url or ""})
    release = OperatorReleaseForm(request.POST if release_sent else None,
                                  initial={"operator_release": request.team.operator_release})
    if release_sent and release.is_valid():
        changed = team_set_operator_release(
            team=request.team, value=release.cleaned_data["operator_release"],
            actor=request.user)
        messages.success(request, "Kill switch release saved." if changed else "Nothing changed.")
        return redirect("team_settings", slug=slug)
    if request.method == "POST" and not release_sent and form.is_valid():
        changed = team_update_webhook(team=request.team,
                                      webhook_url=form.cleaned_data["webhook_url"],
                                      actor=request.user)
        saved = form.cleaned_data["webhook_url"]
        typed = (request.POST.get("webhook_url") or "").strip()
        # Said when what was saved is not what was typed (found by a newcomer:
        # "example.com/hook" was saved as https://example.com/hook without a word).
        messages.success(request, "Nothing changed." if not changed else (
            f"Webhook saved as {saved}." if saved and saved != typed else "Webhook saved."))
        return redirect("team_settings", slug=slug)
    return page(request, "policies/settings.html", {
        "form": form,
        "release_form": release,
        "secret_id": webhook_secret_id(request.team.webhook_secret),
        "secret_shown_at": request.team.webhook_secret_shown_at,
        "new_secret": request.session.pop(NEW_SECRET_SESSION_KEY, None),
    }, status=422 if request.method == "POST" else 200)


@team_view(Role.ADMIN)
@require_http_methods(["GET", "POST"])
def webhook_secret_rotate(request: HttpRequest, slug: str) -> HttpResponse:
    """GET asks to confirm (receivers must switch); POST rotates and shows the secret once."""
    if request.method == "GET":
        return page(request, "policies/confirm.html", {
            "title": "Rotate the webhook signing secret?",
            "effect": "Every webhook from now on, retries of pending ones included, is signed "
                      "with a new secret, shown to you once. Receivers that verify with the "
                      "old one reject them until they are given the new one.",
            "detail": f"current secret: {webhook_secret_id(request.team.webhook_secret)}",
            "action": request.path, "button": "Rotate the secret",
            "cancel": reverse("team_settings", args=[slug]),
        })
    secret = team_rotate_webhook_secret(team=request.team, actor=request.user)
    # Shown once on the next page, then gone, like a new key's token.
    request.session[NEW_SECRET_SESSION_KEY] = {"secret": secret, "id": webhook_secret_id(secret),
                                               "new": True}
    return redirect("team_settings", slug=slug)


@team_view(Role.ADMIN)
@require_POST
def webhook_secret_show(request: HttpRequest, slug: str) -> HttpResponse:
    """Shows the current secret once if nobody has seen it yet (the one the team was made
    with), the same way a rotated one is shown; nothing changes for receivers."""
    secret = team_show_webhook_secret(team=request.team, actor=request.user)
    if secret is None:
        messages.error(request, "This secret was already shown once; rotate it to get a new "
                                "one.")
    else:
        request.session[NEW_SECRET_SESSION_KEY] = {"secret": secret,
                                                   "id": webhook_secret_id(secret),
                                                   "new": False}
    return redirect("team_settings", slug=slug)


# --- Operator audit log --------------------------------------------------------------------------

def _detail_items(action: str, detail: Any, admin: bool) -> list[tuple[str, str]]:
    """An event's detail as key=value pairs, each value as JSON (what the API would show, not
    Python's repr), with webhook URLs masked for everyone but admins (their credentials):
    `team.webhook`'s before and after, and any `webhook_url` inside a detail."""
    def shown(value: Any, is_url: bool) -> Any:
        if isinstance(value, dict):
            return {k: shown(v, k == "webhook_url") for k, v in value.items()}
        return masked_url(value) if is_url and isinstance(value, str) and not admin else value

    if not isinstance(detail, dict):
        return [("", json.dumps(detail, ensure_ascii=False, default=str))] if detail else []
    return [(key, json.dumps(shown(value, action == "team.webhook" or key == "webhook_url"),
                             ensure_ascii=False, default=str))
            for key, value in detail.items()]


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@team_view(Role.VIEWER)
@require_safe
def audit_log(request: HttpRequest, slug: str) -> HttpResponse:
    action = request.GET.get("action", "")[:50]
    actor = request.GET.get("actor", "")[:150]
    events = selectors.audit_page(request.team, action=action, actor=actor,
                                  page=request.GET.get("page") or 1)
    rows = []
    for event in events.object_list:
        diff = history = None
        if event.action == "policy.version" and event.detail is None and event.target:
            # Too large to diff on this page: the policy's history diffs that version alone.
            version = _int_or_none(event.detail_version)
            if version is not None:
                history = reverse("policy_history", kwargs={"slug": slug, "name": event.target})
                history += f"?b={version}" + (f"&a={version - 1}" if version > 1 else "")
        if event.action == "policy.version" and isinstance(event.detail, dict):
            version = event.detail.get("version")
            diff = selectors.yaml_diff(
                event.detail.get("before"), event.detail.get("after"),
                before_label=f"version {version - 1}" if isinstance(version, int) and
                version > 1 else "(nothing)",
                after_label=f"version {version}",
            )
        rows.append({"event": event, "diff": diff, "history": history,
                     "detail": _detail_items(event.action, event.detail,
                                             can(request.role, Role.ADMIN))})
    query = {k: v for k, v in (("action", action), ("actor", actor)) if v}
    return page(request, "policies/audit.html", {
        "events": events, "rows": rows, "action": action, "actor": actor,
        "choices": selectors.audit_choices(request.team),
        "filter_query": urlencode(query),
    })


# --- Operator tokens (SPEC 17) ---------------------------------------------------------------

NEW_OPERATOR_TOKEN_SESSION_KEY = "dashboard:new-operator-token"


@login_required
@require_http_methods(["GET", "POST"])
def operator_tokens(request: HttpRequest) -> HttpResponse:
    """The person's own tokens: create (shown once), list, revoke."""
    form = OperatorTokenForm(request.POST or None, teams=tokens.teams_for_tokens(request.user))
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            new = tokens.operator_token_create(
                user=request.user, name=data["name"], role=data["role"],
                team=form.teams.get(data["team"] or ""), expires_days=data["expires_days"],
                actor=request.user)
        except tokens.TokenError as exc:
            for field, message in exc.fields.items():
                form.add_error(field if field in form.fields else None, message)
        else:
            request.session[NEW_OPERATOR_TOKEN_SESSION_KEY] = {"token": new.secret,
                                                               "name": new.token.name}
            return redirect("operator_tokens")
    listed, left_out = tokens.tokens_of(request.user)
    return page(request, "policies/operator_tokens.html", {
        "form": form,
        "tokens": listed, "left_out": left_out, "max_live": tokens.MAX_LIVE_TOKENS,
        "new_token": request.session.pop(NEW_OPERATOR_TOKEN_SESSION_KEY, None),
    }, status=422 if request.method == "POST" else 200)


@login_required
@require_POST
def operator_token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    token = tokens.token_of(request.user, token_id)
    if token is None:
        raise Http404("No such token.")
    if tokens.operator_token_revoke(token=token, actor=request.user):
        messages.success(request, f"Revoked token {token.name}: it stops working now.")
    return redirect("operator_tokens")
