"""The two bodies the router derives from a client's request: prefill's and decode's.

How kvcache finds a request's KV: by content. A stored chunk's key is a chained hash of
the prompt's token ids (seeded by the namespace and the request's ``cache_salt``), so the
decode instance finds what the prefill instance saved exactly when both see the same
prompt tokens and the same ``cache_salt``. Both bodies therefore keep every field that
shapes the prompt (``prompt``/``messages``, chat template options, ``cache_salt``,
``add_special_tokens``...) untouched, and the prefill body only changes what is generated.
``kv_transfer_params`` follow vLLM's P/D convention (``do_remote_decode`` on the prefill,
whatever the prefill returns handed to decode), so connectors that identify transfers by
id (NIXL and the like) work through the same router. Ours returns the chunks the prefill
stored (``kvcache.handoff``): the decode instance waits until the shared tier holds them.
"""

from __future__ import annotations

from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Fields that only shape the output; dropped from the prefill call, which makes one token
# and throws it away (min_tokens > max_tokens is an error; logprobs cost time).
_OUTPUT_ONLY = (
    "stream_options",
    "logprobs",
    "top_logprobs",
    "min_tokens",
    "echo",
    "best_of",
    "n",
    "prompt_logprobs",
    "response_format",
    "structured_outputs",
    "tools",
    "tool_choice",
)


def prefill_body(body: dict[str, Any], path: str) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in _OUTPUT_ONLY}
    if path == CHAT:
        # Tools and response_format shape the chat template's prompt in some models: keep them.
        for key in ("tools", "tool_choice", "response_format"):
            if key in body:
                out[key] = body[key]
        out.pop("max_tokens", None)
        out["max_completion_tokens"] = 1
    else:
        out["max_tokens"] = 1
    out["stream"] = False
    params = dict(body.get("kv_transfer_params") or {})
    params["do_remote_decode"] = True
    out["kv_transfer_params"] = params
    return out


def decode_body(body: dict[str, Any], prefill_params: dict[str, Any] | None) -> dict[str, Any]:
    if not prefill_params:
        return body
    return {**body, "kv_transfer_params": prefill_params}
