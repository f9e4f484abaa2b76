"""Reading and writing kiln's log-probability files (the format of `kiln score`,
docs/engine-protocol.md), shared by the scripts that score another engine on kiln's
windows: `KILNLP01`, a little-endian u32 header length, the JSON header, then per scored
position the next token's id (u32) and the log-softmax over the vocabulary (f32 each).
"""

import json
import os
import struct

import numpy as np

MAGIC = b"KILNLP01"


def read_header(path):
    """The JSON header of a kiln log-probability file (the windows to copy)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if f.read(8) != MAGIC or size < 12:
            raise SystemExit(f"invalid --reference {path}: not a kiln score file")
        (n,) = struct.unpack("<I", f.read(4))
        # The length comes from the file: checked against its size before reading.
        if n > size - 12:
            raise SystemExit(
                f"invalid --reference {path}: the header claims {n} bytes, the file has {size - 12} after its first 12"
            )
        return json.loads(f.read(n))


def windows(header, ids):
    """Each window's token ids, as `kiln score` cut them: BOS (if any) then the body."""
    window, bos = header["window"], header["bos"]
    body = window - (bos is not None)
    if len(ids) < header["windows"] * body:
        raise SystemExit(
            f"invalid --ids: {len(ids)} tokens, fewer than the reference's "
            f"{header['windows']} windows of {body}"
        )
    for wi in range(header["windows"]):
        yield ([bos] if bos is not None else []) + ids[wi * body : (wi + 1) * body]


class Writer:
    """Writes a log-probability file with the reference's header (model and scheme
    renamed) and accumulates the next-token negative log-likelihood."""

    def __init__(self, path, header, model, scheme):
        self.out = open(path, "wb")
        blob = json.dumps(dict(header, model=model, act_precision=scheme)).encode()
        self.out.write(MAGIC + struct.pack("<I", len(blob)) + blob)
        self.first = header["first_scored"]
        self.nll, self.count = 0.0, 0

    def window(self, seq, logits):
        """Writes the scored positions of one window from its logits (positions x vocab)."""
        lg = np.asarray(logits, dtype=np.float64)[self.first : len(seq) - 1]
        mx = lg.max(axis=1, keepdims=True)
        lp = (lg - (mx + np.log(np.exp(lg - mx).sum(axis=1, keepdims=True)))).astype(np.float32)
        for row, target in zip(lp, seq[self.first + 1 :]):
            self.nll -= float(row[target])
            self.count += 1
            self.out.write(struct.pack("<I", target))
            self.out.write(row.tobytes())

    def close(self):
        """Closes the file and returns the summary line's fields."""
        self.out.close()
        return {"positions": self.count, "perplexity": float(np.exp(self.nll / self.count))}
