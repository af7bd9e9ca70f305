#!/usr/bin/env bash
# One short GPU session, prepared: what a lent GPU machine should measure first, in one command.
#
# The device tool lends a machine for about 15 minutes of device time in all, at most 10 a call, and
# starting it takes minutes of that: one call of about 9 minutes is what a session can count on. This
# script spends it in the order the open issues rank the questions, each stage stopped where the time
# runs out; every stage rewrites its results after each configuration, so whatever ran comes back.
#   1. the machine itself: versions, the CUDA context, cuDNN's and cuBLAS's first handles (seconds);
#   2. the conv nets of the extended suite ("Convolutional nets on CUDA"): VGG-16 at batch 64, the
#      step GPUMemNet's A100 run used 21% more memory for than memplan predicts, then the U-Net with
#      cuDNN's benchmark mode off and on, and ResNet with benchmark on and TF32 off;
#   3. the fit promises (`capped`: memplan's largest batch at a budget runs, the next one does not);
#   4. the rest of the extended suite, in the suite's order.
#
# On the GPU machine, from the source tree (PYTHONUNBUFFERED so that a stopped run's log is whole):
#     PYTHONUNBUFFERED=1 bash benchmarks/gpu_session.sh "$OUT" 540
# Here afterwards: predict the same configurations for the GPU that ran them (`gpu_evidence.py predict
# extended --gpu H200` where the lent machine was an H200; docs/validation/predicted-extended.json is
# for an H100-80GB, which gives the same figures for every configuration far from 80 GB), then `merge`
# and `table` as docs/validation.md shows for the main suite.
# What comes back: environment.json, measured-extended.json, traces-extended.tar.gz,
# measured-capped.json and session.log (the device tool returns at most 8 files).
set -u
out=${1:?usage: bash benchmarks/gpu_session.sh OUT [SECONDS]}
budget=${2:-540}
start=$SECONDS
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
log="$out/session.log"

CONV_NETS=vgg16-fp32-adam-b64,unet-fp32,unet-fp32-benchmark,unet-amp-bf16,resnet-50-cudnn-benchmark,resnet-50-no-tf32,resnet-101-amp-bf16-benchmark

stage() {  # stage NAME COMMAND...: run it in the time left, or say it was skipped
    local name=$1 left
    shift
    left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then
        echo "== $name: skipped, ${left} s left" | tee -a "$log"
        return
    fi
    echo "== $name ($left s left): $*" | tee -a "$log"
    # One configuration may take at most what is left, and the stage is stopped there as a whole.
    timeout --kill-after=10 "$left" "$@" 2>&1 | tee -a "$log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s in all" | tee -a "$log"
}

stage environment python3 benchmarks/gpu_evidence.py environment --out "$out/environment.json"
stage conv-nets python3 benchmarks/gpu_evidence.py measure extended --out "$out" --only "$CONV_NETS" --timeout 150
stage capped python3 benchmarks/gpu_evidence.py capped --out "$out" --timeout 120
stage extended python3 benchmarks/gpu_evidence.py measure extended --out "$out" --timeout 120
