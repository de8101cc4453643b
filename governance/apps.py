from django.apps import AppConfig


class GovernanceConfig(AppConfig):
    """The project as an app: only for the hooks that join its middleware to Django's."""

    name = "governance"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_login_failed

        from governance.middleware import sign_in_throttle
        from governance.throttle import source_of

        def count_failure(sender: object, request: object = None, **kwargs: object) -> None:
            if request is not None:
                sign_in_throttle.failed(source_of(request))  # type: ignore[arg-type]

        # The auth framework's own hook for failed sign-ins; nothing else uses signals here.
        user_login_failed.connect(
            count_failure, weak=False, dispatch_uid="governance-sign-in-throttle"
        )
