"""``push_to_hub``: one commit with the weights and the card, through ``huggingface_hub``."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any, Callable, Optional, Union

from .card import _method_of, render_model_card
from .staging import (
    PUSH_MODES,
    README_NAME,
    HubPushError,
    _collect_files,
    _point_adapter_config_at_hub,
    _resolve_hub_base_model,
    _stage,
    _validate_staged,
)

logger = logging.getLogger(__name__)


TRANSIENT_STATUS_CODES = (408, 429, 500, 502, 503, 504)


_TRANSPORT_ERROR_NAMES = {"TransportError", "TimeoutException", "NetworkError", "RemoteProtocolError"}


# ----------------------------------------------------------------------------------------------------------------------
# Upload: one commit, retried on transient errors, never twice
# ----------------------------------------------------------------------------------------------------------------------
def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status_of(exc: BaseException) -> Optional[int]:
    for e in _chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
    return None


def _is_transient(exc: BaseException) -> bool:
    for e in _chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status in TRANSIENT_STATUS_CODES
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if _TRANSPORT_ERROR_NAMES & {cls.__name__ for cls in type(e).__mro__}:
            return True
    return False


def _transport_cause(exc: BaseException) -> str:
    """The connection-level error under huggingface_hub's wrappers, e.g. "ConnectError: connection refused"."""
    for e in _chain(exc):
        if isinstance(e, (ConnectionError, TimeoutError)) or _TRANSPORT_ERROR_NAMES & {
            c.__name__ for c in type(e).__mro__
        }:
            return f"{type(e).__name__}: {e}"
    return type(exc).__name__


def _server_message(exc: BaseException) -> str:
    for e in _chain(exc):
        message = getattr(e, "server_message", None)
        if message:
            return str(message).strip()
    return ""


class _Redactor:
    def __init__(self, token: Optional[str]) -> None:
        self.token = token if isinstance(token, str) and token else None

    def __call__(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text


def _push_error(exc: BaseException, stage: str, repo_id: str, endpoint: str, attempts: int, redact) -> HubPushError:
    status = _status_of(exc)
    said = _server_message(exc)
    said = f" The server said: {said}" if said else ""
    where = f"{repo_id} on {endpoint}"
    if isinstance(exc, ValueError) and "Invalid metadata in README.md" in str(exc):
        message = f"the Hub rejected the model card metadata while {stage} for {where}: {exc}"
    elif status == 401:
        message = (f"authentication failed (HTTP 401) while {stage} for {where}: the token is invalid, expired or "
                   f"missing. Pass a valid write token (token=..., HF_TOKEN, or `hf auth login`).{said}")
    elif status == 403:
        message = (f"the Hub refused the write (HTTP 403) while {stage} for {where}: the token has no write access "
                   f"to this namespace, or the repository is read-only.{said}")
    elif status == 404:
        message = (f"not found (HTTP 404) while {stage} for {where}: the repository or branch does not exist or is "
                   f"not visible with this token.{said}")
    elif status == 412:
        message = (f"the branch moved while {stage} for {where} (HTTP 412, another commit landed first); nothing was "
                   f"committed by this push. Push again.{said}")
    elif _is_transient(exc):
        cause = f"HTTP {status}" if status else _transport_cause(exc)
        message = (f"{stage} for {where} failed after {attempts} attempt(s) with transient errors ({cause}). A push "
                   "is a single commit: unless the last request reached the server, the repository was left as it "
                   "was. Push again when the Hub is reachable.")
    else:
        message = f"{stage} for {where} failed: {type(exc).__name__}: {exc}"
    return HubPushError(redact(message), stage=stage, status=status)


def _with_retries(fn: Callable[[], Any], stage: str, ctx: dict, before_retry: Optional[Callable[[], Any]] = None):
    attempt = 0
    while True:
        try:
            if attempt and before_retry is not None:
                landed = before_retry()
                if landed is not None:
                    return landed
            return fn()
        except HubPushError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised as HubPushError
            if not _is_transient(exc) or attempt >= ctx["max_retries"]:
                raise _push_error(exc, stage, ctx["repo_id"], ctx["endpoint"], attempt + 1, ctx["redact"]) from exc
            wait = min(ctx["retry_base_wait"] * 2**attempt, 30.0)
            attempt += 1
            logger.warning(
                "%s for %s hit a transient error (%s); retrying in %.1fs (attempt %d of %d).", stage,
                ctx["repo_id"], ctx["redact"](f"HTTP {_status_of(exc)}" if _status_of(exc) else type(exc).__name__),
                wait, attempt + 1, ctx["max_retries"] + 1,
            )
            time.sleep(wait)


def _upload(api, repo_id: str, folder: str, files: list[str], message: str, private: Optional[bool],
            revision: Optional[str], ctx: dict):
    from huggingface_hub import CommitInfo, CommitOperationAdd

    _with_retries(lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"),
                  "creating the repository", ctx)
    branch = revision or "main"
    if branch != "main":
        _with_retries(lambda: api.create_branch(repo_id, branch=branch, exist_ok=True),
                      f"creating branch {branch!r}", ctx)
    parent = _with_retries(lambda: api.repo_info(repo_id, revision=branch).sha, f"reading the head of {branch!r}", ctx)

    def commit():
        # fresh operations per attempt: create_commit mutates them
        operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=os.path.join(folder, p)) for p in files]
        return api.create_commit(repo_id, operations=operations, commit_message=message, revision=branch,
                                 parent_commit=parent)

    def landed_already():
        # a dropped connection can hide a commit that the server applied: never commit twice
        head = api.repo_info(repo_id, revision=branch).sha
        if head == parent:
            return None
        commits = api.list_repo_commits(repo_id, revision=branch)
        if len(commits) >= 2 and commits[0].title == message and commits[1].commit_id == parent:
            logger.warning("The previous attempt's commit %s reached %s before the connection dropped; not "
                           "committing twice.", head, repo_id)
            return CommitInfo(commit_url=f"{api.endpoint}/{repo_id}/commit/{head}", commit_message=message,
                              commit_description="", oid=head, _endpoint=api.endpoint)
        raise HubPushError(
            f"branch {branch!r} of {repo_id} moved to {head} during the push (another writer?); this push committed "
            "nothing. Push again.", stage="creating the commit",
        )

    logger.info("Pushing %d files to %s (branch %s) in one commit: %s", len(files), repo_id, branch, ", ".join(files))
    return _with_retries(commit, "uploading the files and creating the commit", ctx, before_retry=landed_already)


