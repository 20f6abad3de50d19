"""Footprint arithmetic over what a checkpoint's files say (its config and tensor table). Pure: the files are
read by memory.checkpoint; nothing here opens one."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .mla import latent_unquantized, mla_elements, mla_head_dim

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# Tensors mlx-lm's sanitize drops for text serving: vision/audio towers and, in Gemma 4,
# the K/V projections of KV-shared layers (their K/V come from an earlier layer).
DROPPED = re.compile(r"(vision_tower|audio_tower|multi_modal_projector|embed_vision|embed_audio|rotary_emb)")
VISION = re.compile(r"(vision_tower|embed_vision)\.")
SHARED_KV = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\.")
# A native MTP head: dropped with the target by mlx-lm's sanitize (Qwen3.5 / Qwen3-Next `mtp.*`; DeepSeek-V3 / GLM
# store it as the layers after the last), so never the target's bytes; booked as the drafter's when it is loaded.
MTP = re.compile(r"(^|\.)mtp[._]")
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) and text else config


def weight_bytes(config: dict, tensors: dict, with_vision: bool = False) -> int:
    """Bytes of the tensors mlx-lm will keep after loading this checkpoint for text generation, and with the
    vision tower the node loads beside it for a checkpoint that takes images."""
    tc = text_config(config)
    first_shared = tc.get("num_hidden_layers", 0) - (tc.get("num_kv_shared_layers") or 0)
    total = 0
    for name, (dtype, shape) in tensors.items():
        if DROPPED.search(name) and not (with_vision and VISION.search(name) and "rotary_emb" not in name):
            continue
        if is_mtp_head(name, tc):
            continue
        m = SHARED_KV.search(name)
        if m and tc.get("num_kv_shared_layers") and int(m.group(1)) >= first_shared:
            continue
        total += DTYPE_BYTES.get(dtype, 4) * math.prod(shape)
    return total


def is_mtp_head(name: str, tc: dict) -> bool:
    """A tensor of the checkpoint's own MTP head (which the target, as mlx-lm loads it, does not hold)."""
    if MTP.search(name):
        return True
    layer = LAYER_INDEX.match(name)
    layers = tc.get("num_hidden_layers", tc.get("num_layers", 0))  # LongCat-Flash names it num_layers
    return bool(layer and tc.get("num_nextn_predict_layers") and int(layer.group(1)) >= layers)


LAYER = re.compile(r"\.layers\.\d+\.")


