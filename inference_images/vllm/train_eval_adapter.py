"""Train ``eval-llama-reverse``: a LoRA adapter that teaches the eval model a task it lacks.

The base (``train_eval_model.py``) knows successors ("What day comes after Monday?"); the
adapter learns the reverse facts of ``aibrix_operators.evaluation.adapter_tasks`` (the day and
month before, number words back to digits), with a share of the base's own training mix so the
adapted model keeps its other skills. Only the LoRA matrices train (rank ``r`` on every
projection of every layer, scaled by ``lora_alpha / r`` exactly as vLLM applies them); the
output is a PEFT-format adapter (``adapter_config.json`` + ``adapter_model.safetensors``) that
vLLM loads with ``--lora-modules`` or at run time.

Also writes ``<out>-degraded``: the same adapter with noise on its B matrices, the "worse
adapter" the regression test deploys.

Cached like the base: ``train_key.txt`` holds a hash of this script, the task modules, the
config, the training libraries' versions and the base model's own key; a match skips training, and
the machine's model cache (``model_cache.py``) spares another checkout the training.

Usage (inference environment)::

    python inference_images/vllm/train_eval_adapter.py .work/models/eval-llama .work/models/eval-llama-reverse
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import model_cache  # noqa: E402
from train_eval_model import (  # noqa: E402
    TASKS,
    TRAINING_LIBRARIES,
    _cpu_seconds,
    encode_batch,
    greedy_accuracy,
    training_lock,
)

ADAPTER_TASKS = TASKS.with_name("adapter_tasks.py")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG: dict[str, Any] = {
    "rank": 8,
    "alpha": 16,
    # The loss is under 0.002 from step 200 on (2026-12-06: 0.0010 at 200, 0.0009 at 599).
    "steps": 300,
    "batch_size": 48,
    "lr": 3e-3,
    "seed": 0,
    "threads": 1,
    # Shares of each batch taken from the base's facts (successors: the adapter must not swap
    # "after" for "before") and from the base model's own training mix.
    "replay_facts": 0.25,
    "replay": 0.25,
    # Degraded adapter: noise on lora_B with this std, relative to each matrix's own std.
    "degrade_noise": 2.0,
}


def cache_key(config: dict[str, Any], base: Path) -> str:
    digest = hashlib.sha256()
    for path in (HERE, TASKS, ADAPTER_TASKS, base / "train_key.txt"):
        digest.update(path.read_bytes())
    digest.update(json.dumps(config, sort_keys=True).encode())
    digest.update(model_cache.library_versions(*TRAINING_LIBRARIES).encode())
    return digest.hexdigest()[:16]


class LoRALinear:
    """``y = W x + (alpha / r) B A x`` around a frozen linear layer (vLLM's LoRA formula)."""

    def __init__(self, linear: Any, rank: int, alpha: int, gen: Any) -> None:
        import torch

        self.linear = linear
        self.scale = alpha / rank
        fan_in, fan_out = linear.in_features, linear.out_features
        self.A = torch.nn.Parameter(torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5)
        self.B = torch.nn.Parameter(torch.zeros(fan_out, rank))
        original = linear.forward

        def forward(x: Any) -> Any:
            return original(x) + (x @ self.A.T @ self.B.T) * self.scale

        linear.forward = forward


def attach(model: Any, config: dict[str, Any]) -> dict[str, LoRALinear]:
    import torch

    gen = torch.Generator().manual_seed(config["seed"])
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            wrapped[name] = LoRALinear(module, config["rank"], config["alpha"], gen)
    return wrapped


def save_adapter(wrapped: dict[str, LoRALinear], out: Path, base: Path, config: dict[str, Any],
                 noise: float = 0.0) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(config["seed"] + 1)
    tensors = {}
    for name, lora in wrapped.items():
        b = lora.B.detach().clone()
        if noise:
            b += torch.randn(b.shape, generator=gen) * b.std() * noise
        tensors[f"base_model.model.{name}.lora_A.weight"] = lora.A.detach().clone().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": config["rank"], "lora_alpha": config["alpha"], "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "bias": "none", "fan_in_fan_out": False,
        "modules_to_save": None,
    }, indent=2) + "\n")


