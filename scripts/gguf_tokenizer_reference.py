"""Reference token ids for a GGUF file's tokenizer, built with llama.cpp's `gguf` reader
and Hugging Face's `tokenizers`, independently of kiln's Rust rebuild: compare them with
`kiln score -m FILE.gguf --text-file TEXT --ids-only`.

Usage (pinned packages of scripts/fixtures/requirements.txt):
    .venv/bin/python scripts/gguf_tokenizer_reference.py FILE.gguf TEXT > ids.json

Supports what SmolLM2's GGUF needs: `tokenizer.ggml.model = gpt2` with the `smollm`
pre-tokenizer (SmolLM2's tokenizer.json: every digit split off, then GPT-2's byte-level
split). Anything else is refused by name.
"""

import json
import sys

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


def field(r: gguf.GGUFReader, key: str):
    f = r.fields[key]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [int(f.parts[i][0]) for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]][0]


def main() -> None:
    path, text_path = sys.argv[1], sys.argv[2]
    r = gguf.GGUFReader(path)
    model, pre = field(r, "tokenizer.ggml.model"), field(r, "tokenizer.ggml.pre")
    if (model, pre) != ("gpt2", "smollm"):
        sys.exit(f"unsupported tokenizer {model}/{pre}: this reference knows gpt2/smollm")
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    text = open(text_path, encoding="utf-8").read()
    print(json.dumps(tok.encode(text, add_special_tokens=False).ids))


if __name__ == "__main__":
    main()
