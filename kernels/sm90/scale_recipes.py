"""The Hopper GEMM's block-scaled recipes as plain data, without the DSL: the host's dispatch reads them without
loading the kernels, and ``block_scales`` builds the kernels' scale staging on them."""

# recipe name -> (A granularity, W granularity): "group" one scale per 1x128 (a row's 128-element K group),
# "block" one per 128x128
BLOCK_RECIPES = {
    "1x128_128x128": ("group", "block"),
    "128x128_128x128": ("block", "block"),
    "1x128_1x128": ("group", "group"),
}


def is_block_scaled(recipe: str) -> bool:
    return recipe in BLOCK_RECIPES
