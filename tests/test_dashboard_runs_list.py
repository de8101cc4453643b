"""The runs list for the daily job: search, time range, sorting, duration, shadow would-stop
filter, and keyset paging that costs the same on the 4,000th page as on the first."""

from __future__ import annotations

from datetime import UTC, timedelta
from decimal import Decimal
from html import unescape as html_unescape
from urllib.parse import unquote

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from runs.dashboard import selectors as dashboard
from runs.models import Run
from tests.conftest import set_policy
from tests.test_dashboard_runs import _fast, as_user, check, start  # noqa: F401

pytestmark = pytest.mark.django_db


def listed(html: str) -> list[str]:
    return [part.split('"')[0] for part in html.split('<tr id="run-')[1:]]


def url_of(team) -> str:
    return reverse("runs:runs", kwargs={"slug": team.slug})


def test_search_finds_a_run_by_id_prefix_full_id_task_and_external_id(team, users):
    a = start(team, "bot-a", task="Refund order 1234")
    b = start(team, "bot-b", task="Change the address")
    Run.objects.filter(pk=b.pk).update(external_id="ticket-77")
    client = as_user(users)
    for q, expected in [(str(a.pk)[:8], [str(a.pk)]), (str(b.pk), [str(b.pk)]),
                        ("refund ORDER", [str(a.pk)]), ("ticket-77", [str(b.pk)]),
                        ("nothing like it", [])]:
        assert listed(client.get(url_of(team), {"q": q}).content.decode()) == expected, q


def test_the_time_range_keeps_only_recent_runs(team, users):
    old, new = start(team, "old-bot"), start(team, "new-bot")
    Run.objects.filter(pk=old.pk).update(started_at=timezone.now() - timedelta(days=3))
    client = as_user(users)
    assert listed(client.get(url_of(team), {"since": "24h"}).content.decode()) == [str(new.pk)]
    assert set(listed(client.get(url_of(team), {"since": "7d"}).content.decode())) == {
        str(old.pk), str(new.pk)}
    assert len(listed(client.get(url_of(team), {"since": "bogus"}).content.decode())) == 2


def test_runs_sort_by_steps_cost_and_age_and_show_their_duration(team, users):
    runs = [start(team, f"bot-{i}") for i in range(3)]
    for run, steps, cost in zip(runs, [5, 9, 1], ["0.5", "0.1", "2"], strict=True):
        Run.objects.filter(pk=run.pk).update(steps=steps, cost_usd=Decimal(cost))
    Run.objects.filter(pk=runs[0].pk).update(
        status="completed", ended_at=runs[0].started_at + timedelta(seconds=75))
    client = as_user(users)
    ids = [str(r.pk) for r in runs]
    assert listed(client.get(url_of(team), {"sort": "steps"}).content.decode()) == [
        ids[1], ids[0], ids[2]]
    assert listed(client.get(url_of(team), {"sort": "cost"}).content.decode()) == [
        ids[2], ids[0], ids[1]]
    assert listed(client.get(url_of(team), {"sort": "oldest"}).content.decode()) == ids
    html = client.get(url_of(team)).content.decode()
    assert "1 min 15 s" in html  # the completed run's duration


def test_the_would_stop_filter_and_column_show_what_a_shadow_policy_would_have_done(team, users):
    set_policy(team, mode="shadow", step_limits={"max_repeat_action": 1})
    shadow = start(team, "shadow-bot")
    check(team, shadow, "same", {"a": 1})
    check(team, shadow, "same", {"a": 1})  # would stop: loop_detected at step 2
    plain = start(team, "plain-bot")
    check(team, plain, "other", {})
    client = as_user(users)
    html = client.get(url_of(team), {"would_stop": "1"}).content.decode()
    assert listed(html) == [str(shadow.pk)]
    assert "would stop at step 2: loop_detected" in html
    assert set(listed(client.get(url_of(team)).content.decode())) == {str(shadow.pk),
                                                                    str(plain.pk)}


def test_a_bad_cursor_is_ignored_and_the_list_answers(team, users):
    run = start(team)
    for after in ("garbage", "2026-01-01~not-a-uuid", "~", "x" * 500):
        response = as_user(users).get(url_of(team), {"after": after})
        assert response.status_code == 200 and listed(response.content.decode()) == [str(run.pk)]


