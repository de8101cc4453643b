"""Single sign-on with OpenID Connect (SPEC 17, docs/sso.md), on mozilla-django-oidc.

The library gives the authorization request (state, nonce and the PKCE verifier kept in the
session, the S256 challenge) and the nonce's check. Added here: every call to the provider
(discovery, the code's exchange, the keys, userinfo) goes through policies/oidc_provider.py,
with a total deadline, the discovery and the keys kept and a failing provider answered at
once (the library calls it with requests, whose timeouts bound each read, not the call); the
choice of the provider's key from its JWKS; the ID token's issuer and audience (the library
checks neither); a callback that answers every refusal with a page that says why (the
library's raises, a 400 or a 500); and the accounts (policies/sso.py): identity by
(issuer, sub), never e-mail.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import jwt
from django.conf import settings
from django.contrib import auth
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.exceptions import SuspiciousOperation, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render, resolve_url
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import OIDCAuthenticationRequestView

from .oidc_provider import ProviderUnreachable, call, forget, provider, signing_keys
from .sso import SignInRefused, sign_in

log = logging.getLogger(__name__)

BACKEND = "policies.sso_views.SsoBackend"
# A sign-in must come back from the provider within this long of starting.
STATE_MAX_AGE_S = 600


def sso_enabled() -> bool:
    return bool(settings.OIDC_ISSUER)


def forget_provider() -> None:
    """Forget the discovered endpoints, keys and failures (tests, and a provider that
    moved)."""
    forget()


class Refused(Exception):
    """A sign-in answer refused before anyone was signed in: the page's status and words."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class SsoBackend(OIDCAuthenticationBackend):
    """The library's backend, with the endpoints discovered at sign-in instead of read from
    settings at construction, the ID token's issuer and audience verified, and the account
    found by (issuer, sub). ``authenticate`` signs in nobody: Django calls it for password
    sign-ins too; the callback calls ``sign_in_with_code``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # no endpoints read here
        self.OIDC_RP_CLIENT_ID = settings.OIDC_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None
        self.UserModel = auth.get_user_model()

    def authenticate(self, request: Any, **kwargs: Any) -> None:
        return None

    def get_user(self, user_id: Any) -> Any:
        """Django's own lookup (`ModelBackend`, which the library's backend extends and
        overrides without `user_can_authenticate`): none once deactivated (docs/sso.md;
        found by an attacker: a deactivated operator's session still engaged a kill
        switch)."""
        return ModelBackend.get_user(self, user_id)

    def sign_in_with_code(self, request: HttpRequest, *, code: str, nonce: str,
                          code_verifier: str | None) -> Any:
        """Exchange the code, verify the ID token, then the account (policies/sso.py).
        Raises Refused, ProviderUnreachable or SignInRefused."""
        self.request = request
        found = provider()
        self.issuer = found.issuer
        self.OIDC_OP_TOKEN_ENDPOINT = found.token_endpoint
        self.OIDC_OP_JWKS_ENDPOINT = found.jwks_uri
        self.OIDC_OP_USER_ENDPOINT = found.userinfo_endpoint
        payload = {
            "client_id": self.OIDC_RP_CLIENT_ID, "client_secret": self.OIDC_RP_CLIENT_SECRET,
            "grant_type": "authorization_code", "code": code,
            "redirect_uri": request.build_absolute_uri(resolve_url("sso_callback")),
        }
        if code_verifier is not None:
            payload["code_verifier"] = code_verifier
        tokens = self.get_token(payload)
        id_token = tokens.get("id_token") if isinstance(tokens, dict) else None
        if not isinstance(id_token, str):
            raise Refused("The identity provider sent no ID token.")
        claims = self.verify_token(id_token, nonce=nonce)
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject:
            raise Refused("The ID token names no subject (sub).")
        if settings.OIDC_GROUPS_CLAIM not in claims and found.userinfo_endpoint:
            claims = {**self._userinfo(tokens.get("access_token"), subject), **claims}
        result = sign_in(issuer=found.issuer, subject=subject, claims=claims)
        if result.refusal is not None:
            raise result.refusal
        return result.user

    def _userinfo(self, access_token: Any, subject: str) -> dict[str, Any]:
        """The userinfo endpoint's claims (where the provider puts the groups), if they are
        about the ID token's subject."""
        if not isinstance(access_token, str):
            return {}
        info = self.get_userinfo(access_token, None, None)
        if not isinstance(info, dict) or info.get("sub") != subject:
            return {}
        return {settings.OIDC_GROUPS_CLAIM: info.get(settings.OIDC_GROUPS_CLAIM)}

    def get_token(self, payload: dict[str, str]) -> Any:
        """The library's code exchange, through the bounded call: a 4xx is this code refused
        (forged, used, expired), or this server's client refused (below); anything else not
        a 200 the provider failing."""
        answer = call("POST", self.OIDC_OP_TOKEN_ENDPOINT, form=payload, per_person=True)
        if 400 <= answer.status < 500:
            error = _oauth_error(answer)
            if answer.status == 401 or error in CLIENT_ERRORS:
                # The server's configuration, not the person's code: a wrong
                # OIDC_CLIENT_SECRET read "forged, used already or has expired. Sign in
                # again", and everyone signed in again and again (found by a newcomer).
                log.error("SSO: the identity provider refused this server's client at its "
                          "token endpoint (HTTP %s, %s): check OIDC_CLIENT_ID and "
                          "OIDC_CLIENT_SECRET against the client registered there.",
                          answer.status, error or "no error code")
                raise Refused(
                    "The identity provider did not accept this server's client credentials "
                    f"({error or f'HTTP {answer.status}'}): OIDC_CLIENT_ID or "
                    "OIDC_CLIENT_SECRET does not match the client registered there. Signing "
                    "in again will not help: ask an administrator to correct them.", 503)
            raise Refused("The identity provider refused this sign-in's code: it was "
                          "forged, used already or has expired. Sign in again.")
        if answer.status != 200:
            raise ProviderUnreachable(f"its token endpoint answered {answer.status}")
        return answer.json()

    def get_userinfo(self, access_token: str, id_token: Any, payload: Any) -> Any:
        """The library's userinfo request, through the bounded call."""
        answer = call("GET", self.OIDC_OP_USER_ENDPOINT,
                      headers={"Authorization": f"Bearer {access_token}"}, per_person=True)
        if answer.status != 200:
            raise ProviderUnreachable(f"its userinfo endpoint answered {answer.status}")
        if answer.content_type.startswith("application/jwt"):
            return self.verify_token(answer.body.decode("utf-8", "replace"))
        return answer.json()

    def verify_token(self, token: str, **kwargs: Any) -> dict[str, Any]:
        try:
            return super().verify_token(token, **kwargs)
        except SuspiciousOperation as exc:
            if "Nonce" in str(exc):
                raise Refused("The ID token was not issued for this sign-in (its nonce does "
                              "not match): a replayed answer is refused.") from None
            raise Refused("The ID token's signature could not be verified with the identity "
                          "provider's keys.") from None
        except (ValueError, KeyError):
            raise Refused("The ID token is malformed.") from None

    def _verify_jws(self, payload: str, key: Any) -> dict[str, Any]:
        """The library's check of the signature, plus the issuer, the audience, the expiry
        and the times it must carry."""
        try:
            header = jwt.get_unverified_header(payload)
        except jwt.PyJWTError:
            raise Refused("The ID token is malformed.") from None
        if header.get("alg") != self.OIDC_RP_SIGN_ALGO:
            raise Refused(f"The ID token is signed with {header.get('alg')!r}, not "
                          f"{self.OIDC_RP_SIGN_ALGO}.")
        try:
            try:
                return self._decode(payload, key)
            except jwt.InvalidSignatureError:
                if header.get("kid") is not None:
                    raise
                # No key id: the key kept may be the one before a rotation, which an unknown
                # key id would have shown. The provider's keys are asked again (bounded) and
                # the token verified once more if its one signing key has changed.
                fresh = self._single_key(signing_keys(self.OIDC_OP_JWKS_ENDPOINT, stale=True))
                if fresh.key == getattr(key, "key", None):
                    raise
                return self._decode(payload, fresh)
        except jwt.ExpiredSignatureError:
            raise Refused("The ID token has expired. Sign in again.") from None
        except jwt.InvalidIssuerError:
            raise Refused("The ID token was issued by another issuer than the configured "
                          "identity provider.") from None
        except jwt.InvalidAudienceError:
            raise Refused("The ID token was issued for another application.") from None
        except jwt.InvalidSignatureError:
            raise Refused("The ID token's signature could not be verified with the identity "
                          "provider's keys.") from None
        except jwt.PyJWTError as exc:
            raise Refused(f"The ID token is not valid: {exc}.") from None
        except SuspiciousOperation:
            raise Refused("The ID token's signature could not be verified with the identity "
                          "provider's keys: it has no key id, and not one signing key.") from None
        except (KeyError, TypeError, AttributeError):
            raise Refused("The ID token or the provider's keys are malformed.") from None

    def _decode(self, payload: str, key: Any) -> dict[str, Any]:
        return jwt.decode(payload, key, algorithms=[self.OIDC_RP_SIGN_ALGO],
                          audience=self.OIDC_RP_CLIENT_ID, issuer=self.issuer,
                          leeway=settings.OIDC_CLOCK_SKEW_S,
                          options={"require": ["iss", "aud", "exp", "iat", "sub"]})

    def _single_key(self, keys: list[dict[str, Any]]) -> jwt.PyJWK:
        """The provider's one signing key, for a token without a key id (a provider with a
        single key may leave it out)."""
        keys = [key for key in keys
                if key.get("use", "sig") == "sig"
                and key.get("alg", self.OIDC_RP_SIGN_ALGO) == self.OIDC_RP_SIGN_ALGO]
        if len(keys) != 1:
            raise SuspiciousOperation("no key id, and not one signing key")
        return jwt.PyJWK(keys[0], algorithm=self.OIDC_RP_SIGN_ALGO)

    def retrieve_matching_jwk(self, token: str) -> Any:
        """The library's choice of key, from the keys kept (policies/oidc_provider.py): by
        key id (and algorithm, when the key names one); a token without a key id (a provider
        with a single key may leave it out) is verified with the provider's one signing key,
        if it has exactly one."""
        try:
            header = jwt.get_unverified_header(token)
            kid = header.get("kid")
            keys = signing_keys(self.OIDC_OP_JWKS_ENDPOINT,
                                kid=str(kid) if kid is not None else None)
            if kid is not None:
                found = [key for key in keys if key.get("kid") == str(kid)
                         and key.get("alg", header.get("alg")) == header.get("alg")]
                if not found:
                    raise SuspiciousOperation("no key with this key id")
                return jwt.PyJWK(found[-1])
            return self._single_key(keys)
        except SuspiciousOperation:
            raise Refused("The ID token's signature could not be verified with the identity "
                          "provider's keys: none of them has its key id.") from None
        except (KeyError, TypeError, AttributeError, jwt.PyJWTError):
            raise Refused("The ID token or the provider's keys are malformed.") from None


