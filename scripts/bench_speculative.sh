#!/bin/bash
# Interleaved classic / speculative bench-decode runs on a prompt the model must repeat;
# one JSON line per run, tagged with its mode and repetition. Usage:
#   scripts/bench_speculative.sh OUT.jsonl MODEL...   (KILN=path/to/kiln, default target/release/kiln)
K=${KILN:-target/release/kiln}
P="Repeat this text exactly, twice. Text: the kiln was built into the side of the hill, where the clay came out of the ground already damp. Repeat: the kiln was built into the side of the hill, where the clay came out of the ground already damp. Repeat: the kiln was built into the side of the hill, where"
OUT=$1; shift
for model in "$@"; do
  for rep in 1 2 3; do
    for mode in classic 2 4; do
      extra=""; [ $mode != classic ] && extra="--speculative --draft-tokens $mode"
      $K bench-decode -m $model -p "$P" -n 128 --warmup-tokens 8 --threads 2 $extra 2>/dev/null \
        | python3 -c "import json,sys; j=json.load(sys.stdin); j['mode']='$mode'; j['rep']=$rep; print(json.dumps(j))" >> $OUT
    done
  done
done
