"""The trainer's typed contract (`forgelab.types`, `forgelab.engines.contracts`) and the renamed trainer modules'
deprecated aliases: fast, no process."""
from __future__ import annotations

import importlib
import pickle
import sys
import warnings

import pytest
import torch

from forgelab.algos.batching import collate
from forgelab.engines.contracts import check_batch
from forgelab.engines.loss_specs import PackedLoss, pack_loss
from forgelab.types import AdamParams, Episode, LossReport, OptimReport, StepMetrics, TrainBatch

OLD_ROW = {"loss", "grad_norm", "lr", "step", "skipped", "step_time_s", "loss_name"}


def _batch() -> TrainBatch:
    eps = [Episode(id=i, group_id=0, prompt_ids=[1, 2], completion_ids=[3, 4, 5][: 2 + i], generator_logprobs=
                   [-0.5, -0.25, -1.0][: 2 + i], policy_version=0, advantage=float(i)) for i in range(2)]
    return collate(eps, pad_id=0)


def test_collate_builds_a_typed_batch_that_still_reads_by_key():
    b = _batch()
    assert isinstance(b, TrainBatch) and (b.B, b.T) == (2, 4)
    assert b.tokens_B_L.dtype == torch.int64 and b.mask_B_T.dtype == torch.float32
    assert b["tokens_B_L"] is b.tokens_B_L and "ref_logprobs_B_T" in b and b.get("ref_logprobs_B_T") is None
    again = TrainBatch.coerce(dict(b.items()))
    assert all(torch.equal(again[k], v) for k, v in b.items() if v is not None)


def test_check_batch_names_the_bad_field():
    b = _batch()
    with pytest.raises(ValueError, match="mask_B_T"):
        check_batch(TrainBatch(tokens_B_L=b.tokens_B_L, mask_B_T=b.mask_B_T[:, :-1],
                               generator_logprobs_B_T=b.generator_logprobs_B_T, advantages_B=b.advantages_B))
    with pytest.raises(ValueError, match="weights_B_T"):  # a further per-token loss input is checked too
        check_batch(TrainBatch(tokens_B_L=b.tokens_B_L, mask_B_T=b.mask_B_T, advantages_B=b.advantages_B,
                               generator_logprobs_B_T=b.generator_logprobs_B_T,
                               loss_inputs_B_T={"weights_B_T": torch.ones(2, 3)}))
    with pytest.raises(ValueError, match="lacks"):
        check_batch({"tokens_B_L": b.tokens_B_L})


def test_step_metrics_keep_the_old_flat_row():
    fb = LossReport(loss=0.5, loss_name="grpo", grad_norm=2.0, accumulated=1, metrics={"entropy": 1.5})
    opt = OptimReport(step=3, lr=1e-5, grad_norm=2.0, scheduled=True)
    m = StepMetrics.fused(fb, opt, lr=1e-5, step=2, step_time_s=0.1)
    assert m.as_row() == {"entropy": 1.5, "loss": 0.5, "grad_norm": 2.0, "lr": 1e-5, "step": 3, "skipped": 0,
                          "step_time_s": 0.1, "loss_name": "grpo"}
    assert set(m.scalars()) == set(m.as_row()) - {"loss_name"} and m["loss"] == 0.5
    skipped = StepMetrics.fused(LossReport(loss=float("nan"), loss_name="x", grad_norm=float("nan"), accumulated=0,
                                           skipped=True, skip_reason="loss 'x': nan"), None, 1e-5, 2, 0.1)
    assert skipped.as_row() == {"skipped": 1, "skip_reason": "loss 'x': nan", "step": 2, "lr": 1e-5,
                                "step_time_s": 0.1}
    assert OLD_ROW <= set(m.as_row())


def test_adam_params_refuse_what_adamw_would():
    assert AdamParams(lr=1e-4, grad_clip=1.0).betas == (0.9, 0.999)
    for bad in ({"lr": -1.0}, {"lr": 1e-4, "eps": 0.0}, {"lr": 1e-4, "betas": (0.9, 1.0)},
                {"lr": 1e-4, "grad_clip": 0.0}):
        with pytest.raises(ValueError, match="AdamParams"):
            AdamParams(**bad)


@pytest.mark.parametrize("old, new, name", [
    ("forgelab.engines.trainer_core", "forgelab.engines.trainer_state", "TrainerState"),
    ("forgelab.engines.trainer_support", "forgelab.engines.loss_specs", "PackedLoss"),
    ("forgelab.engines.trainer_support", "forgelab.engines.trainer_optim", "WarmupCosine"),
    ("forgelab.engines.lora", "forgelab.engines.lora_adapters", "add_adapters"),
    ("forgelab.engines.lora_slots", "forgelab.engines.trainer_slots", "SlotTrainer"),
    ("forgelab.engines.loss_eval", "forgelab.engines.loss_compare", "compare_on_state"),
])
def test_old_module_paths_still_import_with_a_deprecation_warning(old, new, name):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new.rsplit(".", 1)[1] in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert getattr(mod, name) is getattr(importlib.import_module(new), name)


def _scaled(lp, **kw):
    return lp.sum(), {}


def test_a_packed_loss_pickled_under_the_old_module_path_loads():
    """Trainer checkpoints of earlier releases pickle ``forgelab.engines.trainer_support.PackedLoss``."""
    packed = pack_loss(_scaled)
    old = pickle.dumps(packed, protocol=2).replace(b"forgelab.engines.loss_specs", b"forgelab.engines.trainer_support")
    assert b"forgelab.engines.trainer_support" in old
    back = pickle.loads(old)
    assert isinstance(back, PackedLoss) and back == packed and back.unpack()(torch.ones(2))[0] == 2.0