def test_a_cursor_value_its_column_cannot_hold_is_the_first_page(team, users):
    # Found by an attacker: each of these was a 500 from the database (NaN and huge numbers
    # for the cost column, offsets that put a date past year 9999 or before year 1).
    run = start(team)
    cases = {"cost": ["NaN", "Infinity", "-Infinity", "sNaN", "1e999999999", "1e-999999999"],
             "steps": ["99999999999999999999", "-5"],
             "newest": ["9999-12-31T23:59:59-23:59", "2026-01-01T00:00:00"],
             "oldest": ["0001-01-01T00:00:00+23:59"]}
    client = as_user(users)
    for sort, values in cases.items():
        for value in values:
            for direction in ("after", "before"):
                response = client.get(url_of(team), {"sort": sort,
                                                      direction: f"{value}~{run.pk}"})
                # (A value the column can hold is a cursor like any other: the run itself,
                # its id in the cursor, may be on either side of it.)
                assert response.status_code == 200, (sort, value, direction)
                assert set(listed(response.content.decode())) <= {str(run.pk)}


def test_the_list_of_another_team_shows_nothing_of_it(team, other_team, users):
    theirs = start(other_team, "their-bot", task="secret task")
    client = as_user(users)
    for q in ("secret", str(theirs.pk)):
        assert listed(client.get(url_of(team), {"q": q}).content.decode()) == []
    assert client.get(url_of(other_team)).status_code == 403


def many_runs(team, version, count: int) -> None:
    """``count`` completed runs of ``team``, a second apart, the newest now, their agents
    bot-0 to bot-18: the first made by the ORM, the others copied from it by one INSERT
    ... SELECT in the database (the ORM's bulk_create took most of this test's minute)."""
    now = timezone.now()
    first = Run.objects.create(team=team, agent="bot-0", policy_version=version,
                               status="completed", started_at=now)
    columns = [f.column for f in Run._meta.concrete_fields]
    if connection.vendor == "sqlite":
        series = ("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
                  "WHERE i < %s)")
        made = {"id": "lower(hex(randomblob(16)))",
                # As Django stores a datetime in SQLite: UTC, no offset.
                "started_at": "strftime('%%Y-%%m-%%d %%H:%%M:%%f', %s, '-' || n.i || ' seconds')"}
        at = now.astimezone(UTC).replace(tzinfo=None).isoformat(" ")
    else:
        series = "WITH n(i) AS (SELECT generate_series(1, %s))"
        made = {"id": "gen_random_uuid()",
                "started_at": "%s::timestamptz - n.i * interval '1 second'"}
        at = now
    made["agent"] = "'bot-' || (n.i %% 19)"
    select = ", ".join(made.get(c, f"r.{c}") for c in columns)
    with connection.cursor() as cursor:
        cursor.execute(f"{series} INSERT INTO runs_run ({', '.join(columns)}) "
                       f"SELECT {select} FROM n, runs_run r WHERE r.id = %s",
                       [count - 1, at, Run._meta.pk.get_db_prep_value(first.pk, connection)])
    assert Run.objects.filter(team=team).count() == count


