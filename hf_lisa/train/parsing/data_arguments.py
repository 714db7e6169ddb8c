"""``DataArguments``: where ``hf-lisa train``'s data comes from (files, folders, Hub ids, weighted mixtures), its row
format, its chat template, how it is tokenised and packed, and the preference columns of ``--stage dpo``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ...data.validation import Columns

__all__ = ["DataArguments", "check_data_arguments"]


@dataclass
class DataArguments:
    """Where the training data comes from and how it is turned into tokens."""

    dataset_name: Optional[str] = field(
        default=None,
        metadata={
            "help": "Hub dataset id (needs network) or a local dataset folder. Uses --dataset_split for training, and "
            "its validation (or test) split when it has one."
        },
    )
    dataset_config_name: Optional[str] = field(
        default=None, metadata={"help": "Configuration (subset) of the Hub dataset.", "aliases": ["--dataset_config"]}
    )
    dataset_split: str = field(
        default="train", metadata={"help": "Split of --dataset_name to train on (e.g. 'train', 'train_sft')."}
    )
    train_file: Optional[str] = field(
        default=None,
        metadata={
            "help": "Local training data: a .jsonl, .json, .csv, .parquet or .txt file, or a folder of them. Several "
            "sources mixed by weight: 'a.jsonl:0.7,b.jsonl:0.3' (or a YAML list of {path, weight} in a config "
            "file). With neither train_file nor dataset_name, the bundled arithmetic task is used."
        },
    )
    mix_strategy: str = field(
        default="auto",
        metadata={
            "help": "How several --train_file sources mix: 'concat' (every row of every source once, shuffled; no "
            "weights), 'first_exhausted' (draw by weight, stop when the first source runs out; rows may stay "
            "unused), 'all_exhausted' (draw by weight until every source has given every row, re-using the rows of "
            "the sources that run out), or 'auto': concat without weights, first_exhausted with them. LLaMA-Factory's "
            "interleave_under / interleave_over are first_exhausted / all_exhausted."
        },
    )
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Local validation file, same format as train_file."}
    )
    validation_split_percentage: float = field(
        default=5.0,
        metadata={"help": "Percent of train held out for validation when there is no validation file or split."},
    )
    max_seq_length: int = field(
        default=512, metadata={"help": "Longest tokenised row; see --overlength for longer rows."}
    )
    data_format: str = field(
        default="auto",
        metadata={
            "help": "Row format: 'prompt_completion', 'messages' (OpenAI-style chat), 'alpaca' (instruction, input, "
            "output, optional system), 'sharegpt' (conversations of from/value turns), 'text', or 'auto' (from the "
            "column names).",
            "aliases": ["--dataset_format"],
        },
    )
    prompt_column: str = field(
        default="prompt", metadata={"help": "Prompt column (prompt/completion rows, and --stage dpo preference rows)."}
    )
    completion_column: str = field(
        default="completion", metadata={"help": "Completion column (prompt/completion format)."}
    )
    messages_column: str = field(default="messages", metadata={"help": "Column of chat messages (chat format)."})
    text_column: str = field(default="text", metadata={"help": "Text column (plain-text format)."})
    completion_only_loss: bool = field(
        default=True,
        metadata={
            "help": "Compute the loss on completion / assistant tokens only. False trains on the prompt tokens too."
        },
    )
    chat_template: str = field(
        default="auto",
        metadata={
            "help": "Chat template: 'auto' (the tokenizer's, when it has one), 'always' (the tokenizer's, refused "
            "when it has none), 'never' (plain prompt + completion), a built-in by name (chatml, llama-3, ...; see "
            "docs/data.md) or a Jinja file. A named or file template replaces the tokenizer's and is saved with the "
            "tokenizer and the adapter. Chat rows always need a template."
        },
    )
    overlength: str = field(
        default="skip",
        metadata={
            "help": "Rows longer than max_seq_length: 'skip' (counted and logged), 'truncate', or 'error'."
        },
    )
    on_bad_row: str = field(
        default="skip",
        metadata={
            "help": "Rows with a missing, empty or non-string field (an empty assistant turn, list content, an "
            "unknown role, ...): 'skip' (counted by reason, logged as a table with their lines, and recorded in "
            "training_summary.json) or 'error' (stop at the first, naming its file and line)."
        },
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Pack several short training rows into each sequence of up to max_seq_length tokens; attention "
            "never crosses a row boundary (positions restart at each row) and the loss equals the unpacked loss. "
            "--per_device_train_batch_size then counts sequences; evaluation rows stay unpacked. Refused for a model "
            "that would attend across rows (docs/data.md)."
        },
    )
    chosen_column: str = field(
        default="chosen",
        metadata={"help": "Preferred response column (--stage dpo preference rows): strings, or chat messages."},
    )
    rejected_column: str = field(
        default="rejected",
        metadata={"help": "Dispreferred response column (--stage dpo preference rows): strings, or chat messages."},
    )
    max_train_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep only the first N training rows (for quick runs)."}
    )
    max_eval_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep only the first N validation rows."}
    )
    preprocessing_num_workers: Optional[int] = field(
        default=None, metadata={"help": "Processes for tokenisation (datasets.map num_proc)."}
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Re-tokenise instead of reusing the datasets cache."}
    )
    eval_generation_samples: Optional[int] = field(
        default=None,
        metadata={
            "help": "Validation prompts scored by generation exact match before and after training (0 disables). "
            "Default: 64 for the bundled task, 0 otherwise."
        },
    )
    generation_max_new_tokens: int = field(
        default=32, metadata={"help": "Generation length for the exact-match evaluation (greedy)."}
    )
    answer_pattern: Optional[str] = field(
        default=None,
        metadata={
            "help": "Regex whose first group is the answer compared by exact match, e.g. '####\\s*(-?\\d+)'. Default: "
            "the whole stripped completion ('####' answers for the bundled task)."
        },
    )
    answer_lenient: bool = field(
        default=True,
        metadata={
            "help": "When answer_pattern does not match a generation, compare its last number instead (so a model "
            "that has not learnt the answer format is still scored on its answer)."
        },
    )
    demo_train_samples: int = field(
        default=2000, metadata={"help": "Rows generated for the bundled task's train split."}
    )

    def columns(self) -> Columns:
        """The rows' column names (``--prompt_column``, ``--completion_column`` and the like)."""
        return Columns(self.prompt_column, self.completion_column, self.messages_column, self.text_column)


def check_data_arguments(data_args: DataArguments) -> None:
    """The data options' own checks, each naming the option, the value and what is allowed (``UsageError``); run by
    :func:`hf_lisa.train.parsing.arguments.validate_args` before anything loads."""
    from ...data.formats import check_format_arguments
    from ...data.sources import check_source_arguments

    check_format_arguments(data_args.data_format, data_args.chat_template)  # formats, template names and files
    check_source_arguments(data_args)  # --train_file specs and weights, --dataset_name/--dataset_config/--dataset_split