def rank_weight_bytes(config: dict, tensors: dict, ranks: int) -> int:
    """One rank's share of a model split across `ranks` (a node group): the layers' weights divided (tensor
    parallelism splits each layer's projections, pipeline parallelism the layers), and the rest (embeddings,
    final norm, head) whole on every rank."""
    total = weight_bytes(config, tensors)
    layered = weight_bytes(config, {n: t for n, t in tensors.items() if LAYER.search(n)})
    return total - layered + -(-layered // ranks)


@dataclass(frozen=True)
class KVShape:
    bytes_per_token_full: int  # grows with every token
    bytes_per_token_sliding: int  # grows until the window, then stays
    sliding_window: int | None
    bytes_per_row: int = 0  # a hybrid model's recurrent layers' state: the same at any length (recurrent_row_bytes)

    def bytes_for(self, tokens: int) -> int:
        """What one row of `tokens` holds (a row holds its recurrent state from its first token)."""
        window = tokens if self.sliding_window is None else min(tokens, self.sliding_window)
        return self.bytes_per_token_full * tokens + self.bytes_per_token_sliding * window + self.bytes_per_row

    def per_rank(self, ranks: int) -> KVShape:
        """One rank's share in a node group: each holds its KV heads' (tensor) or its layers' (pipeline)."""
        return KVShape(-(-self.bytes_per_token_full // ranks), -(-self.bytes_per_token_sliding // ranks),
                       self.sliding_window, -(-self.bytes_per_row // ranks))


@dataclass(frozen=True)
class KVQuant:
    """A quantized KV cache: `bits` per element in groups of `group_size` along the head dimension, each group
    with a scale and a bias in the activations' float type (mlx-lm's QuantizedKVCache layout)."""

    bits: int
    group_size: int

    def bytes(self, elements: int, dtype_bytes: int) -> int:
        return elements * self.bits // 8 + 2 * dtype_bytes * -(-elements // self.group_size)


QUANT_GROUPS = (128, 64, 32)  # the group sizes mx.quantize supports


def quant_group(head_dim: int, group_size: int) -> int | None:
    """The group a quantized KV cache uses for heads of `head_dim`: `group_size` when it divides the head dimension,
    else the largest smaller supported size that does; None when none does (that KV stays in full precision)."""
    for g in (group_size,) + tuple(g for g in QUANT_GROUPS if g < group_size):
        if head_dim % g == 0:
            return g
    return None


def full_head_dim(config: dict) -> int:
    """The head dimension of the full-attention layers' K and V (Gemma 4's own `global_head_dim`)."""
    tc = text_config(config)
    heads = tc.get("num_attention_heads", 1)
    return (mla_head_dim(tc) or tc.get("global_head_dim") or tc.get("head_dim")
            or tc.get("hidden_size", 0) // max(heads, 1))


def full_layer_quant(config: dict, quant: KVQuant | None) -> KVQuant | None:
    """How a full-attention layer's KV is stored under `quant` (provider.engine.kv_quant makes the caches by this):
    in `quant`'s bits, in the group quant_group gives, or in full precision (None)."""
    if quant is None or latent_unquantized(text_config(config)):  # an MLA latent stays in full precision
        return None
    group = quant_group(full_head_dim(config), quant.group_size)
    return None if group is None else KVQuant(quant.bits, group)


def sliding_head_dim(config: dict) -> int:
    """The head dimension of the sliding-window layers' K and V (Gemma 4's `head_dim`; other models' only one)."""
    tc = text_config(config)
    heads = tc.get("num_attention_heads", 1)
    return tc.get("head_dim") or tc.get("hidden_size", 0) // max(heads, 1)


SLIDING_BITS = 8  # a quantized sliding window's bits (docs/memory.md: a quantized KV cache)


def sliding_layer_quant(config: dict, quant: KVQuant | None) -> KVQuant | None:
    """How a sliding-window layer's KV is stored under `quant` (provider.engine.kv_quant makes its rotating caches
    by this): in full precision unless `quant` goes below SLIDING_BITS, then at SLIDING_BITS in the group
    quant_group gives for the sliding layers' head dimension (None: full precision). The windows hold the nearest
    context: at 4 bits they flip over 40 % of the demo model's greedy tokens; at 8 bits they flip a few (93.3 %
    equal, against 99.6 % with the windows in full precision), which kv_bits = 8, the setting for quality, does not
    pay; kv_bits = 4, the setting for capacity, does (3.21x the jobs admitted on the demo against 2.67x)."""
    if quant is None or quant.bits >= SLIDING_BITS:
        return None
    group = quant_group(sliding_head_dim(config), quant.group_size)
    return None if group is None else KVQuant(SLIDING_BITS, group)


def kv_shape(config: dict, dtype_bytes: int = 2, quant: KVQuant | None = None) -> KVShape:
    """K and V bytes per token, per non-shared layer; sliding layers separately (they stop at the window). With
    `quant`, each layer's KV as the quantized cache stores it: full-attention layers by full_layer_quant,
    sliding-window layers by sliding_layer_quant. A hybrid's recurrent layers hold no K/V but a state per row
    (bytes_per_row), in full precision whatever `quant` says. An MLA layer holds what provider.memory.mla says."""
    tc = text_config(config)
    mla = mla_elements(tc)
    heads = tc.get("num_attention_heads", 1)
    kv_heads = tc.get("num_key_value_heads") or heads
    head_dim = sliding_head_dim(config)
    shared = tc.get("num_kv_shared_layers") or 0
    types = layer_kinds(tc)
    types = types[: (tc.get("num_hidden_layers") or len(types)) - shared]
    recurrent = types.count(LINEAR)
    window = tc.get("sliding_window")
    full_quant, sliding_quant = full_layer_quant(config, quant), sliding_layer_quant(config, quant)
    full = sliding = 0
    for kind in types:
        if kind in (LINEAR, NO_CACHE):  # no K/V (a recurrent layer: a state per row instead)
            continue
        if kind == "sliding_attention" and window:
            sliding += 2 * _kv_bytes(kv_heads * head_dim, dtype_bytes, sliding_quant)
        elif mla:  # MLA: its latent (or per-head expansion) as keys and positional key as values, not K and V
            full += sum(_kv_bytes(n, dtype_bytes, full_quant) for n in mla)
        else:  # Gemma 4's full layers have their own head size and KV head count
            h = tc.get("num_global_key_value_heads") or kv_heads
            full += (1 if tc.get("attention_k_eq_v") else 2) * _kv_bytes(h * full_head_dim(config), dtype_bytes,
                                                                         full_quant)
    return KVShape(full, sliding, window if sliding else None, recurrent * recurrent_row_bytes(tc, dtype_bytes))


LINEAR = "linear_attention"
NO_CACHE = "no_cache"  # Nemotron-H's MLP and MoE blocks: layers of their own that hold nothing per token or row
# Nemotron-H's blocks, by the characters of `hybrid_override_pattern` or the names of its block list (mlx-lm's map)
_BLOCKS = {"*": "full_attention", "M": LINEAR, "-": NO_CACHE, "E": NO_CACHE}
_BLOCK_CHARS = {"full_attention": "*", "attention": "*", "linear_attention": "M", "mamba": "M", "conv": "M",
                "moe": "E", "mlp": "-"}


def _block_pattern(tc: dict) -> list[str] | None:
    """A Nemotron-H config's blocks as mlx-lm builds them (None: not a Mamba2 hybrid)."""
    if not tc.get("mamba_num_heads"):
        return None
    chars = tc.get("hybrid_override_pattern")
    if chars is None:
        chars = [_BLOCK_CHARS.get(t, "*") for t in tc.get("layers_block_type") or tc.get("layer_types") or []]
    return [_BLOCKS.get(c, "full_attention") for c in chars]


def layer_kinds(tc: dict) -> list[str]:
    """Each layer's kind as mlx-lm builds it. A Gated DeltaNet hybrid (Qwen3.5, Qwen3-Next: its config has
    `full_attention_interval` or `linear_num_value_heads`) by the interval: layer i is full attention when
    (i + 1) % interval is 0 (4 when absent), whatever `layer_types` says; a Mamba2 hybrid (Nemotron-H) by its
    block pattern, one layer per block (only its Mamba2 and attention blocks hold a cache); others by
    `layer_types`, or all full."""
    blocks = _block_pattern(tc)
    if blocks is not None:
        return blocks
    layers = tc.get("num_hidden_layers", 0)
    if "full_attention_interval" in tc or (tc.get("linear_num_value_heads") and not tc.get("layer_types")):
        every = tc.get("full_attention_interval") or 4
        return ["full_attention" if (i + 1) % every == 0 else LINEAR for i in range(layers)]
    return list(tc.get("layer_types") or ["full_attention"] * layers)


def recurrent_row_bytes(tc: dict, dtype_bytes: int) -> int:
    """One row's state in one Gated DeltaNet layer (mlx-lm's qwen3_5 / qwen3_next, an ArraysCache of two): the
    conv window, (kernel - 1) x conv_dim in the activations' float type (conv_dim: q, k and v, 2 x key heads x
    key dim + value heads x value dim), and the recurrence's state, value heads x value dim x key dim in float32
    (gated_delta_update makes it float32 and keeps its dtype). Constant in the row's length. A Mamba2 layer
    (Nemotron-H): the conv window over x, B and C (heads x head dim + 2 x groups x state size) and the SSM state,
    heads x head dim x state size in float32 (mlx-lm's ssm computes it from float32 time steps)."""
    if tc.get("mamba_num_heads"):
        inner = tc["mamba_num_heads"] * tc.get("mamba_head_dim", 0)
        state = tc.get("ssm_state_size", 0)
        conv = (tc.get("conv_kernel", 4) - 1) * (inner + 2 * tc.get("n_groups", 1) * state) * dtype_bytes
        return conv + inner * state * 4
    hk, dk = tc.get("linear_num_key_heads", 0), tc.get("linear_key_head_dim", 0)
    hv, dv = tc.get("linear_num_value_heads", 0), tc.get("linear_value_head_dim", 0)
    conv = (tc.get("linear_conv_kernel_dim", 4) - 1) * (2 * hk * dk + hv * dv) * dtype_bytes
    return conv + hv * dv * dk * 4


def _kv_bytes(elements: int, dtype_bytes: int, quant: KVQuant | None) -> int:
    return elements * dtype_bytes if quant is None else quant.bytes(elements, dtype_bytes)


SSD_BLOCK = 256  # mlx-lm's ssm_attn reads a prompt chunk in blocks of this many positions (its `step`)


@dataclass(frozen=True)
class ActivationShape:
    """Scratch a forward needs: per token it reads, per (query, key) pair of attention scores, per row, and per
    pair of positions within one block of a Mamba2 scan."""

    per_token: int  # hidden states and MLP intermediates
    per_score: int  # attention scores and their softmax across the heads (float32)
    per_row: int  # the last position's logits
    per_block_token: int = 0  # a Mamba2 layer's SSD scan, per position of one block: head-sized vectors
    per_block_pair: int = 0  # and per pair of positions in it: its [heads, block, block] decay and mixing matrices

    def prefill_bytes(self, rows: int, chunk: int, kv_len: int) -> int:
        """Peak scratch of `rows` rows reading `chunk` prompt tokens each, attending to `kv_len` positions."""
        block = min(chunk, SSD_BLOCK)
        return rows * (chunk * self.per_token + chunk * max(kv_len, chunk) * self.per_score
                       + block * (self.per_block_token + block * self.per_block_pair) + self.per_row)


def activation_shape(config: dict, dtype_bytes: int = 4, stepped: bool | None = None,
                     attention_only: bool = False) -> ActivationShape:
    """A forward's scratch; with a Gated DeltaNet's stepped recurrence (stepped_scan_bytes) when MLX steps it
    (`stepped`; None: as mlx-lm will on this machine, stepped_recurrence) and a Mamba2 layer's scan; neither for
    `attention_only` (an MTP head reading with its target: attention and MLP layers of its own only)."""
    tc = text_config(config)
    hidden = tc.get("hidden_size", 0)
    inter = tc.get("intermediate_size", 4 * hidden)
    if tc.get("use_double_wide_mlp"):
        inter *= 2
    heads = tc.get("num_attention_heads", 1)
    vocab = tc.get("vocab_size") or config.get("vocab_size", 0)
    scan_token, scan_row = stepped_scan_bytes(tc, False if attention_only else stepped)
    ssd_token, ssd_pair = (0, 0) if attention_only else ssd_scan_bytes(tc)
    # Scores and their softmax are both alive in attention (float32, every head): two per (query, key) pair.
    return ActivationShape(dtype_bytes * (6 * hidden + 3 * inter) + scan_token, dtype_bytes * 2 * heads,
                           dtype_bytes * 2 * vocab + scan_row, ssd_token, ssd_pair)


def ssd_scan_bytes(tc: dict) -> tuple[int, int]:
    """(per position of a block, per pair of positions in it): what a Mamba2 layer's prompt read holds in mlx-lm's
    chunked SSD scan (ssm_attn, on every backend: only single-token steps take Metal's kernel), one block of
    SSD_BLOCK positions at a time. A block makes [heads, block, block] float32 matrices (segsum's repeat, its
    cumulative sums, the decay, C·B and their product: ~6 alive at once) and per position some two dozen
    head-sized vectors; a longer chunk's next block reuses them (400 tokens hold what 256 do). Fitted on this CPU
    (peak over one forward after a first chunk, 1 row; tests/test_memory_books.py holds it): the Nemotron-H fixture
    (8 heads x 16, state 16) 2.9, 9.3, 14.1 MiB for 100, 200, 256 tokens; 16 x 64 with state 64: 13.0, 32.5, 46.0;
    32 x 32 with state 128: 18.1, 49.6, 72.3 (the books had 1 to 4; they have 3.8, 11.8, 18.1; 14.9, 37.8, 54.0;
    20.9, 57.1, 84.0)."""
    if _block_pattern(tc) is None or LINEAR not in layer_kinds(tc):
        return 0, 0
    heads, head_dim, state = tc["mamba_num_heads"], tc.get("mamba_head_dim", 0), tc.get("ssm_state_size", 0)
    return 4 * (24 * heads * head_dim + 2 * heads * state), 4 * 6 * heads


def stepped_scan_bytes(tc: dict, stepped: bool | None = None) -> tuple[int, int]:
    """(per token read, per row): what a Gated DeltaNet layer holds while mlx-lm steps its recurrence one position
    at a time (gated_delta_ops: on a CPU, or a key dim the Metal kernel does not take). Each step's state
    (value heads x value dim x key dim, float32) stays alive until the evaluation reaches the step's output
    (y = sum(state x q)), which MLX's depth-first order puts after the whole chain of states; so a chunk's read
    holds a layer's state per position, and a few head-sized vectors (q, k repeated to the value heads, v, y,
    the delta). Measured (mx.get_peak_memory over one forward, this CPU): memory_ledger's phase m model
    (16 x 64 x 64) 17, 32, 62 MiB for 50, 100, 200 tokens of one row, 130 MiB for 4 rows of 100, against 18,
    34, 66 and 135 MiB booked with the rest of activation_shape; tests/test_memory_books.py's (16 x 128 x 128)
    64, 119, 227 MiB for 50, 100, 200 tokens against 66, 120, 229. A Metal kernel holds none of it."""
    hv, dk, dv = (tc.get(k, 0) for k in ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    if not hv or tc.get("mamba_num_heads") or LINEAR not in layer_kinds(tc):
        return 0, 0
    if not (stepped if stepped is not None else stepped_recurrence(dk)):
        return 0, 0
    state = hv * dv * dk * 4
    return state + 10 * hv * max(dk, dv) * 4, 12 * state  # the per-row part: measured, 9 to 11 states a row


def stepped_recurrence(key_dim: int) -> bool:
    """Whether mlx-lm's gated_delta_update steps the recurrence (gated_delta_ops) here rather than run its Metal
    kernel: its own test."""
    import mlx.core as mx

    metal = bool(getattr(mx, "metal", None) and mx.metal.is_available())
    return not metal or mx.default_device() != mx.gpu or key_dim < 32 or key_dim % 32 != 0


def activation_bytes(config: dict, prefill_step: int, dtype_bytes: int = 4, stepped: bool | None = None,
                     attention_only: bool = False) -> int:
    """Peak scratch of one prefill chunk of one row: hidden states, MLP intermediates, attention scores, last
    logits, a recurrent layer's scan (activation_shape)."""
    return activation_shape(config, dtype_bytes, stepped, attention_only).prefill_bytes(1, prefill_step, prefill_step)


def vision_scratch_bytes(config: dict, soft_tokens: int, dtype_bytes: int = 4) -> int:
    """One image through a Gemma 4 vision tower, at its peak, bounded from above: the one-hot position lookup
    (patches x 2 axes x the position table) and what is made from it, one layer's attention scores and the
    tower's patch mask ((heads + 1) x patches^2), hidden-sized activations and the pixels. Images are encoded
    one at a time, so a job's scratch is its largest image's. On the fixture tower (MLX's peak over one encode,
    CPU) 37, 158 and 1,218 MiB at 63, 266 and 1,064 soft tokens, against 44, 235 and 1,729 MiB from this."""
    vc = config.get("vision_config") or {}
    patches = soft_tokens * vc.get("pooling_kernel_size", 3) ** 2
    table = vc.get("position_embedding_size", 10240)
    heads = vc.get("num_attention_heads", 12)
    hidden = max(vc.get("hidden_size", 768), vc.get("intermediate_size", 3072))
    pixels = 3 * vc.get("patch_size", 16) ** 2
    return dtype_bytes * patches * (5 * table + (heads + 1) * patches + 16 * hidden + pixels)


def media_read_bytes(config: dict, prompt_tokens: int, dtype_bytes: int = 4) -> int:
    """What reading a prompt with media holds beside its KV until it is read: the whole prompt's input
    embeddings with the tower's features in place (and the features themselves until then), and Gemma 4's
    per-layer inputs for every position (layers x their width)."""
    tc = text_config(config)
    per_layer = (tc.get("hidden_size_per_layer_input") or 0) * tc.get("num_hidden_layers", 0)
    return dtype_bytes * prompt_tokens * (2 * tc.get("hidden_size", 0) + per_layer)
