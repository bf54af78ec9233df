#!/usr/bin/env bash
# Run named benchmark/check steps on the GPU machine in one call, each with its own time limit,
# its full log under $OUT/<step>.log and its JSON/plots under $OUT; prints a short summary per step.
#
#     PYTHONPATH=src bash benchmarks/device_steps.sh train-quick ring-quick fp8-accuracy ...
#
# Steps: warm-train, warm-train-quick, train, train-quick, train-extras, decode(-quick), paged, decode-fp8(-quick), ring(-quick), fp8-accuracy, prefill-fp8(-quick),
# tune-fp8, tune-splits, tune-decode-small, tune-decode-unsplit, tune-paged-configs, tune-paged-shift, tune-paged-ab, tune-paged-pdl, tune-decode-merged, tune-decode-wave, tune-paged-wave, tune-paged-w2, tune-paged-b1, tune-paged-mid, tune-decode-long (POINTS, SPLITS, CONFIGS), decode-long-ab (POINTS, ROUNDS, ONLY), warp-split-probe (POINTS, CONFIGS, ROUNDS, LAYOUTS), sanitize-warp-split, read-ceiling, read-sizes (POINTS), decode-timeline (POINTS), pipe-probe, gluon-check-fp8-d256c, prefill-quick, e2e-quick, e2e, e2e-decode-ab (ROUNDS, NEW_TOKENS, BATCH), window-probe (ROUNDS, CHECK_ONLY), sanitize-window, window-train (ROUNDS, CHECK_ONLY), window-varlen (ROUNDS, CHECK_ONLY), sanitize-window-varlen, varlen-bwd (ROUNDS, CHECK_ONLY, NAME), varlen-host (ROUNDS, NAME, THRESHOLD, THRESHOLD_ONLY), sanitize-varlen-host, varlen-bwd-host, varlen-gap (ROUNDS, NAME, RAGGED), sanitize-varlen-bwd, varlen-gluon-check, sanitize-varlen-gluon, varlen-gather (ROUNDS, LONG), fp8-pool-gather (ROUNDS), varlen-decode (ROUNDS, CHECK_ONLY, NO_CHECK, MIXED, MIXED_ONLY, MAX_QUERIES, POINTS), sanitize-varlen-decode, e4m3-rows-probe, work-list (ROUNDS, CHECK_ONLY, ROUTES, MIXED_ONLY), sanitize-work-list, window-tiles (ROUNDS, CHECK_ONLY), sanitize-window-tiles, sanitize-window-train, sanitize-quick, sanitize-decode, sanitize-gluon, gluon-check(-fp8, -16bit), gluon-bwd-check(-only), gluon-bwd-sanitize, train-profile, train-cprofile, sanitize-gluon-pq, gluon-ab, gluon-ab-lazy, gluon-ab-poly(-d64, -b), gluon-ab-pq-d64, gluon-check-poly, gluon-ab-prmt, gluon-check-pack, sanitize-gluon-pack, gluon-check-skip, gluon-ab-skip, sanitize-gluon-skip, gluon-ab-poly-d256, gluon-check-pq-d64, gluon-ab-fp8-c256, gluon-check-fp8-c256, gluon-check-pvec, gluon-ab-pvec, sanitize-gluon-poly, gluon-check-lazy, sanitize-gluon-lazy, gluon-ab-d64, gluon-ab-d256, gluon-ab-order(2), gluon-ab-own(-heads), gluon-ab-group, gluon-check-own, gluon-check-d64, gluon-check-fp8-causal, sanitize-gluon-own, gluon-check-snake, sanitize-gluon-snake, launch-check, prefill-host, fp8-host, fp8-compile, sanitize-fp8-host, decode-host, paged-gap(-t16, -t16-b1(-wide), -base: BASELINE=an older gluon_decode.py, POINTS), gluon-decode-correct-rows, fp8-decode-ab(-tiles, -splits, -short, -b16, -b1, -vregs: CONFIGS, POINTS, -paged: POINTS, PAGES, ROUNDS, SQ), chunked-prefill (POINTS, CONFIGS, PAGES, ONLY, NO_CHECK), chunked-prefill-check, sanitize-chunked-prefill, paged-boxes (POINTS, PAGES, BOXES, STAGES, HEAD_DIM, FULL), short-queries (POINTS), eager-key-counts, merge-share (POINTS, ROUNDS), stream-decode (POINTS, ROUNDS), sanitize-stream-decode, fp8-query-check, fp8-query-ab (POINTS, ROUNDS), sanitize-fp8-query, spec-decode-ab (SQ, POINTS, CONFIGS, PAGED_CONFIGS, BF16_CONFIGS, BF16_PAGED_CONFIGS, BASELINE, ONLY), gluon-decode-correct-fp8, gluon-decode-correct-vregs (E4M3_PLAN), decode-fp8-rounds, decode-fp8-layout, decode-probe(-paged, -fp8(-warps, -plan), -bf16-w2(-ab, -ab2, -unsplit), -unsplit-tiles, -wave-w2, -b64, -fp8-mid, -mid-pairs, -mid-plan, -trigger, -combine(-warps)), gluon-debug, ncu-decode, ncu-decode-pair (PAIR), ncu-gluon, fuzz-gpu (SEED, SECONDS_FUZZ, FAMILY), sinks-cost (ROUNDS, KINDS), sanitize-sinks-cost (KINDS), sanitize-sinks, out-into (ROUNDS), softcap-check (ROUNDS, CHECK_ONLY), sanitize-softcap, softcap-ab (ROUNDS, HEAD_DIMS), softcap-train (ROUNDS, CHECK_ONLY), sanitize-softcap-train, wide-rows-check (CASES, CONFIG), varlen-bounds, kvcache-bounds. Set STEP_LIMIT (seconds) to change
# the per-step limit (default 240). Everything lands in $OUT/results.tgz (results-<pid>.tgz when an earlier run
# of this script in the same call left one there; the device tool brings back
# only a few files per call).
set -u
FINAL=${OUT:-/tmp/flashtile-out}
OUT=$(mktemp -d)
mkdir -p "$FINAL"
# A second run into the same $OUT in one device call keeps the first one's results (results-<pid>.tgz).
TARBALL=results.tgz
[ -e "$FINAL/$TARBALL" ] && TARBALL=results-$$.tgz
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src}
LIMIT=${STEP_LIMIT:-240}
SANITIZER=(compute-sanitizer --tool memcheck --target-processes application-only --print-limit 20)

