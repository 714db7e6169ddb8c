"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU (``deepspeed.initialize``, ``DS_ACCELERATOR=cpu``), 2 ranks, ``torchrun``.
Fixed trainable sets train; layer switching is refused with an error naming FSDP2 (DeepSpeed #5639)."""

from __future__ import annotations

import json

import pytest

from dist_common import free_port, launch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install -e '.[distributed]'")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    launch(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "tests/distributed/deepspeed_worker.py", str(out)], extra_env={"DS_ACCELERATOR": "cpu"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("adapter", ["lora", "lisa"])
def test_adapter_path_trains_under_zero(ranks, stage, adapter):
    result = ranks[0][f"zero{stage}"][adapter]
    losses = result["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    assert result["trainable_changed"] == result["trainable_tensors"]  # every adapter tensor was updated
    assert ranks[1][f"zero{stage}"][adapter]["trainable_changed"] == result["trainable_tensors"]


@pytest.mark.parametrize("stage", [2, 3])
def test_sparse_mask_reselection_identical_on_both_ranks_under_zero(ranks, stage):
    a, b = ranks[0][f"zero{stage}"]["lisa"], ranks[1][f"zero{stage}"]["lisa"]
    assert a["mask_updates"] == 2 and a["masks_changed"] > 0  # as steps 2 and 5 begin: once per interval of 3
    assert a["mask_crc"] == b["mask_crc"]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("case", ["full_engine_optimizer", "full_client_optimizer", "adapter_gamma"])
def test_layer_switching_is_refused_naming_fsdp2(ranks, stage, case):
    message = ranks[0][f"zero{stage}"]["refusals"][case]
    assert message is not None, f"ZeRO-{stage} {case} was not refused"
    assert "FSDP2" in message
