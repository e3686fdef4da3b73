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

The router owns ``kv_transfer_params``: a client's are dropped, never passed on. They steer
the connectors (``remote_host``/``remote_port`` of the pulling kind), and a batch line,
including a Batch API tenant's, is a client.
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
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: dict[str, Any], prefill_params: Any) -> dict[str, Any]:
    """The client's body for decode, with the prefill's ``kv_transfer_params`` (if it returned
    an object) in place of anything the client sent under that name."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if isinstance(prefill_params, dict) and prefill_params:
        out["kv_transfer_params"] = prefill_params
    return out
