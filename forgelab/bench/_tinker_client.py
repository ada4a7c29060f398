"""The REST arm of `python -m forgelab.bench primitives`: a plain tinker SDK program (run with ``.venv-tinker``'s
Python, TINKER_BASE_URL / TINKER_API_KEY from the environment) that takes one optimizer step per ``step`` line
on stdin and prints the step's client-side seconds. argv[1]: JSON with ``model``, ``rank``, ``lr`` and ``data``
(``[tokens, logprobs, advantages]`` per sequence). It imports nothing from forgelab.
"""
import json
import sys
import time

import tinker
from tinker import types


def main() -> None:
    spec = json.loads(sys.argv[1])
    data = []
    for tokens, logprobs, advantages in spec["data"]:
        n = len(tokens) - 1
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
            "logprobs": types.TensorData(data=logprobs, dtype="float32", shape=[n]),
            "advantages": types.TensorData(data=advantages, dtype="float32", shape=[n])}))
    adam = types.AdamParams(learning_rate=spec["lr"])
    with tinker.ServiceClient() as service:
        tc = service.create_lora_training_client(base_model=spec["model"], rank=spec["rank"],
                                                 train_unembed=False).result()
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "step":
                break
            t0 = time.perf_counter()
            fb, opt = tc.forward_backward(data, "importance_sampling"), tc.optim_step(adam)
            fb.result()
            opt.result()
            print(time.perf_counter() - t0, flush=True)


if __name__ == "__main__":
    main()
