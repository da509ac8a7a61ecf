"""The agent's local state: its method's arrays and the last round it finished,
saved after each round under ``state_dir`` and loaded again when the same run
welcomes it back (a restarted agent goes on where it was)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from .config import EdgeConfig
from .methods import EdgeMethod

log = logging.getLogger("edge_agent")


class AgentLocalState:
    """Local state for :class:`~edge_agent.agent.EdgeAgent`."""

    # Set up by EdgeAgent.__init__ (agent.py).
    config: EdgeConfig
    method: EdgeMethod | None
    settings: dict[str, Any]
    last_round_done: int

    def _state_paths(self) -> tuple[Path, Path] | None:
        if not self.config.state_dir:
            return None
        base = Path(self.config.state_dir)
        return base / f"{self.config.agent_id}.npz", base / f"{self.config.agent_id}.json"

    def _save_local_state(self) -> None:
        paths = self._state_paths()
        if paths is None or self.method is None:
            return
        arrays_path, meta_path = paths
        arrays_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = arrays_path.with_suffix(".tmp.npz")
        np.savez(tmp, **self.method.state_arrays())
        os.replace(tmp, arrays_path)
        meta = {"run": self.config.run_id, "method": self.method.name, "last_round_done": self.last_round_done, "settings": self.settings}
        meta_path.write_text(json.dumps(meta))

    def _load_local_state(self) -> None:
        paths = self._state_paths()
        if paths is None or self.method is None or not paths[0].exists() or not paths[1].exists():
            return
        meta = json.loads(paths[1].read_text())
        if meta.get("run") != self.config.run_id or meta.get("method") != self.method.name or meta.get("settings") != self.settings:
            earlier = (meta.get("settings") or {}).get("run_started_at")
            if meta.get("run") == self.config.run_id and earlier and earlier != self.settings.get("run_started_at"):
                log.info("ignoring local state in %s: it is from an earlier run %s (started %s, this one %s); "
                         "starting this run's models afresh", paths[0], self.config.run_id, earlier, self.settings.get("run_started_at"))
            else:
                log.info("ignoring local state of another run/method in %s", paths[0])
            return
        with np.load(paths[0], allow_pickle=False) as data:
            self.method.load_state_arrays({k: data[k] for k in data.files})
        self.last_round_done = int(meta.get("last_round_done", -1))
