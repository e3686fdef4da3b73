"""Local serving helpers (start/stop an OpenAI-compatible vLLM server on this machine)."""
