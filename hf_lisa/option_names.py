"""The option names ``hf-lisa train`` accepts, for a fast refusal of a mistyped flag before torch, transformers or PEFT
are imported (about 14 s on a small machine): :func:`unknown_options`. Generated from the real parser (the four argument
dataclasses, transformers' ``TrainingArguments`` included) by ``python tests/test_option_names.py --write``; the test
fails when it is out of date. Used only while the installed transformers is the version it was generated with;
otherwise the full parser answers, as before. The peers' names (LLaMA-Factory, axolotl, TRL) come from
:mod:`hf_lisa.option_aliases`: an alias is known, a near miss is refused with the option to use.
"""

from __future__ import annotations

import importlib.metadata
from typing import Sequence

from .option_aliases import ALIASES, hint

#: the transformers version whose ``TrainingArguments`` the names were generated from
TRANSFORMERS_VERSION = '5.23.0'
#: every ``--name`` of the parser, ``-`` spelled ``_`` (``--no_x`` forms included)
NAMES = frozenset({
    'accelerator_config', 'activation_checkpointing', 'activation_checkpointing_kwargs', 'adam_beta1', 'adam_beta2',
    'adam_epsilon', 'alpha_pattern', 'answer_lenient', 'answer_pattern', 'attn_implementation',
    'auto_find_batch_size', 'average_tokens_across_devices', 'base_model_id', 'batch_eval_metrics', 'bf16',
    'bf16_full_eval', 'block_size', 'bnb_4bit_compute_dtype', 'bnb_4bit_quant_type', 'cache_dir', 'chat_template',
    'chosen_column', 'chunked_loss', 'completion_column', 'completion_only_loss', 'cpu_allocator', 'data_format',
    'data_seed', 'dataloader_drop_last', 'dataloader_in_order', 'dataloader_multiprocessing_context',
    'dataloader_num_workers', 'dataloader_persistent_workers', 'dataloader_pin_memory',
    'dataloader_prefetch_factor', 'dataset_config', 'dataset_config_name', 'dataset_format', 'dataset_name',
    'dataset_split', 'ddp_backend', 'ddp_broadcast_buffers', 'ddp_bucket_cap_mb', 'ddp_comm_hook',
    'ddp_find_unused_parameters', 'ddp_static_graph', 'ddp_timeout', 'debug', 'deepspeed', 'delete_foreign_files',
    'demo_train_samples', 'disable_tqdm', 'do_eval', 'do_predict', 'do_train', 'dpo_beta', 'enable_jit_checkpoint',
    'eval_accumulation_steps', 'eval_delay', 'eval_do_concat_batches', 'eval_generation_samples', 'eval_on_start',
    'eval_steps', 'eval_strategy', 'eval_use_gather_object', 'exclude_modules', 'fp16', 'fp16_full_eval', 'fsdp',
    'fsdp_config', 'full_determinism', 'fuse_sparse_delta', 'generation_max_new_tokens',
    'gradient_accumulation_steps', 'gradient_checkpointing', 'gradient_checkpointing_kwargs', 'greater_is_better',
    'hub_always_push', 'hub_model_id', 'hub_private_repo', 'hub_revision', 'hub_strategy', 'hub_token',
    'ignore_data_skip', 'importance_steps', 'include_for_metrics', 'include_num_input_tokens_seen',
    'interpolation_beta_l2', 'interpolation_delta_bound', 'keep_checkpoints', 'label_names',
    'label_smoothing_factor', 'layer_interpolation', 'layers_pattern', 'layers_to_transform', 'layerwise_lr_decay',
    'learning_rate', 'length_column_name', 'liger_kernel_config', 'lisa_activated_layers', 'lisa_alpha',
    'lisa_always_trainable', 'lisa_dropout', 'lisa_interval_steps', 'lisa_layers_attribute',
    'lisa_optimizer_state_policy', 'lisa_sampling', 'load_best_model_at_end', 'load_in_4bit', 'load_in_8bit',
    'local_rank', 'log_level', 'log_level_replica', 'log_on_each_node', 'logging_first_step',
    'logging_nan_inf_filter', 'logging_steps', 'logging_strategy', 'lr_scheduler_kwargs', 'lr_scheduler_type',
    'mask_init', 'mask_keep_learned', 'mask_seed', 'mask_update_interval', 'max_eval_samples', 'max_grad_norm',
    'max_seq_length', 'max_steps', 'max_train_samples', 'messages_column', 'method', 'metric_for_best_model',
    'mix_strategy', 'model_name_or_path', 'model_revision', 'modules_to_save', 'monitor_block_groups',
    'monitor_plateau_grad_norm', 'monitor_plateau_steps', 'n_m', 'neftune_noise_alpha', 'new_block_bonus',
    'no_answer_lenient', 'no_average_tokens_across_devices', 'no_chunked_loss', 'no_completion_only_loss',
    'no_dataloader_in_order', 'no_dataloader_pin_memory', 'no_eval_do_concat_batches', 'no_fuse_sparse_delta',
    'no_keep_checkpoints', 'no_log_on_each_node', 'no_logging_nan_inf_filter', 'no_remove_unused_columns',
    'no_skip_memory_metrics', 'num_train_epochs', 'on_bad_row', 'optim', 'optim_8bit_embeddings', 'optim_args',
    'optim_step_in_backward', 'optim_target_modules', 'output_dir', 'overlength', 'overwrite_cache',
    'overwrite_output_dir', 'packing', 'parallelism_config', 'per_device_eval_batch_size',
    'per_device_train_batch_size', 'powersgd_rank', 'powersgd_start_iter', 'prediction_loss_only',
    'preprocessing_num_workers', 'progress_check_steps', 'project', 'prompt_column', 'push_mode', 'push_to_hub',
    'r', 'rank_pattern', 'rejected_column', 'remove_unused_columns', 'report_to',
    'restore_callback_states_from_checkpoint', 'resume_from_checkpoint', 'run_name', 'save_on_each_node',
    'save_only_model', 'save_steps', 'save_strategy', 'save_total_limit', 'seed', 'skip_memory_metrics', 'sparsity',
    'sparsity_pattern', 'sparsity_structure', 'stage', 'target_modules', 'text_column', 'tf32', 'tokenizer_name',
    'torch_compile', 'torch_compile_backend', 'torch_compile_mode', 'torch_dtype', 'torch_empty_cache_steps',
    'trackio_bucket_id', 'trackio_space_id', 'trackio_static_space_id', 'train_file', 'train_sampling_strategy',
    'trust_remote_code', 'use_bnb_nested_quant', 'use_cache', 'use_cpu', 'use_liger_kernel', 'validation_file',
    'validation_split_percentage', 'warmup_steps', 'weight_decay',
})
#: first arguments that are a config file, not an option
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def matches_installed_transformers() -> bool:
    try:
        return importlib.metadata.version("transformers") == TRANSFORMERS_VERSION
    except importlib.metadata.PackageNotFoundError:
        return False