def train(base: Path, out: Path, config: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    sys.path.insert(0, str(TASKS.parents[2]))
    from aibrix_operators.evaluation import adapter_tasks, tasks

    torch.set_num_threads(config["threads"])
    torch.manual_seed(config["seed"])
    tok = AutoTokenizer.from_pretrained(base)
    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    facts = adapter_tasks.reverse_fact_items()
    checks = {"reverse_facts": facts, "short_answer": tasks.short_answer_items()}
    model.eval()
    before = {n: round(greedy_accuracy(model, tok, items), 4) for n, items in checks.items()}
    wrapped = attach(model, config)
    params = [p for lora in wrapped.values() for p in (lora.A, lora.B)]
    opt = torch.optim.AdamW(params, lr=config["lr"], weight_decay=0.0)
    # Linear decay to zero: a constant rate left the last steps' loss jumping between the two
    # fact directions ("after" / "before"), which differ by one token.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / config["steps"])
    replay = tasks.training_examples(config["seed"] + 7, tasks.eval_prompts())
    rng = random.Random(config["seed"])
    n_replay = int(config["batch_size"] * config["replay"])
    n_facts = int(config["batch_size"] * config["replay_facts"])
    base_facts = tasks.short_answer_items()
    cpu0, wall0 = _cpu_seconds(), time.monotonic()
    model.train()
    for step in range(config["steps"]):
        batch = rng.choices(facts, k=config["batch_size"] - n_replay - n_facts)
        batch += rng.choices(base_facts, k=n_facts) + [next(replay) for _ in range(n_replay)]
        ids, labels = encode_batch(tok, batch)
        loss = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == config["steps"] - 1:
            print(f"step {step:4d} loss {loss.item():.4f} cpu {_cpu_seconds() - cpu0:.0f}s", flush=True)
    model.eval()
    after = {n: round(greedy_accuracy(model, tok, items), 4) for n, items in checks.items()}
    save_adapter(wrapped, out, base, config)
    save_adapter(wrapped, out.parent / (out.name + "-degraded"), base, config, config["degrade_noise"])
    gen = torch.Generator().manual_seed(config["seed"] + 1)
    with torch.no_grad():  # the same noise as the saved degraded adapter, to measure it
        for lora in wrapped.values():
            lora.B.add_(torch.randn(lora.B.shape, generator=gen) * lora.B.std() * config["degrade_noise"])
    degraded = {n: round(greedy_accuracy(model, tok, items), 4) for n, items in checks.items()}
    return {"degraded_accuracy": degraded, "train_cpu_s": round(_cpu_seconds() - cpu0, 1),
            "train_wall_s": round(time.monotonic() - wall0, 1), "steps": config["steps"],
            "final_loss": round(loss.item(), 4),
            "base_accuracy": before, "adapter_accuracy": after}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the eval model (train_eval_model.py's output)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, help="override the config's steps (experiments)")
    parser.add_argument("--lr", type=float, help="override the config's learning rate (experiments)")
    args = parser.parse_args(argv)
    # The base model's lock too, shared (always base first, then this folder's: no two orders, no
    # deadlock): the base must not be retrained underneath while this reads its key and weights,
    # and whoever only checks the base (the nightly-eval test) need not wait for this training.
    with training_lock(args.base, shared=True), training_lock(args.out):
        _train_unless_cached(args)


def _train_unless_cached(args: argparse.Namespace) -> None:
    config = dict(CONFIG, **{k: v for k, v in (("steps", args.steps), ("lr", args.lr)) if v})
    key = cache_key(config, args.base)
    key_file = args.out / "train_key.txt"
    degraded = args.out.parent / (args.out.name + "-degraded") / "adapter_model.safetensors"
    if key_file.exists() and key_file.read_text().strip() == key and degraded.exists():
        print(f"eval adapter up to date: {args.out} (key {key})")
        return
    folders = [args.out, degraded.parent]
    if model_cache.restore(args.out.name, key, folders):
        return
    report = train(args.base, args.out, config)
    report["key"] = key
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    key_file.write_text(key + "\n")  # last: an interrupted run retrains
    print(json.dumps(report, indent=2))
    model_cache.store(args.out.name, key, folders)


if __name__ == "__main__":
    main()
