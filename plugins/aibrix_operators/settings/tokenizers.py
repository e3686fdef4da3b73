"""The models' tokenizers a dry run counts input tokens with (``[aibrix_batch] tokenizers``,
batch/prompt_tokens.py).

    [aibrix_batch]
    tokenizers = {"llama-3-8b": "/models/llama-3-8b", "qwen": "/models/qwen"}

A JSON object: served model name -> a local Hugging Face model directory on the workers (its
``tokenizer.json`` and chat template; the weights are not read). The deployment names them; a
batch only picks one by its model. Unset: dry runs estimate input tokens from bytes.
"""

from __future__ import annotations

import json
import os

from aibrix_operators import config_sections

SECTION = config_sections.BATCH
KEY = "tokenizers"


class TokenizerSettingError(ValueError):
    """``tokenizers`` is not an object of model names to absolute directories."""


def parse_tokenizer_dirs(raw: str | None) -> dict[str, str]:
    if raw is None or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise TokenizerSettingError(f"[{SECTION}] {KEY} is not JSON ({exc}); set an object such as "
                                    '{"my-model": "/models/my-model"}') from exc
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) and os.path.isabs(v) for k, v in value.items()):
        raise TokenizerSettingError(f"[{SECTION}] {KEY} must map each model name to an absolute "
                                    "directory path on the workers")
    return value


def load_tokenizer_dirs() -> dict[str, str]:
    from airflow.sdk import conf

    return parse_tokenizer_dirs(conf.get(SECTION, KEY, fallback=None))
