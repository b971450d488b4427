"""The environment's packages against this repository's top-level names."""

import importlib.metadata


def test_no_other_distribution_provides_a_top_level_kernels_package():
    # flowrt ships a top-level `kernels` package; another distribution with that import name (Hugging Face's
    # `kernels`, which transformers 5.25 requires) is shadowed by it, and transformers' import then fails on ours
    others = set(importlib.metadata.packages_distributions().get("kernels", [])) - {"flowrt"}
    assert not others, f"installed distributions also provide a top-level `kernels` package: {sorted(others)}"
