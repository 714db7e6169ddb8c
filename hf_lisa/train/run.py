"""``run()``: one fine-tuning job from parsed arguments to the saved model, top to bottom."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional, Sequence

import torch

from ..errors import WHILE_RUNNING
from ..methods import get_method
from .parsing.arguments import DataArguments, LisaArguments, ModelArguments, parse_args
from .console import metrics_line, use_compact_console
from ..evaluation import compute_metrics, generation_exact_match, generation_rows, preprocess_logits_for_metrics
from ..optim.memory import apply_cpu_allocator
from .methods import apply_method, lisa_knobs, load_model_and_tokenizer, resolve_model_path
from .outputs import (
    LOSS_PLOT_NAME,
    SUMMARY_PREFIX,
    TRAINING_SUMMARY_NAME,
    _manifest_callback,
    _summary_callback,
    build_training_summary,
    plot_losses,
    save_final_model,
    staged_final_model,
    start_notes,
    write_error,
    write_model_card,
)
from .run_folder.output_dir import MANIFEST_NAME, check_output_dir, checkpoint_step, claim_output_dir, clear_previous_run
from ..data.preference import DPO, DPO_EVAL_METRICS, SFT
from .preflight import check_before_loading
from .run_folder.run_lock import OutputDirLock
from .quantization import prepare_quantized_model
from ..trainer import LisaTrainer

logger = logging.getLogger("hf_lisa.train")


def _pin_tensorboard_logging_dir(trainer) -> None:
    """Fix TensorBoard's log dir now, as ``on_train_begin`` would: ``output_dir/runs/<time>_<host>``.

    ``TensorBoardCallback`` only chooses that directory in ``on_train_begin``; anything logged before (our evaluation
    before training) creates its writer with ``log_dir=None``, i.e. ``./runs`` of the current directory, and training
    then keeps that writer. ``TENSORBOARD_LOGGING_DIR`` (transformers 5's replacement for ``logging_dir``) and a
    ``logging_dir`` on the arguments, where one exists, still win.
    """
    from transformers.integrations import TensorBoardCallback
    from transformers.integrations.integration_utils import default_logdir

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, TensorBoardCallback) and cb.tb_writer is None and cb.logging_dir is None:
            cb.logging_dir = getattr(trainer.args, "logging_dir", None) or os.path.join(
                trainer.args.output_dir, default_logdir()
            )


# ----------------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------------
def _setup_logging(training_args) -> None:
    import datasets
    import transformers

    level = training_args.get_process_log_level()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    logger.setLevel(logging.INFO if training_args.should_log else level)
    logging.getLogger("hf_lisa").setLevel(logging.INFO if training_args.should_log else level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)


def run(model_args: ModelArguments, data_args: DataArguments, lisa_args: LisaArguments, training_args) -> dict:
    """Train with already-parsed arguments and return the training summary (also written to the output dir)."""
    _setup_logging(training_args)
    started = time.time()
    # the Trainer's own push would upload a pickled training_args.bin and a card without base_model: push ourselves
    push_repo = training_args.hub_model_id if training_args.push_to_hub else None
    training_args.push_to_hub = False
    # released when run() returns or raises; a run that fails removes the folder the lock created if it stayed empty
    with OutputDirLock(training_args.output_dir, bookkeeping=(MANIFEST_NAME,)) as lock:
        _check_and_prepare(model_args, lisa_args, training_args, data_args, lock)  # locks, then checks the folder
        finished = _finished_checkpoint(training_args)
        if finished is not None:
            return finished
        claim_output_dir(training_args, lock)  # a second run into output_dir is refused from here on
        raw, bundled, held_out = _load_data(model_args, data_args, training_args, stage=lisa_args.stage)
        job = _Run(model_args, data_args, lisa_args, training_args, raw, bundled, started, held_out)
        job.build()
        try:
            job.evaluate_and_print("_before", "before training: ")
            job.train()
            job.evaluate_and_print("", "after training:  ")
            return job.save_and_push(push_repo)
        except Exception as err:  # a failure while running: exit status 1 whatever its type (unless a UsageError)
            named = write_error(err, training_args.output_dir)  # a full or read-only disk: say where it wrote
            setattr(named or err, WHILE_RUNNING, training_args.output_dir)
            if named is not None:
                raise named from err
            raise


def _check_and_prepare(model_args, lisa_args, training_args, data_args=None, lock=None) -> None:
    """Seed, allocator and every check that needs no weights: the output folder (under its ``lock``, taken first),
    the model's config on meta."""
    from transformers import set_seed

    if not torch.cuda.is_available():
        training_args.dataloader_pin_memory = False  # pinning is meaningless without a GPU and only warns
    allocator = apply_cpu_allocator(training_args.cpu_allocator, on_cpu=training_args.device.type == "cpu")
    if allocator:
        logger.info(allocator)
    set_seed(training_args.seed)
    check_output_dir(model_args, lisa_args, training_args, lock)  # resolves --resume_from_checkpoint latest/true
    check_before_loading(model_args, lisa_args, training_args, data_args)  # config, files, meta model: no weights


def _finished_checkpoint(training_args) -> Optional[dict]:
    """A resume from a checkpoint saved at ``--max_steps`` (or later) trains nothing and writes nothing: say so and
    return ``{"output_dir", "resumed_from", "global_step", "trained_steps": 0}``; ``None`` when there is a step to
    train. (transformers would run one more step past ``max_steps`` and save the model again.)"""
    checkpoint, max_steps = training_args.resume_from_checkpoint, training_args.max_steps
    if not checkpoint or max_steps <= 0:
        return None
    step = checkpoint_step(checkpoint)
    if step < max_steps:
        return None
    if training_args.process_index == 0:
        print(f"[{SUMMARY_PREFIX}] {checkpoint} was saved at step {step}, and --max_steps is {max_steps}: nothing "
              "left to train, nothing written. Raise --max_steps to train further from it.", flush=True)
    return {"output_dir": training_args.output_dir, "resumed_from": checkpoint, "global_step": step,
            "trained_steps": 0}


def _load_data(model_args, data_args, training_args, stage: str = SFT):
    """``(training data, whether the bundled task is used, rows of train held out for evaluation)``: loaded,
    subsampled and checked before the model loads. The data is a :class:`~hf_lisa.data.training_data.TrainingData`
    (files, folders, a dataset, weighted mixtures), or for ``--stage dpo`` its one source's ``DatasetDict``."""
    from .. import data as data_lib
    from .. import demo_task
    from ..data.mixing import check_resumed_mixture, mixture_settings
    from ..data.training_data import load_training_data

    bundled = data_args.train_file is None and data_args.dataset_name is None
    if bundled and stage == DPO:
        from ..data.preference import refuse_bundled_task

        refuse_bundled_task()  # prompt/completion rows: no preference pairs
    if bundled:
        demo_task.announce_bundled_task(data_args.demo_train_samples, training_args.process_index == 0)
        with training_args.main_process_first(desc="writing the bundled task"):
            data_args.train_file, data_args.validation_file = demo_task.cached_dataset_files(
                data_args.demo_train_samples
            )
        if data_args.answer_pattern is None:
            data_args.answer_pattern = r"####\s*(-?\d+)"
        if data_args.eval_generation_samples is None:
            data_args.eval_generation_samples = 64
    # every source read and checked line by line; validation rows held out, --max_*_samples applied
    raw = load_training_data(data_args, seed=training_args.seed, cache_dir=model_args.cache_dir)
    check_resumed_mixture(training_args.resume_from_checkpoint, mixture_settings(raw))  # the checkpoint's mixture
    held_out = raw.held_out  # before --max_eval_samples: what training never sees
    if stage == DPO:  # preference rows: their columns, before the model loads (hf_lisa.data.preference)
        raw = raw.as_raw(f"--stage {DPO}")  # one source's rows (TRL tokenises them)
        from ..data.preference import check_preference_data

        check_preference_data(raw, data_args)
        return raw, bundled, held_out
    # options, formats, a validation file against the training file, mixed formats: before the model loads
    raw.check(lambda part: data_lib.check_data(
        part, data_args.max_seq_length, data_format=data_args.data_format, overlength=data_args.overlength,
        on_bad_row=data_args.on_bad_row, columns=data_args.columns(),
    ))  # each source on its own (hf_lisa.data.training_data)
    return raw, bundled, held_out


class _Run:
    """The state of one job between its stages: the model, the trainer, the metrics measured before and after."""

    def __init__(self, model_args, data_args, lisa_args, training_args, raw, bundled: bool, started: float,
                 held_out: int = 0) -> None:
        self.model_args, self.data_args, self.lisa_args, self.training_args = model_args, data_args, lisa_args, \
            training_args
        self.raw, self.bundled, self.started, self.held_out = raw, bundled, started, held_out
        self.metrics: dict[str, float] = {}
        self.start_info: dict = {}  # the trainable summary, filled at train begin

    def build(self) -> None:
        """Load the model and tokenizer, tokenize, wrap the model for the method, build the ``LisaTrainer``."""
        from .. import data as data_lib

        model_args, data_args, lisa_args, training_args = (self.model_args, self.data_args, self.lisa_args,
                                                           self.training_args)
        path, self.base_model_id = resolve_model_path(model_args)
        model, self.tokenizer = load_model_and_tokenizer(model_args, path)
        if lisa_args.stage == DPO:  # preference pairs through TRL's DPOTrainer
            return self._build_preference(model)
        with training_args.main_process_first(desc="tokenizing"):  # each source on its own, then mixed
            tokenized, self.report = self.raw.tokenize(lambda part: data_lib.tokenize_datasets(
                part, self.tokenizer, max_seq_length=data_args.max_seq_length,
                data_format=data_args.data_format, completion_only_loss=data_args.completion_only_loss,
                overlength=data_args.overlength, chat_template=data_args.chat_template,
                text_column=data_args.text_column, prompt_column=data_args.prompt_column,
                completion_column=data_args.completion_column, messages_column=data_args.messages_column,
                num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache,
                on_bad_row=data_args.on_bad_row,
            ))
        self.chat = data_lib.use_chat_template(self.tokenizer, data_args.chat_template)
        model = prepare_quantized_model(model, training_args)  # a bitsandbytes base: PEFT's k-bit preparation
        self.collator, self.packing = data_lib.data_collator(self.tokenizer), None
        if data_args.packing:  # train rows side by side, checked on this model first (hf_lisa.data.packing)
            from ..data.packing import prepare_packing

            tokenized, self.collator, self.packing = prepare_packing(
                tokenized, model, self.tokenizer, data_args.max_seq_length, training_args.seed, self.collator)
        if training_args.gradient_checkpointing and get_method(lisa_args.method).is_adapter:
            model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
        model, scheduling_callbacks = apply_method(model, lisa_args, seed=training_args.seed)
        self.scheduling_callbacks = scheduling_callbacks
        self.trainer = self._trainer(model, tokenized, scheduling_callbacks)
        self.gen_rows = []
        n_gen = data_args.eval_generation_samples or 0
        for validation, data_format in self.raw.validation_splits() if n_gen else ():  # each source's, in order
            if data_format != "text" and len(self.gen_rows) < n_gen:  # text rows have no answer
                self.gen_rows += generation_rows(validation, data_format, n_gen - len(self.gen_rows),
                                                 chat=self.chat, columns=data_args.columns())

    def _build_preference(self, model) -> None:
        """``--stage dpo``: the rows checked and converted (TRL's ``DPOTrainer`` tokenises them), the reference model
        (a frozen copy of the loaded model for the methods that train its weights), the method, the trainer; no
        generation exact match (:mod:`hf_lisa.data.preference`, :mod:`hf_lisa.train.dpo`)."""
        from .dpo import reference_model
        from ..data.preference import preference_datasets

        data_args, lisa_args, training_args = self.data_args, self.lisa_args, self.training_args
        with training_args.main_process_first(desc="checking the preference rows"):
            rows, self.report = preference_datasets(self.raw, self.tokenizer, data_args, self.held_out)
        self.chat, self.packing, self.gen_rows = False, None, []
        self.ref_model = reference_model(model, lisa_args.method)  # before apply_method and any step
        model = prepare_quantized_model(model, training_args)
        if training_args.gradient_checkpointing and get_method(lisa_args.method).is_adapter:
            model.enable_input_require_grads()
        model, self.scheduling_callbacks = apply_method(model, lisa_args, seed=training_args.seed)
        self.trainer = self._trainer(model, rows, self.scheduling_callbacks)

    def _trainer(self, model, tokenized, scheduling_callbacks) -> LisaTrainer:
        """The ``LisaTrainer`` with the scheduling, summary and monitoring callbacks, prepared for DDP."""
        from ..distributed import configure_trainer_for_lisa
        from ..data.mixing import mixture_record_callback, mixture_settings
        from hf_lisa.trainer_callbacks.monitoring import TrainingMonitorCallback

        lisa_args, training_args = self.lisa_args, self.training_args
        monitor = TrainingMonitorCallback(
            plateau_grad_norm=lisa_args.monitor_plateau_grad_norm,
            plateau_steps=lisa_args.monitor_plateau_steps,
            num_block_groups=lisa_args.monitor_block_groups,
            lisa_layers_attribute=lisa_args.lisa_layers_attribute,
        )
        notes = start_notes(training_args, self.held_out, self.data_args.validation_split_percentage)
        notes += [self.packing.line()] if self.packing else []
        callbacks = scheduling_callbacks + [_summary_callback(lisa_args.method, training_args.output_dir,
                                                              lisa_args.lisa_layers_attribute, self.start_info,
                                                              schedules=scheduling_callbacks, notes=notes),
                                            _manifest_callback()]  # checkpoints listed in output_dir's manifest
        mixture = mixture_settings(self.raw) if lisa_args.stage != DPO else None
        callbacks += [mixture_record_callback(mixture)] if mixture else []  # in each checkpoint, checked on resume
        # LisaTrainer's settings are fields of training_args (a hf_lisa.trainer.LisaTrainingArguments); the block
        # path of its learning-rate decay groups is the schedule's
        options = dict(lisa_layers_attribute=lisa_args.lisa_layers_attribute)
        if lisa_args.stage == DPO:  # TRL's DPOTrainer with LisaTrainer's behaviour composed in (hf_lisa.train.dpo)
            from .dpo import dpo_trainer

            trainer = dpo_trainer(model, self.ref_model, training_args, self.data_args, lisa_args, tokenized,
                                  self.tokenizer, self.report, callbacks, self.held_out, **options)
            self.eval_dataset = trainer.eval_dataset
        else:
            self.eval_dataset = eval_dataset = tokenized.get("validation")
            trainer = LisaTrainer(
                model=model,
                args=training_args,
                train_dataset=tokenized["train"],
                eval_dataset=eval_dataset,
                processing_class=self.tokenizer,
                data_collator=self.collator,
                compute_metrics=compute_metrics if eval_dataset is not None else None,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics if eval_dataset is not None else None,
                callbacks=callbacks,
                **options,
            )
        monitor.attach(trainer)  # the LISA callbacks placed themselves ahead of the integrations as it was built
        use_compact_console(trainer)  # one line per log event on the console; --report_to gets every value
        _pin_tensorboard_logging_dir(trainer)
        # DDP: unused-parameter detection (LISA freezes after the wrap), active-set all-reduce, --ddp_comm_hook
        configure_trainer_for_lisa(trainer, comm_hook=lisa_args.ddp_comm_hook, powersgd_rank=lisa_args.powersgd_rank,
                                   powersgd_start_iter=lisa_args.powersgd_start_iter)
        return trainer

    def evaluate_and_print(self, suffix: str, label: str) -> None:
        """Evaluation loss/perplexity/accuracy and generation exact match into ``metrics`` (keys + ``suffix``),
        printed in one line on the main process."""
        trainer, data_args, metrics = self.trainer, self.data_args, self.metrics
        if self.eval_dataset is not None:
            result = trainer.evaluate()
            sft = ("eval_loss", "eval_perplexity", "eval_token_accuracy")
            for key in DPO_EVAL_METRICS if self.lisa_args.stage == DPO else sft:
                if key in result:
                    metrics[key + suffix] = float(result[key])
        if self.gen_rows:
            score, samples = generation_exact_match(
                trainer.model, self.tokenizer, self.gen_rows, self.chat,
                max_new_tokens=data_args.generation_max_new_tokens,
                batch_size=self.training_args.per_device_eval_batch_size * 2,
                answer_pattern=data_args.answer_pattern, lenient=data_args.answer_lenient,
                progress=trainer.is_world_process_zero() and not self.training_args.disable_tqdm,
            )
            metrics["eval_exact_match" + suffix] = score
            if trainer.is_world_process_zero():
                logger.info("exact match %s training: %.3f; e.g. %r -> %r", "before" if suffix else "after", score,
                            samples[0]["prompt"], samples[0]["generation"])
        line = metrics_line(metrics, suffix)
        if trainer.is_world_process_zero() and line:
            print(f"[{SUMMARY_PREFIX}] {label}{line}", flush=True)

    def train(self) -> None:
        """Clear what an earlier run left in ``output_dir``, then train (resuming where asked)."""
        training_args = self.training_args
        with training_args.main_process_first(desc="clearing what an earlier run left in output_dir"):
            if training_args.should_save:
                clear_previous_run(training_args)
        train_result = self.trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        self.metrics["train_loss"] = float(train_result.training_loss)

    def switch_steps(self) -> list[int]:
        """The steps after the first where the layer schedule drew new active blocks in this session."""
        histories = [getattr(getattr(cb, "layer_scheduler", None), "history", None) or []
                     for cb in self.scheduling_callbacks]
        return sorted({step for history in histories for step, _ in history if step})

    def save_and_push(self, push_repo: Optional[str]) -> dict:
        """Save the final model, summary, plot and card (staged, then moved into place); push if asked."""
        trainer, lisa_args, training_args = self.trainer, self.lisa_args, self.training_args
        metrics, base_model_id = self.metrics, self.base_model_id
        output_dir = training_args.output_dir
        saved_mode = "adapter" if get_method(lisa_args.method).is_adapter else "merged"
        # everything goes to a staging folder, moved into output_dir once complete: a crash leaves no half model
        with staged_final_model(output_dir, training_args.should_save,
                                getattr(training_args, "keep_checkpoints", True)) as staging:
            save_final_model(trainer, trainer.model, self.tokenizer, staging, lisa_args.method)
            summary = build_training_summary(
                self.model_args, self.data_args, lisa_args, training_args, base_model_id=base_model_id,
                lisa=lisa_knobs(lisa_args), metrics=metrics, global_step=trainer.state.global_step,
                data_report=self.report, bundled=self.bundled, trainable=self.start_info, started=self.started,
            )
            summary.data.update(self.raw.summary() if hasattr(self.raw, "summary") else {})  # a mixture's sources
            if self.packing:  # rows, sequences, rows per sequence, filled positions
                summary.data["packing"] = self.packing.to_dict()
            if trainer.is_world_process_zero():
                plot = plot_losses(
                    trainer.state.log_history, os.path.join(staging, LOSS_PLOT_NAME),
                    before_eval_loss=metrics.get("eval_loss_before"), after_eval_loss=metrics.get("eval_loss"),
                    final_step=trainer.state.global_step,
                    title=f"hf-lisa: {lisa_args.method} on {os.path.basename(base_model_id.rstrip('/'))}",
                    switch_steps=self.switch_steps(),
                )
                summary.loss_plot = LOSS_PLOT_NAME if plot else None
                summary.save(staging)
                # the card is rendered once, for the repo the run pushes to; the push uploads it if it keeps the
                # saved form
                card = write_model_card(staging, summary, saved_mode, repo_id=push_repo)
        pushed_to = None
        if trainer.is_world_process_zero():
            push_mode = lisa_args.push_mode or saved_mode
            kind = "adapter" if saved_mode == "adapter" else "full weights"
            extra = f", {LOSS_PLOT_NAME}" if plot else ""
            print(f"[{SUMMARY_PREFIX}] wrote {output_dir} ({kind}, {TRAINING_SUMMARY_NAME}{extra}) in "
                  f"{summary.runtime_seconds:.0f} s", flush=True)
            if push_repo:
                from ..hub import push_to_hub

                pushed_to = str(push_to_hub(
                    output_dir, push_repo, mode=push_mode, private=training_args.hub_private_repo,
                    token=training_args.hub_token, training_summary=summary,
                    card=card if push_mode == saved_mode else None,
                    base_model=base_model_id if "/" in base_model_id and not os.path.exists(base_model_id) else None,
                ))
                print(f"[{SUMMARY_PREFIX}] pushed {push_mode} to {push_repo}: {pushed_to}", flush=True)
        result = summary.to_dict()  # training_summary.json's keys, and where the push went
        if pushed_to:
            result["pushed_to"] = pushed_to
        return result


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse ``argv`` (``sys.argv[1:]`` by default), train, save, and return the training summary."""
    return run(*parse_args(argv))
