"""LoRA adapters as batch models: the deployment's registry, and adapters made present on a server."""
