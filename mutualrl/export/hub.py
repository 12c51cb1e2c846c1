"""Uploading an exported policy to the Hugging Face Hub (``mutualrl export --push-to-hub REPO``).

As TRL's ``push_to_hub`` does: ``huggingface_hub.create_repo(REPO, exist_ok=True)`` then
``upload_folder`` of the exported directory, the token from the usual places (``HF_TOKEN``,
``hf auth login``). Repository ids are checked before anything is exported (a bad one is
bad input: exit 2). An upload that fails — no network, ``HF_HUB_OFFLINE``, no or a wrong token,
the Hub refusing — is :class:`HubPushError`, one line saying that the export directory is complete
and where it is, so the upload can be repeated without exporting again (``mutualrl export`` exits
1 then: the export succeeded, the environment failed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import huggingface_hub as hub

from mutualrl.errors import UserError

PLACEHOLDER = "{policy}"


class HubPushError(RuntimeError):
    """An upload to the Hub failed; the message names the complete export directory."""


def check_repo_ids(repo: str, policies: Sequence[str]) -> dict[str, str]:
    """``{policy: repository id}`` for pushing ``policies`` to ``repo`` (``{policy}`` in it is replaced
    by each policy's name; it is required with several policies). :class:`UserError` for an id the Hub
    would refuse."""
    if len(policies) > 1 and PLACEHOLDER not in repo:
        raise UserError(f"--push-to-hub {repo!r}: {len(policies)} policies are exported ({', '.join(policies)}); "
                        f"put {PLACEHOLDER} in the repository id (e.g. {repo}-{PLACEHOLDER}) or export one with "
                        "--policy")
    out = {}
    for name in policies:
        repo_id = repo.replace(PLACEHOLDER, name)
        try:
            hub.utils.validate_repo_id(repo_id)
        except hub.errors.HFValidationError as exc:
            raise UserError(f"--push-to-hub: {repo_id!r} is not a valid Hub repository id ({exc})") from None
        out[name] = repo_id
    return out


def push_to_hub(directory: str | os.PathLike[str], repo_id: str, *, private: bool = False,
                token: str | None = None, commit_message: str | None = None) -> str:
    """Create ``repo_id`` (a model repository; kept when it exists) and upload ``directory`` into it;
    returns the repository's URL. Any failure of the Hub or the network is :class:`HubPushError`."""
    directory = Path(directory)
    message = commit_message or f"mutualrl export of {directory.name}"
    try:
        url = hub.create_repo(repo_id, private=private, token=token, exist_ok=True, repo_type="model")
        hub.upload_folder(repo_id=repo_id, folder_path=str(directory), token=token, repo_type="model",
                          commit_message=message)
    except Exception as exc:  # network, offline mode, auth, the Hub: one message
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HubPushError(f"could not push {directory} to the Hub repository {repo_id!r} ({type(exc).__name__}: "
                           f"{first}); the export directory {directory} is complete: push it again when the Hub can "
                           f"be reached: hf upload {repo_id} {directory}") from exc
    return str(getattr(url, "url", url))
