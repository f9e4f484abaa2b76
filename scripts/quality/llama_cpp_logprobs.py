"""Per-position log-probabilities of a GGUF model under llama.cpp, in the format of
`kiln score`, so `cargo xtask bench-quality --compare llama.cpp=FILE` measures llama.cpp's
arithmetic against kiln's f32 reference on the same file, token ids and windows.

llama.cpp is not part of kiln: the script drives a llama.cpp build's shared library
through the ctypes bindings of the llama-cpp-python source release that matches it (only
its `llama_cpp/llama_cpp.py` and `_ctypes_extensions.py`, imported without the package's
high-level wrapper). Point it at them with `--bindings DIR` (the unpacked
llama_cpp_python-X.Y.Z directory) and `--lib DIR` (the directory holding libllama.so,
e.g. llama.cpp's build/bin). Each of kiln's windows (ids from `kiln score --ids-only`;
windows, BOS and scored positions copied from kiln's reference file) is one fresh
sequence in one `llama_decode` call with every position's logits requested, with
llama.cpp's defaults otherwise (f16 KV cache, its CPU kernels and their activation
quantization).

Usage:
    kiln score -m MODEL.gguf --text-file CORPUS --ids-only > ids.json
    python scripts/quality/llama_cpp_logprobs.py --bindings .../llama_cpp_python-0.3.36 \
        --lib .../llama.cpp/build/bin --gguf MODEL.gguf --ids ids.json \
        --reference DIR/m0-reference.lp --output DIR/llama-cpp.lp [--threads N]
"""

import argparse
import ctypes
import importlib
import json
import os
import sys
import types

import numpy as np

from kiln_lp import Writer, read_header, windows


def bindings(src, lib):
    """llama-cpp-python's low-level ctypes module, loading the library in `lib`."""
    if not os.path.isfile(os.path.join(src, "llama_cpp", "llama_cpp.py")):
        raise SystemExit(f"invalid --bindings {src}: no llama_cpp/llama_cpp.py under it")
    os.environ["LLAMA_CPP_LIB_PATH"] = lib
    # A bare package object, so importing the submodule skips the package's __init__
    # (which pulls in the high-level wrapper and its extra dependencies).
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [os.path.join(src, "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bindings", required=True, help="unpacked llama-cpp-python source release")
    ap.add_argument("--lib", required=True, help="directory holding the matching libllama.so")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--ids", required=True, help="JSON list of token ids (kiln score --ids-only)")
    ap.add_argument("--reference", required=True, help="kiln's reference .lp (windows, BOS, positions)")
    ap.add_argument("--output", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    header = read_header(a.reference)
    with open(a.ids) as f:
        ids = json.load(f)
    ll = bindings(a.bindings, a.lib)
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(a.gguf.encode(), mp)
    if not model:
        raise SystemExit(f"invalid --gguf {a.gguf}: llama.cpp could not load it")
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    if vocab != header["vocab"]:
        raise SystemExit(f"invalid --gguf {a.gguf}: vocabulary {vocab}, the reference has {header['vocab']}")
    window = header["window"]
    cp = ll.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = window
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = a.threads
    ctx = ll.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    batch = ll.llama_batch_init(window, 0, 1)
    name = f"llama.cpp {a.gguf}"
    out = Writer(a.output, header, name, "llama.cpp")
    for seq in windows(header, ids):
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        batch.n_tokens = len(seq)
        for i, t in enumerate(seq):
            batch.token[i] = t
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        rc = ll.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode failed with {rc}")
        ptr = ll.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(len(seq), vocab))
        out.window(seq, logits)
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    print(json.dumps(out.close()))


if __name__ == "__main__":
    main()
