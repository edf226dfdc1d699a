"""The data sets the training katas use: offline handwritten digits by default, MNIST on request.

    train = load("digits", "train")     # 1437 real handwritten digits, 1x28x28, works offline
    test = load("digits", "test")       # the 360 held out for accuracy
    train = load("mnist", "train", root="~/data")                  # MNIST files already there
    train = load("mnist", "train", root="~/data", download=True)   # fetch them (needs internet)

The digits are scikit-learn's bundled set (1797 scans of 8x8 pixels, 0-16, from 43 writers),
scaled up to 28x28 so the tutorial's ConvNet takes them unchanged. The held-out split is fixed
(seeded), so every rank and every run sees the same one. Both data sets give (image, label)
pairs: a float tensor of shape (1, 28, 28), normalised to mean 0 and deviation 1 over the
training images, and an integer 0-9. Nothing is ever downloaded unless asked for.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib.util
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

NAMES = ("digits", "mnist")
SPLITS = ("train", "test")
IMAGE_SIZE = 28
HELD_OUT_FRACTION = 0.2
SPLIT_SEED = 0  # fixed, never a parameter: every rank must cut the data the same way
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class DataError(ValueError):
    """A data set that cannot be loaded; the message says what was wrong and what to do."""


def load(name: str = "digits", split: str = "train", root=None, download: bool = False) -> Dataset:
    """The ``split`` ("train" or "test") of data set ``name`` ("digits" or "mnist")."""
    if name == "digits":
        if root is not None or download:
            raise DataError(
                "the digits come with scikit-learn and need no --data-root or --download; "
                "for MNIST pass --data mnist"
            )
        return digits(split)
    if name == "mnist":
        return mnist(root, split, download)
    raise DataError(f"unknown data set {name!r}: choose one of {', '.join(NAMES)}")


def digits(split: str = "train") -> TensorDataset:
    """scikit-learn's handwritten digits at 28x28, ``split`` "train" (80 %) or "test" (20 %)."""
    _check_split(split)
    images, labels = _digits_tensors()
    order = _digits_order(len(labels))
    held_out = round(len(labels) * HELD_OUT_FRACTION)
    chosen = order[held_out:] if split == "train" else order[:held_out]
    return TensorDataset(images[chosen], labels[chosen])


def mnist(root, split: str = "train", download: bool = False) -> Dataset:
    """torchvision's MNIST from ``root`` (where ``MNIST/raw/`` lives); fetched only if ``download``."""
    _check_split(split)
    if root is None:
        raise DataError(
            "MNIST needs a folder: pass --data-root DIR (the folder that holds MNIST/raw/), and "
            "--download if the files are not there yet (needs internet). Offline, use the default "
            "--data digits."
        )
    root = Path(root).expanduser()
    if root.exists() and not root.is_dir():
        raise DataError(
            f"--data-root {root} is a file; it must be a folder (the one that holds MNIST/raw/)"
        )
    if not download:
        if not root.is_dir():
            raise DataError(
                f"--data-root {root} does not exist. Point it at the folder that holds MNIST/raw/, "
                "or add --download to fetch MNIST there (needs internet), or use the default "
                "--data digits, which works offline."
            )
        missing = [f for f in MNIST_FILES if not (root / "MNIST" / "raw" / f).exists()]
        if missing:
            raise DataError(
                f"no MNIST under {root}: {root / 'MNIST' / 'raw'} lacks {', '.join(missing)}. "
                "Add --download to fetch them (needs internet), point --data-root at the folder "
                "that holds MNIST/, or use the default --data digits, which works offline."
            )
    try:
        from torchvision import datasets, transforms  # ~2 s to import: only when MNIST is asked for
    except ImportError:
        raise DataError(
            "MNIST needs torchvision: pip install torchvision (or use --data digits)"
        ) from None
    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))]
    )
    try:
        return datasets.MNIST(
            str(root), train=split == "train", download=download, transform=transform
        )
    except RuntimeError as error:
        if not download:
            raise DataError(
                f"the MNIST files under {root} could not be read ({error}): remove them and "
                "add --download to fetch them again"
            ) from None
        raise DataError(
            f"could not download MNIST into {root} ({error}). Is this machine offline? Copy the "
            f"files {', '.join(MNIST_FILES)} into {root / 'MNIST' / 'raw'} by hand, or use the "
            "default --data digits, which works offline."
        ) from None


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data``, ``--data-root`` and ``--download`` for a program that trains; see ``from_arguments``."""
    parser.add_argument(
        "--data",
        choices=NAMES,
        default="digits",
        help="digits: scikit-learn's handwritten digits, offline (default); mnist: torchvision's",
    )
    parser.add_argument(
        "--data-root", default=None, help="for --data mnist: the folder that holds MNIST/raw/"
    )
    parser.add_argument(
        "--download", action="store_true", help="for --data mnist: fetch it (needs internet)"
    )


def from_arguments(args: argparse.Namespace, split: str = "train") -> Dataset:
    """The ``split`` of the data set that ``add_data_arguments``'s options name."""
    return load(args.data, split, args.data_root, args.download)


# --------------------------------------------------------------------------- the digits


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")


def _digits_order(count: int) -> torch.Tensor:
    return torch.randperm(count, generator=torch.Generator().manual_seed(SPLIT_SEED))


@functools.lru_cache(maxsize=1)
def _digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits as (N, 1, 28, 28) float images (normalised) and (N,) int64 labels."""
    rows = _digits_rows()
    pixels = rows[:, :-1].reshape(-1, 1, 8, 8) / 16.0
    labels = rows[:, -1].long()
    images = torch.nn.functional.interpolate(
        pixels, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False
    )
    train = images[_digits_order(len(labels))[round(len(labels) * HELD_OUT_FRACTION) :]]
    images = (
        images - train.mean()
    ) / train.std()  # training statistics only: the test set stays unseen
    images.requires_grad_(False)
    return images.contiguous(), labels


def _digits_rows() -> torch.Tensor:
    """The rows of scikit-learn's digits.csv.gz: 64 pixels then the label.

    Read straight from the file: importing sklearn.datasets costs ~1 s per process, the file ~0.02 s.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the offline digits come with scikit-learn: pip install scikit-learn")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    if path.exists():
        with gzip.open(path, "rt") as f:
            rows = [[float(v) for v in line.split(",")] for line in f if line.strip()]
        return torch.tensor(rows, dtype=torch.float32)
    from sklearn.datasets import load_digits  # a scikit-learn that keeps the file elsewhere

    bunch = load_digits()
    data = torch.as_tensor(bunch.data, dtype=torch.float32)
    return torch.cat([data, torch.as_tensor(bunch.target, dtype=torch.float32)[:, None]], dim=1)
