"""Full-parameter LISA (LisaCallback) through a real ``Trainer.train()`` on tiny llama models built from config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_lisa.optim.state import optimizer_state_bytes, unwrap_optimizer
from hf_lisa.scheduler.sampler import LayerSampler
from hf_lisa.scheduler import LayerwiseScheduler
from hf_lisa.trainer_callbacks import LisaCallback, check_lisa_training_setup


def _train(model, args, dataset, callbacks=()):
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))
    trainer.train()
    return trainer


def _snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _active_per_step(trainer):
    """Active blocks of every optimizer step, from the Trainer's own log history (logging_steps=1)."""
    return {
        h["step"]: h["lisa/active_blocks"]
        for h in trainer.state.log_history
        if "loss" in h and "lisa/active_blocks" in h
    }


def _block_changed(model, before, index):
    prefix = f"model.layers.{index}."
    return {n: not torch.equal(p, before[n]) for n, p in model.named_parameters() if n.startswith(prefix)}


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_active_set_rotates_exactly_at_multiples_of_k(tiny_llama, token_dataset, training_args, grad_accum):
    k, steps = 3, 10
    lisa = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=k, lisa_sampling="uniform", seed=7)
    trainer = _train(
        tiny_llama(), training_args(max_steps=steps, gradient_accumulation_steps=grad_accum), token_dataset(), [lisa]
    )
    history = lisa.layer_scheduler.history
    # one draw at train begin, then exactly one per multiple of K; none at step 1 (no double switch at 0 and 1)
    assert [step for step, _ in history] == [0, 3, 6, 9]
    reference = LayerSampler(num_layers=4, lisa_activated_layers=1, seed=7)
    assert [blocks for _, blocks in history] == [reference.sample() for _ in range(4)]
    # the optimizer step that starts at global_step s trains the set drawn for period s // K
    per_step = _active_per_step(trainer)
    assert sorted(per_step) == list(range(1, steps + 1))
    for step, logged in per_step.items():
        expected = history[(step - 1) // k][1]
        assert logged == ",".join(map(str, expected)), (step, logged, expected)


@pytest.mark.parametrize(
    "optim",
    [
        "adamw_torch",
        "adamw_torch_fused",
        "adafactor",
        "sgd",
        pytest.param(
            "adamw_bnb_8bit",
            marks=pytest.mark.skipif(
                __import__("importlib").util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed"
            ),
        ),
    ],
)
def test_active_blocks_change_and_never_active_blocks_stay_bit_identical(
    tiny_llama, token_dataset, training_args, optim
):
    model = tiny_llama(num_layers=4)
    before = _snapshot(model)
    lisa = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, seed=3)
    trainer = _train(model, training_args(max_steps=4, optim=optim), token_dataset(), [lisa])

    ever_active = {b for _, blocks in lisa.layer_scheduler.history for b in blocks}
    assert 1 <= len(ever_active) <= 2
    for index in range(4):
        changed = _block_changed(model, before, index)
        if index in ever_active:
            assert all(changed.values()), f"block {index} was active but some weights did not move: {changed}"
        else:
            assert not any(changed.values()), f"block {index} was never active but moved: {changed}"
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert not torch.equal(dict(model.named_parameters())[name], before[name]), name
    # drop policy: whatever state the optimizer keeps belongs to the current trainable set only
    current = {id(p) for p in lisa.layer_scheduler.trainable_parameters()}
    assert {id(p) for p in unwrap_optimizer(trainer.optimizer).state} <= current


def _adamw_state_bytes(params):
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)  # exp_avg, exp_avg_sq, float32 step


def test_optimizer_holds_state_only_for_current_blocks_after_100_switches(tiny_llama, token_dataset, training_args):
    model = tiny_llama(num_layers=4, hidden=16, vocab=32)
    lisa = LisaCallback(lisa_activated_layers=2, lisa_interval_steps=1, seed=0)
    trainer = _train(model, training_args(max_steps=101, logging_steps=101), token_dataset(vocab=32), [lisa])

    scheduler = lisa.layer_scheduler
    assert len(scheduler.history) == 101  # the initial draw + 100 switches
    assert len({tuple(b) for _, b in scheduler.history}) > 1
    expected_params = scheduler.trainable_parameters()  # embeddings + lm_head + final norm + the 2 current blocks
    optimizer = unwrap_optimizer(trainer.optimizer)  # through accelerate's AcceleratedOptimizer
    assert type(optimizer) is torch.optim.AdamW and optimizer is not trainer.optimizer
    held = optimizer.state
    assert {id(p) for p in held} == {id(p) for p in expected_params}
    expected_bytes = _adamw_state_bytes(expected_params)
    assert optimizer_state_bytes(trainer.optimizer) == expected_bytes
    assert trainer.state.log_history[-2]["lisa/optimizer_state_bytes"] == expected_bytes
    # E+H+norm of this model: 2 * 32 * 16 + 16 parameters
    assert scheduler.param_counts()["always_trainable"] == 2 * 32 * 16 + 16


