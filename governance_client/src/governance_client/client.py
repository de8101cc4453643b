"""The agent's side of the check API (SPEC 5): start a run, check every action, finish.

Typical use::

    with GovernanceClient(url, key) as client, client.run("support-bot", task=question) as run:
        while True:
            action = model.next_action(history)
            decision = run.check(action.name, action.args)
            if not decision.allowed:
                run.output = decision.user_notice(partial_response)
                break
            run.report(execute(action))
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal

import httpx

from .decision import GOVERNANCE_UNAVAILABLE, Decision
from .errors import ApiError, GovernanceError, GovernanceUnavailable, RunFinished, api_error
from .keys import normalize_text
from .local import LocalLedger, LocalLimits

__all__ = ["FailMode", "GovernanceClient", "Run", "result_digest"]

logger = logging.getLogger("governance_client")

FailMode = Literal["closed", "open"]
ActionType = Literal["tool", "llm", "other"]
FinishStatus = Literal["completed", "failed", "stopped"]

RETRY_STATUSES = frozenset({502, 503, 504})
MAX_BACKOFF_S = 5.0
TEXT_LIMIT = 2000  # SPEC 5.2: error and summary are at most 2,000 characters
DIGEST_LIMIT = 128

UNAVAILABLE_NEXT_ACTION = (
    "Do not run this action: return the partial response and try again later, once the "
    "governance service is reachable."
)


class GovernanceClient:
    """A connection to the governance service, shared by the runs of one agent process.

    ``fail_mode`` says what a check answers when the service cannot be reached (connection error,
    timeout or 5xx, after ``retries`` retries spaced by ``backoff * 2**n`` seconds):

    * ``"closed"`` (default): a stop with reason ``governance_unavailable``; ``start_run`` raises
      ``GovernanceUnavailable``. Nothing runs ungoverned.
    * ``"open"``: the agent goes on under ``local_limits`` (``max_steps``, ``max_repeat_action``;
      by default the step limits of the run's policy), decided by the client (``Decision.local``).
      If ``start_run`` itself cannot reach the service, the run is started locally, with a
      ``local-…`` id, and every check of it is decided locally.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 5.0,
        fail_mode: FailMode = "closed",
        local_limits: LocalLimits | None = None,
        retries: int = 2,
        backoff: float = 0.25,
        http_client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if fail_mode not in ("closed", "open"):
            raise ValueError(f"fail_mode must be 'closed' or 'open', not {fail_mode!r}")
        if retries < 0 or backoff < 0:
            raise ValueError("retries and backoff must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.fail_mode: FailMode = fail_mode
        self.local_limits = local_limits
        self.retries = retries
        self.backoff = backoff
        self._sleep = sleep
        self._headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json"}
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(timeout=timeout, transport=transport)

    def __enter__(self) -> GovernanceClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def start_run(
        self,
        agent: str,
        *,
        task: str | None = None,
        policy: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        external_id: str | None = None,
    ) -> Run:
        """Start a run (``POST /api/v1/runs``); with a known ``external_id``, resume that run.

        Raises ``KillSwitchEngaged`` (409), ``InvalidRequest`` (422, e.g. an unknown policy) and
        other ``ApiError``; ``GovernanceUnavailable`` only with ``fail_mode="closed"``.
        """
        body: dict[str, Any] = {"agent": agent}
        optional = {"task": task, "policy": policy, "metadata": metadata}
        body.update({k: v for k, v in optional.items() if v is not None})
        if external_id is not None:
            body["external_id"] = external_id
        try:
            # Without an external_id a replayed POST could start a second run, so only the
            # failures that prove the request was not processed are retried.
            response = self._send("POST", "/api/v1/runs", body, replay_safe=external_id is not None)
        except GovernanceUnavailable as exc:
            if self.fail_mode == "closed":
                raise
            logger.warning("governance unreachable, run of %s started locally: %s", agent, exc)
            data = {"run_id": f"local-{uuid.uuid4().hex}", "status": "running", "agent": agent}
            return Run(self, data, local=True)
        return Run(self, self._expect(response, 200, 201))

    @contextmanager
    def run(
        self,
        agent: str,
        *,
        task: str | None = None,
        policy: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        external_id: str | None = None,
    ) -> Iterator[Run]:
        """``start_run`` as a context manager that always finishes the run.

        On exit the run is finished ``stopped`` if a decision stopped it, ``failed`` if the block
        raised (the exception propagates), else ``completed``; with ``run.output`` in every case,
        so a partial response is never lost. A run finished inside the block is left alone.
        """
        run = self.start_run(
            agent, task=task, policy=policy, metadata=metadata, external_id=external_id
        )
        try:
            yield run
        except BaseException:
            try:
                run._finish_on_exit(failed=True)
            except GovernanceError:
                # The agent's own exception is the one worth seeing.
                logger.exception("could not finish run %s", run.id)
            raise
        run._finish_on_exit(failed=False)

    # -- HTTP ---------------------------------------------------------------------------------

    def _send(
        self, method: str, path: str, body: Any = None, *, replay_safe: bool = True
    ) -> httpx.Response:
        """Send with bounded retries; raise ``GovernanceUnavailable`` once they are spent."""
        failure = ""
        attempts = 0
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(min(self.backoff * 2 ** (attempt - 1), MAX_BACKOFF_S))
            attempts += 1
            try:
                response = self._http.request(
                    method, self.base_url + path, json=body, headers=self._headers
                )
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                not_sent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                if replay_safe or not_sent:
                    continue
                break
            status = response.status_code
            if status in RETRY_STATUSES:
                failure = f"HTTP {status}"
                # A 503 is the service saying it did nothing; a 502/504 may hide a success.
                if replay_safe or status == 503:
                    continue
                break
            if status >= 500:
                raise GovernanceUnavailable(f"{method} {path}: HTTP {status}")
            return response
        raise GovernanceUnavailable(
            f"{method} {path} failed after {attempts} attempt(s): {failure}"
        )

    @staticmethod
    def _expect(response: httpx.Response, *ok: int) -> dict[str, Any]:
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code not in ok:
            raise api_error(response.status_code, body)
        if not isinstance(body, dict):
            raise ApiError(response.status_code, "invalid_response", "expected a JSON object")
        return body


class Run:
    """One run of an agent. Check every action with ``check``, report its outcome with
    ``report``, end with ``finish`` (or let ``GovernanceClient.run`` do it)."""

    def __init__(self, client: GovernanceClient, data: Mapping[str, Any], *, local: bool = False):
        self._client = client
        self.data: dict[str, Any] = dict(data)
        self.id = str(data["run_id"])
        self.agent: str | None = data.get("agent")
        self.status: str = str(data.get("status") or "running")
        self.local = local
        #: The final or partial response, sent by ``finish``.
        self.output: str | None = None
        #: The first decision that stopped the run, if any.
        self.stop_decision: Decision | None = None
        self.last_decision: Decision | None = None
        self.finished = False
        limits = client.local_limits or LocalLimits.from_policy(data.get("policy"))
        self._ledger = LocalLedger(limits)
        self._pending: dict[str, Any] | None = None
        # Checks of one run are serialized, as on the server: the ledger and the pending
        # result belong to one sequence of actions.
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<Run {self.id} {self.status}{' local' if self.local else ''}>"

    @property
    def pending_result(self) -> dict[str, Any] | None:
        """The outcome reported since the last check, which the next check will send."""
        return self._pending

    def check(
        self,
        name: str,
        args: Mapping[str, Any] | None = None,
        *,
        type: ActionType = "tool",
        progress: str | int | float | None = None,
        last_result: Mapping[str, Any] | None = None,
        cost_usd: float | None = None,
    ) -> Decision:
        """Ask whether the action may run. Call it after choosing the action, before running it.

        ``last_result`` defaults to what ``report`` recorded. Retries reuse one ``check_id``, so
        the service counts the check once however many times it is sent.
        """
        with self._lock:
            if self.local or self._ledger.stop is not None:
                return self._remember(self._ledger.decide(name, args))
            result = dict(last_result) if last_result is not None else self._pending
            body: dict[str, Any] = {
                "check_id": uuid.uuid4().hex,
                "action": {"name": name, "args": dict(args or {}), "type": type},
            }
            if progress is not None:
                body["progress"] = progress
            if result is not None:
                body["last_result"] = result
            if cost_usd is not None:
                body["cost_usd"] = cost_usd
            # A result describes one action: sent (or lost to an outage), it is not sent again.
            self._pending = None
            try:
                response = self._client._send("POST", f"/api/v1/runs/{self.id}/check", body)
            except GovernanceUnavailable as exc:
                return self._remember(self._unavailable(name, args, str(exc)))
            decision = Decision.from_response(self._client._expect(response, 200))
            self._ledger.record(name, args, decision)
            return self._remember(decision)

    def report(
        self,
        result: Any = None,
        *,
        error: BaseException | str | None = None,
        summary: str | None = None,
        digest: str | None = None,
    ) -> dict[str, Any]:
        """Record the outcome of the last allowed action; the next ``check`` sends it.

        With ``error`` the outcome is ``status: error`` (the error text is what the service counts
        for repeated errors); otherwise ``ok`` with ``digest`` defaulting to
        ``result_digest(result)`` (none when ``result`` is None). A result whose digest was seen
        before counts as no progress (SPEC 4.3).
        """
        entry: dict[str, Any] = {"status": "ok" if error is None else "error"}
        if error is not None:
            text = str(error)
            if not text and isinstance(error, BaseException):
                text = type(error).__name__
            entry["error"] = normalize_text(text)[:TEXT_LIMIT]
        if digest is None and error is None and result is not None:
            digest = result_digest(result)
        if digest is not None and len(digest) > DIGEST_LIMIT:
            digest = hashlib.sha256(digest.encode()).hexdigest()
        if digest is not None:
            entry["digest"] = digest
        if summary is not None:
            entry["summary"] = summary[:TEXT_LIMIT]
        with self._lock:
            self._pending = entry
        return entry

    def finish(self, status: FinishStatus, output: str | None = None) -> dict[str, Any] | None:
        """End the run (``POST .../finish``) with the final or partial response.

        A run that was already finished (409 ``run_finished``) is not an error: finishing is
        idempotent here. Returns the run as the service has it, or None if it had nothing to say.
        """
        if output is not None:
            self.output = output
        if self.local:
            self.status = status if self.status == "running" else self.status
            self.finished = True
            return None
        body: dict[str, Any] = {"status": status}
        if self.output is not None:
            body["output"] = self.output
        response = self._client._send("POST", f"/api/v1/runs/{self.id}/finish", body)
        try:
            data = self._client._expect(response, 200)
        except RunFinished:
            self.finished = True
            return None
        self.finished = True
        self.status = str(data.get("status") or status)
        self.data.update(data)
        return data

    def _finish_on_exit(self, *, failed: bool) -> None:
        if self.finished:
            return
        status: FinishStatus = "failed" if failed else "completed"
        if self.stop_decision is not None:
            status = "stopped"
        try:
            self.finish(status)
        except GovernanceUnavailable as exc:
            # The agent's work is done either way; the service will see the run as still running.
            logger.warning("could not finish run %s (%s): %s", self.id, status, exc)

    def _unavailable(self, name: str, args: Mapping[str, Any] | None, detail: str) -> Decision:
        if self._client.fail_mode == "open":
            logger.warning("governance unreachable, deciding %s locally: %s", name, detail)
            return self._ledger.decide(name, args)
        return Decision(
            decision="stop",
            reason=GOVERNANCE_UNAVAILABLE,
            message=f"The governance service is unreachable ({detail}); fail_mode='closed' "
            "stops every action until it answers again.",
            next_action=UNAVAILABLE_NEXT_ACTION,
            local=True,
        )

    def _remember(self, decision: Decision) -> Decision:
        self.last_decision = decision
        if not decision.allowed and self.stop_decision is None:
            self.stop_decision = decision
            if decision.reason != "run_finished":
                self.status = "killed" if decision.reason == "killed" else "stopped"
        return decision


def result_digest(result: Any) -> str:
    """SHA-256 hex of a stable serialization: the same output always gives the same digest.

    Text is hashed as UTF-8, bytes as is, anything else as sorted-keys JSON (dataclasses and
    objects with ``model_dump`` as their fields). Pass ``digest=`` to ``report`` for objects
    whose ``str`` is not stable.
    """
    if isinstance(result, bytes | bytearray):
        data = bytes(result)
    elif isinstance(result, str):
        data = result.encode("utf-8")
    else:
        try:
            text = json.dumps(
                result, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain
            )
        except (TypeError, ValueError):
            text = repr(result)
        data = text.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):
        return model_dump()
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    return str(value)