def unknown_options(argv: Sequence[str]) -> list[str]:
    """The ``--flags`` of ``argv`` that ``hf-lisa train`` does not know (``[]`` when it cannot tell: another
    transformers version). ``--help`` and values are not flags; ``--debug`` is the command's own."""
    if not matches_installed_transformers():
        return []
    unknown = []
    for token in argv:
        if not token.startswith("--") or token in ("--help", "--debug"):
            continue
        name = token[2:].split("=", 1)[0].replace("-", "_")
        if name and name not in NAMES and name not in ALIASES:
            unknown.append(token.split("=", 1)[0])
    return unknown


def suggestion(flag: str, prefix: str = "--") -> str:
    """``'--flag' (did you mean '--known'?)``, as the full parser says it; a peer's near miss (``--base_model``) gets
    the option to use and why instead. ``prefix``: ``""`` for a config file's key."""
    return name_hint(flag, flag[len(prefix):].replace("-", "_"), NAMES, prefix)


def name_hint(shown: str, name: str, known, prefix: str = "--") -> str:
    """``shown`` quoted, with the near miss's refusal of ``name`` or the closest of ``known`` and the aliases."""
    import difflib

    miss = hint(name)
    if miss:
        return f"{shown!r} ({miss})"
    close = difflib.get_close_matches(name, sorted(set(known) | set(ALIASES)), n=1)
    return f"{shown!r}" + (f" (did you mean '{prefix}{close[0]}'?)" if close else "")


def unknown_keys(keys: Sequence[str]) -> list[str]:
    """The keys of a config file that ``hf-lisa train`` does not know (``[]`` when it cannot tell)."""
    if not matches_installed_transformers():
        return []
    return [key for key in keys if not isinstance(key, str) or (key not in NAMES and key not in ALIASES)]
