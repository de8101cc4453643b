from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from policies.document import MAX_DOCUMENT_BYTES, DocumentError, load_yaml
from policies.services import policy_apply


class Command(BaseCommand):
    help = "Create or update the teams and policies of a YAML policy document (SPEC 3)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("file", type=Path)

    def handle(self, *args: Any, file: Path, **options: Any) -> None:
        try:
            with file.open("rb") as stream:
                # One byte past the bound is enough to refuse it: a larger file is never read.
                raw = stream.read(MAX_DOCUMENT_BYTES + 1)
        except OSError as exc:
            raise CommandError(f"cannot read {file}: {exc.strerror}") from None
        try:
            data = load_yaml(raw)
        except DocumentError as exc:
            raise CommandError(f"{file} {exc.errors['document']}") from None
        try:
            changes = policy_apply(data=data, source="yaml")
        except DocumentError as exc:
            lines = "\n".join(f"  {field}: {msg}" for field, msg in exc.errors.items())
            raise CommandError(f"{file} is invalid, nothing was applied:\n{lines}") from None
        for line in changes:
            self.stdout.write(line)
        if not changes:
            self.stdout.write("no changes")
