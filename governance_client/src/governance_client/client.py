# Generated from aio.py by governance_client/scripts/unasync_client.py: do not edit.
# Edit aio.py and run the script again (a test fails while this file is not current).
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

``AsyncGovernanceClient`` (``governance_client.aio``) has the same surface for asyncio code.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Callable, Mapping
from contextlib import contextmanager
from decimal import Decimal
from types import TracebackType
from typing import Any, Literal

import httpx
import tenacity

from ._core import (
    MAX_POLL_S,
    ActionType,
    FailMode,
    FinishStatus,
    PreparedCheck,
    Retryable,
    RunCore,
    Settings,
    approval_final,
    approval_limit,
    attempt_timeout,
    classify_error,
    classify_response,
    constant,
    expect,
    gave_up,
    local_start,
    poll_deadline,
    result_digest,
    retry_policy,
    service_root,
    start_body,
    subagent_fallback,
    traced_headers,
)
from ._transport import Sleep, send_once, sync_sleep
from .decision import DEADLINE_EXPIRED, Decision
from .errors import (
    ApiError,
    GovernanceError,
    GovernanceUnavailable,
    RunFinished,
    agent_key_problem,
)
from .journal import Journal, default_folder
from .local import LocalLimits

__all__ = ["GovernanceClient", "Run", "FailMode", "result_digest"]

logger = logging.getLogger("governance_client")


