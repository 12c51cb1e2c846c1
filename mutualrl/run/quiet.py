"""Keeping third-party progress bars and info logs out of mutualrl's own output."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' tqdm bars (loading, saving shards) and its info logs inside the block,
    and tqdm used directly (the GGUF loader); everything is restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    tqdm_env = os.environ.get("TQDM_DISABLE")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env
        hf_logging.set_verbosity(level)
        if was_enabled:
            hf_logging.enable_progress_bar()


def silence_transformers() -> None:
    """For a whole worker process: no per-load progress bars or info logs from transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
