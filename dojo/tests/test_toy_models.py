"""The toy models keep the promises Parts III-V build on."""

from __future__ import annotations

import pytest
import torch

from dojo.toy_models import MODELS, loss, make_batch, make_model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shards_of_equal_size_average_to_the_whole_batch(name):
    model = make_model(name, seed=3)
    whole = make_batch(name, 12, seed=4)
    loss(model, whole).backward()
    expected = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    shards = [tuple(t[i::3] for t in whole) for i in range(3)]
    summed = None
    for shard in shards:
        model.zero_grad()
        loss(model, shard).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
    for got, want in zip(summed, expected):
        torch.testing.assert_close(got / 3, want, rtol=1e-5, atol=1e-6)


def test_seeds_decide_every_weight_and_buffer_and_the_traits_are_there():
    a, b, c = make_model("buffer", 1), make_model("buffer", 1), make_model("buffer", 2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.scale, c.scale), "a different seed gives a different buffer"
    tied = make_model("tied", 0)
    assert tied.output.weight is tied.embedding.weight and len(list(tied.parameters())) == 3
    frozen = make_model("frozen", 0)
    assert not frozen.frozen.weight.requires_grad
    assert not torch.equal(frozen.frozen.weight, make_model("frozen", 1).frozen.weight)
    with pytest.raises(ValueError, match="unknown toy model 'big'"):
        make_model("big", 0)
