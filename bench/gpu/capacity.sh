#!/usr/bin/env bash
# `bench capacity` on CUDA, one level per run: MODEL:STREAMS[:BEAM] ... (default tiny.en:1000
# base:500 tiny.en:500; BEAM sets every final's beam, as `serve --beam`: 1 is greedy finals,
# which torch_graph gave every run before 2026-11-30), 6 front-end workers, 4 client processes,
# 60-s streams started within 10 s. The first run gets a 30-s py-spy profile of the engine
# process once its streams are all live.
# Results and logs in $OUT/capacity.tgz, rewritten after every run.
R=/tmp/capacity; mkdir -p $R
save() { tar czf "$OUT/capacity.tgz" -C /tmp capacity; }
t0=$(date +%s); first=1
for spec in ${*:-tiny.en:1000 base:500 tiny.en:500}; do
  IFS=: read -r model streams beam <<< "$spec"; name=${model}-${streams}${beam:+-beam$beam}
  beams=(); [ -n "$beam" ] && beams=(--set stream.final_beam_size=$beam --set stream.context_beam_size=$beam)
  echo "== $name at $(( $(date +%s) - t0 )) s"
  if [ $first = 1 ]; then
    ( sleep 50; pid=$(pgrep -o -f "^python3 -m captiond.cli bench capacity")
      py-spy record --nonblocking --format raw -r 50 -d 30 --threads -p "$pid" -o $R/pyspy-$name.txt ) > $R/pyspy.log 2>&1 &
  fi
  timeout 200 python3 -m captiond.cli bench capacity --engine torch_graph --device cuda \
    --model "$model" --workers 6 --client-procs 4 --streams "$streams" "${beams[@]}" \
    --out $R/$name > $R/$name.log 2>&1
  echo "rc=$?"; grep -v '^ ' $R/$name.log | tail -3; wait; save; first=0
done
echo "== done at $(( $(date +%s) - t0 )) s"
