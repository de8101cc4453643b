from django.apps import AppConfig


class BacktestsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "backtests"
    verbose_name = "Backtests"
