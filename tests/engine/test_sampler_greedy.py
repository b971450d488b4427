"""The greedy pick (sampler.greedy_tokens) agrees with torch.argmax, ties, NaN and all -inf rows included."""

import torch

from flowrt.engine.sampler import greedy_tokens


def test_greedy_tokens_match_torch_argmax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, 5] = x[1, 900] = 50.0  # a tie: the first index wins
    x[2, 17] = float("nan")  # NaN counts as the largest
    x[3] = float("-inf")  # nothing allowed: index 0
    x[4, 999] = 1e9
    want = x.argmax(dim=-1).tolist()
    assert greedy_tokens(x).tolist() == want == [int(x[0].argmax()), 5, 17, 0, int(x[4].argmax()), int(x[5].argmax())]
    assert greedy_tokens(x[:, :500]).tolist() == x[:, :500].argmax(dim=-1).tolist()  # a strided view
    assert greedy_tokens(x.bfloat16()).tolist() == x.bfloat16().argmax(dim=-1).tolist()  # the torch path
