"""A NomicBERT config.json (nomic-embed-text v1 / v1.5) read the one way both of its readers
need: the llama.cpp converter (`ingest.hf_nomic_bert`) and the Core ML lane's owned manifest
(`formats.owned.manifest_nomic`), so the two lanes accept and refuse the same directories.

A directory names its sizes in either of two key sets, and may carry both: transformers'
(`hidden_size`, `num_hidden_layers`, ...) and nomic's own (`n_embd`, `n_layer`, ...: the Hub
checkpoints' original config, which llama.cpp's converter reads). Either is read; when both are
present they must agree, or the directory is refused: the programs would build different models
from it. `check_config` refuses every switch that would make the model another function than
the one both graphs compute (post-norm, SwiGLU, no biases, full NEOX rotary, bidirectional).

The trained context: nomic's config says `n_positions` 8192 with `max_trained_positions` 2048
(v1 and v1.5 were trained at 2048, as llama.cpp's converter records); the smaller one counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.errors import ArtifactInvalid
from formats.hf_config import HfConfig

_EMBED_ARCHS = {"NomicBertModel", "NomicBertForMaskedLM"}
# nomic's default when its config omits max_trained_positions (its own NomicBertConfig's).
_NOMIC_TRAINED_POSITIONS = 2048


@dataclass(frozen=True)
class NomicSizes:
    hidden: int
    layers: int
    heads: int
    ffn: int
    context: int
    norm_eps: float
    rope_base: float
    type_vocab: int
    vocab: int


def _nomic_context(config: HfConfig) -> int | None:
    if "n_positions" not in config:
        return None
    trained = config.positive_int("max_trained_positions", _NOMIC_TRAINED_POSITIONS)
    return min(config.positive_int("n_positions"), trained)


# (what it is, transformers' reading, nomic's reading or None when its key is absent)
def _pairs(config: HfConfig) -> list[tuple[str, Callable[[], Any], Callable[[], Any] | None]]:
    def nomic(key: str, read: Callable[[str], Any]) -> Callable[[], Any] | None:
        return (lambda: read(key)) if config.get(key) is not None else None

    ctx = _nomic_context(config)
    return [
        (
            "hidden size",
            lambda: config.positive_int("hidden_size"),
            nomic("n_embd", config.positive_int),
        ),
        (
            "layers",
            lambda: config.positive_int("num_hidden_layers"),
            nomic("n_layer", config.positive_int),
        ),
        (
            "heads",
            lambda: config.positive_int("num_attention_heads"),
            nomic("n_head", config.positive_int),
        ),
        (
            "ffn size",
            lambda: config.positive_int("intermediate_size"),
            nomic("n_inner", config.positive_int),
        ),
        (
            "context",
            lambda: config.positive_int("max_position_embeddings"),
            (lambda: ctx) if ctx else None,
        ),
        (
            "layer norm eps",
            lambda: config.number("layer_norm_eps"),
            nomic("layer_norm_epsilon", config.number),
        ),
        ("rotary base", lambda: config.rope()[1], nomic("rotary_emb_base", config.number)),
    ]


def _transformers_key_present(config: HfConfig, what: str) -> bool:
    keys = {
        "hidden size": ("hidden_size",),
        "layers": ("num_hidden_layers",),
        "heads": ("num_attention_heads",),
        "ffn size": ("intermediate_size",),
        "context": ("max_position_embeddings",),
        "layer norm eps": ("layer_norm_eps",),
        "rotary base": ("rope_parameters", "rope_theta"),
    }[what]
    return any(config.get(k) is not None for k in keys)


def nomic_sizes(config: HfConfig) -> NomicSizes:
    """The model's sizes from either key set; both present and different is refused."""
    values: dict[str, Any] = {}
    for what, theirs, nomic in _pairs(config):
        if nomic is None:
            values[what] = theirs()
            continue
        mine = nomic()
        if _transformers_key_present(config, what) and theirs() != mine:
            raise ArtifactInvalid(
                f"config.json: {what} is {theirs()!r} by transformers' keys and {mine!r} by "
                "nomic's; transformers and llama.cpp would build different models"
            )
        values[what] = mine
    return NomicSizes(
        hidden=values["hidden size"],
        layers=values["layers"],
        heads=values["heads"],
        ffn=values["ffn size"],
        context=values["context"],
        norm_eps=values["layer norm eps"],
        rope_base=values["rotary base"],
        type_vocab=config.positive_int("type_vocab_size", 2),
        vocab=config.positive_int("vocab_size"),
    )


# nomic's switches, and the only value llama.cpp's nomic-bert graph computes.
_NOMIC_FIXED: dict[str, Any] = {
    "activation_function": "swiglu",
    "prenorm": False,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "causal": False,
}


def check_config(config: HfConfig, sizes: NomicSizes) -> None:
    arch = config.architecture("NomicBertModel")
    if arch not in _EMBED_ARCHS:
        raise ArtifactInvalid(f"unsupported architecture {arch!r} for model_type nomic_bert")
    for key, want in _NOMIC_FIXED.items():
        if key in config and config.get(key) != want:
            raise ArtifactInvalid(
                f"config.json: {key} {config.get(key)!r} is not served (llama.cpp's nomic-bert "
                f"graph computes {key} = {want!r} only)"
            )
    if config.get("moe_every_n_layers"):
        raise ArtifactInvalid("config.json: a mixture-of-experts NomicBERT is not served")
    act = config.string("hidden_act")
    if act not in ("silu", "swish"):
        raise ArtifactInvalid(f"config.json: hidden_act {act!r} (the nomic-bert graph is SwiGLU)")
    kind, _ = config.rope()
    if kind != "default":
        raise ArtifactInvalid(
            f"config.json: rope type {kind!r} (the nomic-bert graph has plain RoPE)"
        )
    if sizes.hidden % sizes.heads:
        raise ArtifactInvalid("hidden size is not a multiple of the attention heads")
    if "head_dim" in config and config.get("head_dim") not in (None, sizes.hidden // sizes.heads):
        raise ArtifactInvalid("config.json: head_dim is not hidden_size / num_attention_heads")
