"""dojo.data (the offline digits, MNIST on request, clear errors) and dojo.models (the ConvNet)."""

from __future__ import annotations

import argparse
import struct

import pytest
import torch

from dojo import data, models


def test_digits_are_28x28_with_a_fixed_held_out_split():
    train, test = data.load("digits", "train"), data.load("digits", "test")
    assert (len(train), len(test)) == (1438, 359), "1797 digits, a fifth of them held out"
    image, label = train[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert label.dtype == torch.int64
    for split in (train, test):
        assert sorted(torch.unique(split.tensors[1]).tolist()) == list(range(10)), (
            "every digit in both splits"
        )
    again = data.load("digits", "test")
    assert torch.equal(again.tensors[0], test.tensors[0]), (
        "the split must be the same on every call"
    )
    # The scans are all different, so a held-out image found among the training images is a leak.
    train_rows = {tuple(row.tolist()) for row in train.tensors[0].flatten(1)}
    assert not any(tuple(row.tolist()) in train_rows for row in test.tensors[0].flatten(1))


def test_digits_are_normalised_on_the_training_images():
    images = data.load("digits", "train").tensors[0]
    assert abs(images.mean().item()) < 1e-4 and abs(images.std().item() - 1) < 1e-4


def test_digits_images_match_their_labels():
    # One mean image per digit, from the training images, must classify most held-out images:
    # a slip that shuffled labels against images, or scrambled pixels, would make this fail.
    train, test = data.load("digits", "train"), data.load("digits", "test")
    images, labels = train.tensors
    centroids = torch.stack([images[labels == d].mean(0).flatten() for d in range(10)])
    distances = torch.cdist(test.tensors[0].flatten(1), centroids)
    accuracy = (distances.argmin(1) == test.tensors[1]).float().mean().item()
    assert accuracy > 0.85, (
        f"nearest mean image classifies only {accuracy:.0%} of the held-out digits"
    )


@pytest.mark.parametrize(
    "call, said",
    [
        (lambda: data.load("fashion"), ["unknown data set 'fashion'", "digits, mnist"]),
        (lambda: data.load("digits", "valid"), ["unknown split 'valid'", "train, test"]),
        (lambda: data.load("digits", root="/data"), ["need no --data-root", "--data mnist"]),
        (lambda: data.load("mnist"), ["--data-root", "--download", "--data digits"]),
    ],
)
def test_bad_requests_say_what_to_do(call, said):
    with pytest.raises(data.DataError) as caught:
        call()
    assert all(text in str(caught.value) for text in said), str(caught.value)


def test_a_missing_mnist_folder_is_a_clear_error_and_nothing_downloads(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(data.DataError, match="does not exist.*--download.*--data digits"):
        data.load("mnist", root=missing)
    assert not missing.exists(), "nothing may be created or downloaded unless --download is given"
    with pytest.raises(data.DataError, match="lacks train-images-idx3-ubyte.*--download"):
        data.load("mnist", root=tmp_path)
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(data.DataError, match="is a file"):
        data.load("mnist", root=a_file)


def _idx(path, magic, shape, values):
    path.write_bytes(struct.pack(f">{len(shape) + 1}i", magic, *shape) + bytes(values))


def test_mnist_files_in_place_are_read(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", 3), ("t10k", 2)):
        _idx(raw / f"{prefix}-images-idx3-ubyte", 2051, (count, 28, 28), [255] * (count * 28 * 28))
        _idx(raw / f"{prefix}-labels-idx1-ubyte", 2049, (count,), [7] * count)
    parser = argparse.ArgumentParser()
    data.add_data_arguments(parser)
    args = parser.parse_args(["--data", "mnist", "--data-root", str(tmp_path)])
    train, test = data.from_arguments(args, "train"), data.from_arguments(args, "test")
    assert (len(train), len(test)) == (3, 2)
    image, label = train[0]
    assert image.shape == (1, 28, 28) and int(label) == 7
    expected = (1.0 - data.MNIST_MEAN) / data.MNIST_STD
    assert torch.allclose(image, torch.full_like(image, expected)), (
        "MNIST is normalised with its usual mean and std"
    )


def test_the_default_arguments_mean_the_offline_digits():
    parser = argparse.ArgumentParser()
    data.add_data_arguments(parser)
    assert len(data.from_arguments(parser.parse_args([]), "test")) == 359


def test_convnet_is_the_tutorials():
    model = models.ConvNet()
    assert model(torch.zeros(5, 1, 28, 28)).shape == (5, 10)
    kinds = [type(m).__name__ for m in model.layer1]
    assert kinds == ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d"]
    plain = models.ConvNet(batch_norm=False)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in plain.modules())
    assert [n for n, _ in plain.named_parameters()] == [
        "layer1.0.weight",
        "layer1.0.bias",
        "layer2.0.weight",
        "layer2.0.bias",
        "fc.weight",
        "fc.bias",
    ]
    with pytest.raises(ValueError, match=r"\(batch, 1, 28, 28\); got \(5, 1, 8, 8\)"):
        model(torch.zeros(5, 1, 8, 8))


def test_accuracy_counts_right_answers_and_keeps_the_mode():
    class Constant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(10))

        def forward(self, x):
            return self.bias.index_fill(0, torch.tensor([3]), 1.0).expand(len(x), 10)

    images = torch.zeros(4, 1, 28, 28)
    dataset = torch.utils.data.TensorDataset(images, torch.tensor([3, 3, 1, 3]))
    model = Constant().train()
    assert models.accuracy(model, dataset, batch_size=3) == 0.75
    assert model.training, "accuracy must put the model back in training mode"
    with pytest.raises(ValueError, match="empty"):
        models.accuracy(model, torch.utils.data.TensorDataset(images[:0], torch.tensor([]).long()))
