"""Hugging Face config files as models: the architecture a config.json names, built on the meta
device (shapes only: no weights, no memory, no download), which is how `sw.plan` takes a model too
large for this machine. transformers is needed only here, so it is imported only here."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from stagewise.cli.errors import CommandLineError, first_line


def model_from_config(path: Path) -> torch.nn.Module:
    """The model `path` (a config.json, or the folder holding one) describes, on the meta device."""
    transformers = _transformers()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise CommandLineError(f"{file} does not exist; give a Hugging Face config.json, or the folder that holds one")
    try:
        config = transformers.AutoConfig.from_pretrained(str(file), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CommandLineError(
            f"{file} is not a Hugging Face model config ({first_line(error)}); it needs a \"model_type\" "
            "transformers knows, such as \"gpt2\" or \"llama\"") from error
    with torch.device("meta"):
        return _build(transformers, config, file)


def _build(transformers: ModuleType, config: Any, file: Path) -> torch.nn.Module:
    """The class the config's "architectures" names, else its causal language model."""
    names = list(config.architectures or [])
    model_class = getattr(transformers, names[0], None) if names else None
    if names and model_class is None:
        raise CommandLineError(f"{file} names the architecture {names[0]!r}, which transformers "
                               f"{transformers.__version__} does not have; fix \"architectures\" or upgrade "
                               "transformers")
    try:
        return model_class(config) if model_class is not None else transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError) as error:
        raise CommandLineError(
            f"{file}: transformers cannot build a causal language model for model_type {config.model_type!r} "
            f"({first_line(error)}); name the model class in the config's \"architectures\", e.g. "
            "[\"T5ForConditionalGeneration\"]") from error


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError as error:
        raise CommandLineError("reading a Hugging Face config needs transformers: pip install transformers") from error
    return transformers

