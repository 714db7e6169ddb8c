"""``--packing``: the packing order, the packed rows token by token on SmolLM2's tokenizer, the attention mask
transformers builds from them, logits and the Trainer's loss equal to the unpacked ones (tiny llama and SmolLM2), the
check that refuses models which would attend across rows, and ``hf-lisa train --packing`` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_gpt2, tiny_llama
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

from hf_lisa.errors import UsageError
from hf_lisa.data.pipeline import IGNORE_INDEX, data_collator, load_raw_datasets, tokenize_datasets
from hf_lisa.data.packing import (
    PackedCollator,
    check_packing_support,
    pack_dataset,
    pack_features,
    pack_rows,
    prepare_packing,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [  # prompt/completion rows of different lengths
    {"prompt": "What is the capital of France?", "completion": "Paris."},
    {"prompt": "2 + 2 =", "completion": "4"},
    {"prompt": "Name three colours of the rainbow, in order.", "completion": "Red, orange and yellow."},
    {"prompt": "Say hi.", "completion": "Hi!"},
    {"prompt": "Translate 'chat' from French to English.", "completion": "Cat."},
    {"prompt": "Is the sea salty?", "completion": "Yes, it is."},
]
TEXT_ROWS = [{"text": "The quick brown fox jumps over the lazy dog."}, {"text": "Bonjour."}]  # every token trained


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_lisa.models import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def smollm2_rows(smollm2, tmp_path_factory):
    """The rows tokenised with SmolLM2's tokenizer as ``hf-lisa train`` tokenises them: prompt/completion rows through
    its chat template (the prompt untrained), then plain-text rows (every token trained, the first one included)."""
    import datasets

    root = tmp_path_factory.mktemp("packing")
    splits = []
    for name, rows in (("chat", ROWS), ("text", TEXT_ROWS)):
        raw = load_raw_datasets(train_file=write_jsonl(root / f"{name}.jsonl", rows), validation_split_percentage=0)
        splits.append(tokenize_datasets(raw, smollm2[1], max_seq_length=128, load_from_cache_file=False)[0]["train"])
    rows = datasets.concatenate_datasets(splits)
    assert rows[len(ROWS)]["labels"][0] == rows[len(ROWS)]["input_ids"][0]  # a first label that counts, unpacked
    return rows


def _random_rows(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        untrained = n // 3 if len(rows) % 2 else 0  # a prompt, then the completion; or every token trained
        labels = [IGNORE_INDEX] * untrained + ids[untrained:]
        rows.append({"input_ids": ids, "attention_mask": [1] * n, "labels": labels})
    return rows


# -- packing order -----------------------------------------------------------------------------------------------------
def test_pack_rows_puts_every_row_in_exactly_one_sequence_within_the_limit():
    import random

    lengths = [random.Random(3).randint(1, 100) for _ in range(400)]
    packs = pack_rows(lengths, 128, seed=0)
    assert sorted(i for pack in packs for i in pack) == list(range(400))
    assert all(sum(lengths[i] for i in pack) <= 128 for pack in packs)
    lower_bound = -(-sum(lengths) // 128)
    assert len(packs) <= 11 / 9 * lower_bound + 1  # best-fit decreasing's guarantee
    assert pack_rows(lengths, 128, seed=0) == packs  # deterministic for a seed
    assert pack_rows(lengths, 128, seed=1) != packs
    assert pack_rows([128, 1, 127], 128, seed=0) in ([[0], [2, 1]], [[2, 1], [0]])  # a full row stands alone


def test_pack_rows_refuses_a_row_that_does_not_fit():
    with pytest.raises(ValueError, match="row 1 has 9 tokens.*max_seq_length=8"):
        pack_rows([3, 9], 8, seed=0)


# -- the packed rows and the mask, token by token on SmolLM2's tokenizer ------------------------------------------------
def test_packed_rows_token_by_token_on_the_smollm2_tokenizer(smollm2, smollm2_rows):
    tokenizer = smollm2[1]
    rows = [smollm2_rows[i] for i in range(len(smollm2_rows))]
    lengths = [len(r["input_ids"]) for r in rows]
    max_len = max(lengths) * 2 + 5
    packed, report = pack_dataset(smollm2_rows, max_len, seed=0)
    groups = pack_rows(lengths, max_len, seed=0)
    assert report.rows == len(rows) == 8 and report.sequences == len(groups) == len(packed) < len(rows)
    assert report.tokens == sum(lengths) and set(packed.column_names) == {"input_ids", "labels", "position_ids"}
    for pack, group in zip(packed, groups):
        offset = 0
        for i in group:
            row, n = rows[i], lengths[i]
            assert pack["input_ids"][offset:offset + n] == row["input_ids"]
            assert pack["labels"][offset] == IGNORE_INDEX  # never predicted from the row before
            assert pack["labels"][offset + 1:offset + n] == row["labels"][1:]
            assert pack["position_ids"][offset:offset + n] == list(range(n))
            offset += n
        assert offset == len(pack["input_ids"])
    # the trained tokens of a sequence are those of its rows (whose first token is never a target), in order
    for pack, group in zip(packed, groups):
        trained = [t for t, label in zip(pack["input_ids"], pack["labels"]) if label != IGNORE_INDEX]
        assert trained == [t for i in group for t, label in zip(rows[i]["input_ids"][1:], rows[i]["labels"][1:])
                           if label != IGNORE_INDEX]
    text = "".join(tokenizer.decode([t for t, label in zip(pack["input_ids"], pack["labels"]) if label != IGNORE_INDEX])
                   for pack in packed)
    assert all(row["completion"] in text for row in ROWS)

    batch = PackedCollator(tokenizer.pad_token_id)([packed[j] for j in range(len(packed))])
    assert "attention_mask" not in batch and batch["use_cache"] is False
    width = batch["input_ids"].shape[1]
    segments = []  # the row (or padding) each position belongs to, per sequence
    for j, group in enumerate(groups):
        ids = [k for k, i in enumerate(group) for _ in range(lengths[i])]
        pad = width - len(ids)
        assert batch["input_ids"][j, len(ids):].tolist() == [tokenizer.pad_token_id] * pad
        assert batch["labels"][j, len(ids):].tolist() == [IGNORE_INDEX] * pad
        assert batch["position_ids"][j, len(ids):].tolist() == list(range(pad))  # padding: a segment of its own
        segments.append(ids + [len(group)] * pad)
    segment = torch.tensor(segments)
    causal = torch.arange(width)[None, :] <= torch.arange(width)[:, None]
    expected = (segment[:, :, None] == segment[:, None, :]) & causal  # (batch, query, key)

    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    config = AutoConfig.from_pretrained(smollm2[0].name_or_path)
    for impl in ("sdpa", "eager"):
        config._attn_implementation = impl
        mask = create_causal_mask(config, torch.zeros(len(groups), width, 1), None, None,
                                  position_ids=batch["position_ids"])
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # eager: an additive float mask
        assert torch.equal(allowed, expected), impl  # no query sees a key of another row, or a later key


# -- logits and the Trainer's loss equal the unpacked ones -------------------------------------------------------------
def _loss_and_grads(trainer, model, batch, grads: bool):
    batches, count = trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    model.zero_grad()
    with torch.set_grad_enabled(grads):
        loss = trainer.compute_loss(model, batches[0], num_items_in_batch=count)
    if grads:
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, count


def _check_equal_to_unpacked(model, rows, max_len, tmp_path, pad_id, tol, grads=True):
    from hf_lisa.trainer.lisa_trainer import LisaTrainer
    from conftest import build_training_args

    groups = pack_rows([len(r["input_ids"]) for r in rows], max_len, seed=0)
    packs = [pack_features([rows[i] for i in group]) for group in groups]
    assert len(packs) < len(rows)
    collator = PackedCollator(pad_id)
    with torch.no_grad():
        packed_logits = model(**{k: v for k, v in collator(packs).items() if k != "labels"}).logits
        for j, group in enumerate(groups):
            offset = 0
            for i in group:
                n = len(rows[i]["input_ids"])
                alone = model(input_ids=torch.tensor([rows[i]["input_ids"]])).logits[0]
                torch.testing.assert_close(packed_logits[j, offset:offset + n], alone, atol=tol, rtol=tol)
                offset += n

    trainer = LisaTrainer(model=model, args=build_training_args(tmp_path), progress_check_steps=0)
    unpacked_batch = _padded(rows, pad_id)
    loss_u, grads_u, count_u = _loss_and_grads(trainer, model, unpacked_batch, grads)
    loss_p, grads_p, count_p = _loss_and_grads(trainer, model, collator(packs), grads)
    assert int(count_p) == int(count_u) == sum(sum(label != IGNORE_INDEX for label in r["labels"][1:]) for r in rows)
    torch.testing.assert_close(loss_p, loss_u, atol=tol, rtol=tol)
    assert grads_u.keys() == grads_p.keys() and (grads_u or not grads)
    for name in grads_u:
        torch.testing.assert_close(grads_p[name], grads_u[name], atol=tol, rtol=tol * 10, msg=name)
    return float(loss_u)


def _padded(rows, pad_id):
    """The unpacked batch: rows right-padded, as ``hf_lisa.data.pipeline.data_collator`` pads them."""
    width = max(len(r["input_ids"]) for r in rows)
    pad = [width - len(r["input_ids"]) for r in rows]
    return {"input_ids": torch.tensor([r["input_ids"] + [pad_id] * n for r, n in zip(rows, pad)]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * n for r, n in zip(rows, pad)]),
            "labels": torch.tensor([r["labels"] + [IGNORE_INDEX] * n for r, n in zip(rows, pad)])}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_logits_loss_and_gradients_equal_unpacked_on_a_tiny_llama(impl, tmp_path):
    model = tiny_llama(num_layers=2)
    model.set_attn_implementation(impl)
    rows = _random_rows([9, 4, 13, 6, 3, 11, 7], vocab=128)
    _check_equal_to_unpacked(model, rows, max_len=20, tmp_path=tmp_path, pad_id=0, tol=1e-5)


def test_packed_logits_and_loss_equal_unpacked_on_smollm2(smollm2, smollm2_rows, tmp_path):
    model, tokenizer = smollm2
    rows = [{k: smollm2_rows[i][k] for k in ("input_ids", "attention_mask", "labels")}
            for i in range(len(smollm2_rows))]
    longest = max(len(r["input_ids"]) for r in rows)
    loss = _check_equal_to_unpacked(model, rows, max_len=2 * longest + 5, tmp_path=tmp_path,
                                    pad_id=tokenizer.pad_token_id, tol=2e-4, grads=False)  # gradients: tiny llama
    assert 0.1 < loss < 10  # a real model's loss on real text


# -- the check on the model ------------------------------------------------------------------------------------------
def test_the_check_accepts_llama_and_gpt2_and_the_flash_layout():
    for model in (tiny_llama(), tiny_gpt2()):  # rotary and absolute position embeddings
        check_packing_support(model, PackedCollator(0))
    check_packing_support(tiny_llama(), PackedCollator(0, flatten=True))


def test_a_cache_would_attend_across_rows_so_the_batch_turns_it_off():
    model = tiny_llama()
    model.config.use_cache = True  # what the model's forward reads when the batch does not say
    rows = _random_rows([6, 5], vocab=128)
    batch = PackedCollator(0)([pack_features(rows)])
    batch.pop("labels")
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([rows[1]["input_ids"]])).logits[0]
        torch.testing.assert_close(model(**batch).logits[0, 6:], alone, atol=1e-5, rtol=1e-5)
        batch.pop("use_cache")  # transformers skips the packed-sequence mask when it builds a cache
        assert not torch.allclose(model(**batch).logits[0, 6:], alone, atol=1e-3)
    check_packing_support(model, PackedCollator(0))


def test_the_flash_layout_is_one_row_with_the_row_boundaries():
    rows = _random_rows([6, 5, 4], vocab=128)
    packs = [pack_features(rows[:2]), pack_features(rows[2:])]
    batch = PackedCollator(0, flatten=True)(packs)
    assert batch["input_ids"].shape == (1, 15) and "attention_mask" not in batch
    assert batch["input_ids"][0].tolist() == sum((r["input_ids"] for r in rows), [])
    assert batch["position_ids"][0].tolist() == list(range(6)) + list(range(5)) + list(range(4))
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 6, 11, 15]
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["max_length_q"] == batch["max_length_k"] == 6
    assert [batch["labels"][0, k].item() for k in (0, 6, 11)] == [IGNORE_INDEX] * 3


def test_a_custom_attention_kernel_that_ignores_the_boundaries_is_refused():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("hf_lisa_test_kernel", sdpa_attention_forward)  # no packed-sequence mask for it
    model = tiny_llama()
    model.set_attn_implementation("hf_lisa_test_kernel")
    with pytest.raises(UsageError, match=r"--packing: LlamaForCausalLM \(attn_implementation='hf_lisa_test_kernel'\) "
                                         r"lets attention cross the rows"):
        check_packing_support(model, PackedCollator(0))


def test_a_model_without_position_ids_is_refused():
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(UsageError, match="MambaForCausalLM.*takes no position_ids"):
        check_packing_support(model, PackedCollator(0))


def test_evaluation_rows_stay_unpacked_and_packed_rows_need_their_positions(smollm2, smollm2_rows):
    tokenizer = smollm2[1]
    tokenized = {"train": smollm2_rows, "validation": smollm2_rows}
    packed, collator, report = prepare_packing(tokenized, smollm2[0], tokenizer, 128, seed=0,
                                               unpacked=data_collator(tokenizer))
    assert len(packed["train"]) == report.sequences < report.rows == len(packed["validation"])
    rows = [smollm2_rows[i] for i in range(3)]
    assert torch.equal(collator(rows)["attention_mask"], data_collator(tokenizer)(rows)["attention_mask"])
    no_positions = {k: v for k, v in packed["train"][0].items() if k != "position_ids"}
    with pytest.raises(ValueError, match=r"missing \['position_ids'\]"):
        collator([no_positions])


# -- hf-lisa train --packing -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing_run")
    return {"model": build_tiny_lm_dir(root / "model", num_layers=3),
            "train": write_jsonl(root / "train.jsonl", copy_task_rows(48, seed=0)),
            "validation": write_jsonl(root / "validation.jsonl", copy_task_rows(8, seed=1))}


@pytest.mark.parametrize("method_options", [
    ["--method", "lisa", "--lisa_activated_layers", "1", "--lisa_interval_steps", "2"],
    ["--method", "lisa-adapter", "--r", "4", "--lisa_activated_layers", "1", "--lisa_interval_steps", "2",
     "--sparsity", "0.5", "--importance_steps", "1", "--mask_update_interval", "2"],  # masks calibrated and reselected on packed batches
], ids=["lisa", "sparse-lisa-adapter"])
def test_hf_lisa_train_packing_trains_on_fewer_sequences(tiny_run, tmp_path, capsys, method_options):
    from hf_lisa.train import main

    out = tmp_path / "out"
    summary = main([
        "--model_name_or_path", tiny_run["model"], "--train_file", tiny_run["train"],
        "--validation_file", tiny_run["validation"], "--output_dir", str(out), "--max_steps", "4",
        "--per_device_train_batch_size", "2", "--learning_rate", "5e-3", "--logging_steps", "2",
        "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true",
        "--eval_generation_samples", "0", "--max_seq_length", "64", "--packing", "true", *method_options,
    ])
    packing = summary["data"]["packing"]
    assert packing["rows"] == summary["data"]["rows_kept"]["train"] == 48
    assert packing["sequences"] < 48 / 2 and packing["ratio"] == round(48 / packing["sequences"], 3)
    assert json.loads((out / "training_summary.json").read_text())["data"]["packing"] == packing
    assert f"packing: 48 training rows in {packing['sequences']} sequences" in capsys.readouterr().out
    metrics = summary["metrics"]
    assert metrics["eval_loss"] < metrics["eval_loss_before"]  # trained, evaluated on the unpacked rows
