"""A plain Tinker program (``tinker==0.38.0``, unmodified) for tests/test_tinker_cookbook.py: it runs in the cookbook's
virtualenv (``.venv-tinker`` after `make tinker-cookbook`), which has torch, so the SDK can compute
``forward_backward_custom`` client-side; then it lists and deletes checkpoints with the SDK's ``RestClient``.

    TINKER_BASE_URL=... TINKER_API_KEY=... python tests/tinker_custom_client.py '<json args>'

Args (JSON): ``base_model``, ``rank``, ``lr``, ``data`` (a list of ``[tokens, weights]``), ``outside`` (``tinker://``
paths naming a directory outside the server's checkpoint root). Prints one JSON line: the custom
loss's output, the saved paths, the checkpoint lists before and after a delete, and the errors of refused calls.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import tinker
import torch
from tinker import types


def custom_loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """``C = -sum_i sum_t w_it * exp(logp_it)``: minus the weighted sum of the target tokens' probabilities (its
    gradient ``-w * p`` differs per token, unlike cross_entropy's). tests/test_tinker_cookbook.py computes the
    same function in process."""
    total = torch.zeros((), dtype=torch.float32)
    for d, lp in zip(data, logprobs):
        total = total - (d.loss_fn_inputs["weights"].to_torch() * torch.exp(lp)).sum()
    return total, {"prob_sum": float(-total.detach())}


def error(call: Any) -> str | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the SDK's error is what the test checks
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    args = json.loads(sys.argv[1])
    with tinker.ServiceClient() as service:  # closing it finishes the session: the server frees its slot
        run(args, service)


def run(args: dict[str, Any], service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=args["base_model"], rank=args["rank"],
                                             train_unembed=False).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": types.TensorData(data=weights, dtype="float32",
                                                                    shape=[len(weights)])})
            for tokens, weights in args["data"]]
    out = tc.forward_backward_custom(data, custom_loss).result()
    tc.optim_step(types.AdamParams(learning_rate=args["lr"])).result()
    state = tc.save_state("custom").result().path
    sampler = tc.save_weights_for_sampler("custom-sampler").result().path
    model_id = tc.model_id

    rest = tinker.RestClient()
    listed = rest.list_checkpoints(model_id).result()
    deleted = rest.delete_checkpoint_from_tinker_path(sampler).result()
    after = rest.list_checkpoints(model_id).result()
    print(json.dumps({
        "model_id": model_id,
        "loss_fn_outputs": [o["logprobs"].tolist() for o in out.loss_fn_outputs],
        "metrics": out.metrics,
        "state": state, "sampler": sampler,
        "listed": [(c.checkpoint_id, c.checkpoint_type, c.tinker_path, c.size_bytes) for c in listed.checkpoints],
        "delete_returned": deleted,
        "after": [c.tinker_path for c in after.checkpoints],
        "errors": {
            "delete_again": error(lambda: rest.delete_checkpoint_from_tinker_path(sampler).result()),
            "sample_deleted": error(lambda: service.create_sampling_client(model_path=sampler).sample(
                types.ModelInput.from_ints([1, 27]), 1, types.SamplingParams(max_tokens=2)).result()),
            **{f"delete {p}": error(lambda p=p: rest.delete_checkpoint_from_tinker_path(p).result())
               for p in args["outside"]},
            **{f"list {p}": error(lambda p=p: rest.list_checkpoints(p.removeprefix("tinker://").split("/")[0]).result())
               for p in args["outside"]},
        },
    }), flush=True)


if __name__ == "__main__":
    main()
