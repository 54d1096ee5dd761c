#!/bin/bash
# The output of every offline tool over every shipped config, one file per command, to compare two commits byte for
# byte (a refactor must leave them identical):
#   bash benchmarks/tool_outputs.sh /tmp/after      # in the repo root, .venv active; ~10-25 min on 2 cores
#   diff -r /tmp/before /tmp/after
# Hub model ids are not fetched (HF_HUB_OFFLINE=1): those estimates stop at the same error line on both sides.
# `configs generate` last: it must find nothing to change.
out=$1; mkdir -p $out
export HF_HUB_OFFLINE=1  # Hub model configs are not on this machine: fail fast, the same way before and after
fsdp-recipes ls > $out/ls.txt 2>&1; echo "rc $?" >> $out/ls.txt
fsdp-recipes ls --check > $out/ls_check.txt 2>&1; echo "rc $?" >> $out/ls_check.txt
for f in accelerate_configs/*.yaml; do
  [ "$(basename $f)" = topologies.yaml ] && continue
  n=$(basename $f .yaml)
  fsdp-recipes validate-config $f > $out/validate_$n.txt 2>&1; echo "rc $?" >> $out/validate_$n.txt
  for m in benchmarks/llama_1b.json benchmarks/qwen3_moe_small.json; do
    mn=$(basename $m .json)
    fsdp-recipes estimate --model $m --accelerate-config $f > $out/est_${n}_$mn.txt 2>&1; echo "rc $?" >> $out/est_${n}_$mn.txt
    fsdp-recipes estimate --model $m --accelerate-config $f --json > $out/estj_${n}_$mn.txt 2>&1; echo "rc $?" >> $out/estj_${n}_$mn.txt
  done
done
for r in recipes/configs/*/*.yaml; do
  n=$(echo $r | tr / _)
  acc=$(head -5 $r | grep -o 'accelerate_configs/[a-z0-9_]*\.yaml' | head -1)
  [ -z "$acc" ] && continue
  fsdp-recipes estimate --recipe-config $r --accelerate-config $acc > $out/rest_$n.txt 2>&1; echo "rc $?" >> $out/rest_$n.txt
done
fsdp-recipes configs generate > $out/configs_generate.txt 2>&1; git status --short accelerate_configs >> $out/configs_generate.txt
