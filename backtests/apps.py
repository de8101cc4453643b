from django.apps import AppConfig


class BacktestsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "backtests"
    verbose_name = "Backtests"

    def ready(self) -> None:
        # The policies app asks for a change's effect on recent runs before saving it, and
        # may not import the backtests (pyproject.toml's contracts): the reader is handed in.
        from policies import impact

        from .impact import recent_impacts

        impact.provide(recent_impacts)
