"""Secrets never reach a file or screen we write: names that look secret and the values of such environment
variables are replaced by a marker in configs, metrics, logs and messages."""

from __future__ import annotations

import os
import re
from typing import Any

REDACTED = "***REDACTED***"

_SECRET_WORDS = {"secret", "password", "passwd", "apikey", "credential", "credentials"}
_SECRET_LAST_WORDS = {"token", "key"}
"""Only as the last word: HF_TOKEN and api_key are secrets, pad_token_id and num_key_value_heads not."""


def is_secret_name(name: str) -> bool:
    """True for names like HF_TOKEN, wandb_api_key, db-password (not max_new_tokens)."""
    parts = re.split(r"[_\-.]", name.lower())
    return any(part in _SECRET_WORDS for part in parts) or parts[-1] in _SECRET_LAST_WORDS


def secret_values_from_env(env: dict[str, str] | None = None) -> list[str]:
    env = dict(os.environ) if env is None else env
    return sorted(
        (value for name, value in env.items() if is_secret_name(name) and len(value) >= 6),
        key=len,
        reverse=True,
    )


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    """Replace every secret value found in the environment (or given) by a marker."""
    for value in secret_values_from_env() if secrets is None else secrets:
        text = text.replace(value, REDACTED)
    return text


def redact(data: Any, secrets: list[str] | None = None) -> Any:
    """A copy of nested data with secret-named keys and known secret values hidden."""
    secrets = secret_values_from_env() if secrets is None else secrets
    if isinstance(data, dict):
        return {
            key: REDACTED if is_secret_name(str(key)) and value else redact(value, secrets)
            for key, value in data.items()
        }
    if isinstance(data, list | tuple):
        return [redact(item, secrets) for item in data]
    if isinstance(data, str):
        return redact_text(data, secrets)
    return data
