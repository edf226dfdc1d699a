"""The tutorial's ConvNet, and the accuracy of a model on a data set.

    input 1x28x28
      -> conv 5x5, 16 channels -> BatchNorm -> ReLU -> max-pool 2   (layer1: 16x14x14)
      -> conv 5x5, 32 channels -> BatchNorm -> ReLU -> max-pool 2   (layer2: 32x7x7)
      -> flatten -> linear 1568 -> 10                               (fc: one score per digit)

``ConvNet(batch_norm=False)`` is the same network without BatchNorm: a model whose gradient on
a batch depends on each sample alone, which k05 needs to show that N ranks on N shards compute
exactly what one process computes on the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn

IMAGE_SHAPE = (1, 28, 28)
NUM_CLASSES = 10


def _block(in_channels: int, out_channels: int, batch_norm: bool) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=5, stride=1, padding=2),
        nn.BatchNorm2d(out_channels) if batch_norm else nn.Identity(),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),
    )


class ConvNet(nn.Module):
    """Two conv-BN-ReLU-pool blocks and a linear layer: 1x28x28 images in, 10 scores out."""

    def __init__(self, num_classes: int = NUM_CLASSES, batch_norm: bool = True):
        super().__init__()
        self.layer1 = _block(1, 16, batch_norm)
        self.layer2 = _block(16, 32, batch_norm)
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != IMAGE_SHAPE:
            # Without this the mistake surfaces as a puzzling matrix-size error inside fc.
            raise ValueError(
                f"ConvNet takes a batch of 1x28x28 images, shape (batch, 1, 28, 28); got "
                f"{tuple(x.shape)}. dojo.data gives images of that shape."
            )
        out = self.layer2(self.layer1(x))
        return self.fc(out.reshape(out.size(0), -1))


@torch.no_grad()
def accuracy(model: nn.Module, dataset, batch_size: int = 512, device=None) -> float:
    """The fraction of ``dataset``'s (image, label) pairs that ``model`` classifies correctly.

    The model is put in eval mode (BatchNorm uses its running statistics) and back in the mode
    it was in.
    """
    if len(dataset) == 0:
        raise ValueError("accuracy of an empty data set is undefined: give it some samples")
    device = device if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    try:
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
        for images, labels in loader:
            predictions = model(images.to(device)).argmax(dim=1)
            correct += (predictions == labels.to(device)).sum().item()
    finally:
        model.train(was_training)
    return correct / len(dataset)
