"""Generate a small random LoRA adapter (PEFT format) for a model made by make_model.py.

No adapter can be downloaded on the machines this project is developed on, so test
adapters are made offline: ``adapter_config.json`` plus ``adapter_model.safetensors`` with
``lora_A`` / ``lora_B`` for ``q_proj`` and ``v_proj`` of every layer, seeded. ``lora_B`` is
non-zero (PEFT initialises it to zero, which would make the adapter a no-op), so the
adapter's outputs differ from the base model's. Only torch and safetensors are needed.

Usage (inference environment)::

    python inference_images/vllm/make_lora.py BASE_MODEL_DIR OUT_DIR [--seed N] [--rank R]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = ("q_proj", "v_proj")
# Large enough that greedy tokens change on the tiny random model (its weights have
# std 0.02), small enough that activations stay finite.
_STD = 0.05


def _proj_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, kv_heads * head_dim)}


def make_lora(base: Path, out: Path, seed: int = 0, rank: int = 8) -> Path:
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    shapes = _proj_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for name in TARGETS:
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * _STD
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * _STD
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="model directory (config.json)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    print(make_lora(args.base, args.out, args.seed, args.rank))


if __name__ == "__main__":
    main()
