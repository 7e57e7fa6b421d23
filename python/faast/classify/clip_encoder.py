"""CLIP image and text embeddings for the classifiers, from transformers or open_clip, cached on disk.

The paper's vision experiments use CLIP RN50 (open_clip: ``ClipEncoder.open_clip("RN50", "openai")``); any
transformers CLIP checkpoint works too (``ClipEncoder.transformers("openai/clip-vit-base-patch32")``). Weights are
fetched by those libraries, so this needs their caches or network; nothing here downloads by itself. Embeddings are
L2-normalised float32 on CPU; with a cache folder each input set is encoded once (keyed by the model's identity and
a sha256 of the inputs).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import persist

__all__ = ["ClipEncoder"]


class ClipEncoder:
    """Wraps a CLIP model: encode_images(uint8 [N, H, W, 3]) and encode_texts(list of str), both [N, d] float32.

    Args:
        image_fn: preprocessed images [B, 3, h, w] -> image features [B, d].
        text_fn: list of strings -> text features [B, d].
        preprocess: uint8 HWC images [B, H, W, 3] -> model input [B, 3, h, w] float.
        identity: a string naming model and weights, part of every cache key.
    """

    def __init__(
        self,
        image_fn: Callable[[torch.Tensor], torch.Tensor],
        text_fn: Callable[[list[str]], torch.Tensor],
        preprocess: Callable[[torch.Tensor], torch.Tensor],
        identity: str,
        device: torch.device | str = "cpu",
    ) -> None:
        self.image_fn, self.text_fn, self.preprocess = image_fn, text_fn, preprocess
        self.identity = identity
        self.device = torch.device(device)

    @classmethod
    def transformers(cls, model: object, *, device: str | torch.device | None = None) -> ClipEncoder:
        """From a transformers CLIPModel instance or a model id / local folder (with its tokenizer)."""
        import transformers

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        name = model if isinstance(model, str | os.PathLike) else getattr(model.config, "_name_or_path", "custom")
        if isinstance(model, str | os.PathLike):
            model = transformers.CLIPModel.from_pretrained(model)
        tokenizer = transformers.AutoTokenizer.from_pretrained(name) if str(name) != "custom" else None
        return cls.from_clip_model(model, tokenizer, identity=f"transformers:{name}", device=device)

    @classmethod
    def from_clip_model(
        cls, model: object, tokenizer: object, *, identity: str, device: str | torch.device = "cpu"
    ) -> ClipEncoder:
        """From a transformers CLIPModel and tokenizer already in memory (e.g. built from a config in a test)."""
        model = model.to(device).eval().requires_grad_(False)
        size = model.config.vision_config.image_size
        # CLIP's normalisation constants (the same for every OpenAI CLIP checkpoint).
        mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
        std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)

        def preprocess(images: torch.Tensor) -> torch.Tensor:
            x = images.permute(0, 3, 1, 2).float() / 255.0
            x = torch.nn.functional.interpolate(x, size=(size, size), mode="bicubic", align_corners=False)
            return ((x.clamp(0, 1) - mean) / std).to(device)

        def image_fn(x: torch.Tensor) -> torch.Tensor:
            return _features(model.get_image_features(pixel_values=x))

        def text_fn(texts: list[str]) -> torch.Tensor:
            if tokenizer is None:
                raise ValueError("texts: this encoder was built without a tokenizer")
            batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(device)
            return _features(model.get_text_features(**batch))

        return cls(image_fn, text_fn, preprocess, identity, device)

    @classmethod
    def open_clip(cls, name: str = "RN50", pretrained: str = "openai", *, device: str | None = None) -> ClipEncoder:
        """From open_clip (pip install open_clip_torch); RN50/openai is the paper's backbone."""
        try:
            import open_clip
        except ImportError as exc:
            raise ImportError("ClipEncoder.open_clip needs open_clip: pip install open_clip_torch") from exc
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model, _, transform = open_clip.create_model_and_transforms(name, pretrained=pretrained, device=device)
        model.eval().requires_grad_(False)
        tokenizer = open_clip.get_tokenizer(name)

        def preprocess(images: torch.Tensor) -> torch.Tensor:
            from PIL import Image

            return torch.stack([transform(Image.fromarray(img.numpy())) for img in images]).to(device)

        return cls(
            lambda x: model.encode_image(x), lambda t: model.encode_text(tokenizer(t).to(device)),
            preprocess, f"open_clip:{name}:{pretrained}", device,
        )  # fmt: skip

    # ------------------------------------------------------------------ encoding

    def _cached(
        self, kind: str, payload: bytes, n: int, compute: Callable[[], torch.Tensor], cache_dir
    ) -> torch.Tensor:  # noqa: ANN001
        if cache_dir is None:
            return compute()
        key = hashlib.sha256(f"{self.identity}|{kind}|{n}|".encode() + payload).hexdigest()
        path = Path(cache_dir) / f"{key}.safetensors"
        if path.is_file():
            try:
                stored = persist.read_verified(path)[0]["embeddings"]
                if stored.shape[0] == n:
                    return stored
            except (ValueError, KeyError):
                pass  # a damaged entry is recomputed and overwritten
        out = compute()
        persist.write_atomic(path, {"embeddings": out}, {"model": self.identity, "kind": kind})
        return out

    def encode_images(
        self, images: torch.Tensor, *, batch_size: int = 64, cache_dir: str | os.PathLike | None = None
    ) -> torch.Tensor:
        """uint8 images [N, H, W, 3] -> L2-normalised float32 embeddings [N, d] on CPU."""
        if (
            not isinstance(images, torch.Tensor)
            or images.dtype != torch.uint8
            or images.dim() != 4
            or images.shape[-1] != 3
        ):
            got = f"{images.dtype} {list(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"images: expected a uint8 tensor [N, H, W, 3], got {got}")

        def compute() -> torch.Tensor:
            out = []
            with torch.inference_mode():
                for start in range(0, images.shape[0], batch_size):
                    out.append(self.image_fn(self.preprocess(images[start : start + batch_size])).float().cpu())
            return torch.nn.functional.normalize(torch.cat(out), dim=-1)

        payload = hashlib.sha256(images.contiguous().numpy().tobytes()).digest() + str(list(images.shape)).encode()
        return self._cached("images", payload, images.shape[0], compute, cache_dir)

    def encode_texts(self, texts: Sequence[str], *, cache_dir: str | os.PathLike | None = None) -> torch.Tensor:
        """Strings -> L2-normalised float32 embeddings [N, d] on CPU."""
        texts = list(texts)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("texts: expected a non-empty list of strings")

        def compute() -> torch.Tensor:
            with torch.inference_mode():
                return torch.nn.functional.normalize(self.text_fn(texts).float().cpu(), dim=-1)

        return self._cached("texts", "\x1f".join(texts).encode(), len(texts), compute, cache_dir)


def _features(out: object) -> torch.Tensor:
    # transformers 5 may return a model output object instead of a tensor from get_*_features.
    if isinstance(out, torch.Tensor):
        return out
    for name in ("image_embeds", "text_embeds", "pooler_output"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"unexpected CLIP feature output {type(out).__name__}")
