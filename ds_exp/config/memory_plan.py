"""Byte accounting in one place: per-rank memory of model states and activations, a checkpoint's size on disk. Model
states per parameter follow the ZeRO paper: mixed precision 2 + 2 + 4 master bytes + the optimizer's state
(optimizers.py); fp32 4 + 4 + the state, + 4 master bytes at stages 1-3 (bench/memory.py). Buckets are not included."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ds_exp.config.optimizer_settings import OptimizerConfig
from ds_exp.config.optimizers import OPTIMIZERS, entry_of
from ds_exp.config.schema import Config, LoraConfig, OffloadConfig, plain
from ds_exp.fast_path.settings import FastPathSettings
from ds_exp.long_context.settings import LongContextSettings


@dataclass(frozen=True)
class OptimizerState:
    """The optimizer's own fp32 state per trainable parameter, and the parameters it keeps another amount for."""

    per_param: float = 8.0  # AdamW's two moments
    aux_params: int = 0
    aux_per_param: float = 0.0

    def bytes(self, trainable: int) -> int:
        aux = min(self.aux_params, trainable)
        return round(trainable * self.per_param + aux * (self.aux_per_param - self.per_param))


def optimizer_state(
    opt: OptimizerConfig,
    offload: OffloadConfig,
    lora: LoraConfig,
    facts: dict[str, int] | None = None,
    accelerator: str = "cuda",
) -> OptimizerState:
    """The state of the optimizer `opt` builds on `accelerator`; with `facts` None, an upper bound."""
    entry = entry_of(opt) or OPTIMIZERS["adamw"]
    offloaded = str(plain(offload.optimizer)) != "none"
    impl = entry.impl_for(opt, offload=offloaded, accelerator=accelerator)
    per_param = float(entry.state_bytes(opt, impl))
    if entry.aux_state_bytes is None:
        return OptimizerState(per_param)
    if facts is None:
        return OptimizerState(max(per_param, entry.aux_state_bytes))
    aux = 0
    if int(lora.dim) == 0:  # what DeepSpeed hands the auxiliary AdamW: embeddings, the head, vectors
        embeddings = facts["vocab"] * facts["hidden"] * (1 if facts.get("tied") else 2)
        aux = embeddings + (2 * facts["layers"] + 1) * facts["hidden"]
    return OptimizerState(per_param, aux, float(entry.aux_state_bytes))


