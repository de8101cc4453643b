from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_save

        from policies.models import PolicyVersion
        from runs.check.rate_limits import register_saved_rules

        def registered(sender: object, instance: PolicyVersion, created: bool,
                       **kwargs: object) -> None:
            # Policies know nothing of runs (the import contracts): a saved version's
            # rate-limit rules are registered here, in the save's transaction.
            if created and not kwargs.get("raw"):
                register_saved_rules(instance)

        post_save.connect(registered, sender=PolicyVersion, weak=False,
                          dispatch_uid="runs.register_saved_rules")
