"""The Celery app. With no REDIS_URL, tasks run eagerly in the calling process (settings)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")

app = Celery("governance")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# The runs app keeps its tasks in its parts (docs/architecture.md), not in one runs/tasks.py.
# Their names stay the ones they were queued under ("runs.tasks.*", "policies.tasks.*") so
# messages already in a queue when an installation upgrades are still understood.
app.autodiscover_tasks(["runs.killswitch", "runs.webhooks", "runs.audit", "runs.check",
                       "runs.approvals"])
