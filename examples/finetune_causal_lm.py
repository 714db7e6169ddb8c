"""Fine-tune a causal LM with LISA adapters in your own Trainer code.

    python examples/finetune_causal_lm.py            # embedded SmolLM2-135M-Instruct, bundled arithmetic task
    python examples/finetune_causal_lm.py --model_name_or_path HuggingFaceTB/SmolLM2-360M-Instruct \
        --train_file my_data.jsonl --max_steps 500

The three LISA pieces are a ``LisaConfig`` (the PEFT adapter), ``LisaAdapterCallback`` (which blocks' adapters train,
and when the sparse masks are re-selected) and, optionally, ``TrainingMonitorCallback`` (TensorBoard scalars).
"""

import argparse

from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import hf_lisa
from hf_lisa.data import data_collator, tokenize_datasets
from hf_lisa.demo_task import load_task_or_file
from hf_lisa.models import default_model_path
from hf_lisa.trainer_callbacks import LisaAdapterCallback, prepare_trainer
from hf_lisa.trainer_callbacks.monitoring import TrainingMonitorCallback

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model_name_or_path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
parser.add_argument("--train_file", default=None, help="jsonl/csv/parquet; default: the bundled arithmetic task")
parser.add_argument("--output_dir", default="outputs/finetune_causal_lm")
parser.add_argument("--max_steps", type=int, default=60)
parser.add_argument("--learning_rate", type=float, default=1e-3)
args = parser.parse_args()

model_path = args.model_name_or_path or default_model_path()
tokenizer = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path)

# 40% block-sparse rank-8 updates on the attention projections; 2 blocks' adapters train at a time, K = 10 steps
config = hf_lisa.LisaConfig(
    task_type="CAUSAL_LM", r=8, lisa_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    sparsity=0.4, lisa_activated_layers=2, lisa_interval_steps=10,
)
model = get_peft_model(model, config)
model.print_trainable_parameters()

raw = load_task_or_file(args.train_file)  # your file, or the bundled arithmetic task
datasets, _ = tokenize_datasets(raw, tokenizer, max_seq_length=256)  # loss on the completions only

training_args = TrainingArguments(
    args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8, learning_rate=args.learning_rate,
    lr_scheduler_type="cosine", warmup_steps=5, logging_steps=10, save_strategy="no", report_to="tensorboard",
)
trainer = Trainer(
    model=model, args=training_args, train_dataset=datasets["train"], eval_dataset=datasets["validation"],
    processing_class=tokenizer, data_collator=data_collator(tokenizer), callbacks=[LisaAdapterCallback(seed=42)],
)
prepare_trainer(trainer)  # hand the Trainer to the LISA callbacks: DDP, lisa/* in TensorBoard/W&B, the guard
TrainingMonitorCallback().attach(trainer)  # ahead of TensorBoard, so that its scalars reach the event files

before = trainer.evaluate()["eval_loss"]
trainer.train()
after = trainer.evaluate()["eval_loss"]
print(f"eval loss: {before:.4f} -> {after:.4f}")
trainer.save_model(args.output_dir)  # adapter (factors and masks) and tokenizer (the processing_class)