# OAuth 2.0's token-endpoint errors about the client itself (RFC 6749 5.2), not the code.
CLIENT_ERRORS = frozenset({"invalid_client", "unauthorized_client"})


def _oauth_error(answer: Any) -> str | None:
    """The ``error`` code of a token endpoint's refusal, if it sent one (RFC 6749 5.2)."""
    try:
        body = json.loads(answer.body)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, str) and error.isascii() and error.isprintable() \
        and len(error) <= 64 else None


def refusal_page(request: HttpRequest, message: str, status: int) -> HttpResponse:
    titles = {403: "Not allowed", 503: "Single sign-on unavailable"}
    return render(request, "registration/sso_refused.html",
                  {"title": titles.get(status, "Sign-in refused"), "message": message},
                  status=status)


def _unreachable(request: HttpRequest, exc: ProviderUnreachable) -> HttpResponse:
    password = {"all": " or sign in with your password",
                "superusers": " (a superuser may sign in with a password)"}.get(
                    settings.OIDC_PASSWORD_LOGIN, "")
    response = refusal_page(
        request, "Single sign-on is unavailable: the identity provider cannot be reached or "
        f"answered unexpectedly: {exc}. Try again shortly{password}, or ask an "
        "administrator.", 503)
    if exc.retry_after:
        response["Retry-After"] = str(exc.retry_after)
    return response


