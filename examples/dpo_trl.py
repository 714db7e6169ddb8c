"""Preference tuning (DPO) with LISA adapters through TRL's ``DPOTrainer``.

    python examples/dpo_trl.py                       # embedded SmolLM2-135M-Instruct, pairs from the bundled task
    python examples/dpo_trl.py --train_file my_preferences.jsonl --max_steps 500   # prompt / chosen / rejected rows

The difference from ``sft_trl.py``: the data are preference pairs and the trainer is ``DPOTrainer``. No reference model
is loaded: for a PEFT model, DPOTrainer computes the reference log-probabilities with the adapters disabled, that is,
from the base model. The bundled pairs prefer the worked solution of an arithmetic problem over the same solution with
the final answer off by one.

Needs TRL: ``pip install "hf-lisa[trl]"``.
"""

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

import hf_lisa
from hf_lisa.demo_task import ANSWER_MARKER, load_task_or_file
from hf_lisa.models import default_model_path
from hf_lisa.trainer_callbacks import LisaAdapterCallback, prepare_trainer

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model_name_or_path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
parser.add_argument("--train_file", default=None,
                    help="jsonl/csv/parquet with prompt, chosen, rejected; default: pairs from the bundled task")
parser.add_argument("--output_dir", default="outputs/dpo_trl")
parser.add_argument("--max_steps", type=int, default=60)
parser.add_argument("--learning_rate", type=float, default=1e-4)
parser.add_argument("--beta", type=float, default=0.1, help="DPO's β: how far the policy may move from the reference")
parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TRL's default); fp32 otherwise")
args = parser.parse_args()

model_path = args.model_name_or_path or default_model_path()
tokenizer = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path)


def preference_pair(row: dict) -> dict:
    """A bundled problem as a chat preference pair: the right answer against the last line off by one."""
    right, wrong = row["answer"], str(int(row["answer"]) + 1)
    ending = f"= {right}\n{ANSWER_MARKER} {right}"  # how every bundled completion ends
    rejected = row["completion"].removesuffix(ending) + f"= {wrong}\n{ANSWER_MARKER} {wrong}"
    return {
        "prompt": [{"role": "user", "content": row["prompt"]}],
        "chosen": [{"role": "assistant", "content": row["completion"]}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


raw = load_task_or_file(args.train_file)  # your prompt/chosen/rejected rows, or the bundled arithmetic task
if not args.train_file:
    raw = raw.map(preference_pair, remove_columns=raw["train"].column_names)

# rank-8 adapters on the attention projections; 2 blocks' adapters train at a time, K = 10 steps
config = hf_lisa.LisaConfig(
    task_type="CAUSAL_LM", r=8, lisa_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    lisa_activated_layers=2, lisa_interval_steps=10,
)
training_args = DPOConfig(
    args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8, learning_rate=args.learning_rate,
    beta=args.beta, lr_scheduler_type="cosine", warmup_steps=5, logging_steps=10, save_strategy="no",
    report_to="none", max_length=256, bf16=args.bf16,  # gradient checkpointing stays on (TRL's default)
)
trainer = DPOTrainer(
    model=model, args=training_args, train_dataset=raw["train"], eval_dataset=raw["validation"],
    processing_class=tokenizer, peft_config=config, callbacks=[LisaAdapterCallback(seed=42)],
)
prepare_trainer(trainer)  # hand the Trainer to the LISA callbacks: DDP, lisa/* in TensorBoard/W&B, the guard
trainer.model.print_trainable_parameters()

before = trainer.evaluate()  # policy = reference at the start: loss log 2, no preference yet
trainer.train()
after = trainer.evaluate()
print(f"eval loss: {before['eval_loss']:.4f} -> {after['eval_loss']:.4f}")
print(f"reward accuracy: {before['eval_rewards/accuracies']:.3f} -> {after['eval_rewards/accuracies']:.3f}")
trainer.save_model(args.output_dir)  # adapter and tokenizer (the processing_class)
