"""A plain Tinker SDK program, run by tests/test_tinker_sdk.py with ``.venv-tinker/bin/python`` (tinker==0.38.0
unmodified) against forgelab's Tinker server: TINKER_BASE_URL and TINKER_API_KEY come from the environment, the
work from argv[1] (JSON). It prints one JSON line of what the SDK returned; the test judges it.

Nothing here imports forgelab: it is what a Tinker user's own script looks like.
"""
from __future__ import annotations

import json
import sys

import tinker
from tinker import types


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    inputs = {"target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1])}
    if weights is not None:
        inputs["weights"] = types.TensorData(data=weights, dtype="float32", shape=[len(weights)])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def error_of(call) -> str | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    spec = json.loads(sys.argv[1])
    model, rank = spec["model"], spec["rank"]
    out: dict[str, object] = {"version": tinker.__version__}

    out["wrong_key"] = error_of(lambda: tinker.ServiceClient(api_key="tml-" + "0" * 32).create_lora_training_client(
        base_model=model, rank=rank, train_unembed=False).result())
    with tinker.ServiceClient() as service:  # leaving it finishes the session: the server frees its slots
        run(service, spec, out)
    print(json.dumps(out))


def run(service: tinker.ServiceClient, spec: dict, out: dict[str, object]) -> None:
    model, rank = spec["model"], spec["rank"]
    adam = types.AdamParams(learning_rate=spec["lr"], beta1=0.9, beta2=0.95, eps=1e-8)
    out["unembed"] = error_of(lambda: service.create_lora_training_client(base_model=model, rank=rank).result())
    tc = service.create_lora_training_client(base_model=model, rank=rank, train_unembed=False).result()
    out["tokenized"] = tc.get_tokenizer().encode(spec["text"])

    data = [datum(tokens, weights) for tokens, weights in spec["data"]]
    # a second client B, on the same engines: its adapter and logprobs before and after all of tc's work below
    b = service.create_lora_training_client(base_model=model, rank=rank, train_unembed=False).result()
    b.forward_backward(data, "cross_entropy").result()
    b.optim_step(adam).result()  # B moves off the common initial adapter, so its weights are its own
    out["b_before"] = b.save_weights_for_sampler("b-before").result().path
    out["b_logprobs_before"] = [o["logprobs"].tolist() for o in b.forward(data, "cross_entropy").result().loss_fn_outputs]
    losses, logprobs = [], None
    for _ in range(spec["steps"]):
        fb = tc.forward_backward(data, "cross_entropy")  # both submitted before either is awaited
        opt = tc.optim_step(adam)
        result = fb.result()
        opt.result()
        losses.append(result.metrics["loss:sum"])
        if logprobs is None:
            logprobs = [o["logprobs"].tolist() for o in result.loss_fn_outputs]
    out["losses"], out["logprobs"] = losses, logprobs

    def step(client) -> list[float]:  # one step's loss, then the loss after it
        fb, opt = client.forward_backward(data, "cross_entropy"), client.optim_step(adam)
        before = fb.result().metrics["loss:sum"]
        opt.result()
        return [before, client.forward(data, "cross_entropy").result().metrics["loss:sum"]]

    state = tc.save_state("s1").result().path
    first = step(tc)
    tc.load_state_with_optimizer(state).result()
    again = step(tc)
    other = service.create_training_client_from_state_with_optimizer(state).result()
    out["state"], out["resume"] = state, [first, again, step(other)]

    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(types.ModelInput.from_ints(spec["prompt"]), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
    samples = []
    for seq in res.sequences:
        full = spec["prompt"] + list(seq.tokens)
        fwd = tc.forward([datum(full)], "cross_entropy").result()  # the same weights, scored by the trainer
        samples.append({"tokens": list(seq.tokens), "logprobs": list(seq.logprobs), "stop": seq.stop_reason,
                        "forward": fwd.loss_fn_outputs[0]["logprobs"].tolist()[-len(seq.tokens):]})
    out["samples"] = samples

    # one on-policy importance-sampling step's loss: the sampler's logprobs as q, advantage 1 on the sampled tokens
    seq, n_prompt = samples[0], len(spec["prompt"])
    rl = datum(spec["prompt"] + seq["tokens"])
    zeros = [0.0] * (n_prompt - 1)
    for key, values in (("logprobs", zeros + seq["logprobs"]), ("advantages", zeros + [1.0] * len(seq["tokens"]))):
        rl.loss_fn_inputs[key] = types.TensorData(data=values, dtype="float32", shape=[len(values)])
    out["importance_sampling"] = tc.forward_backward([rl], "importance_sampling").result().metrics["loss:sum"]
    out["outside"] = error_of(lambda: service.create_sampling_client(
        model_path="tinker://../sampler_weights/" + spec["outside"]).result())
    out["bad_loss"] = error_of(lambda: tc.forward_backward(data, "dro").result())
    out["b_after"] = b.save_weights_for_sampler("b-after").result().path
    out["b_logprobs_after"] = [o["logprobs"].tolist() for o in b.forward(data, "cross_entropy").result().loss_fn_outputs]


if __name__ == "__main__":
    main()
