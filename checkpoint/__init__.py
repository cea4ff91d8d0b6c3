"""What a model is on disk, and nothing of a device: finding it, its config, its tokenizer, its files."""


class ConfigError(ValueError):
    """A checkpoint or engine setting headrace cannot honour."""
