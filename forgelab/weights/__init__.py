"""Weight sync in one home: trainer -> generators, every version accounted for.

| module | side | what |
|---|---|---|
| `forgelab.weights.sender` | trainer (rank 0) | gather once, send to each generator mesh; `TRANSPORTS` ("auto": shared memory with message fallback, "message") |
| `forgelab.weights.shm` | both | the shared-memory safetensors file: writer (trainer), reader (generator), stale-file sweep |
| `forgelab.weights.receiver` | generator | check names/shapes, pause admission, reload in place (LoRA: load the adapter under a new name), bump the version |
| `forgelab.weights.adapter` | both | LoRA adapters in PEFT's format: names, shapes, the adapter directory, merging into HF weights |
| `forgelab.weights.sync` | controller | `WeightSync.push(version) -> PushReport` to the healthy replicas; `catch_up` for a respawned one |
"""
from forgelab.weights.sync import PushReport, WeightSync

__all__ = ["PushReport", "WeightSync"]
