"""``hf-lisa push``: the command-line front of :func:`push_to_hub`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from .staging import PUSH_MODES

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------------
# CLI: hf-lisa push OUTPUT_DIR REPO_ID --mode adapter|merged
# ----------------------------------------------------------------------------------------------------------------------
PUSH_DESCRIPTION = (
    "Push a training output directory to the Hugging Face Hub as a LISA adapter or merged model, in one commit, with a "
    "model card. No pickle file is unpickled or uploaded."
)


def add_push_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``hf-lisa push`` to ``parser`` (the ``push`` subcommand of ``hf-lisa``, or its own)."""
    parser.add_argument("output_dir", help="Directory the training saved its final model to.")
    parser.add_argument("repo_id", help="Target repo, 'namespace/name'; created if missing.")
    parser.add_argument("--mode", choices=PUSH_MODES, default=None,
                        help="adapter: adapter_config.json + adapter_model.safetensors; merged: full safetensors "
                        "weights with the adapter folded in. Default: adapter for adapter output, merged for "
                        "full-parameter output.")
    parser.add_argument("--private", action="store_true", default=None, help="Create the repo private.")
    parser.add_argument("--revision", default=None, help="Branch to push to (created from main if missing).")
    parser.add_argument("--commit_message", "--commit-message", dest="commit_message", default=None)
    parser.add_argument("--token", default=None,
                        help="Write token. Prefer HF_TOKEN or `hf auth login`: a token on the command line can end "
                        "up in your shell history. Never printed.")
    parser.add_argument("--base_model", "--base-model", dest="base_model", default=None,
                        help="Hub id of the base model, when training used a local copy (recorded in the pushed "
                        "adapter_config.json; an adapter on a local base is refused without it).")
    parser.add_argument("--max_shard_size", "--max-shard-size", dest="max_shard_size", default="5GB",
                        help="Largest safetensors shard in merged mode (default 5GB).")
    parser.add_argument("--max_retries", "--max-retries", dest="max_retries", type=int, default=3,
                        help="Retries on transient HTTP errors (default 3).")
    parser.add_argument("--dry_run", "--dry-run", dest="dry_run", action="store_true",
                        help="Build and check everything, print the file list and the model card a push would "
                        "upload, and upload nothing (no request is made; no token needed).")
    return parser


def push_command(args: argparse.Namespace) -> int:
    """Run ``hf-lisa push`` with parsed arguments; returns the exit code: 0 on success (the commit URL is printed),
    2 when what was asked cannot be pushed (a folder without a model, a bad repo id or option), 1 when the push
    failed on the way (the Hub, the connection); the reason is printed, never the token."""
    from .push import _Redactor, push_to_hub
    from .staging import HubPushError

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    redact = _Redactor(args.token)
    try:
        info = push_to_hub(
            args.output_dir, args.repo_id, mode=args.mode, private=args.private, revision=args.revision,
            commit_message=args.commit_message, token=args.token, base_model=args.base_model,
            max_shard_size=args.max_shard_size, max_retries=args.max_retries, dry_run=args.dry_run,
        )
    except HubPushError as exc:  # the Hub or the connection failed: a failure while running
        print(f"hf-lisa push: error: {redact(str(exc))}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, NotADirectoryError, TypeError) as exc:  # what was asked cannot be pushed
        print(f"hf-lisa push: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    print(info.format() if args.dry_run else str(info))
    return 0


def hub_cli(argv: Optional[Sequence[str]] = None) -> int:
    """``hf-lisa push OUTPUT_DIR REPO_ID [--mode adapter|merged] [--private] [--revision R] [--commit_message M]
    [--token T]``.

    ``argv`` holds the arguments after ``hf-lisa push`` (a leading ``"push"`` is accepted too). Returns the exit
    code: 0 on success (the commit URL is printed), 1 when the push failed (the reason is printed, never the token),
    2 for invalid arguments.

    Example:
        ```py
        >>> from hf_lisa.hub import hub_cli
        >>> hub_cli(["outputs/smollm2-lisa", "me/smollm2-lisa", "--mode", "adapter"])  # doctest: +SKIP
        0
        ```
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "push":
        argv = argv[1:]
    parser = add_push_arguments(argparse.ArgumentParser(prog="hf-lisa push", description=PUSH_DESCRIPTION, allow_abbrev=False))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on errors
        return int(exc.code or 0)
    return push_command(args)
