"""One application error (governance/errors.py): every refusal of the services is an AppError
with an HTTP status and a code, whatever the module that raises it, and the agent API answers
any of them in the SPEC 5.3 envelope."""

from __future__ import annotations

from typing import Any

import pytest

from governance.errors import AppError
from runs.approvals.services import ApprovalError
from runs.approvals.waits import RETRY_AFTER_S, TooManyWaits
from runs.check.api import _on_refusal
from runs.check.services import ServiceError
from runs.killswitch.services import KillSwitchError, resolve_target
from runs.webhooks.delivery import SendTestRefused


def test_every_refusal_of_the_services_is_the_application_error() -> None:
    for refusal in (ServiceError, ApprovalError, TooManyWaits, SendTestRefused,
                    KillSwitchError):
        assert issubclass(refusal, AppError)


def test_a_kill_switch_refusal_has_its_status_and_code() -> None:
    with pytest.raises(AppError) as refused:
        resolve_target(scope="nowhere")
    assert (refused.value.status, refused.value.code) == (422, "invalid_request")
    assert str(refused.value) == refused.value.message
    assert refused.value.message.startswith("Unknown scope 'nowhere'")


def test_the_api_answers_an_application_error_in_the_envelope_with_its_retry_after(
        rf: Any) -> None:
    refused = AppError(429, "too_many_waits", "Wait.", retry_after_s=RETRY_AFTER_S)
    response = _on_refusal(rf.get("/"), refused)
    assert response.status_code == 429
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    assert response.content == (b'{"error": {"code": "too_many_waits", "message": "Wait.", '
                                b'"fields": {}}}')
    plain = _on_refusal(rf.get("/"), AppError(404, "not_found", "No such run.", {"x": "y"}))
    assert not plain.has_header("Retry-After")
    assert plain.status_code == 404