class SsoLoginView(OIDCAuthenticationRequestView):
    """"Sign in with SSO": the library's authorization request (state, nonce, PKCE) to the
    endpoint discovered now."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(OIDCAuthenticationRequestView, self).__init__(*args, **kwargs)
        self.OIDC_RP_CLIENT_ID = settings.OIDC_CLIENT_ID

    def get(self, request: HttpRequest) -> HttpResponse:
        if not sso_enabled():
            raise Http404("Single sign-on is not configured.")
        try:
            self.OIDC_OP_AUTH_ENDPOINT = provider().authorization_endpoint
        except ProviderUnreachable as exc:
            return _unreachable(request, exc)
        if not request.user.is_authenticated:
            # A visitor's session holds this sign-in's state, good for STATE_MAX_AGE_S: it is
            # kept no longer (a sign-in gives it the full age again, `full_session`). Every
            # anonymous press of the button made a session row kept two weeks, and nothing
            # removed expired ones (found by an attacker: a row per request, for ever).
            request.session.set_expiry(STATE_MAX_AGE_S)
        return super().get(request)


def full_session(request: HttpRequest) -> None:
    """A signed-in session's age is the configured one (SESSION_COOKIE_AGE), whatever a
    sign-in started as a visitor set (`SsoLoginView.get`)."""
    request.session.set_expiry(None)


def sso_callback(request: HttpRequest) -> HttpResponse:
    """The provider's answer. Every way it can be wrong is a page saying so; nobody is
    signed in and no account is made unless the whole answer checks out."""
    if not sso_enabled():
        raise Http404("Single sign-on is not configured.")
    if request.method != "GET":
        return refusal_page(request, "A sign-in answer comes as a GET.", 405)
    state = request.GET.get("state") or ""
    states = request.session.get("oidc_states")
    started = states.pop(state, None) if isinstance(states, dict) and state else None
    if started is not None:  # used once: a replay of this answer finds nothing
        request.session["oidc_states"] = states
        request.session.save()
    error = request.GET.get("error")
    if error:
        return refusal_page(request, "The identity provider did not sign you in "
                            f"({error[:100]}).", 403)
    code = request.GET.get("code")
    if not code or not state:
        return refusal_page(request, "This sign-in answer is incomplete (no code or state).",
                            400)
    if not isinstance(started, dict) or not isinstance(started.get("nonce"), str):
        return refusal_page(request, "This sign-in answer does not belong to a sign-in "
                            "started in this browser, or was used already (unknown state). "
                            "Sign in again.", 400)
    if time.time() - float(started.get("added_on") or 0) > STATE_MAX_AGE_S:
        return refusal_page(request, "This sign-in took too long. Sign in again.", 400)
    try:
        user = SsoBackend().sign_in_with_code(
            request, code=code, nonce=started["nonce"],
            code_verifier=started.get("code_verifier"))
    except Refused as exc:
        log.warning("SSO sign-in refused: %s", exc.message)
        return refusal_page(request, exc.message, exc.status)
    except SignInRefused as exc:
        return refusal_page(request, exc.message, exc.status)
    except ProviderUnreachable as exc:
        return _unreachable(request, exc)
    next_url = request.session.pop("oidc_login_next", None)  # made safe when it was stored
    auth.login(request, user, backend=BACKEND)
    full_session(request)
    return HttpResponseRedirect(next_url or resolve_url(settings.LOGIN_REDIRECT_URL))


# --- The login page ---------------------------------------------------------------------------

class PasswordSignInForm(AuthenticationForm):
    """The password form under OIDC_PASSWORD_LOGIN: ``all`` signs in anyone, ``superusers``
    only superusers (everyone else through SSO), ``off`` nobody. A refused account gets the
    same words as a wrong password: the form never tells whose password was right. Under
    ``superusers`` those words say who may sign in here, whatever went wrong (found by a
    newcomer: an operator's right password read as a wrong one)."""

    def get_invalid_login_error(self) -> ValidationError:
        if settings.OIDC_PASSWORD_LOGIN != "superusers":
            return super().get_invalid_login_error()
        return ValidationError(
            "Please enter a correct username and password. Only a superuser signs in with a "
            "password here; everyone else signs in with SSO.", code="invalid_login")

    def clean(self) -> dict[str, Any]:
        mode = settings.OIDC_PASSWORD_LOGIN
        if mode == "off":
            raise ValidationError("Password sign-in is off: sign in with SSO.", code="off")
        cleaned = super().clean()
        if mode == "superusers" and self.user_cache is not None \
                and not self.user_cache.is_superuser:
            self.user_cache = None
            raise self.get_invalid_login_error()
        return cleaned


class SignInView(LoginView):
    authentication_form = PasswordSignInForm
    redirect_authenticated_user = True

    def form_valid(self, form: Any) -> HttpResponse:
        response = super().form_valid(form)
        full_session(self.request)
        return response

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["sso"] = sso_enabled()
        context["password_login"] = settings.OIDC_PASSWORD_LOGIN
        return context
