"""Per-position log-probabilities of a GGUF llama model under mlx-lm, in the format of
`kiln score`, so `cargo xtask bench-quality --compare NAME=FILE` measures mlx-lm's 4-bit
weights against kiln's f32 reference on the same file, token ids and windows.

Two weight schemes (`--weights`):
- `gguf`: the GGUF's Q4_0/Q4_1/Q8_0 tensors as mlx affine groups of 32, exactly as mlx
  reads them (Q4_1 is `w = d*q + m`: lossless), the f16 scales, biases and norms widened
  to f32 (exact);
- `mlx-q4g64`: those weights dequantized to f32, then quantized by mlx-lm's own default
  (`mlx_lm.utils.quantize_model`: affine, 4 bits, groups of 64, every linear layer and the
  embedding), as `mlx_lm.convert -q` would store them.
llama.cpp's permutation of the Q and K rows is undone as kiln undoes it; the windows, BOS
and scored positions are copied from kiln's reference file and the token ids come from
`kiln score --ids-only`, so both engines score the same positions. Each window is one
forward of mlx-lm's llama model, activations in f32.

`--kernels` picks how the 4-bit layers multiply. `mlx` runs mlx's quantized matmul; on
the CPU (mlx-cpu wheel) that is a scalar loop, about a second per 512x576x1536 product
here, so a 512-token window of SmolLM2-135M takes minutes and the corpus hours. `dense`
(the default) dequantizes each layer once (`mx.dequantize`, exact in f32) and multiplies
in f32 by mlx's matmul, which calls BLAS: the same products on the same weights, summed
in another order (f32 rounding only; `--kernels mlx` on a window checks it). The wheel
links netlib's reference BLAS; preload an optimized one for speed, e.g.
`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0` (Debian libopenblas0-pthread).

Usage (pinned packages of scripts/fixtures/requirements.txt):
    kiln score -m MODEL.gguf --text-file CORPUS --ids-only > ids.json
    LD_PRELOAD=.../libopenblas.so.0 .venv/bin/python scripts/quality/mlx_logprobs.py \
        --gguf MODEL.gguf --ids ids.json --reference DIR/m0-reference.lp \
        --output DIR/mlx.lp [--weights gguf|mlx-q4g64] [--kernels dense|mlx] [--max-windows N]
"""

import argparse
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.utils import quantize_model

from kiln_lp import Writer, read_header, windows

NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def scalar(meta, key):
    v = meta[key]
    return v.item() if hasattr(v, "item") else v


def unpermute(a, heads):
    """llama.cpp stores row h*hd + 2i + b where Hugging Face has h*hd + b*hd/2 + i."""
    n = a.shape[0]
    hd = n // heads
    x = np.array(a.astype(mx.float32) if a.dtype == mx.float16 else a)
    x = x.reshape(heads, hd // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
    return mx.array(x).astype(a.dtype)


def load_gguf(path):
    """mlx-lm's llama model with the GGUF's weights as stored (groups of 32), floats in f32."""
    w, meta = mx.load(path, return_metadata=True)
    arch = meta["general.architecture"]
    if arch != "llama":
        raise SystemExit(f"unsupported general.architecture {arch!r}: this script runs llama")
    p = "llama."
    heads, kv = int(scalar(meta, p + "attention.head_count")), int(scalar(meta, p + "attention.head_count_kv"))
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=int(scalar(meta, p + "embedding_length")),
        num_hidden_layers=int(scalar(meta, p + "block_count")),
        intermediate_size=int(scalar(meta, p + "feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rms_norm_eps=float(scalar(meta, p + "attention.layer_norm_rms_epsilon")),
        vocab_size=int(w["token_embd.scales"].shape[0]),
        rope_theta=float(scalar(meta, p + "rope.freq_base")),
        tie_word_embeddings="output.weight" not in w,
    )
    weights = {}
    for name, a in w.items():
        parts = name.split(".")
        if parts[0] == "blk":
            layer, kind, field = parts[1], parts[2], parts[3]
            if kind == "attn_q":
                a = unpermute(a, heads)
            elif kind == "attn_k":
                a = unpermute(a, kv)
            hf = f"model.layers.{layer}.{NAMES[kind]}.{field}"
        elif parts[0] == "token_embd":
            hf = f"model.embed_tokens.{parts[1]}"
        elif parts[0] == "output_norm":
            hf = "model.norm.weight"
        elif parts[0] == "output":
            hf = f"lm_head.{parts[1]}"
        else:
            raise SystemExit(f"unexpected tensor {name}")
        if a.dtype in (mx.float16, mx.bfloat16, mx.float32):
            a = a.astype(mx.float32)
        weights[hf] = a
    model = llama.Model(args)

    def bits_of(path, module):
        """Each layer at its stored width (the embedding may be Q8_0 beside Q4_1 layers)."""
        if f"{path}.scales" not in weights:
            return False
        packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
        return {"group_size": 32, "bits": packed.shape[1] * 32 // (scales.shape[1] * 32)}

    nn.quantize(model, class_predicate=bits_of)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model, args


def dense(model, args):
    """The same model with every quantized layer dequantized to f32 (exact)."""
    weights = dict(nn.utils.tree_flatten(model.parameters()))
    for path, m in model.named_modules():
        if hasattr(m, "group_size") and hasattr(m, "scales"):
            for field in ("scales", "biases"):
                weights.pop(f"{path}.{field}", None)
            weights[f"{path}.weight"] = mx.dequantize(
                m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits
            ).astype(mx.float32)
    out = llama.Model(args)
    out.load_weights(list(weights.items()), strict=True)
    mx.eval(out.parameters())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--ids", required=True, help="JSON list of token ids (kiln score --ids-only)")
    ap.add_argument("--reference", required=True, help="kiln's reference .lp (windows, BOS, positions)")
    ap.add_argument("--output", required=True)
    ap.add_argument("--weights", choices=["gguf", "mlx-q4g64"], default="gguf")
    ap.add_argument("--kernels", choices=["dense", "mlx"], default="dense")
    ap.add_argument("--max-windows", type=int, help="score only the first N windows")
    a = ap.parse_args()
    header = read_header(a.reference)
    if a.max_windows is not None:
        if a.max_windows < 1 or a.max_windows > header["windows"]:
            raise SystemExit(f"invalid --max-windows {a.max_windows}: accepted 1 to {header['windows']}")
        per_window = header["window"] - 1 - header["first_scored"]
        header = dict(header, windows=a.max_windows, positions=a.max_windows * per_window)
    with open(a.ids) as f:
        ids = json.load(f)
    model, args = load_gguf(a.gguf)
    if a.weights == "mlx-q4g64":
        model = dense(model, args)
        quantize_model(model, {}, None, None)
        mx.eval(model.parameters())
    if a.kernels == "dense":
        model = dense(model, args)
    scheme = f"mlx-lm-{a.weights}-{a.kernels}"
    out = Writer(a.output, header, f"mlx-lm ({a.weights}, {a.kernels} kernels) {a.gguf}", scheme)
    for seq in windows(header, ids):
        logits = model(mx.array(seq)[None])[0].astype(mx.float32)
        mx.eval(logits)
        out.window(seq, np.array(logits))
    print(json.dumps(out.close()))


if __name__ == "__main__":
    main()