def test_keep_policy_keeps_state_of_every_block_ever_trained(tiny_llama, token_dataset, training_args):
    model = tiny_llama(num_layers=4, hidden=16, vocab=32)
    lisa = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=1, seed=0, lisa_optimizer_state_policy="keep")
    trainer = _train(model, training_args(max_steps=12), token_dataset(vocab=32), [lisa])
    scheduler = lisa.layer_scheduler
    ever = sorted({b for _, blocks in scheduler.history for b in blocks})
    assert len(ever) > 1
    expected = list(scheduler.always_params) + [p for b in ever for p in scheduler.block_params[b]]
    assert optimizer_state_bytes(trainer.optimizer) == _adamw_state_bytes(expected)


class _AdamStepRecorder(TrainerCallback):
    """Reads Adam's ``step`` counter of every active block right after each optimizer step."""

    def __init__(self, lisa):
        self.lisa, self.records = lisa, []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        scheduler, opt = self.lisa.layer_scheduler, unwrap_optimizer(optimizer)
        self.records.append({b: int(opt.state[scheduler.block_params[b][0]]["step"]) for b in scheduler.active})


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_resampled_block_starts_a_fresh_adam_sequence_under_drop(tiny_llama, token_dataset, training_args, policy):
    lisa = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=1, seed=1, lisa_optimizer_state_policy=policy)
    recorder = _AdamStepRecorder(lisa)
    _train(tiny_llama(hidden=16, vocab=32), training_args(max_steps=14), token_dataset(vocab=32), [lisa, recorder])

    trained_steps: dict[int, int] = {}
    reactivations = continuations = 0
    previous: dict[int, int] = {}
    for record in recorder.records:
        (block, adam_step), = record.items()
        if block in previous:  # active in the step before: the sequence continues
            assert adam_step == previous[block] + 1
            continuations += 1
        elif block in trained_steps:  # re-sampled after a pause
            reactivations += 1
            assert adam_step == (1 if policy == "drop" else trained_steps[block] + 1)
        else:
            assert adam_step == 1
        trained_steps[block] = adam_step
        previous = record
    assert reactivations >= 2 and continuations >= 1


def test_full_lisa_with_all_blocks_equals_plain_full_finetuning(tiny_llama, token_dataset, training_args):
    # fp32 on CPU; tolerance 1e-6 absolute (we observe exact equality: the same kernels run on the same values)
    plain = tiny_llama(seed=5)
    _train(plain, training_args(max_steps=6), token_dataset())
    lisa_model = tiny_llama(seed=5)
    lisa = LisaCallback(lisa_activated_layers=4, lisa_interval_steps=2, seed=0)
    _train(lisa_model, training_args(max_steps=6), token_dataset(), [lisa])
    assert len(lisa.layer_scheduler.history) == 3
    for (name, a), (_, b) in zip(plain.named_parameters(), lisa_model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_importance_sampling_learns_gradient_norms_of_trained_blocks(tiny_llama, token_dataset, training_args):
    lisa = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, lisa_sampling="importance", seed=0)
    _train(tiny_llama(), training_args(max_steps=6), token_dataset(), [lisa])
    scheduler = lisa.layer_scheduler
    trained = {b for _, blocks in scheduler.history[:-1] for b in blocks} | set(scheduler.active)
    scores = scheduler.sampler.scores
    assert all(scores[b] is not None and scores[b] > 0 for b in trained)
    assert all(scores[b] is None for b in range(4) if b not in trained)


