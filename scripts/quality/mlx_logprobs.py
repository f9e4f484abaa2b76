"""Per-position log-probabilities of a GGUF llama model with mlx-lm, in the format of
`kiln score`, so `cargo xtask bench-quality --compare NAME=FILE` can measure mlx-lm's
arithmetic against kiln's f32 reference on the same weights and the same windows.

mlx reads the GGUF's Q4_0/Q4_1/Q8_0 tensors as MLX affine groups of 32 (the same exact
mapping kiln uses); llama.cpp's permutation of the Q and K rows is undone as kiln undoes
it; the windows, BOS and scored positions are copied from kiln's reference file, and the
token ids come from `kiln score --ids-only` on the same text, so both engines score
exactly the same positions.

Usage (pinned packages of scripts/fixtures/requirements.txt):
    kiln score -m MODEL.gguf --text-file CORPUS --ids-only > ids.json
    .venv/bin/python scripts/quality/mlx_logprobs.py --gguf MODEL.gguf --ids ids.json \
        --reference DIR/m0-reference.lp --output DIR/mlx.lp [--dtype f32|f16]

`--dtype f32` (the default) widens the f16 scales, biases and norms to f32 (exact), so
mlx-lm runs its 4-bit kernels with f32 activations; `--dtype f16` keeps them as stored,
as mlx-lm runs the file by default.
"""

import argparse
import json
import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

MAGIC = b"KILNLP01"
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


def load(path, dtype):
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
            a = a.astype(mx.float32 if dtype == "f32" else a.dtype)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--ids", required=True, help="JSON list of token ids (kiln score --ids-only)")
    ap.add_argument("--reference", required=True, help="kiln's reference .lp (windows, BOS, positions)")
    ap.add_argument("--output", required=True)
    ap.add_argument("--dtype", choices=["f32", "f16"], default="f32")
    a = ap.parse_args()
    with open(a.reference, "rb") as f:
        if f.read(8) != MAGIC:
            raise SystemExit(f"invalid --reference {a.reference}: not a kiln score file")
        (n,) = struct.unpack("<I", f.read(4))
        header = json.loads(f.read(n))
    ids = json.load(open(a.ids))
    model, args = load(a.gguf, a.dtype)
    window, first, windows, bos = header["window"], header["first_scored"], header["windows"], header["bos"]
    body = window - (bos is not None)
    out_header = dict(header, model=f"mlx-lm ({a.dtype}) {a.gguf}", act_precision=f"mlx-lm-{a.dtype}")
    blob = json.dumps(out_header).encode()
    nll, count = 0.0, 0
    with open(a.output, "wb") as out:
        out.write(MAGIC + struct.pack("<I", len(blob)) + blob)
        for wi in range(windows):
            seq = ([bos] if bos is not None else []) + ids[wi * body : (wi + 1) * body]
            logits = model(mx.array(seq)[None])[0].astype(mx.float32)
            mx.eval(logits)
            lg = np.array(logits, dtype=np.float64)
            for pos in range(first, window - 1):
                row = lg[pos]
                lse = row.max() + np.log(np.exp(row - row.max()).sum())
                lp = (row - lse).astype(np.float32)
                target = seq[pos + 1]
                nll -= float(lp[target])
                count += 1
                out.write(struct.pack("<I", target))
                out.write(lp.tobytes())
    print(json.dumps({"positions": count, "perplexity": float(np.exp(nll / count))}))


if __name__ == "__main__":
    main()