@dataclass(frozen=True)
class MemoryEstimate:
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    device_bytes: int  # on the accelerator, per rank
    host_bytes: int  # offloaded to CPU memory (or NVMe), per rank

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def estimate_model_states(
    total_params: int,
    trainable_params: int,
    *,
    stage: int,
    world_size: int,
    precision: str,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    state: OptimizerState = OptimizerState(),
) -> MemoryEstimate:
    weight_bytes = 4 if precision == "fp32" else 2
    # the optimizer's state, plus the fp32 master weights wherever a ZeRO optimizer or mixed precision keeps them
    master = 0 if precision == "fp32" and stage == 0 else 4
    params = total_params * weight_bytes
    grads = trainable_params * weight_bytes
    optimizer = state.bytes(trainable_params) + trainable_params * master
    if stage >= 1:
        optimizer = -(-optimizer // world_size)
    if stage >= 2:
        grads = -(-grads // world_size)
    if stage >= 3:
        params = -(-params // world_size)
    host = (params if offload_param != "none" else 0) + (optimizer if offload_optimizer != "none" else 0)
    return MemoryEstimate(params, grads, optimizer, params + grads + optimizer - host, host)


@dataclass(frozen=True)
class ModelShape:
    """What the activation estimate needs of a decoder-only transformer."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int  # padded, as trained
    heads: int = 0  # 0 = unknown: key/value heads counted as attention heads
    kv_heads: int = 0
    tied: bool = False  # the output layer shares the input embedding's weight (tie_word_embeddings)
    outputs: int = 0  # the output layer's width: 0 = the vocabulary (a reward model's head: 1)


@dataclass(frozen=True)
class LongContext:
    """The knobs that change activation memory beyond batch and length (ds_exp/long_context/)."""

    checkpointing: bool = False
    sequence_parallel: int = 1  # Ulysses: each rank holds 1/N of every sequence
    mlp_tiles: int = 0  # 0 = MLPs untiled
    loss_chunk_tokens: int = 0  # 0 = logits computed whole
    offload: bool = False  # checkpointed layer inputs in host memory (saves device memory on accelerators only)
    attention_scores: bool = False  # eager attention: heads x length x length probabilities per layer
    packed_mask: bool = False  # packed rows without flash-attention: transformers builds a length x length mask
    fused_loss: bool = False  # Liger's fused linear cross-entropy (model.fused_loss): logits a chunk at a time


def estimate_activations(
    *,
    micro_batch: int,
    seq_len: int,
    shape: ModelShape,
    precision: str,
    knobs: LongContext = LongContext(),
    accelerator: str = "cuda",
    embedding_trains: bool = False,
) -> int:
    """Peak per-rank activation bytes of one micro batch's forward and backward, for a Llama-style pre-norm block
    (checked against measured peaks in bench/long_context.py). Per token of a rank (micro batch x seq_len / N), a layer
    keeps about 8 x hidden + 3 x key/value width for attention and 4 x intermediate for the MLP; eager attention also
    heads x length x length probabilities. Checkpointing keeps one hidden per layer plus one layer's full activations
    while it is recomputed; tiled MLPs hold one tile's intermediates. Whole logits cost t x vocabulary plus the loss's
    fp32 copies; tiled, one chunk's. A trained input embedding adds a late phase of its own: its dense gradient, and
    with tied embeddings the output layer's too (three vocabulary x hidden tensors, measured on SmolLM2-135M; two
    untied)."""
    w = 4 if precision == "fp32" else 2
    n = max(int(knobs.sequence_parallel), 1)
    t = micro_batch * -(-seq_len // n)
    hidden, inter = shape.hidden, shape.intermediate
    kv = hidden * shape.kv_heads // shape.heads if shape.heads and shape.kv_heads else hidden
    attention = t * (8 * hidden + 3 * kv) * w
    if knobs.attention_scores:  # eager: each layer keeps its probabilities, its heads over the whole sequence
        attention += micro_batch * -(-max(shape.heads, 1) // n) * seq_len * seq_len * w
    mlp_whole = t * 4 * inter * w
    mlp_kept = t * hidden * w if knobs.mlp_tiles else mlp_whole  # tiled: the tiles' input, recomputed from it
    mlp_tile = -(-mlp_whole // knobs.mlp_tiles) if knobs.mlp_tiles else 0
    layer = attention + mlp_kept
    if knobs.checkpointing:
        on_device = 0 if knobs.offload and accelerator != "cpu" else 1
        kept = shape.layers * t * hidden * w * on_device + layer + mlp_tile
    else:
        kept = shape.layers * layer + mlp_tile
    if knobs.fused_loss:  # Liger: chunks of about t x hidden / vocab tokens (up to twice that), the hidden states'
        # gradient worked out in the forward, and a trained output weight's gradient summed in fp32
        chunk = min(t, max(1, 2 * t * hidden // max(shape.vocab, 1)))
        head_grad = shape.vocab * hidden * 4 if embedding_trains else 0
        logits = 2 * t * hidden * w + chunk * shape.vocab * (w + 4) + head_grad
    elif knobs.loss_chunk_tokens:
        chunk = min(t, knobs.loss_chunk_tokens)
        logits = t * hidden * w + chunk * shape.vocab * (w + 8 + (4 if w == 2 else 0))
    else:
        logits = t * (shape.outputs or shape.vocab) * (w + 8 + (4 if w == 2 else 0))  # + the loss's fp32 copy
    in_flight = 3 * t * hidden * w
    exchange = t * (2 * hidden + 2 * kv) * w if n > 1 else 0  # q, k, v and the output in the heads' layout
    mask = micro_batch * seq_len * seq_len if knobs.packed_mask or knobs.attention_scores else 0
    embedding = (3 if shape.tied else 2) * shape.vocab * shape.hidden * w + in_flight if embedding_trains else 0
    return max(kept + logits + in_flight + exchange + mask, embedding)


def run_estimate(
    cfg: Config, facts: dict[str, int], *, world_size: int, precision: str, accelerator: str
) -> dict[str, int]:
    """Per-rank bytes of a composed config: model states (host too on a CPU) and one micro batch's activations."""
    states = estimate_model_states(
        facts["total"],
        facts["trainable"],
        stage=int(cfg.zero.stage),
        world_size=world_size,
        precision=precision,
        offload_optimizer=str(plain(cfg.offload.optimizer)),
        offload_param=str(plain(cfg.offload.param)),
        state=optimizer_state(cfg.optimizer, cfg.offload, cfg.lora, facts, accelerator),
    )
    long_context = LongContextSettings.of(cfg)
    sp, tiling = long_context.sequence_parallel, long_context.plan(hidden=facts["hidden"], vocab=facts["vocab"])
    # preference pairs (objective=dpo, reward) are two rows each; DPO's reference adds no weights (LoRA's adapters
    # off, or log-probabilities computed before training) and its no-grad forward keeps no activations
    micro = int(cfg.train.micro_batch_size) * (1 if str(plain(cfg.objective.name)) == "sft" else 2)
    tokens = micro * long_context.tokens
    attention = str(cfg.model.attn_implementation or "sdpa")
    fast = FastPathSettings.of(cfg).decide(accelerator, int(cfg.zero.stage))
    # packed rows on a varlen kernel (flash-attn's, torch's) need no length x length mask
    varlen = attention.startswith("flash") or attention == "torch_varlen"
    varlen |= attention == "auto" and accelerator == "cuda" and precision != "fp32"
    knobs = LongContext(
        fused_loss=fast.fused_loss,
        checkpointing=bool(cfg.model.gradient_checkpointing),
        sequence_parallel=sp,
        mlp_tiles=tiling.mlp_shards,
        loss_chunk_tokens=-(-tokens // tiling.loss_chunks) if tiling.loss_chunks and not fast.fused_loss else 0,
        offload=tiling.offload,
        attention_scores=attention == "eager",
        packed_mask=bool(cfg.data.packing) and not varlen,
    )
    sizes = {k: facts[k] for k in ("hidden", "intermediate", "layers", "vocab", "heads", "kv_heads")}
    shape = ModelShape(**sizes, tied=bool(facts["tied"]), outputs=facts.get("outputs", 0))
    activations = estimate_activations(
        micro_batch=micro,
        seq_len=int(cfg.data.max_seq_len),
        shape=shape,
        precision=precision,
        knobs=knobs,
        accelerator=accelerator,
        # frozen under LoRA, unless saved whole beside the adapters (counted whenever any module is: an over-estimate)
        embedding_trains=int(cfg.lora.dim) == 0 or bool(cfg.lora.modules_to_save),
    )
    states_bytes = states.device_bytes + (states.host_bytes if accelerator == "cpu" else 0)
    return {
        "estimate_bytes": states_bytes + activations,
        "model_states_bytes": states_bytes,
        "activation_bytes": activations,
    }


def plan_micro_batch(
    cfg: Config, facts: dict[str, int], device_bytes: int, *, precision: str, world_size: int, use: float = 0.85
) -> tuple[int, bool]:
    """The largest micro batch whose estimate fits `use` of the GPU, without checkpointing if it can; (1, True) else."""
    for checkpointing in (False, True):
        for micro in (16, 8, 4, 2, 1):
            train = replace(cfg.train, micro_batch_size=micro)
            model = replace(cfg.model, gradient_checkpointing=checkpointing)
            one = replace(cfg, train=train, model=model)
            bytes_ = run_estimate(one, facts, world_size=world_size, precision=precision, accelerator="cuda")
            if bytes_["estimate_bytes"] <= use * device_bytes:
                return micro, checkpointing
    return 1, True


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def checkpoint_bytes(trainable: int, precision: str, state: OptimizerState = OptimizerState()) -> int:
    """One DeepSpeed checkpoint's size: trained weights in the training dtype, fp32 master weights, optimizer state."""
    weight = 4 if precision == "fp32" else 2
    return trainable * (weight + 4) + state.bytes(trainable)
