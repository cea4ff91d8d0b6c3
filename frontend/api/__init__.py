"""The OpenAI-compatible HTTP API: `headrace serve`."""
