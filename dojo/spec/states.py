"""Model and optimizer states as the specs compare them: nested dicts and lists of tensors.

to_cpu(state)            a detached CPU copy (a rank can send it back)
devices_of(state)        every device the state's tensors live on
same(a, b)               equal bit for bit, shapes and keys included
largest_gap(a, b)        the tensor of ``a`` farthest from its namesake in ``b``, and how far
close(a, b, **tolerance) a tensor shaped like ``b`` and all-close to it
gap(a, b)                how far tensor ``a`` is from ``b``, in words for a message
"""

from __future__ import annotations

import torch


def to_cpu(state):
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {key: to_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return [to_cpu(value) for value in state]
    return state


def devices_of(state) -> set[str]:
    if isinstance(state, torch.Tensor):
        return {str(state.device)}
    if isinstance(state, dict):
        return set().union(*(devices_of(value) for value in state.values()))
    if isinstance(state, (list, tuple)):
        return set().union(*(devices_of(value) for value in state))
    return set()


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def largest_gap(a: dict, b: dict) -> tuple[str, float]:
    """The name of the tensor of ``a`` farthest from its namesake in ``b``, and how far."""
    gaps = {
        name: (a[name].double() - b[name].double()).abs().max().item()
        for name in a
        if name in b and a[name].shape == b[name].shape
    }
    name = max(gaps, key=gaps.get)
    return name, gaps[name]


def close(a, b: torch.Tensor, **tolerance) -> bool:
    """``a`` is a tensor shaped like ``b``, of its dtype, and all-close to it (``torch.allclose``'s
    tolerance)."""
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and bool(torch.allclose(a, b, **tolerance))
    )


def gap(a, b: torch.Tensor) -> str:
    """How far ``a`` is from the expected tensor ``b``, in words for a message."""
    if a is None:
        return "None"
    if not isinstance(a, torch.Tensor):
        return f"it is {type(a).__name__}, not a tensor"
    if a.shape != b.shape:
        return f"shaped {tuple(a.shape)}, expected {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"it is {a.dtype}, expected {b.dtype}"
    if torch.isnan(a).any():
        return f"it holds {int(torch.isnan(a).sum())} NaNs"
    return f"largest difference {(a.double() - b.double()).abs().max().item():.3g}"
