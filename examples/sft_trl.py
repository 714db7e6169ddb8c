"""Supervised fine-tuning with LISA adapters through TRL's ``SFTTrainer``.

    python examples/sft_trl.py                       # embedded SmolLM2-135M-Instruct, bundled arithmetic task
    python examples/sft_trl.py --model_name_or_path HuggingFaceTB/SmolLM2-360M-Instruct \
        --train_file my_data.jsonl --max_steps 500

The difference from ``finetune_causal_lm.py``: TRL tokenises the rows (prompt/completion or chat ``messages``, loss on
the completion) and wraps the model itself. The ``LisaConfig`` goes to ``SFTTrainer`` as ``peft_config``;
``LisaAdapterCallback`` decides which blocks' adapters train, as in a plain ``Trainer``. Full-parameter LISA works the
same way: no ``peft_config``, and ``callbacks=[LisaCallback(lisa_activated_layers=2, lisa_interval_steps=20)]``.

Needs TRL: ``pip install "hf-lisa[trl]"``.
"""

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import hf_lisa
from hf_lisa.demo_task import load_task_or_file
from hf_lisa.models import default_model_path
from hf_lisa.trainer_callbacks import LisaAdapterCallback, prepare_trainer

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model_name_or_path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
parser.add_argument("--train_file", default=None, help="jsonl/csv/parquet; default: the bundled arithmetic task")
parser.add_argument("--output_dir", default="outputs/sft_trl")
parser.add_argument("--max_steps", type=int, default=60)
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TRL's default); fp32 otherwise")
args = parser.parse_args()

model_path = args.model_name_or_path or default_model_path()
tokenizer = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path)

raw = load_task_or_file(args.train_file)  # your file, or the bundled arithmetic task
if "prompt" in raw["train"].column_names:
    # a user turn and the assistant's reply: TRL renders them with the chat template, loss on the reply only
    raw = raw.map(
        lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}],
                     "completion": [{"role": "assistant", "content": row["completion"]}]},
        remove_columns=raw["train"].column_names,
    )

# 40% block-sparse rank-8 updates on the attention projections; 2 blocks' adapters train at a time, K = 10 steps
config = hf_lisa.LisaConfig(
    task_type="CAUSAL_LM", r=8, lisa_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    sparsity=0.4, lisa_activated_layers=2, lisa_interval_steps=10,
)
training_args = SFTConfig(
    args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8, learning_rate=args.learning_rate,
    lr_scheduler_type="cosine", warmup_steps=5, logging_steps=10, save_strategy="no", report_to="none",
    max_length=256, bf16=args.bf16,  # gradient checkpointing stays on (TRL's default)
)
trainer = SFTTrainer(
    model=model, args=training_args, train_dataset=raw["train"], eval_dataset=raw["validation"],
    processing_class=tokenizer, peft_config=config, callbacks=[LisaAdapterCallback(seed=42)],
)
prepare_trainer(trainer)  # hand the Trainer to the LISA callbacks: DDP, lisa/* in TensorBoard/W&B, the guard
trainer.model.print_trainable_parameters()

before = trainer.evaluate()["eval_loss"]
trainer.train()
after = trainer.evaluate()["eval_loss"]
print(f"eval loss: {before:.4f} -> {after:.4f}")
trainer.save_model(args.output_dir)  # adapter (factors and masks) and tokenizer (the processing_class)
