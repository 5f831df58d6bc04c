#!/usr/bin/env bash
# torch_graph's accuracy on CUDA (FP16), measured as on the CPU: `bench decode --partials` (the
# stream's decodes without real time) of the multilingual corpus with base and of the carried
# English utterances with tiny.en, with beam finals (the default) and greedy ones (`serve --beam
# 1`). The CPU runs to hold them against: bench/results/decode-multi-torch_graph-beam-vm.json
# (float32, 224 errors in 926 units; greedy: decode-multi-float32-greedy-vm.json, 252) and
# decode-gpu-subset-torch_graph-{beam,greedy}-vm.json (the English utterances carried, with
# `--device cpu --set engine.compute_type=float32`: 54 and 68 errors in 427 words).
# Results and logs in $OUT/accuracy.tgz, rewritten after every run.
R=/tmp/accuracy; mkdir -p $R
save() { tar czf "$OUT/accuracy.tgz" -C /tmp accuracy; }
t0=$(date +%s)
greedy=(--set stream.final_beam_size=1 --set stream.context_beam_size=1)
multi=(--manifest ../shared/speech-multi/manifest.jsonl --model base)
run() {  # name, bench decode options...
  local name=$1; shift
  echo "== $name at $(( $(date +%s) - t0 )) s"
  timeout 240 python3 -m captiond.cli bench decode --engine torch_graph --device cuda --partials \
    --out $R/$name "$@" > $R/$name.log 2>&1
  echo "rc=$?"; grep -v '^ ' $R/$name.log | tail -3; save
}
run multi-base "${multi[@]}"
run multi-base-greedy "${multi[@]}" "${greedy[@]}"
run utterance-tiny --clips utterance
run utterance-tiny-greedy --clips utterance "${greedy[@]}"
echo "== done at $(( $(date +%s) - t0 )) s"