@pytest.mark.slow
def test_paging_at_100000_runs_reads_an_index_range_whatever_the_page(team, users):
    """The proof is the plan and the SQL, not a timing: no OFFSET, a LIMIT of one page, the
    (team, started_at) index walked in order, and a count that stops at COUNT_CAP."""
    version = team.policies.get(name="default").current
    many_runs(team, version, 100_000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    client = as_user(users)
    deep = Run.objects.filter(team=team).order_by("-started_at", "-pk")[80_000]
    cursor_value = f"{deep.started_at.isoformat()}~{deep.pk}"

    with CaptureQueriesContext(connection) as first_page:
        first = client.get(url_of(team))
    with CaptureQueriesContext(connection) as deep_page:
        response = client.get(url_of(team), {"after": cursor_value})
    assert first.status_code == response.status_code == 200
    assert "10000+ runs" in first.content.decode()
    assert len(deep_page.captured_queries) == len(first_page.captured_queries)
    html = response.content.decode()
    assert len(listed(html)) == dashboard.RUNS_PER_PAGE
    nxt = unquote(html.split('href="?after=')[1].split('"')[0])
    assert nxt.endswith(listed(html)[-1])
    run_sql = [q["sql"] for q in deep_page.captured_queries if '"runs_run"' in q["sql"]]
    assert run_sql and not any("OFFSET" in sql.upper() for sql in run_sql)
    assert any("LIMIT 26" in sql for sql in run_sql)
    assert any("LIMIT 10001" in sql for sql in run_sql)  # the capped count

    # Forward (after) and back (before): the same index range, walked either way.
    for filters, backwards in [(dashboard.RunFilters(after=cursor_value), False),
                               (dashboard.RunFilters(before=cursor_value), True)]:
        plan = dashboard.page_rows(team, filters, backwards=backwards)[:26].explain()
        assert "run_team_recent" in plan, plan
        if connection.vendor == "sqlite":
            # No sort of the whole team: the index gives the order; only rows that tie on
            # started_at are put in id order ("RIGHT PART OF ORDER BY").
            assert "TEMP B-TREE FOR ORDER BY" not in plan, plan
        else:
            assert "Seq Scan on runs_run" not in plan, plan
    with CaptureQueriesContext(connection) as back_page:
        back = client.get(url_of(team), {"before": cursor_value}).content.decode()
    assert len(listed(back)) == dashboard.RUNS_PER_PAGE
    assert listed(back)[-1] == str(
        Run.objects.filter(team=team).order_by("-started_at", "-pk")[79_999].pk)
    back_sql = [q["sql"] for q in back_page.captured_queries if '"runs_run"' in q["sql"]]
    assert not any("OFFSET" in sql.upper() for sql in back_sql)


def pager_links(html: str) -> dict[str, str]:
    """The pager's links by name (first, previous, next): their query strings."""
    nav = html.split('<nav class="pager"')[1].split("</nav>")[0]
    links = {}
    for part in nav.split("<a ")[1:]:
        query = html_unescape(part.split('href="?')[1].split('"')[0])  # still URL-encoded
        links[part.split('data-page="')[1].split('"')[0]] = query
    return links


def query_dict(query: str) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return dict(parse_qsl(query, keep_blank_values=True))


@pytest.mark.parametrize("sort", ["newest", "oldest", "steps", "cost"])
def test_previous_page_links_walk_back_through_the_same_pages(team, users, sort):
    """60 runs, with ties on every sort column (the id breaks them): forward to the last page
    by "next", then back by "previous" gives the same pages in reverse, ending on the first
    page, which has neither a previous nor a first link."""
    version = team.policies.get(name="default").current
    now = timezone.now()
    Run.objects.bulk_create([
        Run(team=team, agent=f"bot-{i}", policy_version=version, status="completed",
            started_at=now - timedelta(seconds=i // 3), steps=i % 7,
            cost_usd=Decimal(i % 4) / 10)
        for i in range(60)])
    client = as_user(users)
    per = dashboard.RUNS_PER_PAGE
    params = {} if sort == "newest" else {"sort": sort}
    pages, links = [], []
    html = client.get(url_of(team), params).content.decode()
    for _ in range(5):  # bounded: a cursor that does not move would loop forever
        pages.append(listed(html))
        links.append(pager_links(html))
        if "next" not in links[-1]:
            break
        html = client.get(url_of(team), query_dict(links[-1]["next"])).content.decode()
    assert [len(p) for p in pages] == [per, per, 60 - 2 * per]
    everything = [r for p in pages for r in p]
    assert len(set(everything)) == 60
    assert set(links[0]) == {"next"}
    assert set(links[1]) == {"first", "previous", "next"}
    assert set(links[2]) == {"first", "previous"}
    assert query_dict(links[2]["first"]) == params  # the filters kept, the cursor dropped

    back, current = [], links[2]
    for _ in range(5):
        if "previous" not in current:
            break
        previous = query_dict(current["previous"])
        assert previous.get("sort", "newest") == sort and "after" not in previous
        html = client.get(url_of(team), previous).content.decode()
        back.append(listed(html))
        current = pager_links(html)
    assert back == [pages[1], pages[0]]
    assert set(current) == {"next"}  # the first page again: neither previous nor first
    assert "a later page" not in html


def test_paging_back_to_the_start_shows_the_whole_first_page(team, users):
    """A page reached from a cursor near the start (the runs before it were fewer than a
    page): its previous page is the first page, full, not the few rows before the cursor."""
    version = team.policies.get(name="default").current
    now = timezone.now()
    Run.objects.bulk_create([
        Run(team=team, agent="bot", policy_version=version, status="completed",
            started_at=now - timedelta(seconds=i)) for i in range(40)])
    ordered = list(Run.objects.filter(team=team).order_by("-started_at", "-pk"))
    client = as_user(users)
    cursor = f"{ordered[4].started_at.isoformat()}~{ordered[4].pk}"
    html = client.get(url_of(team), {"after": cursor}).content.decode()
    assert listed(html) == [str(r.pk) for r in ordered[5:5 + dashboard.RUNS_PER_PAGE]]
    back = client.get(url_of(team), query_dict(pager_links(html)["previous"])
                      ).content.decode()
    assert listed(back) == [str(r.pk) for r in ordered[:dashboard.RUNS_PER_PAGE]]
    assert set(pager_links(back)) == {"next"}


def test_a_bad_before_cursor_is_the_first_page(team, users):
    run = start(team)
    for before in ("garbage", "2026-01-01~not-a-uuid", "~", "x" * 500):
        response = as_user(users).get(url_of(team), {"before": before})
        assert response.status_code == 200 and listed(response.content.decode()) == [str(run.pk)]
        assert pager_links(response.content.decode()) == {}
