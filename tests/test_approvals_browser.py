"""Approvals in a real browser (SPEC 11): an operator watches the approvals page, a request
appears live, the operator approves it and the waiting agent's long poll and re-sent check
get allow; another is denied with a note and the agent receives the stop with that note.
Debian's chromium through Playwright; never a downloaded browser."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from runs.models import Approval, Run
from tests.conftest import set_policy
from tests.test_approvals_e2e import long_poll
from tests.test_killswitch_browser import session_cookie, signed_in_page

CHROMIUM = Path("/usr/bin/chromium")
PAY = {"name": "payments.refund", "args": {"order": 42, "amount": 19.9}}

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (Debian)"),
]


def test_an_operator_approves_and_denies_live_and_the_agents_get_the_answers(
        server, agent, team, users):
    from playwright.sync_api import expect

    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_seconds": None})
    cookie = session_cookie(users["operator"])
    results: dict[str, Any] = {}

    # No ORM below while Playwright's event loop runs in this thread: the agent talks HTTP.
    with signed_in_page(server, cookie) as page:
        page.goto(f"/teams/{team.slug}/approvals/")
        expect(page.locator("#approvals-empty")).to_be_visible()
        expect(page.locator("[data-live-status]")).to_have_text("Live", timeout=15_000)
        page.evaluate("window.__sameDocument = true")  # gone if the page reloads

        # 1. A request appears live; the operator approves it.
        run_a = agent.start()["run_id"]
        first = agent.check(run_a, action=PAY, check_id="refund-a")
        assert first["decision"] == "pending"
        approval_a = first["approval"]["id"]
        card = page.locator(f"#approval-{approval_a}")
        expect(card).to_have_attribute("data-status", "pending", timeout=15_000)
        expect(card).to_contain_text("payments.refund")
        expect(card).to_contain_text('"order": 42')
        expect(card.locator("time.countdown")).to_contain_text("left")
        expect(page.locator("#nav-approvals-count")).to_have_attribute("data-count", "1")

        poller = threading.Thread(target=long_poll,
                                  args=(agent, approval_a, 45, results.setdefault("a", {})))
        poller.start()
        card.locator("button[value=approve]").click()
        expect(page.locator(f"#approval-{approval_a}")).to_have_attribute(
            "data-status", "approved", timeout=15_000)
        poller.join(40)
        assert results["a"]["body"]["status"] == "approved"
        assert results["a"]["body"]["decision"]["decision"] == "allow"
        resent = agent.check(run_a, action=PAY, check_id="refund-a")
        assert (resent["decision"], resent["reason"]) == ("allow", "step_ok")
        expect(page.locator("#nav-approvals-count")).to_have_attribute("data-count", "0",
                                                                       timeout=15_000)

        # 2. Another is denied with a note; the agent gets the stop with the note.
        run_b = agent.start(agent="billing-bot")["run_id"]
        second = agent.check(run_b, action=PAY, check_id="refund-b")
        approval_b = second["approval"]["id"]
        card_b = page.locator(f"#approval-{approval_b}")
        expect(card_b).to_have_attribute("data-status", "pending", timeout=15_000)
        poller = threading.Thread(target=long_poll,
                                  args=(agent, approval_b, 45, results.setdefault("b", {})))
        poller.start()
        card_b.locator("button[value=deny]").click()  # without a note: refused
        expect(page.locator(f"#approval-{approval_b} .approval__error")).to_contain_text(
            "note")
        page.locator(f"#approval-{approval_b} textarea[name=note]").fill(
            "refunds over the phone only")
        page.locator(f"#approval-{approval_b} button[value=deny]").click()
        expect(page.locator(f"#approval-{approval_b}")).to_have_attribute(
            "data-status", "denied", timeout=15_000)
        poller.join(40)
        decision = results["b"]["body"]["decision"]
        assert (decision["decision"], decision["reason"]) == ("stop", "approval_denied")
        assert "refunds over the phone only" in decision["message"]
        resent = agent.check(run_b, action=PAY, check_id="refund-b")
        assert resent["reason"] == "approval_denied"
        assert "refunds over the phone only" in resent["message"]
        assert page.evaluate("window.__sameDocument") is True

    assert Approval.objects.get(pk=approval_a).decided_by_label == "operator"
    run = Run.objects.get(pk=run_b)
    assert (run.status, run.stop_reason) == ("stopped", "approval_denied")


def test_the_list_does_not_move_under_the_operators_hand(server, agent, team, users):
    """Found by a newcomer: the request under the mouse was decided by someone else, the list
    redrew, the next request moved up under the pointer and the click approved it. While the
    pointer is over a card, the live list is held; it catches up once the pointer leaves."""
    import httpx
    from playwright.sync_api import expect

    from policies.tokens import operator_token_create

    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_seconds": None})
    cookie = session_cookie(users["operator"])
    other = operator_token_create(user=users["admin"], name="other", role="admin").secret
    pending = []
    for bot in ("support-bot", "billing-bot"):
        run_id = agent.start(agent=bot)["run_id"]
        pending.append(agent.check(run_id, action=PAY, check_id=f"pay-{bot}")["approval"]["id"])
    first, second = pending

    with signed_in_page(server, cookie) as page:
        page.goto(f"/teams/{team.slug}/approvals/")
        expect(page.locator("[data-live-status]")).to_have_text("Live", timeout=15_000)
        cards = page.locator("#approvals-list .approval")
        expect(cards.first).to_have_attribute("id", f"approval-{first}")
        page.hover(f"#approval-{first} button[value=approve]")
        # Someone else denies the request under the operator's pointer.
        denied = httpx.post(f"{server.url}/api/v1/approvals/{first}/decide",
                            json={"decision": "deny", "note": "not today"},
                            headers={"Authorization": f"Bearer {other}"}, timeout=30)
        assert denied.status_code == 200, denied.text
        list_region = page.locator("#approvals-list")
        box = page.locator(f"#approval-{first} button[value=approve]").bounding_box()
        for i in range(60):  # the operator's hand moves over the card, about to click
            page.mouse.move(box["x"] + 2 + i % 5, box["y"] + box["height"] / 2)
            if list_region.get_attribute("data-held") == "true":
                break
            page.wait_for_timeout(250)
        expect(list_region).to_have_attribute("data-held", "true")
        # Held: the card under the pointer is still the one the operator aimed at.
        expect(cards.first).to_have_attribute("id", f"approval-{first}")
        expect(page.locator(f"#approval-{first}")).to_have_attribute("data-status",
                                                                      "pending")
        page.mouse.move(0, 0)  # the hand leaves: the list catches up
        expect(page.locator(f"#approval-{first}")).to_have_attribute(
            "data-status", "denied", timeout=15_000)
        expect(list_region).not_to_have_attribute("data-held", "true")
        expect(page.locator(f"#approval-{second}")).to_have_attribute("data-status",
                                                                       "pending")
    assert Approval.objects.get(pk=second).status == "pending"
