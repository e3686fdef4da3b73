"""A request's input tokens counted with its model's own tokenizer, the way vLLM counts them (issue 40.3).

A dry run counts a batch's input tokens exactly when the deployment names the model's tokenizer
(``[aibrix_batch] tokenizers``, settings/tokenizers.py): a Hugging Face model directory with its
``tokenizer.json`` and its chat template (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``). Without one the estimate counts bytes at the measured tokens per byte
(batch/admission.py) and says so.

What vLLM's OpenAI server does, and this repeats:
- a chat request: the chat template rendered over the messages with the generation prompt (as
  transformers' ``apply_chat_template`` renders it: a sandboxed Jinja2 environment with
  ``trim_blocks``, ``lstrip_blocks`` and the tokenizer's special tokens), then tokenized **without**
  special tokens, since the template writes them; a message's list of text parts is joined with
  newlines first (vLLM's "string" content format);
- a completion's prompt, and an embedding's input: tokenized **with** special tokens (both routes'
  ``add_special_tokens`` default); token-id prompts are counted as they are.

A request it cannot count (another route, images, a template that needs what a batch line does not
carry) gives None, and the batch's count is then not made at all: a partial count would pass for
an exact one.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A configured tokenizer directory that cannot be loaded: which, and why."""


def _render_env() -> Any:
    # transformers' own rendering environment (its chat_template_utils): sandboxed, since a model
    # directory's template is code, with the same whitespace control and helpers.
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"the chat template refused the request: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict)
                         and t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return None  # images, audio: not counted here


class PromptTokens:
    """One model's tokenizer and chat template: ``count(url, body)`` is that request's input tokens."""

    def __init__(self, directory: str) -> None:
        path = Path(directory)
        try:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            config_file = path / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            template = _chat_template(path, config)
            self._template = _render_env().from_string(template) if template else None
        except Exception as exc:  # noqa: BLE001 - any load failure is the deployment's directory
            raise TokenizerError(f"cannot load the tokenizer in {directory}: {exc}") from exc
        special = {k: config.get(k) for k in SPECIAL_TOKENS}
        # tokenizer_config.json writes a special token as its text or as {"content": ...}.
        self._special = {k: v.get("content") if isinstance(v, dict) else v for k, v in special.items()}
        self.directory = directory

    def _encode(self, text: str, special: bool) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def _prompts(self, prompt: Any, special: bool) -> int | None:
        if isinstance(prompt, str):
            return self._encode(prompt, special)
        if isinstance(prompt, list) and prompt:
            if all(type(t) is int for t in prompt):
                return len(prompt)
            counts = [self._prompts(p, special) for p in prompt]
            return None if None in counts else sum(c for c in counts if c is not None)
        return None

    def _chat(self, body: dict[str, Any]) -> int | None:
        messages = body.get("messages")
        if self._template is None or not isinstance(messages, list):
            return None
        conversation = []
        for message in messages:
            text = _text(message.get("content")) if isinstance(message, dict) else None
            if text is None:
                return None
            conversation.append({**message, "content": text})
        extra = body.get("chat_template_kwargs")
        generation = body.get("add_generation_prompt", True)
        try:
            rendered = self._template.render(
                **(extra if isinstance(extra, dict) else {}), messages=conversation,
                add_generation_prompt=generation is not False, tools=body.get("tools"), documents=None,
                **{k: v for k, v in self._special.items() if v is not None})
        except Exception:  # noqa: BLE001 - a template that cannot render this line: not counted
            return None
        return self._encode(rendered, special=body.get("add_special_tokens") is True)

    def count(self, url: str, body: dict[str, Any]) -> int | None:
        """The request's input tokens as vLLM counts them; None where this cannot say exactly."""
        special = body.get("add_special_tokens", True) is not False
        if url == CHAT:
            return self._chat(body)
        if url == COMPLETIONS:
            return self._prompts(body.get("prompt"), special)
        if url == EMBEDDINGS:
            return self._prompts(body.get("input"), special)
        return None


