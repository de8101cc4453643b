"""Single sign-on with OpenID Connect (SPEC 17, docs/sso.md), on mozilla-django-oidc.

The library gives the authorization request (state, nonce and the PKCE verifier kept in the
session, the S256 challenge), the code's exchange at the token endpoint, the choice of the
provider's key from its JWKS and the nonce's check. Added here: discovery (lazily, at a
sign-in, with a short timeout), the ID token's issuer and audience (the library checks neither),
a callback that answers every refusal with a page that says why (the library's raises, a 400
or a 500), and the accounts (policies/sso.py): identity by (issuer, sub), never e-mail.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import jwt
import requests
from django.conf import settings
from django.contrib import auth
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.exceptions import SuspiciousOperation, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render, resolve_url
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import OIDCAuthenticationRequestView

from .sso import SignInRefused, sign_in

log = logging.getLogger(__name__)

BACKEND = "policies.sso_views.SsoBackend"
# A sign-in must come back from the provider within this long of starting.
STATE_MAX_AGE_S = 600
DISCOVERY_TTL_S = 3600


def sso_enabled() -> bool:
    return bool(settings.OIDC_ISSUER)


class ProviderUnreachable(Exception):
    """The provider did not answer, or answered nonsense: a 503 page, never a 500."""


@dataclass(frozen=True)
class Provider:
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    userinfo_endpoint: str


_discovered: dict[str, tuple[float, Provider]] = {}
_discovered_lock = threading.Lock()


def provider() -> Provider:
    """The provider's endpoints, from <issuer>/.well-known/openid-configuration, kept for an
    hour per process (a failure is not kept: the next sign-in asks again)."""
    issuer = settings.OIDC_ISSUER
    with _discovered_lock:
        known = _discovered.get(issuer)
    if known is not None and time.monotonic() - known[0] < DISCOVERY_TTL_S:
        return known[1]
    url = f"{issuer}/.well-known/openid-configuration"
    try:
        response = requests.get(url, timeout=settings.OIDC_TIMEOUT)
        response.raise_for_status()
        document = response.json()
    except (requests.RequestException, ValueError) as exc:
        log.warning("OIDC discovery at %s failed: %s", url, exc)
        raise ProviderUnreachable(
            f"its discovery document could not be read ({type(exc).__name__})") from None
    if not isinstance(document, dict):
        raise ProviderUnreachable("its discovery document is not a JSON object")
    # The issuer as the provider spells it (some end it with "/"): ID tokens name it so.
    spelled = document.get("issuer")
    if not isinstance(spelled, str) or spelled.rstrip("/") != issuer:
        raise ProviderUnreachable(
            f"its discovery document names the issuer {document.get('issuer')!r}, "
            f"not OIDC_ISSUER ({issuer!r})")
    try:
        found = Provider(
            issuer=spelled,
            authorization_endpoint=_url(document, "authorization_endpoint"),
            token_endpoint=_url(document, "token_endpoint"),
            jwks_uri=_url(document, "jwks_uri"),
            userinfo_endpoint=str(document.get("userinfo_endpoint") or ""))
    except KeyError as exc:
        raise ProviderUnreachable(f"its discovery document has no {exc.args[0]}") from None
    with _discovered_lock:
        _discovered[issuer] = (time.monotonic(), found)
    return found


def forget_provider() -> None:
    """Forget the discovered endpoints (tests, and a provider that moved)."""
    with _discovered_lock:
        _discovered.clear()


def _url(document: dict[str, Any], name: str) -> str:
    value = document.get(name)
    if not isinstance(value, str) or not value.startswith(("https://", "http://")):
        raise KeyError(name)
    return value


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

    @staticmethod
    def get_settings(attr: str, *args: Any) -> Any:
        if attr == "OIDC_TIMEOUT":
            return settings.OIDC_TIMEOUT
        return OIDCAuthenticationBackend.get_settings(attr, *args)

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
        try:
            tokens = self.get_token(payload)
        except requests.HTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            if 400 <= status < 500:
                raise Refused("The identity provider refused this sign-in's code: it was "
                              "forged, used already or has expired. Sign in again.") from None
            raise ProviderUnreachable(f"its token endpoint answered {status}") from None
        except (requests.RequestException, ValueError) as exc:
            raise ProviderUnreachable(
                f"its token endpoint did not answer ({type(exc).__name__})") from None
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
        try:
            info = self.get_userinfo(access_token, None, None)
        except (requests.RequestException, ValueError) as exc:
            raise ProviderUnreachable(
                f"its userinfo endpoint did not answer ({type(exc).__name__})") from None
        if not isinstance(info, dict) or info.get("sub") != subject:
            return {}
        return {settings.OIDC_GROUPS_CLAIM: info.get(settings.OIDC_GROUPS_CLAIM)}

    def verify_token(self, token: str, **kwargs: Any) -> dict[str, Any]:
        try:
            return super().verify_token(token, **kwargs)
        except SuspiciousOperation as exc:
            if "Nonce" in str(exc):
                raise Refused("The ID token was not issued for this sign-in (its nonce does "
                              "not match): a replayed answer is refused.") from None
            raise Refused("The ID token's signature could not be verified with the identity "
                          "provider's keys.") from None
        except (requests.RequestException, ValueError, KeyError) as exc:
            if isinstance(exc, requests.RequestException):
                raise ProviderUnreachable(
                    f"its keys (JWKS) could not be read ({type(exc).__name__})") from None
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
            return jwt.decode(
                payload, key, algorithms=[self.OIDC_RP_SIGN_ALGO],
                audience=self.OIDC_RP_CLIENT_ID, issuer=self.issuer,
                leeway=settings.OIDC_CLOCK_SKEW_S,
                options={"require": ["iss", "aud", "exp", "iat", "sub"]})
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

    def retrieve_matching_jwk(self, token: str) -> Any:
        """The library's choice by key id; a token without one (a provider with a single
        key may leave it out) is verified with the provider's one signing key, if it has
        exactly one."""
        try:
            if "kid" in jwt.get_unverified_header(token):
                return super().retrieve_matching_jwk(token)
            response = requests.get(self.OIDC_OP_JWKS_ENDPOINT, timeout=settings.OIDC_TIMEOUT)
            response.raise_for_status()
            keys = [key for key in response.json()["keys"]
                    if key.get("use", "sig") == "sig"
                    and key.get("alg", self.OIDC_RP_SIGN_ALGO) == self.OIDC_RP_SIGN_ALGO]
            if len(keys) != 1:
                raise SuspiciousOperation("no key id, and not one signing key")
            return jwt.PyJWK(keys[0], algorithm=self.OIDC_RP_SIGN_ALGO)
        except SuspiciousOperation:
            raise Refused("The ID token's signature could not be verified with the identity "
                          "provider's keys: none of them has its key id.") from None
        except (KeyError, TypeError, AttributeError, jwt.PyJWTError):
            raise Refused("The ID token or the provider's keys are malformed.") from None


def refusal_page(request: HttpRequest, message: str, status: int) -> HttpResponse:
    titles = {403: "Not allowed", 503: "Single sign-on unavailable"}
    return render(request, "registration/sso_refused.html",
                  {"title": titles.get(status, "Sign-in refused"), "message": message},
                  status=status)


def _unreachable(request: HttpRequest, exc: ProviderUnreachable) -> HttpResponse:
    return refusal_page(request, "The identity provider cannot be reached or answered "
                        f"unexpectedly: {exc}. Try again later, or ask an administrator.", 503)


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
        return super().get(request)


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

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["sso"] = sso_enabled()
        context["password_login"] = settings.OIDC_PASSWORD_LOGIN
        return context
