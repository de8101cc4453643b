"""The dashboard's backtests run here, on the ``bulk`` queue: never on the kill switch's worker,
and never in a web process on the production stack (eagerly in-process on the embedded default,
like every task there)."""

from __future__ import annotations

from celery import shared_task

from . import services


@shared_task(name="backtests.tasks.backtest_run", acks_late=True, reject_on_worker_lost=True)
def backtest_run_task(job_id: str) -> None:
    services.backtest_run(job_id=job_id)
