"""Tiny synthetic GGUF models of the dense and mixture-of-experts transformer families llama.cpp runs, for the
tests: one writer, `write_family(path, vocab_gguf, name)`, driven by the table FAMILIES (each entry the keys and
tensors llama.cpp's loader reads for that architecture: src/models/<arch>.cpp at llama.cpp 0c1e57098).

Every model has 4 layers of n_embd 64 and the tokenizer of a real GGUF; weights are float32 (token_embd Q4_0) and
come from the seed, the same tensors for the same seed (scaled so that no model only repeats its input). llama.cpp's outputs on the seed-0 models are in
tests/data/families/ (made by its record.py). What each entry exercises:

    qwen2       QKV biases, NEOX RoPE, an untied output layer
    qwen2-yarn  qwen2 with YaRN RoPE scaling (factor 4 over an original context of 256)
    qwen3       per-head Q/K RMS norms, a head size (32) other than n_embd / n_head
    qwen3moe    qwen3's attention, a mixture-of-experts FFN (8 experts, 2 used, softmax gating, normalised)
    llama3      llama with rope_freqs (Llama 3.1's frequency factors), GQA, freq_base 500000
    phi3        fused QKV and gate-up tensors, LongRoPE (long/short factors chosen by the context size, attention
                factor), Q scaled before attention
    gemma2      embeddings times sqrt(n_embd), post-attention / post-FFN norms, GELU, attention and final logit
                softcaps, sliding-window attention on every other layer (window 32)
    smollm3     llama with NoPE layers (every 4th layer applies no RoPE)
    granite     embedding, residual and attention scales, logits divided by a logit scale
    granitemoe  granite's scales with a mixture of experts (8 experts of feed_forward_length, 2 used)
    olmo2       no pre-norms, norms after attention and FFN, Q/K RMS norms over the whole projection
"""
from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from llamax.rope import llama3_freq_factors
from synthetic import _embeddings, _norm, _normal, _tokenizer, finish

N_EMBD = 64
N_LAYER = 4
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
RMS_EPS = 1e-5
N_CTX_TRAIN = 2048
_GAIN = 4.0   # the blocks' outputs over the tied embedding (else greedy text repeats the input token)

#: name -> (general.architecture, options)
FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2": ("qwen2", dict(rope_base=1e6, qkv_bias=True, untied=True)),
    "qwen2-yarn": ("qwen2", dict(rope_base=1e6, qkv_bias=True, yarn=(4.0, 256))),
    "qwen3": ("qwen3", dict(rope_base=1e6, head_dim=32, qk_norm=True)),
    "qwen3moe": ("qwen3moe", dict(rope_base=1e6, head_dim=32, qk_norm=True, moe=(8, 2, 32))),
    "llama3": ("llama", dict(rope_base=500000.0, rope_freqs=True)),
    "phi3": ("phi3", dict(rope_base=10000.0, fused=True, longrope=256, n_head_kv=N_HEAD)),
    "gemma2": ("gemma2", dict(rope_base=10000.0, gemma2=True, post_gain=8.0, out_norm_gain=0.3)),
    "smollm3": ("smollm3", dict(rope_base=100000.0)),
    "granite": ("granite", dict(rope_base=10000.0, granite=(12.0, 0.22, 0.0078125, 8.0), untied=True, out_gain=4.0,
                                embd_div=12.0)),
    "granitemoe": ("granitemoe", dict(rope_base=10000.0, granite=(12.0, 0.22, 0.0078125, 8.0), untied=True,
                                      out_gain=4.0, embd_div=12.0, moe=(8, 2, N_FF))),
    "olmo2": ("olmo2", dict(rope_base=500000.0, olmo2=True, untied=True, n_head_kv=N_HEAD)),
}


