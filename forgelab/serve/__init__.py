"""forgelab's HTTP doors onto a run's engines: one loopback server module (`forgelab.serve.http`), several APIs
(the OpenAI-compatible agent door, Tinker's primitives) mounted on it as routers.

    from forgelab.serve import LoopbackServer, serve_primitives
    api = await serve_primitives(primitives, LoopbackServer("tinker"))   # Tinker's REST API (docs/tinker.md)
"""
from forgelab.lazy import lazy_exports

_LAZY = {
    "LoopbackServer": "forgelab.serve.http",
    "TinkerAPI": "forgelab.serve.tinker_api",
    "serve_primitives": "forgelab.serve.tinker_api",
    "ADDITION_TASKS": "forgelab.serve.lm_eval_door",
    "write_addition_tasks": "forgelab.serve.lm_eval_door",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
