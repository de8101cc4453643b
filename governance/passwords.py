"""Password sign-in: Django's ModelBackend, less one hash when an address is past its bound.

Django hashes a password for an unknown username too (a deliberately slow pbkdf2, about 0.46 s
of CPU in production), so that the answer's timing does not tell which usernames exist. A
fresh username per attempt made each attempt cost a hash that no (source, username) bucket
bounds: 3 clients at 4 attempts a second from one address raised another team's check p99 12x
(found by an attacker). SPEC 10 forbids refusing anyone by source alone, so past
`THROTTLE_SIGN_IN_FAILURES_PER_ADDRESS` failures from an address nobody is refused for it:
an unknown username from that address is answered as a failed sign-in without that hash
(`SignInThrottleMiddleware` marks the request), and a real account's sign-in is checked as
always, bounded by its own (source, username) bucket. The price: past the bound, that address
can tell by timing which usernames exist (docs/reliability.md, "Failed authentications").
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.http import HttpRequest

from .throttle import SPARE_UNKNOWN_HASH


class PasswordBackend(ModelBackend):
    def authenticate(self, request: HttpRequest | None, username: str | None = None,
                     password: str | None = None, **kwargs: Any) -> Any:
        if request is not None and getattr(request, SPARE_UNKNOWN_HASH, False):
            model = get_user_model()
            name = username if username is not None else kwargs.get(model.USERNAME_FIELD)
            if name is None or password is None:
                return None
            if not model._default_manager.filter(**{model.USERNAME_FIELD: name}).exists():
                return None  # unknown: failed, without the equalising hash
        return super().authenticate(request, username=username, password=password, **kwargs)
