"""The static files' storage: WhiteNoise's hashed and compressed files once collected."""

from __future__ import annotations

from whitenoise.storage import CompressedManifestStaticFilesStorage


class StaticFiles(CompressedManifestStaticFilesStorage):
    """Hashed names (cached for a year by browsers) for what `collectstatic` collected; a
    file's own name for what it has not (a source checkout never collected, the tests, a
    file added since), which WhiteNoise then serves from its app's folder. Django's
    manifest storage would raise instead, and turn every page into a 500."""

    def stored_name(self, name: str) -> str:
        try:
            return super().stored_name(name)
        except ValueError:
            return name