# A tokenizer counts about 4 MB of text a second a core here (bench/dry_run_rate.py), validation's
# pass about 250: past its first EXACT_BYTES a batch's requests are counted 1 in SAMPLE_EVERY, the
# rest at the counted ones' tokens per byte, so a 1 GB dry run is not a 4-minute one.
EXACT_BYTES = 8 * 2**20
SAMPLE_EVERY = 100


class PromptCounter:
    """One batch's input tokens, counted with the deployment's tokenizers by model (``model ->
    directory``, loaded when first needed; an adapter's lines count with its base model's,
    ``adapters``: adapter -> base). Validation calls ``add`` for each valid request, in file order:
    every request of the first ``exact_bytes`` is counted, then 1 in ``sample_every``."""

    def __init__(self, directories: dict[str, str], adapters: dict[str, str] | None = None,
                 problem: str | None = None, exact_bytes: int = EXACT_BYTES,
                 sample_every: int = SAMPLE_EVERY) -> None:
        self._directories = directories
        self._adapters = adapters or {}
        self._loaded: dict[str, PromptTokens] = {}
        # Why no count could be made (a bad setting, a directory that would not load): the dry run's
        # answer says.
        self.problem = problem
        self.exact_bytes, self.sample_every = exact_bytes, sample_every
        self.requests = self.counted_requests = 0
        self.counted_tokens = self.counted_bytes = self.skipped_bytes = 0
        self.uncounted_line = 0  # the first line it could not count: then there is no count

    def directory(self, model: str) -> str | None:
        return self._directories.get(model) or self._directories.get(self._adapters.get(model, ""))

    def count(self, url: str, body: dict[str, Any]) -> int | None:
        """One request's input tokens; None where it cannot say exactly."""
        model = body.get("model") if isinstance(body, dict) else None
        directory = self.directory(model) if isinstance(model, str) else None
        if directory is None:
            return None
        tokens = self._loaded.get(directory)
        if tokens is None:
            try:
                tokens = self._loaded[directory] = PromptTokens(directory)
            except TokenizerError as exc:
                self.problem = str(exc)
                return None
        return tokens.count(url, body)

    def add(self, line: int, url: str, body: dict[str, Any], size: int) -> None:
        """Count (or sample) the request on ``line``, ``size`` bytes of the file."""
        if self.uncounted_line:
            return
        self.requests += 1
        if self.counted_bytes >= self.exact_bytes and self.requests % self.sample_every:
            self.skipped_bytes += size
            return
        tokens = self.count(url, body)
        if tokens is None:
            self.uncounted_line = line
            return
        self.counted_requests += 1
        self.counted_tokens += tokens
        self.counted_bytes += size

    def total(self) -> int | None:
        """The batch's input tokens: exact when every request was counted; None when one could not be."""
        if self.uncounted_line or self.problem is not None or not self.counted_bytes:
            return None
        return self.counted_tokens + round(self.skipped_bytes * self.counted_tokens / self.counted_bytes)

    def basis(self, model: str | None) -> str:
        """What the batch's input-token figure rests on, for its dry run's answer."""
        directory = self.directory(model) if model else None
        if self.total() is not None:
            if not self.skipped_bytes:
                return f"counted with the model's tokenizer ({directory}), every request"
            return (f"counted with the model's tokenizer ({directory}): every request of the first "
                    f"{self.exact_bytes / 2**20:.0f} MiB, then 1 in {self.sample_every} ("
                    f"{self.counted_requests} of {self.requests}); the others at the counted ones' "
                    f"{self.counted_tokens / self.counted_bytes:.4f} tokens per byte")
        if self.problem is not None:
            why = self.problem
        elif directory is None:
            why = f"no tokenizer is configured for model {model!r} ([aibrix_batch] tokenizers)"
        else:
            why = f"line {self.uncounted_line} is a request the tokenizer cannot count exactly here"
        return f"estimated from bytes at the measured tokens per byte: {why}"
