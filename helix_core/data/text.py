"""Caption tokenizers: a tiny built-in byte tokenizer, or any Hugging Face tokenizer."""

from __future__ import annotations

import os

__all__ = ["ByteTokenizer", "Tokenizer", "load_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as ids 3..258 between BOS (1) and EOS (2); 0 is padding. Needs no files."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259

    def encode(self, text: str, max_len: int) -> list[int]:
        body = [b + 3 for b in text.encode("utf-8")][: max_len - 2]
        return [self.bos_token_id, *body, self.eos_token_id]


class Tokenizer:
    """Uniform ``encode(text, max_len) -> ids`` over the byte tokenizer or a Hugging Face one.
    ``source`` is what it was built from (None, a folder path, or the tokenizer object)."""

    def __init__(self, impl, source):
        self.impl, self.source = impl, source

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.impl, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def encode(self, text: str, max_len: int) -> list[int]:
        if isinstance(self.impl, ByteTokenizer):
            return self.impl.encode(text, max_len)
        return list(self.impl(text, truncation=True, max_length=max_len)["input_ids"])


def load_tokenizer(tokenizer=None) -> Tokenizer:
    """``None`` -> the byte tokenizer; a folder path -> ``transformers.AutoTokenizer`` loaded with
    ``local_files_only`` (never downloads); an object with ``__call__`` -> used as is."""
    if tokenizer is None:
        return Tokenizer(ByteTokenizer(), None)
    if isinstance(tokenizer, (str, os.PathLike)):
        if not os.path.isdir(tokenizer):
            raise FileNotFoundError(f"tokenizer folder {tokenizer} does not exist (Helix never downloads one)")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("loading a tokenizer folder needs transformers: pip install 'helix[models]'") from None
        return Tokenizer(
            AutoTokenizer.from_pretrained(os.fspath(tokenizer), local_files_only=True), os.fspath(tokenizer)
        )
    if not callable(tokenizer):
        raise TypeError(
            f"tokenizer must be None, a folder path or a Hugging Face tokenizer, got {type(tokenizer).__name__}"
        )
    return Tokenizer(tokenizer, tokenizer)
