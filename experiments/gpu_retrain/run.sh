#!/usr/bin/env bash
# Retrain every shipped model of the embedded world except the VQ tokenizer on ONE GPU, in about
# ten minutes: the models are small, so independent jobs share the GPU as parallel processes, and
# each run fits its step count into a wall-clock budget (callbacks.time_budget, see
# specgen/modules/callbacks.py; the steps a run chose are in its exported metrics.json).
#
#   bash experiments/gpu_retrain/run.sh            # writes checkpoints/<name>/, logs under $LOGS
#   SCALE=2 bash experiments/gpu_retrain/run.sh    # twice the time for every budget
#   SMOKE=1 bash experiments/gpu_retrain/run.sh    # a few steps per job on any device (tests the chain)
#
# Dependency graph (-> runs after, || runs beside):
#   VQ token shards -> [ AR backbone -> teacher shards -> (f_phi || 1D-MTP heads) ] || AR draft model
#   KL tokenizer -> KL latent shards -> MAR backbone -> MAR draft
#   feature net (FID) || CLIP (CLIPScore)
set -u
PY=${PY:-python}
LOGS=${LOGS:-logs/gpu_retrain}
SCALE=${SCALE:-1}
SMOKE=${SMOKE:-0}
mkdir -p "$LOGS" && LOGS=$(cd "$LOGS" && pwd)
: > "$LOGS/status.txt"

if [ "$SMOKE" = 1 ]; then  # own checkpoint and data folders: the shipped models stay untouched
  mkdir -p "$LOGS/checkpoints" && cp -r checkpoints/vq_shapes "$LOGS/checkpoints/"
  COMMON="paths.checkpoint_dir=$LOGS/checkpoints paths.data_dir=$LOGS/data trainer=cpu logger=csv trainer.max_steps=3 trainer.val_check_interval=3 ++trainer.limit_val_batches=1"
  TOK="data.shard_size=64 data.train_shards=1 data.encode_batch=32"
  DIST="data.shard_size=8 data.train_shards=1 data.sample_batch=8 data.batch_size=4"
  IMG="data.val_size=8 data.batch_size=8"
  VAL="callbacks.val_geneval.prompts_per_task=1 callbacks.val_geneval.samples=1"
else
  COMMON="trainer=gpu logger=csv callbacks.progress.refresh_rate=500 trainer.max_steps=100000"
  TOK="data.train_shards=16 data.render_workers=6 data.batch_size=128"
  DIST="data.train_shards=16 data.sample_batch=512 data.batch_size=64"
  IMG="data.num_workers=4"
  VAL=""
fi

budget() { [ "$SMOKE" = 1 ] && echo "callbacks.time_budget.seconds=null" || \
  echo "callbacks.time_budget.seconds=$(( $1 * SCALE ))"; }

job() {  # job <name> <overrides...>: one training run, its log and exit status
  local name=$1; shift
  local t0=$(date +%s)
  $PY -m specgen.train "$@" $COMMON hydra.run.dir="$LOGS/$name" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$LOGS/status.txt"
  return $rc
}

discrete() {
  job ar_tokens experiment=train/ar_shapes $TOK prepare_only=true || return
  job ar_draft experiment=train/ar_shapes_draft $TOK $(budget 240) &
  job ar_backbone experiment=train/ar_shapes $TOK $VAL $(budget 300) || { wait; return 1; }
  job teacher experiment=train/fphi_shapes $DIST prepare_only=true || { wait; return 1; }
  job fphi experiment=train/fphi_shapes $DIST $(budget 90) &
  job mtp experiment=train/mtp_shapes $DIST $(budget 90) &
  wait
}

continuous() {
  job kl experiment=train/kl_shapes $IMG data.batch_size=64 $(budget 80) || return
  job mar_latents experiment=train/mar_shapes $TOK prepare_only=true || return
  job mar_backbone experiment=train/mar_shapes $TOK $(budget 250) || return
  job mar_draft experiment=train/mar_draft $TOK $(budget 80)
}

evaluation_nets() {
  job featnet experiment=train/featnet_shapes $IMG data.batch_size=128 $(budget 120) &
  job clip experiment=train/clip_shapes $IMG data.batch_size=256 $(budget 200) &
  wait
}

discrete & continuous & evaluation_nets &
wait
echo "all jobs finished" | tee -a "$LOGS/status.txt"
