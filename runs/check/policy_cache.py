"""Policy versions are immutable, so each process keeps the parsed rules by version id
forever: the check never parses a policy document on the hot path."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from governance_client.rules import Policy

from policies.models import PolicyVersion


@lru_cache(maxsize=4096)
def rules_for_version(version_id: int) -> Policy:
    document, number = PolicyVersion.objects.values_list("document", "version").get(
        pk=version_id)
    # The version's number, for the `rule` of its answers (SPEC 16).
    return replace(Policy.from_document(document), version=number)


@lru_cache(maxsize=4096)
def version_label(version_id: int) -> tuple[str, int]:
    """A version's policy name and number, for the check's span (SPEC 18): read once per
    version and process, and only while tracing is on."""
    name, number = PolicyVersion.objects.values_list("policy__name", "version").get(pk=version_id)
    return name, number
