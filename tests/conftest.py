"""Shared test setup: environment defaults every forgelab process inherits."""
import os

# vLLM on CPU otherwise reserves most of the machine's memory for its KV cache.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
