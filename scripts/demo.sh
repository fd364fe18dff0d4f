#!/usr/bin/env bash
# The main job end to end on an embedded default: generate a tiny DeepSeek-V3-shaped Quark MXFP4
# checkpoint, convert it (preshuffle, CK MoE, TP 2), verify it against the source, run the reference
# forward on both and compare the logits (identical bit for bit), revert it and verify the round
# trip. Output under ./out/demo (removed and rebuilt each run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
PREP=.venv/bin/prep
D=out/demo
rm -rf "$D"
mkdir -p "$D"
$PY scripts/make_tiny_deepseek.py "$D/source" --variant v2
$PREP inspect "$D/source"
$PREP convert "$D/source" -o "$D/preshuffle-tp2" --layout preshuffle --moe-layout ck --tp 2
$PREP inspect "$D/preshuffle-tp2"
$PREP verify "$D/preshuffle-tp2" --source "$D/source"
$PREP compare "$D/source" "$D/preshuffle-tp2" --prompt-ids 0,17,42,99,512,1000,7,3
$PREP run "$D/preshuffle-tp2" --prompt-ids 0,17,42,99 --save-logits "$D/logits.safetensors"
$PREP revert "$D/preshuffle-tp2" -o "$D/reverted"
$PREP verify "$D/preshuffle-tp2" --source "$D/reverted"
echo "demo ok: $D"
