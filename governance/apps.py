from collections.abc import Callable

from django.apps import AppConfig


class GovernanceConfig(AppConfig):
    """The project as an app: only for the hooks that join its middleware to Django's."""

    name = "governance"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_in, user_login_failed

        import governance.checks  # noqa: F401  (registers the deploy checks)
        from governance.throttle import SIGN_IN_OUTCOME

        def mark(outcome: str) -> Callable[..., None]:
            def receiver(sender: object, request: object = None, **kwargs: object) -> None:
                if request is not None:
                    setattr(request, SIGN_IN_OUTCOME, outcome)
            return receiver

        # The auth framework's own hooks tell the sign-in throttle (governance/middleware.py)
        # what became of an attempt; nothing else uses signals here.
        user_login_failed.connect(mark("failed"), weak=False,
                                  dispatch_uid="governance-sign-in-failed")
        user_logged_in.connect(mark("succeeded"), weak=False,
                               dispatch_uid="governance-sign-in-succeeded")
