"""The real `openai` SDK client the agent-door tests talk through: one per session (the run's key, or
``<key>.<session>``), no retries (a refusal must show at once)."""
from __future__ import annotations


def door_client(run, session=None):
    import openai

    key = run.door_key if session is None else f"{run.door_key}.{session}"
    return openai.AsyncOpenAI(base_url=run.openai_base_url, api_key=key, max_retries=0)
