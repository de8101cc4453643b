from __future__ import annotations

from django.conf import settings
from django.db import models


class OperatorRelease(models.TextChoices):
    """Who besides the team's admins may release the team's kill switches (team, agent and
    run scopes; the global switch is the superusers'). Only admins by default, as SPEC 7
    says; a team may let the on-call operator who pressed a switch lift it again without
    waking an admin."""

    NONE = "none", "Only admins"
    OWN = "own", "Operators: the switches they engaged themselves"
    ANY = "any", "Operators: any switch of the team"


class Team(models.Model):
    slug = models.SlugField(max_length=50, unique=True)
    name = models.CharField(max_length=200)
    webhook_url = models.URLField(max_length=500, null=True, blank=True)
    webhook_secret = models.CharField(max_length=100, blank=True)
    # When an admin was shown the current secret (null: never, e.g. the one a team is made
    # with): each secret is shown once, like an agent key's token.
    webhook_secret_shown_at = models.DateTimeField(null=True, blank=True)
    retention_days = models.PositiveIntegerField(default=90)
    operator_release = models.CharField(max_length=10, choices=OperatorRelease.choices,
                                        default=OperatorRelease.NONE)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"


ROLE_RANK = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.VIEWER)
    # Given by single sign-on from the provider's groups (policies/sso.py), recomputed at each
    # of the person's SSO sign-ins; False: given by hand (an admin, an invitation, a command),
    # which SSO never changes.
    # db_default: the previous release, which does not know the column, still adds members
    # while this one migrates (docs/upgrades.md).
    from_sso = models.BooleanField(default=False, db_default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "team"], name="one_membership_per_team")
        ]


class SsoIdentity(models.Model):
    """A person of the identity provider (SPEC 17): the account an OpenID Connect sign-in
    with this (issuer, sub) signs in to. Never found by e-mail or username."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                related_name="sso_identity")
    issuer = models.CharField(max_length=300)
    subject = models.CharField(max_length=255)  # the ID token's `sub`
    created_at = models.DateTimeField(auto_now_add=True)
    last_sign_in_at = models.DateTimeField(null=True, blank=True)
    last_groups = models.JSONField(default=list, blank=True)  # as the last sign-in gave them

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["issuer", "subject"],
                                    name="one_account_per_sso_subject")
        ]


class Invitation(models.Model):
    """An offer of a team membership, waiting for its person (policies.services.member_invite).
    Made for a username nobody has, it came with the account, which joins by choosing its
    password through the link; for an account that exists, the account's owner joins by
    signing in and opening the link. Both are made, listed and answered alike, so that an
    admin learns nothing of the accounts of other teams."""

    key = models.CharField(max_length=32, unique=True)  # names it in the link, opaquely
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invitations")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                             related_name="invitations")
    role = models.CharField(max_length=20, choices=Role.choices)
    new_account = models.BooleanField()  # the account was made for it (and its membership)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    accepted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "user"],
                                    condition=models.Q(accepted_at__isnull=True),
                                    name="one_waiting_invitation_per_team")
        ]


class AgentKey(models.Model):
    """A bearer token for agents. Only a hash is stored; the prefix finds the row."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="agent_keys")
    name = models.CharField(max_length=100)
    agent = models.CharField(max_length=100, blank=True)  # empty: any agent name
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]


class Policy(models.Model):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="policies")
    name = models.CharField(max_length=50)
    # The newest version; runs pin the version they started with, so this only moves forward.
    current = models.ForeignKey(
        "PolicyVersion", null=True, on_delete=models.PROTECT, related_name="+"
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="policy_name_per_team")
        ]


class PolicyVersion(models.Model):
    """Immutable: a change to a policy writes a new version, never edits one."""

    policy = models.ForeignKey(Policy, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    document = models.JSONField()  # one normalized policy of the policy document (SPEC 3)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    source = models.CharField(max_length=20, default="api")  # dashboard | import | restore | ...
    note = models.CharField(max_length=500, blank=True)  # the saver's why, shown in history

    class Meta:
        ordering = ["-version"]
        constraints = [
            models.UniqueConstraint(fields=["policy", "version"], name="one_version_number")
        ]


# Events without a team that concern every team: the global kill switch's. Every other event
# without a team (a token for all of its owner's teams reading, SSO's account events) is a
# person's: shown on no team's page (policies/selectors.py), pruned after the longest
# retention of any team (runs/audit/retention.py); these are shown everywhere and kept.
GLOBAL_EVENT_ACTIONS = ("killswitch.engage", "killswitch.release")


class OperatorEvent(models.Model):
    """The operator audit log: who changed what, and when. Append-only."""

    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.SET_NULL)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    actor_label = models.CharField(max_length=150)  # kept when the user is deleted
    action = models.CharField(max_length=50)
    target = models.CharField(max_length=200, blank=True)
    detail = models.JSONField(default=dict, blank=True)
    at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-at", "-id"]


class AuthFailure(models.Model):
    """Failed authentications of one credential from one source, in a fixed window: the
    count the throttle decides by (governance/throttle.py). The database, not Redis, is the
    authority: every server process shares it, and it stays exact when Redis is down."""

    kind = models.CharField(max_length=20)  # "api-key" | "sign-in"
    source = models.CharField(max_length=64)  # the client address (TRUSTED_PROXIES applied)
    credential = models.CharField(max_length=150)  # a key's prefix, or a username
    window_start = models.FloatField()  # Unix time: compared and pruned, never shown
    failures = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["kind", "source", "credential"],
                                    name="one_failure_count_per_credential_and_source")
        ]
        indexes = [models.Index(fields=["window_start"], name="authfailure_window_idx")]


class OperatorToken(models.Model):
    """A bearer token for automation (SPEC 17): it acts as its owner, with the lesser of the
    owner's role and its own, on its team only when one is given. Stored like an agent key:
    only a hash, the prefix finds the row. Tokens start ``gov_op_``."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                             related_name="operator_tokens")
    name = models.CharField(max_length=100)
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="operator_tokens")  # null: every team of the owner
    role = models.CharField(max_length=20, choices=Role.choices)
    prefix = models.CharField(max_length=16, unique=True)
    token_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix})"