def write_family(path: str | os.PathLike, vocab_gguf: str | os.PathLike, name: str, seed: int = 0) -> Path:
    """The 4-layer model FAMILIES[name] with vocab_gguf's tokenizer, written to path (the same seed gives the
    same tensors)."""
    arch, o = FAMILIES[name]
    rng = np.random.default_rng(seed)
    tokenizer = _tokenizer(vocab_gguf)
    t = _embeddings(rng, tokenizer)
    if "out_norm_gain" in o:   # logits below Gemma 2's final softcap (30), which would flatten the top ones
        t["output_norm.weight"] *= o["out_norm_gain"]
    if "embd_div" in o:   # the embedding scale brings the rows back to the blocks' size
        t["token_embd.weight"] /= o["embd_div"]
    if o.get("untied"):
        t["output.weight"] = _normal(rng, t["token_embd.weight"].shape, o.get("out_gain", 1.0) * N_EMBD ** -0.5)
    n_head_kv = o.get("n_head_kv", N_HEAD_KV)
    hd = o.get("head_dim", N_EMBD // N_HEAD)
    nq, nkv = N_HEAD * hd, n_head_kv * hd
    for il in range(N_LAYER):
        p = f"blk.{il}."
        if not o.get("olmo2"):
            t[p + "attn_norm.weight"] = _norm(rng, N_EMBD)
        q = _normal(rng, (nq, N_EMBD), N_EMBD ** -0.5)
        k = _normal(rng, (nkv, N_EMBD), N_EMBD ** -0.5)
        v = _normal(rng, (nkv, N_EMBD), N_EMBD ** -0.5)
        if o.get("fused"):
            t[p + "attn_qkv.weight"] = np.concatenate([q, k, v])
        else:
            t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"] = q, k, v
        if o.get("qkv_bias"):
            t[p + "attn_q.bias"] = _normal(rng, (nq,), 0.5)
            t[p + "attn_k.bias"] = _normal(rng, (nkv,), 0.5)
            t[p + "attn_v.bias"] = _normal(rng, (nkv,), 0.5)
        if o.get("qk_norm"):
            t[p + "attn_q_norm.weight"] = _norm(rng, hd)
            t[p + "attn_k_norm.weight"] = _norm(rng, hd)
        if o.get("olmo2"):
            t[p + "attn_q_norm.weight"] = _norm(rng, nq)
            t[p + "attn_k_norm.weight"] = _norm(rng, nkv)
        t[p + "attn_output.weight"] = _normal(rng, (N_EMBD, nq), _GAIN * nq ** -0.5)
        if o.get("gemma2") or o.get("olmo2"):   # (Gemma 2's blocks as large as its scaled embeddings)
            t[p + "post_attention_norm.weight"] = o.get("post_gain", 1.0) * _norm(rng, N_EMBD)
            t[p + "post_ffw_norm.weight"] = o.get("post_gain", 1.0) * _norm(rng, N_EMBD)
        if not o.get("olmo2"):
            t[p + "ffn_norm.weight"] = _norm(rng, N_EMBD)
        if o.get("moe"):
            n_exp, _, n_ff_exp = o["moe"]
            t[p + "ffn_gate_inp.weight"] = _normal(rng, (n_exp, N_EMBD), 1.0)
            t[p + "ffn_gate_exps.weight"] = _normal(rng, (n_exp, n_ff_exp, N_EMBD), N_EMBD ** -0.5)
            t[p + "ffn_up_exps.weight"] = _normal(rng, (n_exp, n_ff_exp, N_EMBD), N_EMBD ** -0.5)
            t[p + "ffn_down_exps.weight"] = _normal(rng, (n_exp, N_EMBD, n_ff_exp), _GAIN * n_ff_exp ** -0.5)
            continue
        gate = _normal(rng, (N_FF, N_EMBD), N_EMBD ** -0.5)
        up = _normal(rng, (N_FF, N_EMBD), N_EMBD ** -0.5)
        if o.get("fused"):
            t[p + "ffn_up.weight"] = np.concatenate([gate, up])     # phi3: [gate | up] in one tensor
        else:
            t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"] = gate, up
        t[p + "ffn_down.weight"] = _normal(rng, (N_EMBD, N_FF), _GAIN * N_FF ** -0.5)
    if o.get("rope_freqs"):
        t["rope_freqs.weight"] = np.array(llama3_freq_factors(hd, o["rope_base"]), np.float32)
    if o.get("longrope"):
        t["rope_factors_long.weight"] = np.linspace(1.0, 12.0, hd // 2, dtype=np.float32)
        t["rope_factors_short.weight"] = np.linspace(1.0, 1.5, hd // 2, dtype=np.float32)

    path = Path(path)
    w = gguf.GGUFWriter(path, arch)
    w.add_name("llamax synthetic model")   # not the arch: llama.cpp gives a "phi3" name special token attributes
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(o["moe"][2] if arch == "granitemoe" else N_FF)   # granitemoe: the experts' length
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_freq_base(o["rope_base"])
    if "head_dim" in o:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if o.get("moe"):
        n_exp, n_used, n_ff_exp = o["moe"]
        w.add_expert_count(n_exp)
        w.add_expert_used_count(n_used)
        if arch != "granitemoe":
            w.add_expert_feed_forward_length(n_ff_exp)
    if o.get("yarn"):
        factor, orig = o["yarn"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(orig)
    if o.get("longrope"):
        orig = o["longrope"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(N_CTX_TRAIN / orig) / np.log(orig))))
    if o.get("gemma2"):
        w.add_sliding_window(32)
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if o.get("granite"):
        emb, res, att, logit = o["granite"]
        w.add_embedding_scale(emb)
        w.add_residual_scale(res)
        w.add_attention_scale(att)
        w.add_logit_scale(logit)
    return finish(w, tokenizer, t, path)