class GovernanceClient:
    """A connection to the governance service, shared by the runs of one agent process.

    Every request has one overall ``deadline`` (seconds, default 2): the attempts (at most
    ``attempts``, default 3) and the waits between them (full jitter from ``backoff``, capped
    at ``max_backoff``; a 429's or 503's ``Retry-After`` when given) all fit in it. A check
    sends what is left of it to the service (``deadline_ms``), which refuses to decide past it.

    ``fail_mode`` says what a check answers when the service cannot be reached in time:

    * ``"closed"`` (default): a stop with reason ``governance_unavailable``; ``start_run`` raises
      ``GovernanceUnavailable``. Nothing runs ungoverned.
    * ``"open"``: the client decides with the server's own rules (``governance_client.rules``)
      and the run's policy, or ``local_limits`` (``Decision.local``); the decisions are
      uploaded, marked local, once the service answers again. If ``start_run`` itself cannot
      reach the service, the run is started locally, with a ``local-…`` id.

    A check answered ``wait`` (a rate limit, SPEC 12) is retried after ``retry_after_s`` for up
    to ``wait_budget`` seconds (``wait_for_rate_limits=False`` returns it at once); a check
    answered ``pending`` (an approval, SPEC 11) waits for the operator's decision until the
    approval expires, or ``approval_timeout`` seconds if set.

    ``api_key`` is the agent key as it was issued: one with a space, a line break or another
    character no HTTP header can carry is refused here (``ValueError`` naming the character
    and where it is, never the key), not stripped.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        deadline: float = 2.0,
        attempts: int | None = None,
        backoff: float = 0.1,
        max_backoff: float = 1.0,
        fail_mode: FailMode = "closed",
        local_limits: LocalLimits | None = None,
        wait_for_rate_limits: bool = True,
        wait_budget: float = 30.0,
        approval_timeout: float | None = None,
        journal: str | os.PathLike[str] | Literal[False] | None = None,
        retries: int | None = None,
        timeout: float | None = None,
        http_client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Sleep = sync_sleep,
    ) -> None:
        # ``retries`` and ``timeout`` are the first version's names: n retries are n + 1
        # attempts, and a timeout (per attempt then) becomes the overall deadline.
        if attempts is None:
            attempts = 3 if retries is None else retries + 1
        if timeout is not None and deadline == 2.0:
            deadline = timeout
        problem = agent_key_problem(api_key)
        if problem is not None:
            # A key that no request can carry is this machine's mistake, not an outage: said
            # now, once, rather than as "unreachable" at every check (fail-open then ran
            # every action ungoverned).
            raise ValueError(f"{problem}: give the key exactly as it was issued (agent keys "
                             "are printable ASCII, gov_..., without spaces); the key is not "
                             "shown here")
        self.settings = Settings(
            base_url=service_root(base_url), api_key=api_key, deadline=deadline,
            attempts=attempts, backoff=backoff, max_backoff=max_backoff, fail_mode=fail_mode,
            local_limits=local_limits, wait_for_rate_limits=wait_for_rate_limits,
            wait_budget=wait_budget, approval_timeout=approval_timeout,
        )
        self._sleep = sleep
        self._journal = None if journal is False else Journal(
            default_folder() if journal is None else journal, self.settings.base_url, api_key)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(transport=transport)

    @property
    def base_url(self) -> str:
        return self.settings.base_url

    @property
    def fail_mode(self) -> FailMode:
        return self.settings.fail_mode

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
        parent_run_id: str | None = None,
    ) -> Run:
        """Start a run (``POST /api/v1/runs``); with a known ``external_id``, resume that run.
        ``parent_run_id``: start it as a sub-agent's run under that run (SPEC 20; or use
        ``run.child``).

        Raises ``KillSwitchEngaged`` (409), ``ParentFinished`` (409), ``InvalidRequest`` (422,
        e.g. an unknown policy) and other ``ApiError``; ``GovernanceUnavailable`` only with
        ``fail_mode="closed"``.
        """
        body = start_body(agent, task=task, policy=policy, metadata=metadata,
                          external_id=external_id, parent_run_id=parent_run_id)
        try:
            # Safe to send again: the body has an external_id (the author's or the client's).
            response = self._send("POST", "/api/v1/runs", lambda _: body)
        except GovernanceUnavailable as exc:
            if self.fail_mode == "closed":
                raise
            logger.warning("governance unreachable, run of %s started locally: %s", agent, exc)
            return Run(self, local_start(agent), local=True)
        run = Run(self, expect(response, 200, 201))
        # The service answers: what earlier runs left in the journal goes now (after the
        # start, so that an outage costs a start one deadline, not two).
        self._replay_journal()
        return run

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
        After the block, the run refuses checks (``RunClosed``).
        """
        run = self.start_run(
            agent, task=task, policy=policy, metadata=metadata, external_id=external_id
        )
        with _finishing(run):
            yield run

    # -- HTTP ---------------------------------------------------------------------------------

    def _keep(self, core: RunCore, finish: dict[str, Any]) -> None:
        if self._journal is not None:
            self._journal.save(core.id, decisions=list(core.unsynced), finish=finish)

    def _replay_journal(self) -> None:
        """Send what runs of this service and key left in the journal (their local
        decisions, then their finish), oldest first; stop at the first outage."""
        if self._journal is None:
            return
        for entry in self._journal.pending():
            run = Run(self, {"run_id": entry["run_id"], "status": "running"})
            run._core.unsynced = entry["decisions"]
            finish = entry["finish"]
            try:
                run.finish(finish.get("status") or "completed", finish.get("output"))
            except GovernanceUnavailable:
                return  # still unreachable: kept for the next start
            except ApiError as exc:
                logger.warning("journal entry of run %s refused, dropped: %s",
                               entry["run_id"], exc)
            self._journal.done(entry["run_id"])

    def _send(
        self,
        method: str,
        path: str,
        body: Callable[[float], Any] | None = None,
        *,
        replay_safe: bool = True,
        deadline: float | None = None,
        params: Mapping[str, Any] | None = None,
        hold: float = 0.0,
    ) -> httpx.Response:
        """Send within one deadline, retrying what may be retried (tenacity); raise
        ``GovernanceUnavailable`` once the attempts or the time are spent. ``body`` builds
        the body from the seconds left (a check sends them to the service); ``hold`` is how
        long the service keeps the request open on purpose (a long poll)."""
        budget = self.settings.deadline if deadline is None else deadline
        ends = time.monotonic() + budget
        url = self.settings.base_url + path
        headers = traced_headers(self.settings.headers)  # the caller's trace context, now
        attempts = 0

        def attempt() -> httpx.Response:
            nonlocal attempts
            attempts += 1
            remaining = ends - time.monotonic()
            if remaining <= 0:
                raise GovernanceUnavailable("deadline spent", timed_out=True)
            timeout = attempt_timeout(remaining, self.settings.attempts - attempts + 1, hold)
            try:
                response = send_once(
                    self._http, method, url, timeout,
                    json=body(remaining) if body is not None else None,
                    params=params, headers=headers,
                )
            except httpx.TransportError as exc:
                lost = classify_error(exc, replay_safe=replay_safe,
                                      secret=self.settings.api_key)
                # Its chain is set: the error, or none where the error names the key.
                raise lost  # noqa: B904
            failure = classify_response(response, replay_safe=replay_safe)
            if failure is not None:
                raise failure
            return response

        try:
            return tenacity.Retrying(
                sleep=self._sleep, **retry_policy(self.settings, budget)
            )(attempt)
        except (Retryable, GovernanceUnavailable) as exc:
            raise gave_up(method, path, exc, attempts, budget) from exc


