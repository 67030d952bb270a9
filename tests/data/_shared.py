"""Where the optional shared data folder (GPT-2 BPE file, novels shards) is: ``$LIGHTNING_OPT_SHARED_DATA``,
else ``shared/data`` next to the repository checkout. Tests that need it skip when it is absent."""

from __future__ import annotations

import os
from pathlib import Path


def shared_data_dir() -> Path:
    env = os.environ.get("LIGHTNING_OPT_SHARED_DATA")
    return Path(env).expanduser() if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


SHARED = shared_data_dir()
BPE = SHARED / "gpt2" / "r50k_base.tiktoken"
