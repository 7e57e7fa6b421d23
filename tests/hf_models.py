"""Tiny causal LMs built from a config in-process (no hub): GPT-2 / Llama / Qwen2 (tiny_model), any transformers model
type (arch_model), and a character tokenizer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 61


def tiny_model(kind: str, seed: int = 0, layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2
        )
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    model.generation_config.pad_token_id = 0
    return model.eval()


KINDS = ["gpt2", "llama", "qwen2"]

# Tiny-config settings beyond the shared ones (arch_model) that a type needs to build at hidden size 32.
ARCH_OVERRIDES: dict[str, dict] = {
    "helium": {"head_dim": 8},  # its default head_dim (128) ignores hidden_size / heads
    "gptj": {"rotary_dim": 4},  # rotary_dim must fit the head (8)
    "codegen": {"rotary_dim": 4},
    # The scales real checkpoints use (granite-3: 8 or 16), so a head that ignored them would show.
    "granite": {"logits_scaling": 4.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22},
    "granitemoe": {"logits_scaling": 4.0, "num_local_experts": 4, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 32},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
}  # fmt: skip


def arch_model(model_type: str, seed: int = 0, layers: int = 2, **overrides: object) -> torch.nn.Module:
    """A tiny *ForCausalLM of any transformers model type (hidden 32, 4 heads, 2 key-value heads, vocab VOCAB), built
    from AutoConfig.for_model in-process; `overrides` replace config fields."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    settings.update(ARCH_OVERRIDES.get(model_type, {}), **overrides)
    config = transformers.AutoConfig.for_model(model_type, **settings)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = 0
    return model.eval()


class CharTokenizer:
    """Enough of a tokenizer for learn(texts): one id per character."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}


# Prose: lowercase words, spaces, line breaks and the prompts' punctuation (anything else is [UNK]).
PROSE = " \n:.,'-" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPRSTUVWY"


def save_tiny_checkpoint(kind: str, folder, alphabet: str | None = None) -> str:  # noqa: ANN001
    """A tiny model + a character-level fast tokenizer saved like a hub checkpoint (AutoModel* can load it).

    The tokenizer knows the first VOCAB - 3 characters of `alphabet` (default: printable ASCII from the space on).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(alphabet) if alphabet else [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(chars[: VOCAB - 3])}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(
        Regex("[\\s\\S]"), behavior="isolated"
    )  # every character, line breaks too
    core.decoder = decoders.Fuse()  # decode joins characters without spaces
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>",
                                                      eos_token="</s>", pad_token="[UNK]")  # fmt: skip
    tiny_model(kind).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