class Run:
    """One run of an agent. Check every action with ``check``, report its outcome with
    ``report``, end with ``finish`` (or let ``GovernanceClient.run`` do it)."""

    def __init__(
        self, client: GovernanceClient, data: Mapping[str, Any], *, local: bool = False
    ) -> None:
        self._client = client
        self._core = RunCore(client.settings, data, local=local)
        self.id = self._core.id
        self.agent = self._core.agent
        self.data = self._core.data
        self.local = local

    def __repr__(self) -> str:
        return f"<Run {self.id} {self.status}{' local' if self.local else ''}>"

    # The run's memory lives in the core, shared by the two clients.
    @property
    def status(self) -> str:
        return self._core.status

    @property
    def output(self) -> str | None:
        """The final or partial response, sent by ``finish``."""
        return self._core.output

    @output.setter
    def output(self, value: str | None) -> None:
        self._core.output = value

    @property
    def stop_decision(self) -> Decision | None:
        """The first decision that stopped the run, if any."""
        return self._core.stop_decision

    @property
    def last_decision(self) -> Decision | None:
        return self._core.last_decision

    @property
    def subagent_stop(self) -> Decision | None:
        """The sub-agent's stop this run's agent ended with, if any (``subagent_stopped``)."""
        return self._core.subagent_stop

    def subagent_stopped(self, decision: Decision, notice: str | None = None) -> None:
        """Say that this run's agent ends with a sub-agent's stop (``decision``, a child
        run's): what the shipped integrations call when a handoff's receiver or a subgraph
        was stopped and the agent ends there. The child's stop does not stop this run on the
        service (SPEC 20), but its agent is over: this run is then finished ``stopped``
        (the service records ``agent_stopped``), with ``notice`` (what the user was shown;
        default the stop's ``user_notice()``) as its output unless you set one. A later
        check of this run, or a new child, means the agent went on: it is forgotten."""
        self._core.subagent_stopped(decision, notice)

    def exit_status(self, *, failed: bool = False) -> FinishStatus:
        """The status this run's block finishes it with: ``stopped`` if a decision stopped
        it, its last check was not allowed or a sub-agent's stop ended its agent; else
        ``failed`` when ``failed``, else ``completed``."""
        return self._core.exit_status(failed=failed)

    @property
    def finished(self) -> bool:
        return self._core.finished

    @property
    def pending_result(self) -> dict[str, Any] | None:
        """The oldest outcome reported and not yet sent, which the next check will carry."""
        return next(iter(self._core.pending.values()), None)

    @property
    def pending_results(self) -> dict[str, dict[str, Any]]:
        """Every outcome not yet sent, by tool call id, oldest first."""
        return dict(self._core.pending)

    @property
    def unsynced(self) -> list[dict[str, Any]]:
        """Decisions made locally during an outage and not yet uploaded."""
        return list(self._core.unsynced)

    @property
    def kept(self) -> list[dict[str, Any]]:
        """A run started locally: what it decided, which no upload can send (no run on the
        service), until a run started there later takes it over (``adopt``)."""
        return list(self._core.kept)

    def adopt(self, local: Run) -> None:
        """Take over ``local``, a run started locally because the service was unreachable,
        now that this one was started on the service for the same work (`RunCore.adopt`):
        its decisions are uploaded, marked local, before this run's next check."""
        self._core.adopt(local._core)

    def check(
        self,
        name: str,
        args: Mapping[str, Any] | None = None,
        *,
        type: ActionType = "tool",
        progress: str | int | float | None = None,
        last_result: Mapping[str, Any] | None = None,
        cost_usd: float | Decimal | None = None,
        call_id: str | None = None,
    ) -> Decision:
        """Ask whether the action may run. Call it after choosing the action, before running it.

        ``last_result`` defaults to the oldest result ``report`` recorded. Retries reuse one
        ``check_id``, so the service counts the check once however many times it is sent.
        ``call_id`` (the framework's tool call id) is echoed in ``Decision.call_id``.
        """
        core = self._core
        with core.lock:
            prepared = core.prepare(name, args, type=type, progress=progress,
                                    last_result=last_result, cost_usd=cost_usd, call_id=call_id)
            offline = core.decide_offline(prepared)
            if offline is not None:
                return offline
            self._upload()
            return self._ask(prepared)

    def _ask(self, prepared: PreparedCheck) -> Decision:
        core, client = self._core, self._client
        waited = 0.0  # the sleeps asked for: deterministic with an injected sleep
        path = f"/api/v1/runs/{self.id}/check"
        while True:
            try:
                response = client._send("POST", path, prepared.with_deadline)
            except GovernanceUnavailable as exc:
                return core.local_decision(prepared, str(exc), timed_out=exc.timed_out)
            decision = Decision.from_response(expect(response, 200), check_id=prepared.check_id,
                                              call_id=prepared.call_id)
            if decision.reason == DEADLINE_EXPIRED:
                # The service saw the deadline pass and decided nothing (audited expired).
                return core.local_decision(prepared, "the service answered after the deadline",
                                           timed_out=True)
            if decision.decision == "wait" and client.settings.wait_for_rate_limits:
                delay = max(decision.retry_after_s or 0.0, 0.001)
                if waited + delay <= client.settings.wait_budget:
                    waited += delay
                    # Said, so an agent that seems to hang is explained (found by a new agent
                    # author: a check slept, and nothing said why).
                    logger.info("%s is rate limited (run %s): checking it again in %.3g s",
                                prepared.name, self.id, delay)
                    client._sleep(delay)
                    continue  # SPEC 12: the same body again; a wait is decided again
            if decision.decision == "wait":
                decision = core.wait_given_up(prepared, decision, waited)
            if decision.decision == "pending":
                decision = self._await_approval(prepared, decision)
            return core.answered(prepared, decision)

    def _await_approval(self, prepared: PreparedCheck, pending: Decision) -> Decision:
        """Long-poll the approval until it is decided, expires, or the author's timeout."""
        client = self._client
        approval_id = (pending.approval or {}).get("id")
        if not approval_id:
            return pending
        self._core.awaiting_approval(prepared)
        # A check may wait here for minutes: said once, with what it waits for.
        logger.info("%s waits for an operator's approval %s (run %s, expires at %s): the "
                    "check returns once it is decided", prepared.name, approval_id, self.id,
                    (pending.approval or {}).get("expires_at"))
        started = time.monotonic()
        limit = approval_limit(client.settings, pending, started) - started
        # Time spent, by the clock or by the polls that came back still pending (a fake
        # service answers at once: its polls still add up to the time they asked for).
        polled = 0.0
        while (left := limit - max(time.monotonic() - started, polled)) > 0:
            wait = int(min(MAX_POLL_S, left))
            try:
                response = client._send(
                    "GET", f"/api/v1/approvals/{approval_id}", params={"wait": wait},
                    deadline=poll_deadline(client.settings, wait), hold=wait,
                )
                body = expect(response, 200)
            except GovernanceUnavailable as exc:
                if exc.timed_out:
                    # Slow, not gone: the service took the poll and did not answer in time.
                    # The approval's own timeout bounds the wait, not one late read (found
                    # by a newcomer: such a read ended the wait, the run's block finished
                    # the run, and that cancelled the approval the operator was deciding).
                    logger.info("approval %s: a poll got no answer in time, polling again: %s",
                                approval_id, exc)
                    polled += wait or min(left, 1.0)
                    continue
                # Unreachable: an action waiting for a person is never allowed locally.
                self._core.gave_up_waiting(prepared)
                return self._core.local_decision(prepared, str(exc), allow_local=False)
            final = approval_final(body, prepared)
            if final is not None:
                return final
            if body.get("status") != "pending":
                # Decided, but the answer did not carry it: the same check_id asks again.
                response = client._send("POST", f"/api/v1/runs/{self.id}/check",
                                              prepared.with_deadline)
                again = Decision.from_response(expect(response, 200),
                                               check_id=prepared.check_id,
                                               call_id=prepared.call_id)
                if again.decision != "pending":
                    return again
            polled += wait
            if wait == 0:
                polled += min(left, 1.0)
                client._sleep(min(left, 1.0))
        return self._core.approval_given_up(prepared, pending,
                                            max(time.monotonic() - started, polled))

    def _upload(self) -> None:
        """Send the decisions made locally during an outage (best effort: kept on failure)."""
        core = self._core
        while (body := core.upload_body()) is not None:
            sent = len(body["decisions"])
            try:
                response = self._client._send(
                    "POST", f"/api/v1/runs/{self.id}/local-decisions", constant(body))
                data = expect(response, 200)
            except GovernanceUnavailable:
                return
            except GovernanceError as exc:
                if core.refused(sent, exc):
                    continue
                return
            core.uploaded(sent, data)

    def report(
        self,
        result: Any = None,
        *,
        error: BaseException | str | None = None,
        summary: str | None = None,
        digest: str | None = None,
        call_id: str | None = None,
    ) -> dict[str, Any]:
        """Record the outcome of an allowed action; the next ``check`` sends it.

        With ``error`` the outcome is ``status: error`` (the error text is what the service counts
        for repeated errors); otherwise ``ok`` with ``digest`` defaulting to
        ``result_digest(result)`` (none when ``result`` is None). A result whose digest was seen
        before counts as no progress (SPEC 4.3). With parallel tool calls, pass each call's
        ``call_id``: every result is kept and sent, oldest first, one per later check; a
        second report of the same ``call_id`` replaces the first.
        """
        return self._core.report(result, error=error, summary=summary, digest=digest,
                                 call_id=call_id)

    def finish(
        self, status: FinishStatus, output: str | None = None
    ) -> dict[str, Any] | None:
        """End the run (``POST .../finish``) with the final or partial response.

        A run that was already finished (409 ``run_finished``) is not an error: finishing is
        idempotent here. Returns the run as the service has it, or None if it had nothing to say.
        """
        core = self._core
        body = core.finish_body(status, output)
        if self.local:
            core.finished_with(status, None)
            return None
        with core.lock:
            self._upload()
        if core.unsynced:
            # Finished without them, the run would not count actions that ran: both wait,
            # on disk, for the next start (governance_client.journal).
            self._client._keep(core, body)
            raise GovernanceUnavailable(
                f"run {self.id}: {len(core.unsynced)} local decision(s) not uploaded")
        try:
            response = self._client._send("POST", f"/api/v1/runs/{self.id}/finish",
                                                lambda _: body)
            data = expect(response, 200)
        except RunFinished:
            core.finished_with(status, None)
            return None
        except GovernanceUnavailable:
            self._client._keep(core, body)
            raise
        core.finished_with(status, data)
        return data

    def start_child(
        self,
        agent: str,
        *,
        task: str | None = None,
        policy: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        external_id: str | None = None,
    ) -> Run:
        """Start a sub-agent's run under this one (SPEC 20): its checks count on this run
        too, and this run's limits bound it. Its policy defaults to this run's. A run that
        started locally (the service unreachable) starts its children locally too."""
        self._core.went_on()
        if self.local:
            return Run(self._client, local_start(agent), local=True)
        return self._client.start_run(agent, task=task, policy=policy,
                                            metadata=metadata, external_id=external_id,
                                            parent_run_id=self.id)

    def start_subagent(self, name: str) -> Run:
        """A framework's sub-agent as a child run (what the shipped integrations call):
        ``start_child(name)``, except that with a key bound to one agent (which may start
        runs of that agent only, SPEC 5) the child runs under this run's agent, the
        sub-agent's name in its metadata (``subagent``), rather than running ungoverned."""
        try:
            return self.start_child(name)
        except ApiError as exc:
            metadata = subagent_fallback(exc, parent_agent=self.agent, name=name)
            if metadata is None or self.agent is None:
                raise
            return self.start_child(self.agent, metadata=metadata)

    @contextmanager
    def child(
        self,
        agent: str,
        *,
        task: str | None = None,
        policy: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        external_id: str | None = None,
    ) -> Iterator[Run]:
        """``start_child`` as a context manager that always finishes the child run, as
        ``GovernanceClient.run`` does::

            async with run.child(agent="researcher") as sub:
                decision = await sub.check("search.docs", {"q": "refunds"})
        """
        child = self.start_child(agent, task=task, policy=policy, metadata=metadata,
                                       external_id=external_id)
        with _finishing(child):
            yield child

    def _finish_on_exit(self, *, failed: bool) -> None:
        core = self._core
        if core.finished:
            return
        status = core.exit_status(failed=failed)
        try:
            self.finish(status)
        except GovernanceUnavailable as exc:
            # The agent's work is done either way; the service will see the run as still running.
            logger.warning("could not finish run %s (%s): %s", self.id, status, exc)
        finally:
            core.closed = True


@contextmanager
def _finishing(run: Run) -> Iterator[None]:
    """Finish ``run`` when the block ends: ``failed`` if it raised (the exception
    propagates), else as its decisions left it (``Run._finish_on_exit``)."""
    try:
        yield
    except BaseException:
        try:
            run._finish_on_exit(failed=True)
        except GovernanceError:
            # The agent's own exception is the one worth seeing.
            logger.exception("could not finish run %s", run.id)
        raise
    run._finish_on_exit(failed=False)
