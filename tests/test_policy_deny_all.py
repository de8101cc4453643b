"""A deny-all policy is never saved by omission (issue 26): "Only allow the tools listed below"
over an empty list denies every tool of every run, so the editor refuses it unless "Deny every
tool" is ticked too."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from policies.forms import DENY_ALL
from policies.models import Policy
from tests.test_dashboard_policies import form_data

pytestmark = pytest.mark.django_db


def save(client: Client, team: Any, **changes: str) -> Any:
    return client.post(reverse("policy_save", args=[team.slug, "default"]), form_data(**changes))


def allow_list(team: Any) -> Any:
    return Policy.objects.get(team=team, name="default").current.document["tools"]["allow"]


def test_an_empty_allow_list_is_refused_unless_deny_every_tool_is_ticked(team, users):
    admin = Client()
    admin.force_login(users["admin"])
    refused = save(admin, team, restrict_tools="on", tools_allow="")
    assert refused.status_code == 422
    assert DENY_ALL.split(":")[0] in refused.content.decode().replace("&quot;", '"')
    assert allow_list(team) is None  # nothing saved
    assert save(admin, team, restrict_tools="on", tools_allow="",
                deny_every_tool="on").status_code == 302
    assert allow_list(team) == []
    # The editor shows the saved deny-all as such, and saves it again unchanged.
    page = admin.get(reverse("policy", args=[team.slug, "default"])).content.decode()
    assert re.search(r'<input[^>]*name="deny_every_tool"[^>]*checked', page)


def test_deny_every_tool_ticked_alone_denies_every_tool(team, users):
    """Found by a newcomer: ticked without "Only allow" it saved nothing ("Nothing
    changed"); ticked over a list of tools it would contradict it."""
    admin = Client()
    admin.force_login(users["admin"])
    assert save(admin, team, deny_every_tool="on").status_code == 302
    assert allow_list(team) == []
    refused = save(admin, team, restrict_tools="on", tools_allow="search.*",
                   deny_every_tool="on")
    assert refused.status_code == 422
    assert "empty this list, or untick it" in refused.content.decode().replace("&quot;", '"')
    assert allow_list(team) == []  # nothing saved


def test_a_listed_tool_needs_no_confirmation(team, users):
    admin = Client()
    admin.force_login(users["admin"])
    assert save(admin, team, restrict_tools="on", tools_allow="search.*").status_code == 302
    assert allow_list(team) == ["search.*"]


def tools(team: Any) -> Any:
    return Policy.objects.get(team=team, name="default").current.document["tools"]


@pytest.mark.parametrize("changes, why", [
    ({"tools_deny": "*"}, "the deny pattern '*' matches every tool"),
    ({"restrict_tools": "on", "tools_allow": "search.docs", "tools_deny": "search.*"},
     "every allowed tool is denied too: search.docs by search.*"),
    ({"restrict_tools": "on", "tools_allow": "search.web*\nhttp.get",
      "tools_deny": "search.*\nhttp.get"},
     "every allowed tool is denied too: search.web* by search.*, http.get by http.get"),
], ids=["deny-star", "allow-covered", "each-covered"])
def test_patterns_that_deny_every_tool_are_refused_unless_meant(team, users, changes, why):
    """Found by a newcomer: with the empty allow list refused, deny `*` (or an allow list
    its deny patterns cover) still saved a policy that stops every run, without a word."""
    admin = Client()
    admin.force_login(users["admin"])
    before = tools(team)
    refused = save(admin, team, **changes)
    assert refused.status_code == 422
    assert why in refused.content.decode().replace("&#x27;", "'")
    assert tools(team) == before  # nothing saved
    meant = {**changes, "tools_allow": "", "deny_every_tool": "on"}
    assert save(admin, team, **meant).status_code == 302
    # The patterns deny every tool already: the ticked box confirms, it adds no empty list
    # unless the allow list was ticked empty.
    assert tools(team)["deny"] == changes["tools_deny"].split("\n")
    page = admin.get(reverse("policy", args=[team.slug, "default"])).content.decode()
    assert re.search(r'<input[^>]*name="deny_every_tool"[^>]*checked', page)


def test_patterns_that_leave_a_tool_allowed_need_no_confirmation(team, users):
    """Only what is certain is refused: deny search.x* leaves search.y allowed."""
    admin = Client()
    admin.force_login(users["admin"])
    assert save(admin, team, restrict_tools="on", tools_allow="search.*",
                tools_deny="search.x*").status_code == 302
    assert save(admin, team, tools_deny="*.delete\nadmin.?").status_code == 302


def test_a_refused_save_says_so_at_the_top_and_links_each_field(team, users):
    """Found by a newcomer: the page reloaded at its top with nothing to say the save was
    refused; the errors were about 2,000 px below."""
    admin = Client()
    admin.force_login(users["admin"])
    refused = save(admin, team, max_steps="0", max_repeat_action="x")
    assert refused.status_code == 422
    html = refused.content.decode()
    top = html[html.index('id="form-status"'):html.index('class="form-grid"')]
    assert "Not saved." in top and "the 2 fields marked below" in top
    assert 'href="#err-max_steps"' in top and 'href="#err-max_repeat_action"' in top
    assert 'id="err-max_steps"' in html and 'id="err-max_repeat_action"' in html


def test_the_refused_saves_summary_names_each_field_as_the_form_labels_it(team, users):
    """Found by a newcomer: the summary said "Fix the field marked below: Max usd." beside a
    box labelled "Max USD" (and "Tools deny" for "Deny", "Note" for "Change note"): Django's
    names of the fields, not the page's."""
    admin = Client()
    admin.force_login(users["admin"])
    for changes, name, label in [({"max_usd": "-5"}, "max_usd", "Max USD"),
                                 ({"tools_deny": "*"}, "tools_deny", "Deny"),
                                 ({"max_steps": "19", "note": ""}, "note", "Change note")]:
        html = save(admin, team, **changes).content.decode()
        top = html[html.index('id="form-status"'):html.index('class="form-grid"')]
        assert re.findall(r'<a href="#err-(\w+)">([^<]+)</a>', top) == [(name, label)]
        assert re.search(rf'<label for="id_{name}">{re.escape(label)}[< ]', html)


def test_an_emptied_box_says_what_empty_means(team, users):
    """Found by a newcomer: an emptied step limit answered "Input should be a valid
    integer", while an emptied budget means no limit; an emptied error threshold or approval
    timeout silently came back as 3 and 900."""
    admin = Client()
    admin.force_login(users["admin"])
    html = save(admin, team, max_steps="", max_usd="").content.decode()
    error = html.split('id="err-max_steps"', 1)[1].split("</div>", 1)[0]
    assert "Required: a step limit cannot be empty" in error
    assert 'id="err-max_usd" aria-live="polite"></div>' in html
    page = admin.get(reverse("policy", args=[team.slug, "default"])).content.decode()
    assert "1..1000; empty = 3" in page and "1..86400, empty = 900" in page
