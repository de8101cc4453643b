"""What a run could not send before it ended, kept on disk until the service takes it.

A fail-open run decides locally during an outage and uploads those decisions once the service
answers again; a run whose block ends while the service is still down cannot, nor can it be
finished. Lost, the service would show the run ``running`` at its last answered step while
the agent went on and finished. So the client writes them here, one small JSON file per run
(the decisions to upload, and the finish with its output), and the next ``start_run`` of a
client of the same service and key sends them, oldest first, before it starts its own run.

The folder: ``GovernanceClient(journal=...)``, else ``$GOVERNANCE_JOURNAL_DIR``, else
``$XDG_CACHE_HOME/governance-client/journal`` (``~/.cache/...``). Files are named by a hash
of the service's URL and the agent key (the key itself is never written), so a client only
sends what runs of its own team left.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger("governance_client")

#: Entries sent by one start at most: a start waits for them, so a long backlog is sent a
#: few at a time, over the next starts.
REPLAY_PER_START = 5
VERSION = 1


def default_folder() -> Path:
    configured = os.environ.get("GOVERNANCE_JOURNAL_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "governance-client" / "journal"


class Journal:
    """The journal of one client: one service, one agent key."""

    def __init__(self, folder: str | os.PathLike[str], base_url: str, api_key: str) -> None:
        self.folder = Path(folder)
        digest = hashlib.sha256(f"{base_url}\0{api_key}".encode()).hexdigest()
        self.prefix = f"{digest[:16]}-"

    def _path(self, run_id: str) -> Path:
        safe = "".join(c for c in run_id if c.isalnum() or c in "-_")[:100]
        return self.folder / f"{self.prefix}{safe}.json"

    def save(self, run_id: str, *, decisions: list[dict[str, Any]],
             finish: Mapping[str, Any]) -> bool:
        """Keep what run ``run_id`` could not send (atomically: a crash leaves the previous
        file or the new one). False, and a log line, when the disk refuses."""
        entry = {"version": VERSION, "run_id": run_id, "decisions": decisions,
                 "finish": dict(finish), "saved_at": datetime.now(UTC).isoformat()}
        written: str | None = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp",
                                             delete=False, encoding="utf-8") as handle:
                written = handle.name
                json.dump(entry, handle, ensure_ascii=False, default=str)
            os.replace(written, self._path(run_id))
        except OSError as exc:
            logger.error("run %s: could not keep %d local decision(s) and its finish in the "
                         "journal %s: %s", run_id, len(decisions), self.folder, exc)
            if written is not None:
                with contextlib.suppress(OSError):
                    os.unlink(written)
            return False
        logger.warning("run %s: %d local decision(s) and its finish kept in %s until the "
                       "service answers", run_id, len(decisions), self.folder)
        return True

    def pending(self, limit: int = REPLAY_PER_START) -> list[dict[str, Any]]:
        """The oldest entries of this client's service and key (an unreadable one is set
        aside as ``.bad``, never sent)."""
        try:
            paths = sorted(self.folder.glob(f"{self.prefix}*.json"),
                           key=lambda p: p.stat().st_mtime)
        except OSError:
            return []
        entries = []
        for path in paths[:limit]:
            try:
                entry = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(entry, dict) or entry.get("version") != VERSION:
                    raise ValueError("not a journal entry of this version")
                entry["run_id"] = str(entry["run_id"])
                entry["decisions"] = list(entry.get("decisions") or [])
                entry["finish"] = dict(entry.get("finish") or {"status": "completed"})
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.error("journal entry %s unreadable, set aside: %s", path, exc)
                with contextlib.suppress(OSError):
                    path.rename(path.with_suffix(".bad"))
                continue
            entries.append(entry)
        return entries

    def done(self, run_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(run_id).unlink()
