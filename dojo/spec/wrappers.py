"""What the specs of the hand-made DDP wrappers (k12's, k13's) ask of any such wrapper.

forward_keywords(ddp, model, inputs)   in a rank: the wrapper called with a keyword argument
check_forward_keywords(keyword, did)   it passed the keyword on to its module
finish(ddp, cure)                      finish_gradient_synchronization(), its usual crash explained
"""

from __future__ import annotations

import inspect


def forward_keywords(ddp, model, inputs) -> tuple[str, str | None]:
    """``(keyword, did)``: the name of the model's first forward argument, and what
    ``ddp(keyword=inputs)`` did wrong (None: it gave ``model(inputs)``). A model's forward may
    take keyword arguments: the wrapper passes them on. A ``KataTodo`` goes straight through."""
    import torch

    from dojo.todo import KataTodo

    keyword = next(iter(inspect.signature(model.forward).parameters))
    try:
        with torch.no_grad():
            same = torch.equal(ddp(**{keyword: inputs}), model(inputs))
    except KataTodo:
        raise
    except Exception as error:
        return keyword, f"raised {type(error).__name__}: {error}"
    return keyword, None if same else "returned another output than the model's"


def check_forward_keywords(keyword: str, did: str | None, where: str = "") -> None:
    """What ``forward_keywords`` found, held to: the keyword passed on (``where``: the wrapper,
    in front of the message)."""
    assert did is None, (
        f"{where}ddp({keyword}=inputs) {did}, where model({keyword}=inputs) works: forward passes "
        "every argument on to the module, keyword arguments too: "
        "def forward(self, *args, **kwargs): return self.module(*args, **kwargs)"
    )


def finish(ddp, cure: str) -> None:
    """``ddp.finish_gradient_synchronization()``, with torch's usual crash there (a wait on a
    handle that is None) told in the kata's words: ``cure``, what leaves a handle None."""
    try:
        ddp.finish_gradient_synchronization()
    except AttributeError as error:
        if "wait" not in str(error):
            raise
        raise AssertionError(
            f"finish_gradient_synchronization() raised AttributeError: {error}: it waited on a "
            f"handle that is None. {cure}"
        ) from None
