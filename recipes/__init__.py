"""Launch recipes: torchx components and script entry points (``torchrec_het.recipes``)."""

if __name__ == "recipes":  # imported from the repo root by mistake
    raise ImportError("import this package as `torchrec_het.recipes`, not `recipes`")
