"""Launch recipes: torchx components and script entry points (``torchrec_het_bench.recipes``)."""

if __name__ == "recipes":  # imported from the repo root by mistake
    raise ImportError("import this package as `torchrec_het_bench.recipes`, not `recipes`")
