"""Write an OpenAI Batch JSONL file of synthetic requests (for demos and benchmarks).

    python examples/make_batch.py OUT.jsonl --requests 200 --model tiny-llama \
        [--endpoint /v1/chat/completions|/v1/completions|/v1/embeddings] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import random

TOPICS = ["batch inference", "prefix caching", "airflow dags", "kv cache offloading",
          "decode scheduling", "gpu memory", "shard merging", "deadline scaling"]


def make_request(i: int, endpoint: str, model: str, max_tokens: int, rng: random.Random,
                 prompt_words: int) -> dict:
    topic = rng.choice(TOPICS)
    filler = " ".join(rng.choice(topic.split() + ["the", "a", "of", "and"]) for _ in range(prompt_words))
    text = f"Request {i}: write a short note about {topic}. {filler}"
    if endpoint == "/v1/chat/completions":
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                "messages": [{"role": "system", "content": "You are a concise assistant."},
                             {"role": "user", "content": text}]}
    elif endpoint == "/v1/completions":
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "prompt": text}
    else:
        body = {"model": model, "input": text}
    return {"custom_id": f"request-{i}", "method": "POST", "url": endpoint, "body": body}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--endpoint", default="/v1/chat/completions")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as fh:
        for i in range(args.requests):
            req = make_request(i, args.endpoint, args.model, args.max_tokens, rng, args.prompt_words)
            fh.write(json.dumps(req, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
