"""Whole models on the library's layers: a random-weight Llama with Llama-3-8B dimensions, a copy of a model that
shares its tensors (to convert it and keep the original), CUDA-graph capture, and a decode step over a static KV
cache that a CUDA graph can replay, and that a second model with the same layers below its LM head can share. Used
by ``cutedsl-gemm demo``, ``examples/llama_fp8.py`` and ``benchmarks/bench_model.py``.

``transformers`` (the ``[models]`` extra) is imported by the functions that need it, so importing this module does
not require it. The decode step works with transformers' two static-cache conventions: older versions take the
write position from the caller (``cache_position``); newer ones keep it in a tensor in each cache layer and advance
it on every update.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import time

import torch

#: Llama-3-8B's dimensions (its config.json), without the layer count
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
#: the same architecture small enough for a CPU test
TINY_LLAMA = dict(LLAMA3_8B, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=512, max_position_embeddings=1024)


def llama_config(layers: int, dims: dict = LLAMA3_8B):
    """A ``LlamaConfig`` with ``dims`` (default: Llama-3-8B's) and ``layers`` decoder layers."""
    from transformers import LlamaConfig

    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a whole number >= 1, got {layers!r}")
    return LlamaConfig(num_hidden_layers=layers, **dims)


def random_llama(config, device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """``LlamaForCausalLM(config)`` with transformers' random initialisation, built directly on ``device`` in
    ``dtype`` (buffers that transformers computes in fp32, the rotary frequencies, stay fp32), in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose modules are new objects but whose parameters and buffers are ``model``'s own
    tensors: converting its linears (which replaces modules) leaves ``model`` as it was and costs no second
    copy of the weights that stay."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


#: The attention ``use_packed_gqa_attention`` registers with transformers.
PACKED_GQA_SDPA = "sdpa_packed_gqa"


def packed_gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                    **kwargs):
    """transformers' SDPA attention, except at one query token with grouped key / value heads: there each kv head's
    g query heads go to SDPA as g query positions of that head (its mask rows alike), so the step reads the cache
    once, where transformers versions that repeat every key and value g times first (``repeat_kv``) copy it g times
    and read that. The same product: query head h attends with kv head h // g either way."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(b, kv_heads, groups, d)
    mask = attention_mask
    if mask is not None:  # (b | 1, 1 | heads, 1, L): one row per packed position
        mask = (mask.expand(mask.shape[0], 1, groups, mask.shape[-1]) if mask.shape[1] == 1
                else mask.reshape(mask.shape[0], kv_heads, groups, mask.shape[-1]))
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


def use_packed_gqa_attention(model: torch.nn.Module) -> None:
    """Run ``model``'s attention through ``packed_gqa_sdpa`` (registered with transformers as ``PACKED_GQA_SDPA``,
    with SDPA's masks), whatever the installed transformers does with grouped heads at decode. Copies made after
    the call (``sharing_copy``) attend the same way."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_GQA_SDPA, packed_gqa_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_GQA_SDPA, sdpa_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(PACKED_GQA_SDPA)
    else:
        model.config._attn_implementation = PACKED_GQA_SDPA


def replace_modules(model: torch.nn.Module, names, make) -> None:
    """Replace each submodule of ``model`` named in ``names`` by ``make(submodule)``."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, make(getattr(owner, child)))


def random_tokens(config, batch: int, length: int, seed: int = 1, device="cuda") -> torch.Tensor:
    """(batch, length) token ids drawn uniformly from the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=gen).to(device)


def cuda_graph(fn, warmup: int = 2):
    """Capture ``fn()`` in a CUDA graph after ``warmup`` calls on a side stream (which compile kernels and fill
    plan caches); returns ``(graph, output)``: ``graph.replay()`` reruns the captured work into ``output``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output


def _static_cache(config, batch: int, length: int, device, dtype):
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    given = dict(max_batch_size=batch, batch_size=batch, device=device, dtype=dtype)
    return StaticCache(config=config, max_cache_len=length, **{k: v for k, v in given.items() if k in params})


def _logits_kwargs(params) -> dict:
    """The forward keyword that keeps only the last position's logits (named differently across versions)."""
    name = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    return {name: 1} if name else {}


def last_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the last position of a cache-free forward over ``input_ids`` (batch, n): (batch, vocab)."""
    keep = _logits_kwargs(inspect.signature(model.forward).parameters)
    return model(input_ids=input_ids, use_cache=False, **keep).logits[:, -1]


#: How far two replays of one decode step may differ (relative Frobenius): bf16 attention and split-K reductions are
#: not bit-reproducible, and quantizing the activations turns a last-bit difference into a rounding flip. A replay
#: that writes the wrong cache slot differs by far more.
REPLAY_RTOL = 0.05


class DecodeStep:
    """One decode step of a causal LM over a static KV cache of ``max_length`` positions: each of ``batch``
    sequences takes the token in ``self.tokens`` at position ``self.position``; ``forward()`` returns the
    logits of that token, (batch, vocab).

    Every input is a fixed tensor updated in place, and the step first sets the cache's own write position to
    ``self.position`` (where transformers keeps one in the cache and advances it on every update), so a CUDA graph
    of the step can be replayed: as one step repeated (timing), or with ``feed`` / ``advance`` between replays
    (generation); ``check_replay`` checks that a replay does, before a timing loop repeats it. When ``max_length``
    is exactly the prompt length + 1 the step attends to every cache position and passes no attention mask;
    otherwise it passes a (batch, max_length) mask of the positions written so far.
    """

    def __init__(self, model, batch: int, max_length: int):
        self.model, self.batch, self.max_length = model, batch, max_length
        device = model.get_input_embeddings().weight.device
        dtype = model.get_input_embeddings().weight.dtype
        self.cache = _static_cache(model.config, batch, max_length, device, dtype)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = None
        self._counters = []
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._takes_cache_position = "cache_position" in params
        self._keep = _logits_kwargs(params)

    def _inputs(self, tokens, positions, mask):
        kw = {"input_ids": tokens, "position_ids": positions.view(1, -1).expand(tokens.shape[0], -1),
              self._cache_kw: self.cache, "use_cache": True, "attention_mask": mask}
        if self._takes_cache_position:
            kw["cache_position"] = positions
        return kw | self._keep

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Write ``prompt`` (batch, n) into the cache at positions 0..n-1 and return the logits of its last
        token; the next step writes position n."""
        if prompt.dim() != 2 or prompt.shape[0] != self.batch or not 0 < prompt.shape[1] < self.max_length:
            raise ValueError(f"prompt must be (batch={self.batch}, n) token ids with 0 < n < max_length="
                             f"{self.max_length}, got shape {tuple(prompt.shape)}")
        n = prompt.shape[1]
        positions = torch.arange(n, device=self.position.device)
        logits = self.model(**self._inputs(prompt, positions, None)).logits[:, -1]
        self._counters = self._position_counters(n)
        self.position.fill_(n)
        if self.max_length > n + 1:
            self.mask = torch.zeros(self.batch, self.max_length, dtype=torch.long, device=self.position.device)
            self.mask[:, : n + 1] = 1
        return logits

    def _position_counters(self, n: int) -> list:
        """The cache's own write positions (scalar integer tensors of its layers), checked to be ``n`` after a
        prefill of n tokens; none in transformers versions that take ``cache_position``."""
        found = [t for layer in getattr(self.cache, "layers", ()) for t in vars(layer).values()
                 if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.is_floating_point()]
        wrong = sorted({int(t) for t in found} - {n})
        if wrong:
            raise RuntimeError(f"the static cache holds integer scalars {wrong} after a prefill of {n} tokens; this "
                               "transformers version keeps a state DecodeStep does not know how to replay")
        return found

    def write_positions(self) -> list:
        """The cache's own write positions now, as ints (synchronises); empty where the caller passes them."""
        return [int(t) for t in self._counters]

    def check_replay(self, run, output: torch.Tensor | None = None, times: int = 3, rtol: float | None = None):
        """Run the step ``times`` times through ``run`` (a CUDA graph's replay, a compiled step or the step itself;
        its logits are in ``output`` when given, else returned by ``run``) and return a copy of the logits.

        Before each run the cache's write positions are set to 0, so a run that does not put them back to
        ``self.position`` writes an in-bounds slot, and the check raises instead of the next run writing past the
        cache's end (a device-side assert on a GPU, which no later call survives). Raises ``RuntimeError`` if a
        run leaves a write position other than ``position + 1`` or the logits of two runs differ by more than
        ``rtol`` (relative Frobenius; 0: bit for bit; None: ``REPLAY_RTOL``)."""
        rtol = REPLAY_RTOL if rtol is None else rtol
        expect = int(self.position) + 1
        first = None
        for _ in range(times):
            for counter in self._counters:
                counter.fill_(0)
            result = run()
            logits = result if output is None else output
            moved = sorted(set(self.write_positions()) - {expect})
            if moved:
                raise RuntimeError(f"a run of the decode step left the static cache's write position at {moved}, not "
                                   f"{expect}: it does not write the slot of position {expect - 1}, and replaying it "
                                   "would walk past the cache")
            if first is None:
                first = logits.clone()
            elif not torch.equal(logits, first) and (rtol == 0 or _rel_diff(logits, first) > rtol):
                raise RuntimeError(f"two runs of the same decode step gave different logits (relative difference "
                                   f"{_rel_diff(logits, first):.3g})")
        return first

    def with_model(self, model) -> DecodeStep:
        """This step run by ``model``, over the same cache, tokens, position and mask (shared, not copied): for a
        model whose layers below the LM head are this step's model's (the same weights, another head), so that the
        cache this step's prefill wrote is the one ``model``'s prefill would write. Each of the two steps rewrites
        the slot of ``position`` before reading it, so their runs (and CUDA graphs) may take turns."""
        if type(model) is not type(self.model) or model.config.to_dict() != self.model.config.to_dict():
            raise ValueError("with_model takes a model of the same class and config as the step's own")
        other = copy.copy(self)
        other.model = model
        return other

    def forward(self) -> torch.Tensor:
        for counter in self._counters:
            counter.copy_(self.position.view(()))
        return self.model(**self._inputs(self.tokens, self.position, self.mask)).logits[:, -1]

    __call__ = forward

    def feed(self, tokens: torch.Tensor) -> None:
        """The tokens of the next step, (batch,) or (batch, 1)."""
        self.tokens.copy_(tokens.view(self.batch, 1))

    def advance(self) -> None:
        """Move to the next position (on the device: no synchronisation)."""
        self.position.add_(1)
        if self.mask is not None:
            self.mask.index_fill_(1, self.position.clamp(max=self.max_length - 1), 1)


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def greedy_generate(model, prompt: torch.Tensor, new_tokens: int, graph: bool = True):
    """Greedy decoding of ``new_tokens`` tokens after ``prompt`` (batch, n) with a static cache, each step
    replayed from one CUDA graph (``graph=False``: eager). Returns ``(tokens (batch, new_tokens), decode
    seconds)``; the time covers the ``new_tokens - 1`` decode steps after the prefill, synchronised."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (one from the prefill, one or more decoded), got {new_tokens}")
    step = DecodeStep(model, prompt.shape[0], prompt.shape[1] + new_tokens)
    nxt = step.prefill(prompt).argmax(-1)
    if graph:
        captured, logits = cuda_graph(step)
        run = captured.replay
    else:
        logits, run = None, step
    step.check_replay(run, logits, times=1)  # rewrites the slot the first step writes; refuses a replay that walks
    out = [nxt]
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        step.feed(nxt)
        result = run()
        nxt = (logits if graph else result).argmax(-1)
        out.append(nxt)
        step.advance()
    sync()
    return torch.stack(out, dim=1), time.perf_counter() - start


# ---- mixture-of-experts models ----------------------------------------------------------------------------------
#: Qwen3-30B-A3B's dimensions (its config.json), without the layer count (``QWEN3_30B_A3B_LAYERS``): 128 experts of
#: width 768 in every layer, 8 routed per token, routing weights renormalised over the 8
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_30B_A3B_LAYERS = 48
#: the same architecture small enough for a CPU test
TINY_QWEN3_MOE = dict(QWEN3_30B_A3B, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                      num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      vocab_size=512, max_position_embeddings=1024)
#: Mixtral-8x7B's dimensions (its config.json), without the layer count (32)
MIXTRAL_8X7B = dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_MIXTRAL = dict(MIXTRAL_8X7B, hidden_size=256, intermediate_size=256, num_local_experts=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=1024)
#: model kind -> its transformers config class
MOE_CONFIGS = {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}


def moe_config(kind: str, layers: int, dims: dict):
    """The transformers config of a mixture-of-experts model ``kind`` ("qwen3_moe", "mixtral") with ``dims`` and
    ``layers`` decoder layers."""
    import transformers

    if kind not in MOE_CONFIGS:
        raise ValueError(f"kind must be one of {', '.join(MOE_CONFIGS)}, got {kind!r}")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a whole number >= 1, got {layers!r}")
    return getattr(transformers, MOE_CONFIGS[kind])(num_hidden_layers=layers, **dims)


def random_causal_lm(config, device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """The causal LM of ``config`` (``AutoModelForCausalLM.from_config``) with transformers' random initialisation,
    built directly on ``device`` in ``dtype`` (what transformers keeps in fp32 stays fp32), in eval mode: for any
    architecture, as ``random_llama`` for Llama."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)
