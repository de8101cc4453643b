"""SPEC 12 and 14 add `rate_limits` and `budgets.max_idle_seconds` to the policy document.

Versions are immutable in meaning, so a version stored before these fields existed must keep
behaving as it did: no rate limit, never abandoned. Writing those values (`[]` and null) into
the stored documents, rather than defaulting at every read, keeps one shape for every reader
(the check, the export, the diff, the editor) and lets an exported team be applied back
without creating a new version. Documents that already have the fields are left alone.
"""

from django.db import migrations


def fill(apps, schema_editor):
    PolicyVersion = apps.get_model("policies", "PolicyVersion")
    for version in PolicyVersion.objects.all().only("id", "document").iterator():
        document = dict(version.document)
        budgets = dict(document.get("budgets") or {})
        changed = False
        if "max_idle_seconds" not in budgets:
            budgets["max_idle_seconds"] = None
            document["budgets"] = budgets
            changed = True
        if "rate_limits" not in document:
            document["rate_limits"] = []
            changed = True
        if changed:
            PolicyVersion.objects.filter(pk=version.pk).update(document=document)


class Migration(migrations.Migration):
    dependencies = [("policies", "0003_version_note")]

    operations = [migrations.RunPython(fill, migrations.RunPython.noop)]
