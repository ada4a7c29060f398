"""Runnable recipes: ``python -m forgelab.recipes.<name> --help``.

    tiny_model       the shipped tiny model (HF format) and its model card
    tool_warmstart   its calculator-tool warm start
    sft              (a module, not a command) the supervised loop both of them run
    teacher          a distillation teacher: the shipped model after GRPO on addition (cached HF directory)
    real_shapes      random-weight checkpoints of real architectures (Qwen3-0.6B/1.7B, Llama-3.2-1B shapes)
"""
from forgelab.lazy import lazy_exports

_LAZY = {
    "distill_teacher": "forgelab.recipes.teacher",
    "teacher_cache_dir": "forgelab.recipes.teacher",
    "SHAPES": "forgelab.recipes.real_shapes",
    "real_shape_checkpoint": "forgelab.recipes.real_shapes",
    "real_shape_config": "forgelab.recipes.real_shapes",
    "TOOL_WARMSTART": "forgelab.recipes.tool_warmstart",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
