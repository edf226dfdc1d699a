"""Small models with the traits that make data parallelism hard, shared by Parts III-V.

    FrozenLayerModel   a frozen layer, randomly initialised like the others: it never gets a
                       gradient, yet ranks that start from different seeds disagree on it
    TiedModel          the embedding and the output layer share one weight (one parameter
                       reached twice: one gradient, one hook, one all-reduce)
    BufferModel        a buffer (random, not trained) besides the parameters: state that
                       DDP must copy from the first rank like the weights

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
