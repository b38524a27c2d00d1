"""A Weights & Biases run whose files live in ``run_dir/wandb`` (``wandb.init(dir=run_dir)``).

The run's id is kept in ``run_dir/wandb_run_id``: a run resumed from a checkpoint in the same
``run_dir`` continues the same W&B run (``wandb.init(id=..., resume="allow")``); a fresh start gets
a new one. ``log.wandb_mode=auto`` logs online only where the user's environment allows it
(``WANDB_MODE`` if set, else online when an API key is configured, else offline), so a machine
without a network or an account still gets the offline run (``wandb sync run_dir/wandb/offline-run-*``).
"""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sysx.config import ConfigError
from sysx.config.checks import first_line
from sysx.tracking.scalars import tagged_scalars

RUN_ID_FILE = "wandb_run_id"
DEFAULT_HOST = "https://api.wandb.ai"


def has_api_key(env: Mapping[str, str] | None = None) -> bool:
    """An API key is configured: ``WANDB_API_KEY``, or a ``~/.netrc`` (``$NETRC``) entry for the
    W&B host (``WANDB_BASE_URL``), where ``wandb login`` stores it."""
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or DEFAULT_HOST).hostname or ""
    try:
        entry = netrc.netrc(env.get("NETRC") or None).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def resolve_mode(setting: str, env: Mapping[str, str] | None = None) -> str:
    """``log.wandb_mode`` as W&B takes it: ``offline`` / ``online`` as given; ``auto``: ``WANDB_MODE``
    if set, else ``online`` with an API key, else ``offline``."""
    if setting != "auto":
        return setting
    env = os.environ if env is None else env
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    return "online" if has_api_key(env) else "offline"


def stored_run_id(run_dir: Path, first_step: int) -> str | None:
    """The W&B run id a run resumed at ``first_step`` continues (None for a fresh start)."""
    path = Path(run_dir) / RUN_ID_FILE
    if first_step > 0 and path.is_file():
        return path.read_text(encoding="utf-8").strip() or None
    return None


class WandbBackend:
    """Each record's :func:`tagged_scalars` logged to a W&B run at its step."""

    def __init__(
        self,
        run_dir: Path,
        *,
        project: str,
        name: str | None,
        mode: str,
        first_step: int = 0,
        config: dict[str, Any] | None = None,
    ) -> None:
        import wandb

        run_dir = Path(run_dir)
        self.mode = resolve_mode(mode)
        run_id = stored_run_id(run_dir, first_step)
        try:
            self._run: Any = wandb.init(
                project=project,
                name=name or run_dir.resolve().name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                mode=self.mode,  # type: ignore[arg-type]
                config=config,
            )
        except (wandb.errors.Error, OSError) as err:
            wandb.teardown()  # the service it may have started
            raise ConfigError(
                f"log.backends contains wandb but wandb.init ({self.mode}) failed: {first_line(err).rstrip('.')}; "
                "set log.wandb_mode=offline to log without a network, or fix the W&B login (wandb login)"
            ) from None
        (run_dir / RUN_ID_FILE).write_text(self._run.id + "\n", encoding="utf-8")
        self.run_id: str = self._run.id
        self.where = f"{run_dir / 'wandb'} (W&B {self.mode}, run {self.run_id})"

    def write(self, record: Mapping[str, Any]) -> None:
        """The record's scalars at ``record["step"]``."""
        if self._run is not None:
            self._run.log(tagged_scalars(record), step=int(record["step"]))

    def close(self, *, failed: bool = False) -> None:
        """Finish the run (exit code 1 when ``failed``) and stop this process's W&B service, so no
        ``wandb-core`` process outlives the job (idempotent)."""
        if self._run is None:
            return
        import wandb

        run, self._run = self._run, None
        try:
            run.finish(exit_code=1 if failed else 0)
        finally:
            wandb.teardown()
