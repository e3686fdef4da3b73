"""Generate a small random-weight Llama model with a locally trained tokenizer.

No model can be downloaded on the machines this project is developed on, so the
default model is made offline: a ``LlamaForCausalLM`` with random weights plus a
byte-level BPE tokenizer trained on text written here, wrapped as a normal
Hugging Face model directory (config, safetensors, tokenizer, chat template).
Generated text is gibberish; token counts, timings and KV-cache behaviour are real.

Usage (inference environment)::

    python inference_images/vllm/make_model.py OUT_DIR [--preset tiny|bench]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PRESETS: dict[str, dict[str, int]] = {
    # Fast enough for tests; big enough that timings and KV transfers mean something.
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 vocab_size=4096),
    # Prefill compute dominates on a CPU: for KV-cache benchmarks.
    "bench": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192,
                  vocab_size=8192),
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (
    "the batch model request token prefill decode cache layer shard merge airflow "
    "kernel tensor prompt answer question system user assistant evaluate summary "
    "data pipeline offline inference throughput latency memory block chunk hash "
    "queue worker driver result output error retry deadline scale replica router"
).split()


def _corpus(lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    text = []
    for _ in range(lines):
        n = rng.randint(5, 40)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 100000)))
        text.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return text


def build_tokenizer(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<unk>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(20000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", model_max_length=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path, preset: str, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    shape = dict(PRESETS[preset])
    tok = AutoTokenizer.from_pretrained(out)
    shape["vocab_size"] = len(tok)
    config = LlamaConfig(
        **shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=True, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    # Sampling defaults that vLLM reads; a random model never emits EOS reliably,
    # so requests should pass max_tokens.
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
    }))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (args.out / "config.json").exists():
        print(f"model already present: {args.out}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out, PRESETS[args.preset]["vocab_size"], args.seed)
    build_model(args.out, args.preset, args.seed)
    print(f"wrote {args.preset} model to {args.out}")


if __name__ == "__main__":
    main()
