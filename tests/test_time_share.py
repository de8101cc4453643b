"""The token bucket of time that paces the work which is not the checks' (governance/shares.py):
the live screens' looks and the agents' bulk calls."""

from __future__ import annotations

import pytest

from governance import shares
from governance.shares import TimeShare


def test_the_next_piece_of_work_waits_what_the_last_took_over_the_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(shares.time, "monotonic", lambda: now[0])
    share = TimeShare(burst_s=0.25)
    assert share.wait_s(0.2) == 0.0  # a quiet process starts work at once
    share.spend(1.0)
    assert share.wait_s(0.2) == pytest.approx(5.0)  # 1 s of work at a fifth: 5 s
    now[0] += 2.0
    assert share.wait_s(0.2) == pytest.approx(3.0)  # paid back as time passes
    now[0] += 100.0
    assert share.wait_s(0.2) == 0.0
    share.spend(0.3)  # a long quiet time saved no more than the burst
    assert share.wait_s(0.2) == pytest.approx((0.3 - 0.25) / 0.2)
    share.forgive()
    assert share.wait_s(0.2) == 0.0


def test_a_share_out_of_range_is_taken_as_its_nearest_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(shares.time, "monotonic", lambda: now[0])
    share = TimeShare(burst_s=0.0)
    share.spend(0.1)
    assert share.wait_s(5.0) == pytest.approx(0.1)  # at most all of the time
    assert share.wait_s(0.0) == pytest.approx(1000.0)  # at least a ten-thousandth


def test_a_piece_owes_what_the_last_took_as_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pieces that overlap: counted only as each ended, the ones asked for while another ran
    # found nothing owed and all started together (docs/performance.md, `heavy_reads`).
    now = [0.0]
    monkeypatch.setattr(shares.time, "monotonic", lambda: now[0])
    share = TimeShare(burst_s=0.0)
    assert share.begin() is None  # nothing to expect yet: the caller keeps the turn
    share.spend(0.5)
    now[0] += 2.5  # paid back at a fifth
    assert share.wait_s(0.2) == 0.0
    begun = share.begin()
    assert begun == 0.5
    assert share.wait_s(0.2) == pytest.approx(2.5)  # the next waits while this one runs
    share.spend(0.7, begun)  # it took more than expected: only the difference comes off
    assert share.wait_s(0.2) == pytest.approx(3.5)
    assert share.begin() == 0.7
