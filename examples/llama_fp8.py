"""A transformers Llama in FP8 (or another recipe of ``cutedsl_gemm.nn``: ``--recipe int8``, ``int4_weight``, ..):
convert its linear layers with ``cutedsl_gemm.nn.convert``, then generate greedily with the bf16 model and with the
converted one (each decode step replayed from a CUDA graph) and compare tokens/s.

    python examples/llama_fp8.py [--layers 8] [--recipe row] [--tokens 128] [--batch 1]
    python examples/llama_fp8.py --checkpoint /path/to/Meta-Llama-3-8B --prompt "The capital of France is"

Without --checkpoint the model is a random-weight Llama with Llama-3-8B dimensions and --layers layers (nothing is
downloaded). With it, the checkpoint is loaded from that directory (local_files_only); when the directory holds a
tokenizer, the prompt is text and both generations are printed. Needs transformers (pip install -e ".[models]");
generating needs a Hopper GPU. Without one the script converts a tiny random-weight Llama of the same architecture
on the CPU (the weights quantized by the kernels' torch reference, the same bits) and prints what was converted,
what was kept and the layers' quantized buffers.
"""

import argparse

import torch

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.tools import models as M


def load(args):
    """(bf16 model on the GPU, tokenizer or None)."""
    if args.checkpoint is None:
        return M.random_llama(M.llama_config(args.layers, M.LLAMA3_8B), "cuda"), None
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    dtype = {"dtype" if version >= (4, 56) else "torch_dtype": torch.bfloat16}  # the keyword was renamed in 4.56
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, local_files_only=True, **dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
    except (OSError, ValueError):  # a directory with weights and config only
        tokenizer = None
    return model.to("cuda").eval().requires_grad_(False), tokenizer


def convert_only(args):
    """No Hopper GPU: ``convert`` on a tiny random-weight Llama on the CPU, and what it made of each layer."""
    model = M.random_llama(M.llama_config(2, M.TINY_LLAMA), "cpu")
    report = cnn.convert(model, recipe=args.recipe, filter=lambda name, module: name != "lm_head")
    print(f"No Hopper GPU here: converted a 2-layer Llama with hidden size {model.config.hidden_size} on the CPU "
          f"({args.recipe}): {report}")
    for name in report.converted[:7]:  # one decoder layer's linears
        layer = model.get_submodule(name)
        buffers = ", ".join(f"{k} {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                            for k, v in layer.state_dict().items() if k != "_extra_state")
        print(f"  {name}: {buffers}")
    print("Generating with the converted model, and timing it against bf16, needs a Hopper GPU (H100, H200 or H800).")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", metavar="DIR", help="a local transformers checkpoint (default: random weights)")
    p.add_argument("--layers", type=int, default=8, help="layers of the random-weight model (default 8)")
    p.add_argument("--recipe", choices=list(cnn.LINEAR_RECIPES), default="row",
                   help="cutedsl_gemm.nn recipe of the converted model (default row)")
    p.add_argument("--tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--batch", type=int, default=1, help="sequences generated together (default 1)")
    p.add_argument("--prompt", default="The history of the transistor begins", help="text prompt (with a tokenizer)")
    p.add_argument("--prompt-length", type=int, default=32, help="random prompt tokens without a tokenizer")
    args = p.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        return convert_only(args)
    if args.tokens < 2:
        raise SystemExit("--tokens must be at least 2")

    model, tokenizer = load(args)
    if tokenizer is not None:
        prompt = tokenizer(args.prompt, return_tensors="pt").input_ids.repeat(args.batch, 1).cuda()
    else:
        prompt = M.random_tokens(model.config, args.batch, args.prompt_length)

    # A second model that shares every tensor with the first; convert() swaps its nn.Linear modules for quantized
    # ones (weights quantized once, activations per call). The LM head stays bf16, as quantized deployments keep it.
    converted = M.sharing_copy(model)
    report = cnn.convert(converted, recipe=args.recipe, filter=lambda name, module: name != "lm_head")
    print(f"converted {len(report.converted)} linear layers ({args.recipe}); kept bf16: lm_head"
          + "".join(f", {name} ({why})" for name, why in report.skipped.items() if name != "lm_head"))

    generated, rate = {}, {}
    for name, m in (("bf16", model), (args.recipe, converted)):
        tokens, seconds = M.greedy_generate(m, prompt, args.tokens)
        generated[name], rate[name] = tokens, args.batch * (args.tokens - 1) / seconds
        print(f"{name:11s}: {rate[name]:8.1f} tokens/s ({args.batch} x {args.tokens - 1} decode steps, "
              f"{1e3 * seconds / (args.tokens - 1):.2f} ms per step)")
    print(f"{args.recipe} / bf16: {rate[args.recipe] / rate['bf16']:.2f}x")
    same = (generated[args.recipe] == generated["bf16"]).int().cumprod(dim=1).sum(dim=1)
    print(f"greedy tokens identical to bf16 for the first {same.min().item()} of {args.tokens} (worst sequence)")
    if tokenizer is not None:
        for name, tokens in generated.items():
            print(f"\n[{name}] {args.prompt}{tokenizer.decode(tokens[0], skip_special_tokens=True)}")


if __name__ == "__main__":
    main()
