"""Small models with the traits that make data parallelism hard, shared by Parts III-V.

    FrozenLayerModel   a frozen layer, randomly initialised like the others: it never gets a
                       gradient, yet ranks that start from different seeds disagree on it
    TiedModel          the embedding and the output layer share one weight (one parameter
                       reached twice: one gradient, one hook, one all-reduce)
    BufferModel        a buffer (random, not trained) besides the parameters: state that
                       DDP must copy from the first rank like the weights
    TinyTransformer    Part IV's model (embedding, attention and MLP blocks, norm, output):
                       sharded, split by heads, cut into stages and given experts by k17-k22

Each takes a batch from ``make_batch(name, size, seed)`` and returns one output per sample, so
``loss(model, batch)`` (the mean over the batch) on N equal shards averages to the loss of the
whole batch, and N ranks' averaged gradients equal one process's on the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn

IN_FEATURES, HIDDEN, OUT_FEATURES, VOCABULARY = 8, 16, 4, 32


class FrozenLayerModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(IN_FEATURES, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)  # random like the rest, but never trained
        self.last = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.frozen(torch.relu(self.first(x)))))


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, HIDDEN)
        self.hidden = nn.Linear(HIDDEN, HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCABULARY, bias=False)
        self.output.weight = self.embedding.weight  # tied: one parameter, used twice

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(torch.tanh(self.hidden(self.embedding(tokens))))


class BufferModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(IN_FEATURES, HIDDEN)
        # A buffer, not a parameter: no gradient, but part of the state every replica must share.
        # (Not BatchNorm: its batch statistics would make N shards differ from one whole batch.)
        self.register_buffer("scale", torch.rand(HIDDEN) + 0.5)
        self.last = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x) * self.scale))


MODELS = {"frozen": FrozenLayerModel, "tied": TiedModel, "buffer": BufferModel}


def make_model(name: str, seed: int) -> nn.Module:
    """Model ``name`` with its weights drawn from ``seed`` (ranks with different seeds differ)."""
    if name not in MODELS:
        raise ValueError(f"unknown toy model {name!r}: use one of {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name]()


def make_batch(name: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` for model ``name``: ``size`` samples drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    if name == "tied":
        inputs = torch.randint(0, VOCABULARY, (size,), generator=generator)
        return inputs, torch.randint(0, VOCABULARY, (size,), generator=generator)
    inputs = torch.randn(size, IN_FEATURES, generator=generator)
    return inputs, torch.randn(size, OUT_FEATURES, generator=generator)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean loss over the batch: cross-entropy for token models, squared error otherwise."""
    inputs, targets = batch
    outputs = model(inputs)
    if targets.dtype == torch.long:
        return nn.functional.cross_entropy(outputs, targets)
    return nn.functional.mse_loss(outputs, targets)


# --- Part IV: one tiny transformer that every kata cuts up differently ----------------------------
#
#   tokens -> embedding -> block -> block -> ... -> norm -> output -> logits
#                          block = x + attention(norm(x)); x + mlp(norm(x))
#
# ZeRO and FSDP shard its weights and optimizer state, tensor parallelism splits its attention
# heads and MLP, pipeline parallelism gives its blocks to different ranks, expert parallelism
# replaces an MLP by experts. Attention reshapes with -1 heads, so a rank holding only some
# heads' columns (tensor parallel) runs the same forward on them.

SEQUENCE, MODEL_DIM, HEADS, MLP_DIM, BLOCKS = 8, 16, 4, 64, 2


class Attention(nn.Module):
    """Causal self-attention with separate query/key/value projections (columns split by head)."""

    def __init__(self, dim: int = MODEL_DIM, heads: int = HEADS):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be a multiple of heads {heads}")
        self.head_dim = dim // heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, length, head_dim)
            return t.view(batch, length, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        return self.out(attended.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, dim: int = MODEL_DIM, hidden: int = MLP_DIM):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int = MODEL_DIM):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim)  # MLP_DIM at the default MODEL_DIM

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    def __init__(self, blocks: int = BLOCKS, dim: int = MODEL_DIM, vocabulary: int = VOCABULARY):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


def make_transformer(seed: int, blocks: int = BLOCKS) -> TinyTransformer:
    """A TinyTransformer with its weights drawn from ``seed``; the global RNG is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyTransformer(blocks)


def make_tokens(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``: ``size`` sequences of SEQUENCE tokens and their next tokens."""
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCABULARY, (size, SEQUENCE + 1), generator=generator)
    return stream[:, :-1], stream[:, 1:]


def transformer_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of the batch (so N equal shards average to the whole)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