def _inherit_license(api, hub_base: Optional[str]) -> Optional[str]:
    """The base model's license from its Hub card, best effort: a card without one is still a valid card."""
    if not hub_base:
        return None
    try:
        data = api.model_info(hub_base, timeout=10).card_data
    except Exception as exc:  # noqa: BLE001 - offline, private or missing base: just no license
        logger.info("Could not read the license of %s (%s); the card has none unless given.", hub_base,
                    type(exc).__name__)
        return None
    license_ = data.get("license") if data is not None else None
    return license_ if isinstance(license_, str) else None


def push_to_hub(
    model_or_dir,
    repo_id: str,
    mode: Optional[str] = None,
    private: Optional[bool] = None,
    revision: Optional[str] = None,
    commit_message: Optional[str] = None,
    token: Optional[str] = None,
    card_data: Optional[dict] = None,
    base_model: Optional[str] = None,
    tokenizer=None,
    *,
    training_summary: Optional[dict] = None,
    max_shard_size: Union[int, str] = "5GB",
    endpoint: Optional[str] = None,
    max_retries: int = 3,
    retry_base_wait: float = 1.0,
):
    """Push a LISA adapter or merged model to the Hub as one commit with a complete model card.

    ``mode="adapter"`` uploads ``adapter_config.json`` and ``adapter_model.safetensors`` (factors, masks and
    interpolation scalars), the card, the loss plot and the tokenizer files when present. ``mode="merged"`` folds
    ``ΔW = s · M ⊙ (B A)`` into the base weights and uploads sharded safetensors with ``config.json``,
    ``generation_config.json`` and the tokenizer; adapters with layer interpolation cannot be merged and raise
    ``ValueError``. Full-parameter LISA output (a plain transformers model or its directory) is pushed as merged.

    Everything is built in a temporary folder and checked first, then uploaded by a single ``create_commit``: a
    failure leaves the repo as it was. Pickle files (``*.bin``, ``*.pt``, ``training_args.bin``, …) are never
    uploaded. Transient HTTP errors are retried with exponential backoff.

    Args:
        model_or_dir: a ``peft.PeftModel``, a ``transformers.PreTrainedModel`` (full-parameter LISA), or a training
            output directory. A directory may hold ``training_summary.json`` (method, LISA settings,
            hyperparameters, metrics, datasets, loss plot, license, the base model's Hub id) for the card.
        repo_id: ``"namespace/name"``; created if missing.
        mode: ``"adapter"`` or ``"merged"``; by default adapters are pushed as adapters and full weights as merged.
        private: create the repo private (an existing repo keeps its visibility).
        revision: branch to push to, created from ``main`` if missing.
        commit_message: defaults to "Upload adapter (hf-lisa, <method>)" / "Upload merged weights (...)".
        token: a write token; defaults to ``HF_TOKEN`` or the saved login. Never printed or logged.
        card_data: metadata overrides for the card, e.g. ``{"language": "en", "license": "mit"}``.
        base_model: Hub id of the base model, for the card and for the uploaded adapter config when training
            recorded a local path.
        tokenizer: a tokenizer to upload with the model.
        training_summary: the training summary as a dict, for model objects (a directory's file is read itself).
        max_shard_size: largest safetensors shard of merged weights.
        endpoint: the Hub endpoint; ``HF_ENDPOINT`` by default.
        max_retries: retries of each Hub call on transient errors (5xx, 429, dropped connections).
        retry_base_wait: first backoff in seconds; doubles at each retry, capped at 30 s.

    Returns:
        `huggingface_hub.CommitInfo`: the URL of the commit (a ``str``), with ``.oid``.

    Raises:
        HubPushError: the Hub refused or failed the push (the message names the step and the HTTP status).
        ValueError: invalid arguments, or an adapter that cannot be merged.

    Example:
        ```py
        >>> import hf_lisa
        >>> hf_lisa.push_to_hub("outputs/smollm2-lisa", "me/smollm2-lisa")  # doctest: +SKIP
        >>> hf_lisa.push_to_hub("outputs/smollm2-lisa", "me/smollm2-lisa-merged", mode="merged")  # doctest: +SKIP
        ```
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.utils import validate_repo_id

    if mode is not None and mode not in PUSH_MODES:
        raise ValueError(f"mode={mode!r} is invalid; allowed: {PUSH_MODES} (or None to choose from the input).")
    validate_repo_id(repo_id)
    if "/" not in repo_id:
        raise ValueError(f"repo_id={repo_id!r} is invalid; expected 'namespace/name'.")
    if max_retries < 0 or retry_base_wait < 0:
        raise ValueError(f"max_retries={max_retries} and retry_base_wait={retry_base_wait} must be >= 0.")

    with tempfile.TemporaryDirectory(prefix="hf-lisa-push-") as folder:
        staged = _stage(model_or_dir, mode, folder, tokenizer, max_shard_size, base_model, dict(training_summary or {}))
        hub_base = _resolve_hub_base_model(base_model, (card_data or {}).get("base_model"),
                                           staged.summary.get("base_model"), staged.source_base)
        if staged.mode == "adapter":
            _point_adapter_config_at_hub(staged, hub_base)
        api = HfApi(endpoint=endpoint, token=token)
        license_ = None
        if not (card_data or {}).get("license") and not staged.summary.get("license"):
            license_ = _inherit_license(api, hub_base)
        card = render_model_card(
            repo_id, staged.mode, base_model=hub_base, adapter_config=staged.adapter_config,
            model_config=staged.model_config, summary=staged.summary, card_data=card_data,
            loss_plot=staged.loss_plot, license=license_,
        )
        card.save(os.path.join(folder, README_NAME))
        files = _collect_files(folder, staged.mode, staged.loss_plot)
        _validate_staged(staged, files)
        method = _method_of(staged.mode, staged.adapter_config, staged.summary)
        message = commit_message or (
            f"Upload adapter (hf-lisa, {method})" if staged.mode == "adapter"
            else f"Upload merged weights (hf-lisa, {method})"
        )
        ctx = {"repo_id": repo_id, "endpoint": api.endpoint, "redact": _Redactor(token or get_token()),
               "max_retries": max_retries, "retry_base_wait": retry_base_wait}
        info = _upload(api, repo_id, folder, files, message, private, revision, ctx)
    logger.info("Pushed %s to %s: %s", staged.mode, repo_id, info)
    return info
