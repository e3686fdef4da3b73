"""Input tokens counted with the model's own tokenizer (batch/prompt_tokens.py, issue 40.3), checked
against transformers' own counting in the inference venv: the chat template applied with the
generation prompt and tokenized without special tokens, completions and embeddings tokenized with
them, as vLLM's OpenAI server does. The tokenizer is built here, Llama-like: its post-processor adds
``<s>`` (so getting ``add_special_tokens`` wrong is off by one a request) and its template writes
``bos_token`` itself. The vLLM-side check (a DAG dry run's count equal to the prompt tokens vLLM
reported for the same file) is in tests/integration/test_dag_local.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aibrix_operators.batch.prompt_tokens import PromptCounter, PromptTokens
from aibrix_operators.batch.validation import validate_stream
from aibrix_operators.settings.tokenizers import TokenizerSettingError, parse_tokenizer_dirs
from tests.integration.conftest import INFERENCE_PYTHON

pytestmark = pytest.mark.service  # the reference count runs transformers in the inference venv

TEMPLATE = ("{{ bos_token }}{% for m in messages %}\n<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT = "/v1/chat/completions"

REQUESTS: list[tuple[str, dict]] = [
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hello there, how are you?"}]}),
    (CHAT, {"model": "m", "messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "ünïcödé and emoji 🙂"}]}),
    ("/v1/completions", {"model": "m", "prompt": "The quick brown fox"}),
    ("/v1/completions", {"model": "m", "prompt": ["one prompt", "and another, longer prompt"]}),
    ("/v1/embeddings", {"model": "m", "input": "embed this sentence"}),
]

REFERENCE = r"""
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
counts = []
for url, body in json.load(sys.stdin):
    if url == "/v1/chat/completions":
        # vLLM's "string" content format: a message's text parts joined with newlines.
        messages = [{**m, "content": m["content"] if isinstance(m["content"], str)
                     else "\n".join(p["text"] for p in m["content"])} for m in body["messages"]]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        counts.append(len(tok(text, add_special_tokens=False)["input_ids"]))
    else:
        prompt = body.get("prompt", body.get("input"))
        prompts = [prompt] if isinstance(prompt, str) else prompt
        counts.append(sum(len(tok(p)["input_ids"]) for p in prompts))
print(json.dumps(counts))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    out = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [f"the quick brown fox {i} jumps over the lazy dog, hello there how are you" for i in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": TEMPLATE}))
    return out


def _reference(model: Path) -> list[int]:
    proc = subprocess.run([str(INFERENCE_PYTHON), "-c", REFERENCE, str(model)], input=json.dumps(REQUESTS),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_counts_equal_transformers_counts_for_chat_completions_and_embeddings(model_dir: Path) -> None:
    tokens = PromptTokens(str(model_dir))
    ours = [tokens.count(url, body) for url, body in REQUESTS]
    assert ours == _reference(model_dir)
    # The special-token rule is exercised: the template's <s> is counted once, a completion gets one.
    assert tokens.count("/v1/completions", {"prompt": "hello"}) == tokens.count(
        "/v1/completions", {"prompt": "hello", "add_special_tokens": False}) + 1


def test_validation_counts_a_files_tokens_or_names_the_line_it_could_not(
        model_dir: Path, tmp_path: Path) -> None:
    counter = PromptCounter({"m": str(model_dir)}, adapters={"m-lora": "m"})
    chats = [body for url, body in REQUESTS if url == CHAT]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": {**body, "max_tokens": 4}}
             for i, body in enumerate(chats)]
    lines.append({**lines[0], "custom_id": "adapter", "body": {**lines[0]["body"], "model": "m-lora"}})
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with path.open("rb") as stream:
        report = validate_stream(stream, adapters={"m-lora": "m"}, count_tokens=counter)
    assert report.ok, report.errors
    expected = sum(PromptTokens(str(model_dir)).count(CHAT, line["body"]) for line in lines)
    assert report.input_tokens == expected and report.work().input_tokens == expected
    assert counter.basis("m") == f"counted with the model's tokenizer ({model_dir}), every request"

    # An image part cannot be counted here: no figure at all, and the line that stopped it named.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    lines.append({**lines[0], "custom_id": "img", "body": {**lines[0]["body"], "messages": [
        {"role": "user", "content": [image]}]}})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    counter = PromptCounter({"m": str(model_dir)}, adapters={"m-lora": "m"})
    with path.open("rb") as stream:
        report = validate_stream(stream, adapters={"m-lora": "m"}, count_tokens=counter)
    assert report.ok and report.input_tokens is None
    assert f"line {len(lines)} is a request the tokenizer cannot count" in counter.basis("m")


def test_past_its_exact_share_a_big_file_is_sampled_and_says_so(model_dir: Path, tmp_path: Path) -> None:
    texts = [" ".join(["hello there"] * (1 + i % 40) + ["the lazy dog"] * (i % 7)) for i in range(2000)]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": {
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": t}]}}
        for i, t in enumerate(texts)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    exact = PromptTokens(str(model_dir))
    truth = sum(exact.count(CHAT, line["body"]) for line in lines)
    counter = PromptCounter({"m": str(model_dir)}, exact_bytes=20_000, sample_every=8)
    with path.open("rb") as stream:
        report = validate_stream(stream, count_tokens=counter)
    assert counter.counted_requests < 2000 // 4  # sampled: most requests never tokenized
    # The sample's tokens per byte stand for the rest: within 3 % on this mix of lengths.
    assert report.input_tokens == pytest.approx(truth, rel=0.03) and report.input_tokens != truth
    assert f"then 1 in 8 ({counter.counted_requests} of 2000)" in counter.basis("m")


def test_a_model_without_a_tokenizer_or_a_bad_directory_is_said_not_guessed(tmp_path: Path) -> None:
    counter = PromptCounter({"m": str(tmp_path / "missing")})
    assert counter.count(CHAT, {"model": "other", "messages": []}) is None
    assert "no tokenizer is configured for model 'other'" in counter.basis("other")
    counter.add(1, CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, 10)
    assert counter.total() is None and "cannot load the tokenizer" in counter.basis("m")


@pytest.mark.parametrize("raw", ['["/m"]', '{"m": "relative/dir"}', "not json", '{"": "/m"}'])
def test_the_setting_takes_only_model_names_to_absolute_directories(raw: str) -> None:
    with pytest.raises(TokenizerSettingError, match=r"\[aibrix_batch\] tokenizers"):
        parse_tokenizer_dirs(raw)
    assert parse_tokenizer_dirs('{"m": "/models/m"}') == {"m": "/models/m"}
    assert parse_tokenizer_dirs(None) == {}
