#!/usr/bin/env bash
# Continue the MAR-style backbone from its shipped export on ONE GPU, distil the CSpD draft again from
# the result, then measure what CSpD needs: GenEval of the target and the per-step log ratio of the pair.
# About ten minutes; every budget scales with SCALE (see run.sh for the time-budget mechanism).
#
#   bash experiments/gpu_retrain/mar_continue.sh       # overwrites checkpoints/mar_shapes{,_draft}
#   PAIR=p2 bash experiments/gpu_retrain/mar_continue.sh   # the CPU-sized pair: checkpoints/mar_p2_shapes{,_draft}
#   SMOKE=1 bash experiments/gpu_retrain/mar_continue.sh   # a few steps on any device, own folders
set -u
PY=${PY:-python}
LOGS=${LOGS:-logs/mar_continue}
SCALE=${SCALE:-1}
SMOKE=${SMOKE:-0}
PAIR=${PAIR:-base}
if [ "$PAIR" = p2 ]; then
  TARGET=mar_p2_shapes; DRAFT=mar_p2_shapes_draft; TRAIN_EXP=train/mar_shapes_cpu; DRAFT_EXP=train/mar_draft_cpu
elif [ "$PAIR" = base ]; then
  TARGET=mar_shapes; DRAFT=mar_shapes_draft; TRAIN_EXP=train/mar_shapes; DRAFT_EXP=train/mar_draft
else
  echo "PAIR=$PAIR: expected base or p2" >&2; exit 2
fi
mkdir -p "$LOGS" && LOGS=$(cd "$LOGS" && pwd)
: > "$LOGS/status.txt"
CK=checkpoints
if [ "$SMOKE" = 1 ]; then
  CK="$LOGS/checkpoints" && mkdir -p "$CK" && cp -r checkpoints/kl_shapes checkpoints/$TARGET checkpoints/featnet_shapes "$CK/"
  [ -d checkpoints/$DRAFT ] && cp -r checkpoints/$DRAFT "$CK/"
  COMMON="paths.checkpoint_dir=$CK paths.data_dir=$LOGS/data trainer=cpu logger=csv trainer.max_steps=3 trainer.val_check_interval=3 ++trainer.limit_val_batches=1"
  TOK="data.shard_size=64 data.train_shards=1 data.encode_batch=32"
  EVAL="paths.checkpoint_dir=$CK benchmark.geneval.prompts_per_task=1 benchmark.geneval.samples_per_prompt=1 decoding.fn.num_iter=2"
  budget() { echo "callbacks.time_budget.seconds=null"; }
  DEV=cpu
else
  COMMON="trainer=gpu logger=csv callbacks.progress.refresh_rate=500 trainer.max_steps=100000"
  TOK="data.train_shards=8 data.render_workers=12 data.batch_size=128"
  EVAL="benchmark.geneval.prompts_per_task=12"
  budget() { echo "callbacks.time_budget.seconds=$(( $1 * SCALE ))"; }
  DEV=cuda
fi

job() {  # job <name> <module> <overrides...>
  local name=$1 mod=$2; shift 2
  local t0=$(date +%s)
  $PY -m "$mod" "$@" hydra.run.dir="$LOGS/$name" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$LOGS/status.txt"
  return $rc
}

DRAFT_INIT=""
[ -d "$CK/$DRAFT" ] && DRAFT_INIT="init_from=$CK/$DRAFT"  # the first p2 draft starts from scratch
job latents specgen.train experiment=$TRAIN_EXP $TOK $COMMON prepare_only=true || exit 1
job mar specgen.train experiment=$TRAIN_EXP $TOK $COMMON init_from=$CK/$TARGET module.lr=6e-4 \
  module.warmup_steps=200 $(budget 330) || exit 1
job draft specgen.train experiment=$DRAFT_EXP $TOK $COMMON $DRAFT_INIT module.warmup_steps=100 \
  $(budget 120) || exit 1
job geneval specgen.eval experiment=eval/mar_shapes generator.backbone_dir=$CK/$TARGET generator.device=$DEV logger=csv $EVAL
$PY -m specgen.analysis.cspd_trace --backbone $CK/$TARGET --draft $CK/$DRAFT --out "$LOGS/trace" \
  > "$LOGS/trace.log" 2>&1; echo "trace rc=$?" | tee -a "$LOGS/status.txt"
echo "all jobs finished" | tee -a "$LOGS/status.txt"