command_for() {
    case $1 in
        warm-train) echo "python benchmarks/warm_cache.py train --workers 15" ;;
        warm-train-quick) echo "python benchmarks/warm_cache.py train --quick --workers 15" ;;
        train) echo "python -m flashtile bench train --out $OUT" ;;
        train-quick) echo "python -m flashtile bench train --quick --out $OUT" ;;
        train-extras) echo "python -c \"import torch, flashtile.bench.check as c; c.run_training_extras(torch.device('cuda'))\"" ;;
        decode) echo "python -m flashtile bench decode --out $OUT" ;;
        decode-quick) echo "python -m flashtile bench decode --quick --out $OUT" ;;
        paged) echo "python -m flashtile bench paged --out $OUT" ;;
        decode-fp8) echo "python -m flashtile bench decode-fp8 --out $OUT" ;;
        decode-fp8-quick) echo "python -m flashtile bench decode-fp8 --quick --out $OUT" ;;
        ring-quick) echo "python -m flashtile bench ring --quick --out $OUT" ;;
        ring) echo "python -m flashtile bench ring --out $OUT" ;;
        fp8-accuracy) echo "python -m flashtile bench fp8-accuracy --out $OUT" ;;
        fuzz-gpu) echo "python benchmarks/fuzz_gpu.py --out $OUT --seed ${SEED:-1} --seconds ${SECONDS_FUZZ:-230} ${FAMILY:+--family $FAMILY}" ;;
        wide-rows-check) echo "python benchmarks/wide_rows_check.py ${CASES:+'$CASES'} ${CONFIG:+--config '$CONFIG'}" ;;
        prefill-fp8-quick) echo "python -m flashtile bench prefill --dtype fp8 --quick --out $OUT" ;;
        prefill-fp8) echo "python -m flashtile bench prefill --dtype fp8 --out $OUT" ;;
        tune-fp8) echo "python benchmarks/tune_fp8.py --out $OUT --dims 64,128,256" ;;
        tune-fp8-128) echo "python benchmarks/tune_fp8.py --out $OUT --dims 128 --seqlens 4096,16384" ;;
        tune-splits) echo "python benchmarks/tune_decode.py --out $OUT --workers 2 --points '16,12,2,4096,0;16,12,2,32768,0;16,32,8,1024,0;1,32,8,4096,0;1,32,8,32768,0;1,12,2,32768,16' --split-counts 2,4,6,8,12,16,24,32,48,64,66,128" ;;
        tune-decode-small) echo "python benchmarks/tune_decode.py --out $OUT --workers 8 --points '16,32,8,1024,0;16,32,8,4096,0;16,12,2,1024,0;16,12,2,4096,0;1,32,8,4096,0;1,32,8,32768,0' --split-counts 1,2,4,8,16,32 --configs '64,4,4,1;64,4,3,1;128,4,2,1;32,4,6,1'" ;;
        tune-decode-unsplit) echo "python benchmarks/tune_decode.py --out $OUT --workers 8 --points '16,32,8,1024,0;16,32,8,4096,0;16,32,8,16384,0;64,32,8,1024,0;64,32,8,4096,0;64,12,2,1024,0;64,12,2,4096,0;64,12,2,32768,0' --split-counts 1,2 --configs '64,4,4,1;64,4,5,1;64,8,4,1;128,4,3,1;128,8,3,1;64,4,4,0'" ;;
        gluon-check-fp8-d256c) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 280 --only d256-fp8-causal-n64-s2-ws-persistent-snake" ;;
        tune-paged-shift) echo "python benchmarks/tune_decode.py --out $OUT --workers 12 --points '1,32,8,16384,16;1,32,8,32768,16;1,32,8,32768,0;1,12,2,32768,16;1,12,2,32768,0;64,12,2,16384,16;64,12,2,16384,0;16,32,8,32768,16' --split-counts 0 --configs '32,4,4,0;32,4,4,1;64,4,3,0;64,4,3,1;64,4,4,0;128,4,2,0;128,4,3,0;32,4,6,0'" ;;
        tune-paged-ab) echo "python benchmarks/tune_decode.py --out $OUT --workers 4 --points '1,32,8,16384,16;1,32,8,32768,16;1,12,2,16384,16;1,12,2,32768,16;16,12,2,1024,16;16,12,2,4096,16;16,12,2,16384,16;64,12,2,16384,16' --split-counts 0 --configs '64,4,3,0;128,4,2,0;64,4,3,0;128,4,2,0'" ;;
        tune-paged-pdl) echo "python benchmarks/tune_decode.py --out $OUT --workers 4 --points '1,32,8,4096,16;1,32,8,16384,16;1,32,8,32768,16;1,32,8,65536,16;1,12,2,16384,16;1,12,2,32768,16;16,12,2,1024,16;16,12,2,4096,16;16,32,8,4096,16' --split-counts 0 --configs '128,4,2,1;128,4,2,0;128,4,2,1'" ;;
        tune-decode-merged) echo "python benchmarks/tune_decode.py --out $OUT --workers 6 --points '16,32,8,1024,0;16,32,8,4096,0;1,32,8,32768,0;1,32,8,65536,0;16,12,2,65536,0' --split-counts 1,2,16,33,48,66 --configs '32,4,4,1;64,4,4,1;64,4,3,1'" ;;
        tune-decode-wave) echo "python benchmarks/tune_decode.py --out $OUT --workers 4 --points '1,32,8,32768,0;1,32,8,131072,0;2,32,8,32768,0;4,32,8,16384,0;4,32,8,65536,0;16,12,2,16384,0;16,12,2,65536,0' --split-counts 0 --configs '32,4,4,1;64,4,4,1'" ;;
        tune-paged-wave) echo "python benchmarks/tune_decode.py --out $OUT --workers 4 --points '1,32,8,32768,16;1,32,8,65536,16;16,12,2,16384,16;16,12,2,65536,16' --split-counts 16,4 --configs '64,4,4,0;64,4,4,1;128,4,2,0'" ;;
        tune-paged-w2) echo "python benchmarks/tune_decode.py --out $OUT --workers 4 --points '1,32,8,16384,16;1,32,8,32768,16;1,12,2,16384,16;1,12,2,32768,16;16,32,8,16384,16;16,12,2,4096,16;16,12,2,16384,16;64,12,2,16384,16' --split-counts 0 --configs '128,4,2,0;32,2,3,0;64,2,3,0;64,2,2,0;32,2,4,0;128,4,2,0'" ;;
        tune-paged-b1) echo "python benchmarks/tune_decode.py --out $OUT --workers 4 --points '1,12,2,16384,16;1,12,2,32768,16;1,12,2,65536,16;1,32,8,16384,16;1,32,8,32768,16' --split-counts 32,64,128 --configs '128,4,2,0;64,4,3,0;32,2,3,0'" ;;
        tune-paged-mid) echo "python benchmarks/tune_decode.py --out $OUT --workers 4 --points '12,32,8,16384,16;48,12,2,16384,16;24,32,8,16384,16;20,32,8,4096,16;10,32,8,4096,16' --split-counts 1,2,3,4 --configs '128,4,2,0;32,4,4,0'" ;;
        tune-paged-configs) echo "python benchmarks/tune_decode.py --out $OUT --workers 12 --points '1,32,8,16384,16;1,32,8,32768,16;1,32,8,32768,0;16,32,8,16384,16;16,32,8,32768,16;16,32,8,32768,0;64,32,8,16384,16;64,32,8,16384,0;16,12,2,32768,16;16,12,2,32768,0;1,12,2,32768,16;1,12,2,32768,0' --split-counts 1 --configs '32,4,4,1;32,4,4,0;64,4,3,1;64,4,4,1;64,4,4,0;128,4,3,0;128,4,2,0;128,4,2,1'" ;;
        tune-decode-long) echo "python benchmarks/tune_decode.py --out $OUT --workers 8 --points '${POINTS:-16,32,8,16384,0;16,32,8,65536,0;16,32,8,131072,0;64,12,2,131072,0;16,12,2,65536,0}' --split-counts ${SPLITS:-1,2,3,4} --configs '${CONFIGS:-64,4,4,1;64,4,3,1;32,4,4,1;32,2,3,1;128,4,2,1}'" ;;
        warp-split-probe) echo "python benchmarks/warp_split_probe.py --out $OUT --rounds ${ROUNDS:-10} ${POINTS:+--points '$POINTS'} ${CONFIGS+--configs '$CONFIGS'} ${LAYOUTS:+--layouts}" ;;
        sanitize-warp-split) echo "${SANITIZER[*]} python benchmarks/warp_split_probe.py --shipped-cases" ;;
        decode-long-ab) echo "python benchmarks/decode_long_ab.py --out $OUT --rounds ${ROUNDS:-10} ${POINTS:+--points '$POINTS'} ${ONLY:+--only '$ONLY'} ${NO_CHECK:+--no-check}" ;;
        read-sizes) echo "python benchmarks/read_sizes.py --out $OUT ${POINTS:+--points '$POINTS'}" ;;
        decode-timeline) echo "python benchmarks/decode_timeline.py --out $OUT ${POINTS:+--points '$POINTS'}" ;;
        pipe-probe) echo "python benchmarks/pipe_probe.py --out $OUT" ;;
        read-ceiling) echo "python -c \"import torch; from flashtile.bench.decode import measure_ceiling, ceiling_line; m = measure_ceiling(torch.device('cuda')); print(ceiling_line(m)); [print(r) for r in m['read_configs']]\"" ;;
        prefill) echo "python -m flashtile bench prefill --out $OUT" ;;
        prefill-quick) echo "python -m flashtile bench prefill --quick --out $OUT" ;;
        e2e-quick) echo "python -m flashtile bench e2e --quick --out $OUT" ;;
        e2e) echo "python -m flashtile bench e2e --out $OUT" ;;
        window-probe) echo "python benchmarks/window_probe.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${CHECK_ONLY:+--check-only}" ;;
        window-train) echo "python benchmarks/window_probe.py --train --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${CHECK_ONLY:+--check-only}" ;;
        window-varlen) echo "python benchmarks/window_probe.py --varlen --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${CHECK_ONLY:+--check-only}" ;;
        sanitize-window-varlen) echo "${SANITIZER[*]} python benchmarks/window_probe.py --varlen --check-only" ;;
        varlen-bwd) echo "python benchmarks/varlen_bwd.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${CHECK_ONLY:+--check-only} ${NAME:+--name $NAME}" ;;
        varlen-host) echo "python benchmarks/varlen_host.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${NAME:+--name $NAME} ${THRESHOLD:+--threshold} ${THRESHOLD_ONLY:+--threshold-only $THRESHOLD_ONLY}" ;;
        varlen-gap) echo "python benchmarks/varlen_gap.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${NAME:+--name $NAME} ${RAGGED:+--ragged}" ;;
        varlen-bwd-host) echo "python benchmarks/varlen_bwd_host.py" ;;
        sanitize-varlen-host) echo "${SANITIZER[*]} python benchmarks/varlen_host.py --bitwise-only" ;;
        sanitize-varlen-bwd) echo "${SANITIZER[*]} python benchmarks/varlen_bwd.py --small" ;;
        window-tiles) echo "python benchmarks/window_tiles.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${CHECK_ONLY:+--check-only}" ;;
        sanitize-window-tiles) echo "${SANITIZER[*]} python benchmarks/window_tiles.py --check-only" ;;
        sanitize-window-train) echo "${SANITIZER[*]} python benchmarks/window_probe.py --train --check-only --max-len 3000" ;;
        sanitize-window) echo "${SANITIZER[*]} python benchmarks/window_probe.py --check-only --max-len 3000" ;;
        e2e-decode-ab) echo "python benchmarks/e2e_decode_ab.py ${ROUNDS:-8} ${NEW_TOKENS:-128} ${BATCH:-1}" ;;
        sanitize-quick) echo "${SANITIZER[*]} python benchmarks/sanitize.py --quick" ;;
        sanitize-gluon) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only" ;;
        varlen-decode) echo "python benchmarks/varlen_decode.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${CHECK_ONLY:+--check-only} ${NO_CHECK:+--no-checks} ${MIXED:+--mixed} ${MIXED_ONLY:+--mixed-only} ${MAX_QUERIES:+--max-queries $MAX_QUERIES} ${POINTS:+--points '$POINTS'}" ;;
        work-list) echo "python benchmarks/work_list.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${CHECK_ONLY:+--check-only} ${ROUTES:+--routes} ${MIXED_ONLY:+--mixed-only}" ;;
        sanitize-work-list) echo "${SANITIZER[*]} python benchmarks/work_list.py --small" ;;
        sanitize-varlen-decode) echo "${SANITIZER[*]} python benchmarks/varlen_decode.py --small" ;;
        e4m3-rows-probe) echo "python benchmarks/e4m3_rows_probe.py" ;;
        sinks-cost) echo "python benchmarks/sinks_cost.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${KINDS:+--kinds $KINDS}" ;;
        sanitize-sinks-cost) echo "${SANITIZER[*]} python benchmarks/sinks_cost.py --check-only --out $OUT ${KINDS:+--kinds $KINDS}" ;;
        out-into) echo "python benchmarks/out_into.py --out $OUT ${ROUNDS:+--rounds $ROUNDS}" ;;
        softcap-check) echo "python benchmarks/softcap_check.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${CHECK_ONLY:+--check-only}" ;;
        sanitize-softcap) echo "${SANITIZER[*]} python benchmarks/softcap_check.py --check-only --out $OUT" ;;
        softcap-train) echo "python benchmarks/softcap_train.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${CHECK_ONLY:+--check-only}" ;;
        sanitize-softcap-train) echo "${SANITIZER[*]} python benchmarks/softcap_train.py --small --out $OUT" ;;
        softcap-ab) echo "python benchmarks/softcap_ab.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${HEAD_DIMS:+--head-dims $HEAD_DIMS}" ;;
        sanitize-sinks) echo "${SANITIZER[*]} python benchmarks/fuzz_gpu.py --family sinks --scale 0.05 --seconds ${SECONDS_FUZZ:-60} --seed ${SEED:-5} --out $OUT" ;;
        fp8-pool-gather) echo "python benchmarks/fp8_pool_gather.py --out $OUT ${ROUNDS:+--rounds $ROUNDS}" ;;
        varlen-gluon-check) echo "python benchmarks/varlen_gluon.py --check --out $OUT" ;;
        sanitize-varlen-gluon) echo "${SANITIZER[*]} python benchmarks/varlen_gluon.py --check --small" ;;
        varlen-gather) echo "python benchmarks/varlen_gather.py --out $OUT ${ROUNDS:+--rounds $ROUNDS} ${LONG:+--long}" ;;
        varlen-bounds) echo "${SANITIZER[*]} python benchmarks/varlen_bounds.py" ;;
        kvcache-bounds) echo "${SANITIZER[*]} python benchmarks/kvcache_bounds.py" ;;
        sanitize-gluon-fp8) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only --only=fp8" ;;
        gluon-bwd-check-only) echo "python benchmarks/gluon_bwd_check.py --out $OUT --phase check" ;;
        gluon-bwd-check) echo "python benchmarks/gluon_bwd_check.py --out $OUT" ;;
        gluon-bwd-sanitize) echo "${SANITIZER[*]} python benchmarks/gluon_bwd_check.py --phase check --small --out $OUT" ;;
        train-profile) echo "python benchmarks/train_profile.py --out $OUT" ;;
        train-cprofile) echo "python benchmarks/train_profile.py --cprofile --points 1,512,16,16,128,1" ;;
        sanitize-gluon-pq) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only --only=pq" ;;
        gluon-ab) echo "python benchmarks/gluon_ab.py --out $OUT --group gluon-d128-bf16-full-n128-s2-ws-pingpong,gluon-d128-bf16-full-n128-s2-ws-pingpong-persistent,gluon-d128-bf16-full-n128-s2-ws-pingpong-persistent-pq --group gluon-d128-fp8-causal-n128-s3-ws-persistent-joint,gluon-d128-fp8-causal-n128-s3-ws-persistent,gluon-d128-fp8-causal-n128-s2-ws-persistent,gluon-d128-fp8-causal-n128-s3-ws-persistent-joint-pq --group gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent,gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-pq --group gluon-d128-fp8-full-n256-s2-ws-p1,gluon-d128-fp8-full-n256-s2-ws-persistent-p1-pq" ;;
        gluon-ab-poly-d64) echo "python benchmarks/gluon_ab.py --out $OUT --heads 32 --group gluon-d64-bf16-full-n128-s3-ws-persistent-c3,gluon-d64-bf16-full-n128-s3-ws-persistent-c3-poly1,gluon-d64-bf16-full-n128-s3-ws-persistent-c3-poly2,gluon-d64-bf16-full-n128-s3-ws-persistent-c3-poly3 --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3-poly2,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3-poly3 && cp $OUT/gluon-ab.json $OUT/gluon-ab-poly-d64.json" ;;
        gluon-ab-poly) echo "python benchmarks/gluon_ab.py --out $OUT --group gluon-d128-fp8-full-n256-s2-ws-p1,gluon-d128-fp8-full-n256-s2-ws-p1-poly2,gluon-d128-fp8-full-n256-s2-ws-p1-poly3 --group gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint,gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint-poly2,gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint-poly3 --group gluon-d128-bf16-full-n128-s2-ws-pingpong-persistent-pq-lazy,gluon-d128-bf16-full-n128-s2-ws-pingpong-persistent-pq-lazy-poly2 --group gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake-lazy" ;;
        gluon-ab-poly-b) echo "python benchmarks/gluon_ab.py --out $OUT --group gluon-d128-fp8-full-n256-s2-ws-p1,gluon-d128-fp8-full-n256-s2-ws-p1-poly1,gluon-d128-fp8-full-n256-s2-ws-p1-poly2 --group gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint,gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint-poly1,gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint-poly2 --group gluon-d128-bf16-full-n128-s2-ws-pingpong-persistent-pq-lazy --group gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake-lazy && cp $OUT/gluon-ab.json $OUT/gluon-ab-poly-b.json" ;;
        gluon-ab-pq-d64) echo "python benchmarks/gluon_ab.py --out $OUT --heads 32 --group gluon-d64-bf16-full-n128-s3-ws-persistent-c3,gluon-d64-bf16-full-n128-s3-ws-persistent-pq-c3 --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-pq-c3 && cp $OUT/gluon-ab.json $OUT/gluon-ab-pq-d64.json" ;;
        sanitize-gluon-poly) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only --only=fp8-full-n256-s2-ws-p1-poly2,fp8-causal-n128-s3-ws-persistent-snake-joint-poly1,bf16-causal-n128-s3-ws-persistent-snake-own-pq-c3" ;;
        gluon-ab-fp8-c256) echo "python benchmarks/gluon_ab.py --out $OUT --group gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint-poly1,gluon-d128-fp8-causal-n256-s2-ws-persistent-snake-p1-poly2,gluon-d128-fp8-causal-n256-s2-ws-p1-poly2 && cp $OUT/gluon-ab.json $OUT/gluon-ab-fp8-c256.json" ;;
        gluon-check-pvec) echo "python benchmarks/gluon_check.py --out $OUT --phase check --only=-pvec && cp $OUT/gluon-check-check.json $OUT/gluon-check-pvec.json" ;;
        gluon-ab-pvec) echo "python benchmarks/gluon_ab.py --out $OUT --rounds 7 --group gluon-d128-fp8-full-n256-s2-ws-p1-poly2,gluon-d128-fp8-full-n256-s2-ws-p1-poly2-pvec4,gluon-d128-fp8-full-n256-s2-ws-p1-poly2-pvec16 --group gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint-poly1,gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint-poly1-pvec4,gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint-poly1-pvec16 && cp $OUT/gluon-ab.json $OUT/gluon-ab-pvec.json" ;;
        gluon-check-fp8-c256) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 300 --only=fp8-causal-n256" ;;
        gluon-ab-poly-d256) echo "python benchmarks/gluon_ab.py --out $OUT --heads 8 --group gluon-d256-fp8-full-n64-s2-ws-p1,gluon-d256-fp8-full-n64-s2-ws-p1-poly1,gluon-d256-fp8-full-n64-s2-ws-p1-poly2 --group gluon-d256-fp8-causal-n64-s2-ws-persistent-snake,gluon-d256-fp8-causal-n64-s2-ws-persistent-snake-poly1,gluon-d256-fp8-causal-n64-s2-ws-persistent-snake-poly2 && cp $OUT/gluon-ab.json $OUT/gluon-ab-poly-d256.json" ;;
        gluon-check-pq-d64) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 300 --only=-own-pq-c3,d256-fp8-full-n64-s2-ws-p1-poly,d256-fp8-causal-n64-s2-ws-persistent-snake-poly" ;;
        gluon-ab-prmt) echo "python benchmarks/gluon_ab.py --out $OUT --group gluon-d64-bf16-full-n128-s3-ws-persistent-c3,gluon-d64-bf16-full-n128-s3-ws-persistent-c3-prmt --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-pq-c3,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-pq-c3-prmt --group gluon-d128-bf16-full-n128-s2-ws-pingpong-persistent-pq-lazy,gluon-d128-bf16-full-n128-s2-ws-pingpong-persistent-pq-lazy-prmt --group gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake-lazy,gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake-lazy-prmt --group gluon-d256-bf16-full-n64-s2-ws-pingpong-persistent-lazy,gluon-d256-bf16-full-n64-s2-ws-pingpong-persistent-lazy-prmt --group gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent-snake-lazy,gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent-snake-lazy-prmt && cp $OUT/gluon-ab.json $OUT/gluon-ab-prmt.json" ;;
        gluon-check-pack) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 330 --only='bf16-full-n128-s3-ws-persistent-c3$,bf16-causal-n128-s3-ws-persistent-snake-own-pq-c3$,bf16-full-n128-s2-ws-pingpong-persistent-pq-lazy$,bf16-causal-n128-s2-ws-pingpong-persistent-snake-lazy$,bf16-full-n64-s2-ws-pingpong-persistent-lazy$,bf16-causal-n64-s2-ws-pingpong-persistent-snake-lazy$,fp16-causal-n128-s3-ws-persistent-snake-own-pq-c3$,fp16-full-n128-s2-ws-pingpong-persistent-pq-lazy$'" ;;
        sanitize-gluon-pack) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only --only='bf16-full-n128-s3-ws-persistent-c3$,bf16-causal-n128-s3-ws-persistent-snake-own-pq-c3$,bf16-full-n128-s2-ws-pingpong-persistent-pq-lazy$,bf16-causal-n128-s2-ws-pingpong-persistent-snake-lazy$,bf16-full-n64-s2-ws-pingpong-persistent-lazy$,bf16-causal-n64-s2-ws-pingpong-persistent-snake-lazy$,fp16-full-n128-s2-ws-pingpong-persistent-pq-lazy$'" ;;
        gluon-check-skip) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 200 --only='-own-pq-c3$'" ;;
        gluon-ab-skip) echo "python benchmarks/gluon_ab.py --out $OUT --heads 32 --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-pq-c3,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-allrows-pq-c3 && cp $OUT/gluon-ab.json $OUT/gluon-ab-skip.json" ;;
        sanitize-gluon-skip) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only --only='-own-pq-c3$'" ;;
        gluon-check-poly) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 400 --only=-poly,-pq-c3" ;;
        gluon-ab-lazy) echo "python benchmarks/gluon_ab.py --out $OUT --group gluon-d128-bf16-full-n128-s2-ws-pingpong-persistent-pq,gluon-d128-bf16-full-n128-s2-ws-pingpong-persistent-pq-lazy --group gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake,gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake-lazy --group gluon-d256-bf16-full-n64-s2-ws-pingpong-persistent,gluon-d256-bf16-full-n64-s2-ws-pingpong-persistent-lazy --group gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent-snake,gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent-snake-lazy --group gluon-d64-bf16-full-n128-s3-ws-persistent-c3,gluon-d64-bf16-full-n128-s3-ws-persistent-c3-lazy --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3-lazy" ;;
        gluon-check-lazy) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 250 --only=-full-n128-s2-ws-pingpong-persistent-pq-lazy,-causal-n128-s2-ws-pingpong-persistent-snake-lazy,-full-n64-s2-ws-pingpong-persistent-lazy,-causal-n64-s2-ws-pingpong-persistent-snake-lazy" ;;
        sanitize-gluon-lazy) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only --only=bf16-full-n128-s2-ws-pingpong-persistent-pq-lazy,bf16-causal-n128-s2-ws-pingpong-persistent-snake-lazy,bf16-full-n64-s2-ws-pingpong-persistent-lazy,bf16-causal-n64-s2-ws-pingpong-persistent-snake-lazy" ;;
        gluon-ab-d64) echo "python benchmarks/gluon_ab.py --out $OUT --group gluon-d64-bf16-full-n128-s3-ws-pingpong-persistent,gluon-d64-bf16-full-n128-s3-ws-persistent-c3 --group gluon-d64-bf16-causal-n128-s3-ws-pingpong-persistent,gluon-d64-bf16-causal-n128-s3-ws-persistent-c3" ;;
        gluon-ab-d256) echo "python benchmarks/gluon_ab.py --out $OUT --group gluon-d256-bf16-full-n64-s2-ws-pingpong,gluon-d256-bf16-full-n64-s2-ws-pingpong-persistent --group gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent,gluon-d256-bf16-causal-n64-s2-ws-pingpong --group gluon-d256-fp8-causal-n64-s2-ws-persistent" ;;
        gluon-ab-order) echo "python benchmarks/gluon_ab.py --out $OUT --seqlens 1024,2048,4096,8192,16384 --group gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake@blocks,gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake@heads,gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent@blocks,gluon-d128-bf16-causal-n128-s2-ws-pingpong@blocks,gluon-d128-bf16-causal-n128-s2-ws-pingpong@heads --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-c3@blocks,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-c3@heads,gluon-d64-bf16-causal-n128-s3-ws-persistent-c3@blocks --group gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent-snake@blocks,gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent-snake@heads,gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent@blocks,gluon-d256-bf16-causal-n64-s2-ws-pingpong@blocks" ;;
        gluon-ab-order2) echo "python benchmarks/gluon_ab.py --out $OUT --seqlens 1024,2048,4096,8192,16384 --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-c3@blocks,gluon-d64-bf16-causal-n128-s3-ws-pingpong-persistent-snake@blocks,gluon-d64-bf16-causal-n128-s3-ws-pingpong-persistent-snake@heads --group gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint@blocks,gluon-d128-fp8-causal-n128-s3-ws-persistent-snake-joint@heads --group gluon-d256-fp8-causal-n64-s2-ws-persistent-snake@blocks,gluon-d256-fp8-causal-n64-s2-ws-persistent-snake@heads" ;;
        gluon-ab-own) echo "python benchmarks/gluon_ab.py --out $OUT --seqlens 1024,2048,4096,8192,16384 --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-c3,gluon-d64-bf16-causal-n128-s3-ws-pingpong-persistent-snake" ;;
        gluon-ab-own-heads) echo "python benchmarks/gluon_ab.py --out $OUT --heads 32 --seqlens 1024,2048,4096,8192 --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3@blocks,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3@heads" ;;
        gluon-ab-group) echo "python benchmarks/gluon_ab.py --out $OUT --heads 32 --seqlens 2048,4096,8192 --group gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3@blocks,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3@g16,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3@g22,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3@g32,gluon-d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3@g64 --group gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake@blocks,gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake@heads,gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake@g8,gluon-d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake@g16" ;;
        gluon-check-group) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 200 --only d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3,d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake" ;;
        gluon-check-d64) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 200 --only d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3,d64-fp16-causal-n128-s3-ws-persistent-snake-own-c3" ;;
        gluon-check-fp8-causal) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 300 --only d128-fp8-causal-n128-s3-ws-persistent-snake-joint,d256-fp8-causal-n64-s2-ws-persistent-snake" ;;
        gluon-check-own) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 200 --only d64-bf16-causal-n128-s3-ws-persistent-snake-own-c3,d64-fp16-causal-n128-s3-ws-persistent-snake-own-c3" ;;
        sanitize-gluon-own) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only --only=snake-own-c3" ;;
        gluon-check-snake) echo "python benchmarks/gluon_check.py --out $OUT --check-limit 290 --only d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake,d64-bf16-causal-n128-s3-ws-persistent-snake-c3,d256-bf16-causal-n64-s2-ws-pingpong-persistent-snake,d128-fp8-causal-n128-s3-ws-persistent-snake-joint,d256-fp8-causal-n64-s2-ws-persistent-snake" ;;
        sanitize-gluon-snake) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only --only=d256-bf16-full-n64-s2-ws-pingpong-persistent,d128-bf16-causal-n128-s2-ws-pingpong-persistent-snake" ;;
        launch-check) echo "python benchmarks/launch_check.py --out $OUT" ;;
        gluon-check) echo "python benchmarks/gluon_check.py --out $OUT" ;;
        gluon-check-fp8) echo "python benchmarks/gluon_check.py --only fp8 --out $OUT" ;;
        gluon-check-16bit) echo "python benchmarks/gluon_check.py --only 16- --out $OUT" ;;
        sanitize-fp8-query) echo "${SANITIZER[*]} python benchmarks/sanitize.py --fp8-query-only" ;;
        sanitize-decode) echo "${SANITIZER[*]} python benchmarks/sanitize.py --decode-only" ;;
        prefill-host) echo "python benchmarks/prefill_host.py --out $OUT" ;;
        fp8-host) echo "python benchmarks/fp8_host.py --out $OUT --profile" ;;
        fp8-compile) echo "python benchmarks/fp8_compile.py --out $OUT" ;;
        sanitize-fp8-host) echo "${SANITIZER[*]} python benchmarks/fp8_host.py --check-only" ;;
        decode-host) echo "python benchmarks/decode_host.py --out $OUT" ;;
        ncu-decode) echo "python benchmarks/ncu_decode.py --all" ;;
        ncu-decode-pair) echo "python benchmarks/ncu_decode.py --pair ${PAIR:-b16-128k b16-128k-2d}" ;;
        ncu-gluon) echo "python benchmarks/ncu_gluon.py --all" ;;
        decode-fp8-rounds) echo "python benchmarks/decode_fp8_rounds.py --out $OUT" ;;
        decode-fp8-layout) echo "python benchmarks/decode_fp8_layout.py --out $OUT" ;;
        ncu-decode-source) echo "python benchmarks/ncu_decode.py --source ${CASE:-fp8-12-2} $OUT" ;;
        ncu-gluon-source) echo "python benchmarks/ncu_gluon.py --source ${NCU_CASE:-fp8-full-n256-s2-ws-p1-poly2} $OUT && mv $OUT/ncu-source.csv $OUT/ncu-source-${NCU_CASE:-fp8-full-n256-s2-ws-p1-poly2}.csv" ;;
        gluon-debug) echo "python benchmarks/gluon_debug.py --out $OUT" ;;
        gluon-decode-check) echo "python benchmarks/gluon_decode_check.py --out $OUT" ;;
        gluon-decode-check-quick) echo "python benchmarks/gluon_decode_check.py --quick --out $OUT" ;;
        gluon-decode-correct) echo "python benchmarks/gluon_decode_check.py --no-timing --out $OUT" ;;
        gluon-decode-tune2) echo "python benchmarks/gluon_decode_check.py --skip-check --contiguous --out $OUT --points '20,32,8,4096;24,32,8,16384;16,32,8,1024;1,32,8,4096;1,12,2,4096;1,32,8,1024' --variants '64,3,2,1,1;64,3,4,1,1;64,4,1,1,1;32,4,2,1,1;64,4,2,1,1'" ;;
        gluon-ab-qr) echo "python benchmarks/gluon_ab.py --out $OUT --heads 8 --group gluon-d256-bf16-full-n64-s2-ws-pingpong-persistent-lazy,gluon-d256-bf16-full-n64-s2-ws-pingpong-persistent-lazy-qr128 --group gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent-snake-lazy,gluon-d256-bf16-causal-n64-s2-ws-pingpong-persistent-snake-lazy-qr128 && cp $OUT/gluon-ab.json $OUT/gluon-ab-qr.json" ;;
        gluon-check-qr) echo "python benchmarks/gluon_check.py --out $OUT --only=qr128" ;;
        sanitize-gluon-qr) echo "${SANITIZER[*]} python benchmarks/sanitize.py --gluon-only --only=qr128" ;;
        gluon-decode-tune3) echo "python benchmarks/gluon_decode_check.py --skip-check --out $OUT --points '1,12,2,16384;1,12,2,32768;1,12,2,131072;16,12,2,16384;16,12,2,65536;64,12,2,32768' --variants '64,3,2,1,1;64,2,4,1,1;32,4,2,1,1;32,3,4,1,1'" ;;
        gluon-decode-tune) echo "python benchmarks/gluon_decode_check.py --skip-check --out $OUT --points '64,12,2,131072;64,12,2,16384;64,32,8,1024;16,32,8,32768;16,12,2,16384;1,12,2,16384;64,32,8,4096' --variants '64,4,1,1,1;64,6,1,1,1;64,3,2,1,1;32,4,2,1,1;32,6,2,1,1;128,3,1,1,1'" ;;
        decode-probe) echo "python benchmarks/decode_probe.py --out $OUT" ;;
        decode-probe-paged) echo "python benchmarks/decode_probe.py --mode paged --out $OUT" ;;
        decode-probe-fp8) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT" ;;
        decode-probe-fp8-warps) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '16,32,8,32768;1,32,8,32768;16,32,8,4096;64,12,2,16384;16,32,8,1024' --fp8-configs 'e4m3:128,4,3,1;e4m3:32,1,4,4;e4m3:32,1,4,8;e4m3:32,1,3,8;e4m3:64,2,3,2;e4m3:64,2,3,4;e4m3:16,1,4,8;bf16:64,4,4,1;bf16:32,1,4,4;bf16:16,1,4,4;bf16:16,1,4,8'" ;;
        decode-probe-fp8-plan) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '16,32,8,32768;1,32,8,32768;1,12,2,32768;16,32,8,4096;64,12,2,16384;64,32,8,16384;16,12,2,4096' --fp8-configs 'e4m3:128,4,3,0;e4m3:64,2,3,0,4;e4m3:64,2,3,0,2;e4m3:64,2,3,0,3;e4m3:64,2,4,0,4;e4m3:64,2,2,0,4;e4m3:32,2,4,0,4;e4m3:128,4,3,0'" ;;
        decode-probe-bf16-w2) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '16,32,8,1024;16,12,2,4096;16,12,2,1024;1,12,2,32768;1,32,8,4096;1,32,8,1024;16,32,8,4096' --fp8-configs 'bf16:32,2,4,0,4;bf16:32,2,3,0,4;bf16:32,2,4,0,3;e4m3:128,4,3,0'" ;;
        decode-probe-bf16-w2-ab) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '1,32,8,1024;1,32,8,4096;1,32,8,16384;1,12,2,4096;1,12,2,32768;16,12,2,1024;16,12,2,4096;4,32,8,4096;64,32,8,4096' --fp8-configs 'bf16:32,2,3,0,4,128;bf16:32,2,3,0,4,64;bf16:32,2,3,0,4,256;bf16:32,4,4,0,0,128'" ;;
        decode-probe-bf16-w2-ab2) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '1,32,8,1024;1,32,8,4096;1,32,8,16384;1,12,2,4096;1,12,2,32768;16,12,2,1024;16,12,2,4096;4,32,8,4096;64,32,8,4096;2,32,8,8192;8,12,2,2048' --fp8-configs 'bf16:32,2,3,0,0,128;bf16:32,4,4,0,0,128;bf16:32,2,3,0,0,128;bf16:32,4,4,0,0,128'" ;;
        decode-probe-bf16-w2-unsplit) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '16,32,8,1024;16,32,8,4096;64,12,2,1024;64,12,2,4096' --fp8-configs 'bf16:64,4,4,1;bf16:32,2,3,1;bf16:32,2,4,1;bf16:32,2,3,2;bf16:32,2,4,2;bf16:64,4,4,1'" ;;
        decode-probe-unsplit-tiles) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '16,32,8,1024;64,12,2,1024;16,32,8,2048' --fp8-configs 'bf16:64,4,4,1;bf16:128,4,2,1;bf16:64,8,4,1;bf16:32,4,4,1;bf16:128,8,2,1;bf16:64,4,3,1;bf16:32,4,6,1;bf16:64,4,4,1'" ;;
        decode-probe-wave-w2) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '1,32,8,32768;1,32,8,65536;1,32,8,131072;4,32,8,16384;4,32,8,65536;16,12,2,16384;16,12,2,65536' --fp8-configs 'bf16:32,2,3,0,0,128;bf16:32,2,3,0,4,128;bf16:32,2,4,0,4,128;bf16:32,2,4,0,2,128;bf16:64,4,4,0,1,128'" ;;
        decode-probe-b64) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '64,32,8,4096;64,32,8,16384;64,32,8,131072;64,12,2,1024;32,32,8,16384' --fp8-configs 'bf16:64,4,4,1;bf16:32,4,4,1;bf16:64,4,3,1;bf16:64,4,2,1;bf16:128,4,2,1;bf16:32,2,4,1;bf16:64,8,4,1;e4m3:64,2,3,0,2,64'" ;;
        decode-probe-fp8-mid) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '32,32,8,16384;24,32,8,16384;32,32,8,4096;128,12,2,16384' --fp8-configs 'e4m3:64,2,3,3;e4m3:64,2,3,2'" ;;
        decode-probe-mid-pairs) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '24,32,8,16384;20,32,8,16384;32,32,8,16384;48,12,2,16384;24,32,8,4096' --fp8-configs 'bf16:32,2,3,1;bf16:32,2,3,2;bf16:32,2,3,3;bf16:32,2,3,4;bf16:32,2,3,1'" ;;
        decode-probe-mid-plan) echo "python benchmarks/decode_probe.py --mode fp8 --out $OUT --points '12,32,8,16384;48,12,2,16384;24,32,8,16384;20,32,8,4096;10,32,8,4096;40,12,2,4096' --fp8-configs 'bf16:32,2,3,0;bf16:32,2,3,0'" ;;
        fp8-decode-ab) echo "python benchmarks/fp8_decode_ab.py --out $OUT" ;;
        fp8-decode-ab-splits) echo "python benchmarks/fp8_decode_ab.py --out $OUT --points '64,32,8,16384;64,32,8,32768;64,32,8,131072;16,32,8,16384;16,12,2,16384;16,12,2,32768' --configs '64,2,3,3;64,2,3,2;64,4,2,2;64,2,3,6;64,2,3,0'" ;;
        fp8-decode-ab-short) echo "python benchmarks/fp8_decode_ab.py --out $OUT --points '64,32,8,1024;64,32,8,2048;64,32,8,4096;128,32,8,4096;50,32,8,16384;128,32,8,16384' --configs '64,4,2,1'" ;;
        fp8-decode-ab-b16) echo "python benchmarks/fp8_decode_ab.py --out $OUT --points '16,12,2,16384;16,12,2,32768' --configs '64,4,2,8;64,4,2,4;64,2,3,8;64,2,3,16;64,2,3,24'" ;;
        fp8-decode-ab-b1) echo "python benchmarks/fp8_decode_ab.py --out $OUT --points '1,32,8,32768;1,32,8,131072;1,12,2,32768;1,12,2,131072' --configs '64,2,3,16;64,2,3,24;64,2,3,33;64,2,3,66;64,4,2,16;64,4,2,33'" ;;
        fp8-decode-ab-paged) echo "python benchmarks/fp8_decode_ab.py --out $OUT --rounds ${ROUNDS:-4} --points '${POINTS:-1,32,8,32768;16,12,2,16384;16,32,8,32768;64,32,8,16384}' --pages ${PAGES:-16} ${SQ:+--seqlen-q $SQ}" ;;
        fp8-decode-ab-tiles) echo "python benchmarks/fp8_decode_ab.py --out $OUT --configs '64,2,3;64,3,2;128,2,1'" ;;
        gluon-decode-correct-vregs) echo "python benchmarks/gluon_decode_check.py --no-timing --fp8-only --e4m3-plan ${E4M3_PLAN:-4,3,1} --out $OUT" ;;
        fp8-decode-ab-vregs) echo "python benchmarks/fp8_decode_ab.py --out $OUT --points '${POINTS:-1,32,8,32768;1,12,2,32768;16,12,2,16384;16,32,8,32768;64,32,8,16384;64,12,2,16384;16,32,8,4096;1,32,8,131072}' --configs '${CONFIGS:-64,2,3,0,0;64,2,3,0,1;64,4,3,0,1;64,3,3,0,1}' ${BASELINE:+--baseline $BASELINE}" ;;
        spec-decode-ab) echo "python benchmarks/spec_decode_ab.py --out $OUT --seqlen-q ${SQ:-8} ${POINTS:+--points '$POINTS'} ${CONFIGS:+--e4m3-configs '$CONFIGS'} ${PAGED_CONFIGS:+--e4m3-paged-configs '$PAGED_CONFIGS'} ${BF16_CONFIGS:+--bf16-configs '$BF16_CONFIGS'} ${BF16_PAGED_CONFIGS:+--bf16-paged-configs '$BF16_PAGED_CONFIGS'} ${BASELINE:+--baseline $BASELINE} ${ONLY:+--only '$ONLY'} ${NO_CHECK:+--no-check}" ;;
        fp8-query-check) echo "python -c \"import torch; from flashtile.bench import decode_fp8 as d; r = d.run_check(torch.device('cuda')); print(sum(x['passed'] for x in r), 'of', len(r), 'passed')\"" ;;
        fp8-query-ab) echo "python benchmarks/fp8_query_ab.py --out $OUT ${POINTS:+--points '$POINTS'} ${ROUNDS:+--rounds $ROUNDS}" ;;
        chunked-prefill) echo "python benchmarks/chunked_prefill.py --out $OUT ${POINTS:+--points '$POINTS'} ${CONFIGS:+--configs '$CONFIGS'} ${PAGES:+--pages '$PAGES'} ${ONLY:+--only '$ONLY'} ${NO_CHECK:+--no-check}" ;;
        paged-boxes) echo "python benchmarks/paged_boxes.py --out $OUT ${POINTS:+--points '$POINTS'} ${PAGES:+--pages $PAGES} ${BOXES:+--boxes $BOXES} ${STAGES:+--stages $STAGES} ${HEAD_DIM:+--head-dim $HEAD_DIM} ${FULL:+--full}" ;;
        eager-key-counts) echo "python benchmarks/eager_key_counts.py" ;;
        merge-share) echo "python benchmarks/merge_share.py --out $OUT ${POINTS:+--points '$POINTS'} ${ROUNDS:+--rounds $ROUNDS}" ;;
        stream-decode) echo "python benchmarks/stream_decode.py --out $OUT ${POINTS:+--points '$POINTS'} ${ROUNDS:+--rounds $ROUNDS}" ;;
        sanitize-stream-decode) echo "${SANITIZER[*]} python benchmarks/stream_decode.py --small" ;;
        short-queries) echo "python benchmarks/short_queries.py --out $OUT ${POINTS:+--points '$POINTS'}" ;;
        chunked-prefill-check) echo "python benchmarks/chunked_prefill.py --out $OUT --check-only" ;;
        sanitize-chunked-prefill) echo "${SANITIZER[*]} python benchmarks/chunked_prefill.py --out $OUT --check-only --small" ;;
        gluon-decode-correct-fp8) echo "python benchmarks/gluon_decode_check.py --no-timing --fp8-only --out $OUT" ;;
        gluon-decode-correct-rows) echo "python benchmarks/gluon_decode_check.py --no-timing --rows-consumer --out $OUT" ;;
        paged-gap-t16) echo "python benchmarks/paged_gap.py --out $OUT --rounds 6 --points '1,12,2,32768;16,12,2,32768;64,12,2,16384;1,32,8,32768;16,32,8,16384' --transposed '64,3,2;64,2,3;64,4,1'" ;;
        paged-gap-t16-b1) echo "python benchmarks/paged_gap.py --out $OUT --rounds 6 --points '1,12,2,16384;1,12,2,65536;1,12,2,131072' --transposed '64,3,2;64,4,1;64,2,3;64,3,1'" ;;
        paged-gap-t16-b1-wide) echo "python benchmarks/paged_gap.py --out $OUT --rounds 6 --points '1,12,2,16384;1,12,2,32768;1,12,2,131072;1,32,8,16384;1,32,8,32768;1,32,8,65536;1,32,8,131072' --transposed '64,3,1;64,4,1;64,3,2'" ;;
        paged-gap) echo "python benchmarks/paged_gap.py --out $OUT" ;;
        paged-gap-base) echo "python benchmarks/paged_gap.py --out $OUT --rounds 6 --baseline $BASELINE --points '${POINTS:-1,12,2,16384;1,12,2,131072;1,32,8,32768;1,12,2,32768;16,12,2,32768;64,12,2,16384;16,32,8,16384}'" ;;
        decode-probe-combine) echo "python benchmarks/decode_probe.py --mode combine ${BASELINE:+--baseline $BASELINE} --out $OUT" ;;
        decode-probe-combine-warps) echo "python benchmarks/decode_probe.py --mode combine --warps 1,2,4 --out $OUT" ;;
        decode-probe-trigger) echo "python benchmarks/decode_probe.py --mode trigger --out $OUT" ;;
        *) return 1 ;;
    esac
}

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
status=0
for step in "$@"; do
    cmd=$(command_for "$step") || { echo "unknown step $step"; status=1; continue; }
    start=$(date +%s)
    eval "timeout $LIMIT $cmd" > "$OUT/$step.log" 2>&1
    rc=$?
    echo "=== $step rc=$rc $(( $(date +%s) - start ))s: $cmd"
    tail -n "${TAIL_LINES:-12}" "$OUT/$step.log"
    [ $rc -eq 0 ] || status=1
    # packed after every step, so a call that runs out of time still returns the steps it finished
    tar czf "$FINAL/$TARBALL.part" -C "$OUT" . && mv "$FINAL/$TARBALL.part" "$FINAL/$TARBALL"
done
exit $status
