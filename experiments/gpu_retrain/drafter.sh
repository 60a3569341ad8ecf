#!/usr/bin/env bash
# f_phi distilled for acceptance on ONE GPU, inside a fixed wall-clock deadline:
#   1. speed of AR against SSD on the GPU (batch 1 and 16, the default drafter): wall and pass ratios side by side;
#   2. teacher samples at the decoding CFG (the paper's self-distillation; data.stream=true caches the tokens, the
#      training module's frozen backbone recomputes the states per batch), as many shards as fit its time;
#   3. three drafters trained side by side on them, from the shipped `fphi_accept`, each fitting its steps into the
#      time left (callbacks.time_budget): the default recipe (`fphi_gpu`), rollout 2 for the first row's chain
#      (`fphi_gpu_r2`), and the acceptance itself as the guided loss (`fphi_gpu_tv`).
#
#   bash experiments/gpu_retrain/drafter.sh                 # checkpoints/fphi_gpu*/, logs under $LOGS
#   DEADLINE=900 bash experiments/gpu_retrain/drafter.sh    # seconds for the whole script (default 540)
#   SMOKE=1 bash experiments/gpu_retrain/drafter.sh         # a few steps of each stage on the CPU (checks the chain)
#   INIT=fphi_gpu SHARDS=24 bash experiments/gpu_retrain/drafter.sh   # continue the shipped drafter on 24 shards
# Teacher shards already in data/distill are used as they are, the stage samples only the missing ones: shards
# sampled on the CPU (`python -m specgen.train experiment=train/fphi_cpu prepare_only=true data.train_shards=24`, about 5
# minutes and 0.8 MB a shard of 2048) and carried to the GPU machine leave its time to the training steps.
set -u
PY=${PY:-python}
LOGS=${LOGS:-logs/gpu_drafter}
SMOKE=${SMOKE:-0}
DEADLINE=${DEADLINE:-540}
INIT=${INIT:-fphi_accept}  # the drafter the three runs start from (a folder under checkpoints/)
T0=$(date +%s)
mkdir -p "$LOGS" && LOGS=$(cd "$LOGS" && pwd)
: > "$LOGS/status.txt"
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }

if [ "$SMOKE" = 1 ]; then  # own checkpoint and data folders: the shipped models stay untouched
  mkdir -p "$LOGS/checkpoints" && cp -r checkpoints/ar_shapes checkpoints/vq_shapes checkpoints/fphi_accept checkpoints/fphi_gpu "$LOGS/checkpoints/"
  DATA_DIR=$LOGS/data
  PATHS="paths.checkpoint_dir=$LOGS/checkpoints paths.data_dir=$DATA_DIR"
  COMMON="$PATHS trainer=cpu logger=csv trainer.max_steps=3 trainer.val_check_interval=3 ++trainer.limit_val_batches=1"
  DATA="data.train_source=samples data.stream=true data.shard_size=4 data.sample_batch=4 data.batch_size=2"
  SHARDS=2
  SPEED="generator.device=cpu speed.num_prompts=1 speed.batch_sizes=[1,2] speed.min_batches=1 speed.entropy_prompts=1"
  TEACHER_TIME=600 STATE_BATCH=2 SPEED_TIME=600  # CPU stages: limits far above their times (no deadline)
else
  DATA_DIR=data
  PATHS=""
  COMMON="trainer=gpu logger=csv callbacks.progress.refresh_rate=500 trainer.max_steps=100000"
  DATA="data.train_source=samples data.stream=true data.shard_size=2048 data.sample_batch=2048 data.batch_size=64"
  SHARDS=${SHARDS:-16}
  SPEED="generator.device=cuda speed.num_prompts=16 speed.batch_sizes=[1,16] speed.min_batches=2 speed.entropy_prompts=4"
  TEACHER_TIME=${TEACHER_TIME:-130} STATE_BATCH=64 SPEED_TIME=100
fi

stage() {  # stage <name> <seconds> <command...>: one step, its log, exit status and time
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$LOGS/status.txt"
  return $rc
}

# 1. speed (the default drafter), at most 100 s on the GPU
stage speed "$SPEED_TIME" $PY -m specgen.eval experiment=eval/discrete_speed benchmark=none logger=none $PATHS $SPEED \
  '~strategies.ssd_exact' '~strategies.ssd_latent' \
  '~strategies.mtp1d' '~strategies.specdec' '~strategies.sjd' '~strategies.ssd_paper' \
  hydra.run.dir="$LOGS/speed"

# 2. teacher shards: validation first, then training shards until its time is up (each shard is written atomically)
stage teacher "$TEACHER_TIME" $PY -m specgen.train experiment=train/fphi_accept $COMMON $DATA data.train_shards=$SHARDS \
  prepare_only=true hydra.run.dir="$LOGS/teacher"
written=0  # training shards 0..written-1 are on disk (written in order)
while [ "$written" -lt "$SHARDS" ] && ls "$DATA_DIR"/distill/*/"train_$(printf %05d "$written")_tokens.npz" >/dev/null 2>&1
do written=$(( written + 1 )); done
echo "teacher shards written: $written of $SHARDS" | tee -a "$LOGS/status.txt"
[ "$written" -ge 1 ] || exit 1

# 3. drafters side by side, each within the time left (less a margin for validation, export and packing)
budget=$(( $(left) - 75 ))
[ "$SMOKE" = 1 ] && budget=null
echo "training budget: ${budget} s" | tee -a "$LOGS/status.txt"
guard=$(( $(left) - 15 ))
[ "$SMOKE" = 1 ] && guard=600
train() {  # train <name> <overrides...>
  local name=$1; shift
  stage "$name" "$guard" $PY -m specgen.train experiment=train/fphi_accept $COMMON $DATA data.train_shards=$written \
    "init_from=\${paths.checkpoint_dir}/$INIT" module.state_batch=$STATE_BATCH callbacks.time_budget.seconds=$budget task_name=$name export_name=$name "$@" \
    hydra.run.dir="$LOGS/$name"
}
train fphi_gpu &
train fphi_gpu_r2 module.rollout=2 &
train fphi_gpu_tv module.guided_loss=tv &
wait
echo "all stages finished after $(( $(date +%s) - T0 ))s" | tee -a "$LOGS/status.txt"