def test_always_trainable_set_is_configurable_and_counts_tied_weights_once(tiny_llama):
    untied = tiny_llama(num_layers=2, hidden=16, vocab=32)
    default = LayerwiseScheduler(untied, lisa_activated_layers=1, lisa_interval_steps=1)
    names = {n for n, p in untied.named_parameters() if any(p is q for q in default.always_params)}
    assert names == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    only_blocks = LayerwiseScheduler(untied, lisa_activated_layers=1, lisa_interval_steps=1, lisa_always_trainable=())
    assert only_blocks.always_params == [] and len(only_blocks.frozen_params) == 3

    tied = tiny_llama(num_layers=2, hidden=16, vocab=32, tie=True)
    scheduler = LayerwiseScheduler(tied, lisa_activated_layers=1, lisa_interval_steps=1, lisa_always_trainable=("embeddings", "lm_head"))
    assert len(scheduler.always_params) == 1 and scheduler.always_params[0] is tied.lm_head.weight
    assert scheduler.param_counts()["always_trainable"] == 32 * 16
    with pytest.raises(ValueError, match="always_trainable entry 'classifier'"):
        LayerwiseScheduler(tied, lisa_activated_layers=1, lisa_interval_steps=1, lisa_always_trainable=("classifier",))


def test_frozen_always_trainable_set_does_not_move(tiny_llama, token_dataset, training_args):
    model = tiny_llama()
    before = _snapshot(model)
    lisa = LisaCallback(lisa_activated_layers=2, lisa_interval_steps=2, seed=0, lisa_always_trainable=())
    _train(model, training_args(max_steps=4), token_dataset(), [lisa])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(dict(model.named_parameters())[name], before[name]), name
    # the model is handed back with every parameter trainable again
    assert all(p.requires_grad for p in model.parameters())


_SCHEDULE_SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from hf_lisa.trainer_callbacks import LisaCallback

    torch.manual_seed(int(sys.argv[2]))  # a different global RNG per process: the schedule must not depend on it
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 32, (32, 8))]
    lisa = LisaCallback(lisa_activated_layers=2, lisa_interval_steps=2, lisa_sampling=sys.argv[1], seed=1234)
    args = TrainingArguments(tempfile.mkdtemp(), max_steps=12, per_device_train_batch_size=2, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=100)
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data, callbacks=[lisa]).train()
    print("SCHEDULE=" + json.dumps(lisa.layer_scheduler.history))
    """
)


@pytest.mark.slow  # two python processes
def test_same_seed_gives_the_same_schedule_in_two_separate_processes(tmp_path):
    script = tmp_path / "schedule.py"
    script.write_text(_SCHEDULE_SCRIPT)
    runs = []
    for hash_seed, torch_seed in (("1", "0"), ("2", "99")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}
        runs.append(
            subprocess.Popen(
                [sys.executable, str(script), "importance", torch_seed],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        )
    schedules = []
    for proc in runs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("SCHEDULE="))
        schedules.append(json.loads(line.removeprefix("SCHEDULE=")))
    assert schedules[0] == schedules[1]
    assert [s for s, _ in schedules[0]] == [0, 2, 4, 6, 8, 10]
    assert len({tuple(b) for _, b in schedules[0]}) > 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"lisa_activated_layers": 0}, "lisa_activated_layers"),
        ({"lisa_activated_layers": -2}, "lisa_activated_layers"),
        ({"lisa_interval_steps": 0}, "lisa_interval_steps"),
        ({"lisa_sampling": "random"}, "lisa_sampling"),
        ({"lisa_optimizer_state_policy": "reset"}, "lisa_optimizer_state_policy"),
    ],
)
def test_invalid_callback_settings_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LisaCallback(**kwargs)


def test_gamma_larger_than_the_number_of_blocks_fails_at_train_begin(tiny_llama, token_dataset, training_args):
    with pytest.raises(ValueError, match=r"activated_layers.*larger than the number of transformer blocks \(4\)"):
        _train(tiny_llama(), training_args(max_steps=1), token_dataset(), [LisaCallback(lisa_activated_layers=5)])


def test_deepspeed_with_full_parameter_lisa_is_refused_naming_fsdp2(training_args, monkeypatch):
    args = training_args()
    check_lisa_training_setup(args)  # plain single-process CPU training is fine
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="DeepSpeed ZeRO fixes the trainable set.*FSDP2"):
        check_lisa_training_setup(args)
    check_lisa_training_setup(args, freezes_parameters=False)  # γ = N freezes nothing: allowed


def test_peft_model_is_refused_with_the_adapter_callback_named(tiny_llama, token_dataset, training_args):
    import hf_lisa  # noqa: F401  (registers LISA)
    from peft import get_peft_model

    model = get_peft_model(tiny_llama(), hf_lisa.LisaConfig(r=2))
    with pytest.raises(ValueError, match="LisaAdapterCallback"):
        _train(model, training_args(max_steps=1), token_dataset(), [LisaCallback(lisa_activated_layers=1)])
