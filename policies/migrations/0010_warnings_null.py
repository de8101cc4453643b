"""SPEC 16 adds the `warnings` block to the policy document. A version stored before it
existed keeps behaving as it did: no warnings. As 0004 did for `rate_limits`, the value
(null) is written into the stored documents rather than defaulted at every read, so every
reader (the check, the export, the diff, the editor) sees one shape and an exported team
applied back creates no new version. Documents that already have the block are left alone.
"""

from django.db import migrations


def fill(apps, schema_editor):
    PolicyVersion = apps.get_model("policies", "PolicyVersion")
    for version in PolicyVersion.objects.all().only("id", "document").iterator():
        if "warnings" not in version.document:
            document = {**version.document, "warnings": None}
            PolicyVersion.objects.filter(pk=version.pk).update(document=document)


class Migration(migrations.Migration):
    dependencies = [("policies", "0009_operator_tokens_api")]

    operations = [migrations.RunPython(fill, migrations.RunPython.noop)]
