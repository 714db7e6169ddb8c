"""Full-parameter LISA (Pan et al., 2024): no adapters, the sampled blocks' own weights train in place.

    python examples/full_parameter_lisa.py           # embedded SmolLM2-135M-Instruct, bundled arithmetic task

The difference from ``finetune_causal_lm.py``: the model stays a plain transformers model and ``LisaCallback`` makes
the embeddings, LM head and final norm plus γ = 2 sampled blocks trainable ("E+H+γL"), re-drawn every K steps. The
Trainer builds its optimizer over every parameter first, so blocks sampled later do train (LMFlow #726), and the
optimizer state of deactivated blocks is dropped at each switch (LMFlow #768). The output is a full model.
"""

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from hf_lisa.data import data_collator, tokenize_datasets
from hf_lisa.demo_task import load_task_or_file
from hf_lisa.models import default_model_path
from hf_lisa.trainer_callbacks import LisaCallback, prepare_trainer
from hf_lisa.trainer_callbacks.monitoring import TrainingMonitorCallback

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model_name_or_path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
parser.add_argument("--train_file", default=None, help="jsonl/csv/parquet; default: the bundled arithmetic task")
parser.add_argument("--output_dir", default="outputs/full_parameter_lisa")
parser.add_argument("--max_steps", type=int, default=60)
parser.add_argument("--learning_rate", type=float, default=2e-4)
parser.add_argument("--activated_layers", type=int, default=2, help="γ")
parser.add_argument("--interval_steps", type=int, default=20, help="K")
args = parser.parse_args()

model_path = args.model_name_or_path or default_model_path()
tokenizer = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path)

raw = load_task_or_file(args.train_file)  # your file, or the bundled arithmetic task
datasets, _ = tokenize_datasets(raw, tokenizer, max_seq_length=256)

lisa = LisaCallback(
    lisa_activated_layers=args.activated_layers, lisa_interval_steps=args.interval_steps, lisa_sampling="uniform",
    seed=42,
    lisa_always_trainable=("embeddings", "lm_head", "norm"), lisa_optimizer_state_policy="drop",
)
training_args = TrainingArguments(
    args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8, learning_rate=args.learning_rate,
    lr_scheduler_type="cosine", warmup_steps=5, logging_steps=10, save_strategy="no", report_to="tensorboard",
)
trainer = Trainer(
    model=model, args=training_args, train_dataset=datasets["train"], eval_dataset=datasets["validation"],
    processing_class=tokenizer, data_collator=data_collator(tokenizer), callbacks=[lisa],
)
prepare_trainer(trainer)  # hand the Trainer to the LISA callbacks: DDP, lisa/* in TensorBoard/W&B, the guard
TrainingMonitorCallback().attach(trainer)

before = trainer.evaluate()["eval_loss"]
trainer.train()
after = trainer.evaluate()["eval_loss"]
print(f"eval loss: {before:.4f} -> {after:.4f}")
trainer.save_model(args.output_dir)  # full safetensors weights and the tokenizer (the processing_class)
